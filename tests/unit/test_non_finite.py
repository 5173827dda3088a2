"""Non-finite tensor pieces (issue 16), pure parts over the in-memory transport: rejected at
ingest for every consumer, counted against the sender, a waiting consumer fails at once naming
it, and a synchronous step that fails that way waits for the view that excludes the sender."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from p2psync.collectives import Collectives
from p2psync.coordinator import View
from p2psync.coordinator.membership_state import MembershipState
from p2psync.errors import Diverged, NonFinitePiece, PeerFailure, ProtocolError, SumDiverged
from p2psync.sim import loop as sim
from p2psync.strategies.regroup import Regroup
from p2psync.topology import mesh, ring, star
from p2psync.transport import Transport
from p2psync.transport.memory import MemoryHub
from p2psync.wire import encode

pytestmark = pytest.mark.timeout(30)


async def _forge(ep: Transport, peer: int, tag: str, arr: np.ndarray) -> None:
    """What a modified node sends: a tensor piece past its own checks."""
    frames = encode(kind="data", src=ep.node_id, tag=tag, arrays=[arr], run=ep.run_id, inc=ep.incarnation)
    await ep._send_direct(peer, ep.route(peer), 5.0, frames, bulk=True)


async def test_non_finite_pieces_are_rejected_counted_and_fail_the_waiter() -> None:
    hub = MemoryHub(mesh(3))
    eps = {i: hub.endpoint(i) for i in range(3)}
    for e in eps.values():
        await e.start()
    reported: list[tuple[int, str]] = []
    eps[0].offence_listeners.append(lambda n, why: reported.append((n, why)))
    try:
        with pytest.raises(Diverged, match="node 1 was about to send"):  # never by an honest sender
            await eps[1].send(0, "early", [np.array([1.0, np.inf], np.float32)])
        await _forge(eps[1], 0, "early", np.array([1.0, np.inf], np.float32))  # nobody waits yet
        waiting = asyncio.ensure_future(eps[0].recv("piece", timeout=10))
        await asyncio.sleep(0)  # one loop turn (not a delay): the receive registers its waiter
        await _forge(eps[1], 0, "piece", np.array([np.nan], np.float16))
        with pytest.raises(NonFinitePiece) as err:
            await waiting
        assert isinstance(err.value, PeerFailure) and err.value.peers == (1,)
        assert isinstance(err.value, ProtocolError) and err.value.reason == "non_finite"
        assert eps[0].recv_nowait("early") is None and eps[0].recv_nowait("piece") is None
        assert eps[0].offences == {1: 2} and reported == [(1, "non_finite"), (1, "non_finite")]
        await eps[2].send(0, "fine", [np.arange(3, dtype=np.float64), np.array([7], np.int64)])
        assert (await eps[0].recv("fine", timeout=5)).src == 2  # finite and integer data pass
        assert eps[0].stats()["offences"] == {"1": 2}
    finally:
        for e in eps.values():
            await e.close()


@pytest.mark.parametrize("codec", ["none", "int8", "e3m0", "e3m0:sr", "topk:0.25"])
@pytest.mark.parametrize("pieces", [1, 4])
def test_a_sum_that_overflows_is_the_groups_divergence_and_an_own_nan_is_the_nodes(pieces: int, codec: str) -> None:
    """Finite values whose sum overflows raise SumDiverged on the node that summed them (the
    coordinator then ends the run on every member); a node whose own values hold NaN raises a
    plain Diverged (it stops alone) before it sends anything. With every codec: a lossy one
    found the overflowed partial sum only as it encoded it, and took it for this node's own
    divergence (every node stopped alone); the top-k sum of finite parts returned infinity
    silently. In virtual time (:mod:`p2psync.sim.loop`): node 1 waits out its peer timeout for
    the part node 0 never sends."""
    sim.run(_overflow_and_own_nan(pieces, codec))


async def _overflow_and_own_nan(pieces: int, codec: str) -> None:
    hub = MemoryHub(ring(2))
    eps = {i: hub.endpoint(i) for i in range(2)}
    for e in eps.values():
        await e.start()
    colls = {i: Collectives(eps[i], timeout=5.0, piece_bytes=4 * 64 // pieces) for i in eps}
    try:
        big = np.full(64, 3e38, np.float32)
        got = await asyncio.gather(*(colls[i].allreduce(big, tag="big", codec=codec) for i in eps),
                                   return_exceptions=True)
        assert any(isinstance(g, SumDiverged) for g in got), got
        assert all(isinstance(g, SumDiverged) or isinstance(g, np.ndarray) and np.isfinite(g).all() for g in got), got
        own = np.zeros(64, np.float32)
        own[5] = np.nan
        got = await asyncio.gather(colls[0].allreduce(own, tag="nan", codec=codec),
                                   colls[1].allreduce(np.zeros(64, np.float32), tag="nan", codec=codec),
                                   return_exceptions=True)
        assert isinstance(got[0], Diverged) and not isinstance(got[0], SumDiverged), got
    finally:
        for e in eps.values():
            await e.close()


async def test_a_step_failing_on_a_non_finite_piece_waits_for_the_next_view() -> None:
    """Regroup treats a NonFinitePiece like a failed peer (its sender is being excluded):
    the step is redone over the next view, instead of ending the run as other protocol errors do."""
    topo = mesh(2)
    t = MemoryHub(topo).endpoint(0)
    await t.start()
    view = View(epoch=1, members=(0,))
    membership = SimpleNamespace(view=view, failure_timeout=0.2, interval=0.05)
    ctx = SimpleNamespace(node_id=0, topology=topo, transport=t, collectives=Collectives(t), membership=membership,
                          on_failure="continue", view=view, epoch=1, group=(0,),
                          replica=SimpleNamespace(export_state=None, import_state=None, state_size=lambda: 1))
    regroup = Regroup(ctx=ctx, name="ssgd")  # type: ignore[arg-type]
    calls: list[int] = []

    async def op(v: View) -> str:
        calls.append(v.epoch)
        if v.epoch == 1:
            asyncio.get_running_loop().call_soon(new_view)
            raise NonFinitePiece("a piece from node 1 holds NaN", peer=1)
        return "done"

    def new_view() -> None:
        v2 = View(epoch=2, members=(0,))
        ctx.view, ctx.epoch = v2, 2
        regroup.on_view(v2)

    try:
        assert await asyncio.wait_for(regroup.run(3, op), 10) == "done"
        assert calls == [1, 2] and regroup.reformations == 1
    finally:
        await t.close()


def _state(n: int) -> MembershipState:
    st = MembershipState(expected=frozenset(range(n)))
    for i in range(n):
        st.register(i, "fp", 0.0, incarnation=1)
    return st


def test_exclusion_needs_two_reporters_and_never_takes_the_coordinator() -> None:
    topo = mesh(5)
    st = _state(5)
    assert st.report_offences(1, [2], topo.neighbors) == [] and 2 not in st.failed  # one report
    assert st.report_offences(1, [2], topo.neighbors) == []  # the same reporter again
    assert st.report_offences(3, [2], topo.neighbors) == [2] and 2 in st.failed
    assert "reported by nodes [1, 3]" in st.excluded[2]
    st.report_offences(1, [0], topo.neighbors)
    assert st.report_offences(3, [0], topo.neighbors) == [] and 0 not in st.failed  # the coordinator
    assert st.report_offences(2, [4], topo.neighbors) == []  # an excluded node reports nothing
    assert not st.diverged


def test_a_member_whose_sum_diverged_ends_the_run_once() -> None:
    """A sum that overflowed on a member ends the run as diverged (a new epoch whose view carries the
    reason); a node that is no member changes nothing, nor does a second report."""
    st = _state(4)
    epoch = st.epoch
    assert not st.report_diverged(9, "not a member")
    assert st.report_diverged(2, "training diverged at step 3 on node 2: sum overflowed")
    assert st.epoch == epoch + 1 and st.view().ended == st.diverged
    assert "a sum that node 2 computed diverged" in st.diverged and "step 3" in st.diverged
    assert not st.report_diverged(1, "again") and st.epoch == epoch + 1


def test_reports_only_count_from_members_about_their_neighbours() -> None:
    topo = ring(4)  # 0-1-2-3-0
    st = _state(4)
    assert st.report_offences(1, [3, 1, 9], topo.neighbors) == [] and not st.reports  # not neighbours, self, unknown
    assert st.report_offences(0, [1], topo.neighbors) == [] and st.reports == {1: {0}}


def test_a_node_with_one_live_neighbour_is_excluded_on_its_report() -> None:
    st = _state(3)
    assert st.report_offences(0, [1], star(3).neighbors) == [1]  # a leaf: the hub is its one neighbour
    # but never below a majority: in a run of two, one report of the other excludes nobody
    assert _state(2).report_offences(0, [1], mesh(2).neighbors) == []


def test_one_member_reporting_most_members_ends_the_run_as_diverged_excluding_nobody() -> None:
    """One key holder listing all its neighbours in one heartbeat used to exclude them all."""
    topo = mesh(5)
    st = _state(5)
    epoch = st.epoch
    assert st.report_offences(4, [0, 1, 2, 3], topo.neighbors) == []
    assert not st.failed and st.epoch == epoch + 1
    view = st.view()
    assert view.ended == st.diverged and "4 of 5 members" in view.ended and "reported by nodes [4]" in view.ended
    assert View.from_wire(view.to_wire()).ended == view.ended
    assert st.report_offences(1, [2], topo.neighbors) == []  # nothing more once the run ended

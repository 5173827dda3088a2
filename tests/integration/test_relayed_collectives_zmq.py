"""Collectives over a group whose members are not adjacent, over real ZeroMQ on loopback: the
pieces pass through live non-members (the transport relays them hop by hop), results are exact;
a dead relay is routed around; a group the live nodes no longer join fails at once with a
GroupCutOff naming the members cut apart and the dead nodes that would have joined them; in a
keyed cluster relayed pieces are signed by their origin and checked at their destination."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import numpy as np
import pytest

from p2psync.collectives import Collectives
from p2psync.coordinator import View
from p2psync.errors import GroupCutOff, PeerFailure
from p2psync.strategies.regroup import Adopted, Regroup, fetch_state, serve_state
from p2psync.topology import bcube, ring
from p2psync.wire import encode
from tests.helpers import close_replica, direct_reference, free_port, gate_replicas, keyed, make_context, make_trainer, until, zmq_cluster

pytestmark = pytest.mark.timeout(90)


async def _ops(cs: dict[int, Collectives], group: list[int], tag: str, size: int = 50_001) -> None:
    """Allreduce (sum and mean), allgather and broadcast over ``group``; exact results."""
    rng = np.random.default_rng(7)
    data = {i: rng.standard_normal(size).astype(np.float32) for i in group}
    sums = await asyncio.gather(*(cs[i].allreduce(data[i], group, tag=f"{tag}.s") for i in group))
    ref = np.sum([data[i].astype(np.float64) for i in group], axis=0)
    for o in sums:
        np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-5)
        assert o.tobytes() == sums[0].tobytes()
    ints = {i: np.arange(1000, dtype=np.int64) * (i + 1) for i in group}
    isum = await asyncio.gather(*(cs[i].allreduce(ints[i], group, tag=f"{tag}.i") for i in group))
    for o in isum:
        np.testing.assert_array_equal(o, sum(ints.values()))
    rows = await asyncio.gather(*(cs[i].allgather(ints[i][:7], group, tag=f"{tag}.g") for i in group))
    for r in rows:
        assert [list(x) for x in r] == [list(ints[i][:7]) for i in group]
    root = group[-1]
    got = await asyncio.gather(*(cs[i].broadcast(data[i] if i == root else np.zeros(size, np.float32), root,
                                                 group, tag=f"{tag}.b") for i in group))
    for o in got:
        assert o.tobytes() == data[root].tobytes()


async def test_ring4_members_1_and_3_through_a_live_non_member() -> None:
    """Nodes 1 and 3 of ring-4 share no link: every operation runs through node 0 (or 2),
    alive but not a member. Then node 0 dies: its pieces go around it through node 2. Then
    node 2 dies as well: the group is cut apart, and both members say so at once."""
    topo = ring(4, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        cs = {i: Collectives(e, piece_bytes=16 << 10, timeout=10.0) for i, e in eps.items()}
        await _ops(cs, [1, 3], "a")
        assert eps[0].relayed + eps[2].relayed > 0  # the pieces went through a non-member
        assert not any(e.rejected for e in eps.values())
        await eps[0].close()
        for i in (1, 3):
            eps[i].mark_dead(0)
        before = eps[2].relayed
        await _ops(cs, [1, 3], "b")
        assert eps[2].relayed > before
        await eps[2].close()
        for i in (1, 3):
            eps[i].mark_dead(2)
        for i in (1, 3):
            with pytest.raises(GroupCutOff, match=r"members \[1\] and \[3\] cannot reach each other.*"
                                                 r"any one of dead nodes \[0, 2\]") as info:
                await cs[i].allreduce(np.ones(10, np.float32), [1, 3], tag="c")
            assert info.value.parts == ((1,), (3,)) and info.value.peers == (0, 2)


async def test_bcube_members_on_no_common_network_and_a_lossy_codec() -> None:
    """BCube(3,2): nodes 0, 4 and 8 share no network with each other; a ring over relay links
    (through 1, 2 and 5) gives every member the same sum, with a lossy codec too."""
    topo = bcube(3, 2, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        cs = {i: Collectives(e, piece_bytes=8 << 10, timeout=10.0) for i, e in eps.items()}
        group = [0, 4, 8]
        await _ops(cs, group, "x", size=20_001)
        data = {i: np.full(30_000, float(i), np.float32) for i in group}
        outs = await asyncio.gather(*(cs[i].allreduce(data[i], group, tag="q", codec="fp16") for i in group))
        assert all(o.tobytes() == outs[0].tobytes() for o in outs)
        np.testing.assert_allclose(outs[0], 12.0)


async def test_keyed_cluster_signs_relayed_pieces_and_drops_an_unsigned_one() -> None:
    """In a keyed cluster a relayed piece carries its origin's digest and is verified at its
    destination: one sent through a relay without a digest, or with a digest that does not
    verify, is dropped there (``relay_auth``), never delivered."""
    topo, keys = keyed(ring(4, base_port=free_port()))
    async with zmq_cluster(topo, keys=keys) as eps:
        cs = {i: Collectives(e, piece_bytes=16 << 10, timeout=10.0) for i, e in eps.items()}
        await _ops(cs, [1, 3], "k", size=10_001)
        assert eps[0].relayed + eps[2].relayed > 0
        assert not any(e.rejected for e in eps.values())
        for auth, ctr in ((None, None), (b"\1" * 32, 10**6)):
            bare = encode(kind="data", src=1, dst=3, hops=0, tag="forged", arrays=[np.ones(4, np.float32)],
                          run=eps[1].run_id, inc=eps[1].incarnation, auth=auth, ctr=ctr)
            await eps[1]._send_direct(0, eps[1].route(0), 5.0, bare, bulk=True)
        await until(lambda: eps[3].rejected["relay_auth"] >= 2, 10, "both forged pieces dropped at node 3")
        assert eps[3].recv_nowait("forged") is None


async def test_state_sync_of_a_new_epoch_over_a_group_that_needs_a_relay() -> None:
    """Regroup's state sync (allgather of the steps, broadcast of the donor's state and of its
    training state) over the view {1, 3} of ring-4, node 0 alive but no member: the member
    behind adopts the other's state bitwise, and an average of the states is exact."""
    topo = ring(4, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        members = (1, 3)
        trainers = gate_replicas({i: make_trainer(topo, i, seed=i) for i in members})
        ctxs = {i: make_context(topo, eps[i], trainers[i]) for i in members}
        await eps[2].close()  # dead: the pieces go through node 0
        for i in members:
            eps[i].mark_dead(2)
            ctxs[i].membership.views.apply(View(epoch=1, members=members))
            ctxs[i].rpc_server.start()
        try:
            groups = {i: Regroup(ctx=ctxs[i], name="rg") for i in members}
            ran: list[int] = []

            async def op(i: int) -> None:
                ran.append(i)

            got = await asyncio.gather(*(groups[i].run(s, lambda v, i=i: op(i)) for i, s in ((1, 4), (3, 6))))
            donor = await trainers[3].export_state()
            assert (await trainers[1].export_state()).tobytes() == donor.tobytes()
            assert got == [Adopted(6), None] and groups[1].adoptions == 1 and ran == [3]
            before = [await trainers[i].get_params() for i in members]
            avg = await asyncio.gather(*(groups[i].average_state(0, 9) for i in members))
            after = [await trainers[i].get_params() for i in members]
        finally:
            for c in ctxs.values():
                await c.rpc_server.close()
            for t in trainers.values():
                await close_replica(t)
    assert avg == [(1, 10, False)] * 2
    np.testing.assert_allclose(after[0], np.mean(before, axis=0), rtol=1e-6, atol=1e-7)
    assert after[0].tobytes() == after[1].tobytes()
    assert eps[0].relayed > 0


@contextlib.asynccontextmanager
async def _joiner_and_member(peer_timeout: float = 10.0) -> AsyncIterator[tuple[dict, dict, dict]]:
    """Ring-4 over real ZeroMQ with node 0 dead: the joiner (node 1) and the one live member
    (node 3), their endpoints, contexts (a view of the two, RPC servers started) and replicas;
    node 3 serves its state as ``j`` at step 17."""
    topo = ring(4, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        members = (1, 3)
        trainers = gate_replicas({i: make_trainer(topo, i, seed=i) for i in members})
        ctxs = {i: make_context(topo, eps[i], trainers[i], peer_timeout=peer_timeout) for i in members}
        await eps[0].close()
        for i in members:
            eps[i].mark_dead(0)
            ctxs[i].membership.views.apply(View(epoch=1, members=members))
            ctxs[i].rpc_server.start()
        try:
            serve_state(ctxs[3], "j", lambda: 17)
            yield eps, ctxs, trainers
        finally:
            for c in ctxs.values():
                await c.rpc_server.close()
            for t in trainers.values():
                await close_replica(t)


async def test_a_joiner_copies_the_state_of_a_member_it_is_not_adjacent_to() -> None:
    """An asynchronous strategy's joiner (node 1 of ring-4) whose only live member (node 3) is
    not adjacent: the state RPC and the state itself go through node 2 (node 0 is dead)."""
    async with _joiner_and_member() as (eps, ctxs, trainers):
        assert await fetch_state(ctxs[1], "j") == 17
        mine, theirs = [await trainers[i].export_state() for i in (1, 3)]
    assert mine.tobytes() == theirs.tobytes() and eps[2].relayed > 0


async def test_a_joiner_with_no_way_to_a_member_yet_asks_again_until_one_opens() -> None:
    """The joiner (node 1 of ring-4) has both neighbours marked dead when it asks for the state
    (new processes joining too, as after a fenced arc is started again): no member is
    reachable. It asks again until node 2 is heard again, then copies node 3's state through
    it; with no way for its whole ``peer_timeout`` it fails naming that bound."""
    async with _joiner_and_member(peer_timeout=1.0) as (eps, ctxs, trainers):
        eps[1].mark_dead(2)
        with pytest.raises(PeerFailure, match="within 1s"):
            await fetch_state(ctxs[1], "j")
        ctxs[1].peer_timeout = 10.0
        fetch = asyncio.ensure_future(fetch_state(ctxs[1], "j"))
        await asyncio.sleep(0.3)  # (it asks in vain meanwhile)
        assert not fetch.done()
        eps[1].revive(2)
        assert await asyncio.wait_for(fetch, 10) == 17
        mine, theirs = [await trainers[i].export_state() for i in (1, 3)]
    assert mine.tobytes() == theirs.tobytes()


@pytest.mark.parametrize("make", [lambda p: ring(4, base_port=p), lambda p: bcube(2, 2, base_port=p)],
                         ids=["ring4", "bcube2x2"])
async def test_the_direct_plan_relays_through_members_and_encodes_each_contribution_once(make) -> None:
    """``--collective direct``: every member sends each piece straight to its owner, through
    other members where they are not adjacent (relayed unchanged); lossless operations are
    exact, and with e3m0 every member gets the same bits, the owner's sum of its own values and
    each other member's once-decoded piece."""
    topo = make(free_port())
    async with zmq_cluster(topo) as eps:
        cs = {i: Collectives(e, piece_bytes=16 << 10, timeout=10.0, algo="direct") for i, e in eps.items()}
        await _ops(cs, topo.ids, "d")
        assert sum(e.relayed for e in eps.values()) > 0  # non-adjacent members went through another node
        rng = np.random.default_rng(3)
        n = 256 * topo.size  # one piece per member: piece k is member k's
        xs = [rng.standard_normal(n).astype(np.float32) for _ in topo.ids]
        outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag="d.e3m0", codec="e3m0") for i in topo.ids))
        assert all(cs[i].stats_for("d.e3m0").algo == "direct" for i in topo.ids)
        assert not any(e.rejected for e in eps.values())
    want = direct_reference(xs, topo.size, "e3m0")
    for o in outs:
        assert o.tobytes() == want.tobytes()

"""The sharded parameter store (../shared/specs/ssp-dssp-elasticbsp.md §6.1): shard maps, the
owners' SGD against torch's, and push/pull over the in-memory transport."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import numpy as np
import pytest
import torch

from p2psync.coordinator import RpcClient, RpcServer
from p2psync.errors import ConfigError, PeerFailure, PeerTimeout
from p2psync.params import OptimSpec, ParamStore, ShardOptimizer, piece_ranges, shard_bounds
from p2psync.topology import mesh
from p2psync.transport import MemoryHub

from tests.helpers import until

pytestmark = pytest.mark.timeout(60)


def test_shards_are_contiguous_balanced_and_cover_the_vector():
    b = shard_bounds(10, [7, 3, 5])
    assert b == {3: (0, 4), 5: (4, 7), 7: (7, 10)}
    assert shard_bounds(2, [0, 1, 2]) == {0: (0, 1), 1: (1, 2), 2: (2, 2)}
    assert piece_ranges(4, 11, 3) == [(4, 7), (7, 10), (10, 11)] and piece_ranges(2, 2, 3) == [(2, 2)]
    with pytest.raises(ConfigError):
        shard_bounds(4, [1, 1])


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 0.0), (0.9, 1e-2)])
def test_shard_optimizer_is_torch_sgd(momentum, wd):
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(50).astype(np.float32)
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = torch.optim.SGD([p], lr=0.1, momentum=momentum, weight_decay=wd)
    spec = OptimSpec.of(torch.optim.SGD, 50, lr=0.1, momentum=momentum, weight_decay=wd)
    mine = ShardOptimizer(spec, w0, lo=0, pieces=[(0, 30), (30, 50)])
    for _ in range(5):
        g = rng.standard_normal(50).astype(np.float32)
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        mine.apply(0, 30, g[:30], {0: spec.initial[0]})
        mine.apply(30, 50, g[30:], {0: spec.initial[0]})
    assert mine.w.tobytes() == p.detach().numpy().tobytes()


@contextlib.asynccontextmanager
async def stores(topo: Any, w0: np.ndarray, **kw: Any) -> AsyncIterator[dict[int, ParamStore]]:
    hub = MemoryHub(topo)
    eps = {i: hub.endpoint(i, default_timeout=5) for i in topo.ids}
    servers = {i: RpcServer(eps[i]) for i in topo.ids}
    out = {}
    for i in topo.ids:
        await eps[i].start()
        out[i] = ParamStore(transport=eps[i], rpc_server=servers[i], rpc=RpcClient(eps[i], local=servers[i]),
                            members=topo.ids, params=w0,
                            **{"optim": OptimSpec.of(torch.optim.SGD, w0.size, lr=0.1, momentum=kw.pop("momentum", 0.0)),
                               "timeout": 2.0, **kw})
        servers[i].start()
        out[i].start()
    try:
        yield out
    finally:
        for i in topo.ids:
            await out[i].close()
            await servers[i].close(grace=0.1)
            await eps[i].close()


async def test_a_round_of_pushes_is_one_sgd_step_on_the_mean_and_every_pull_agrees():
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(1000).astype(np.float32)
    grads = {i: rng.standard_normal(1000).astype(np.float32) for i in range(3)}
    async with stores(mesh(3), w0, piece_bytes=256) as st:
        stats = await asyncio.gather(*(st[i].push(grads[i]) for i in range(3)))
        pulls = await asyncio.gather(*(st[i].pull() for i in range(3)))
        versions = [s.version for s in st.values()]
    want = w0 - 0.1 * np.mean(list(grads.values()), axis=0)
    for p in pulls:
        np.testing.assert_allclose(p, want, rtol=1e-5, atol=1e-6)
        assert p.tobytes() == pulls[0].tobytes()
    assert versions == [3, 3, 3] and all(s.pieces == 2 * 6 for s in stats)  # 2 remote shards x 6 pieces


async def test_a_push_to_a_dead_owner_is_reported_not_dropped():
    w0 = np.zeros(12, np.float32)
    async with stores(mesh(3), w0, timeout=0.5) as st:
        await st[2].close()
        await st[2].transport.close()
        with pytest.raises((PeerFailure, PeerTimeout), match="node 2|owner"):
            await st[0].push(np.ones(12, np.float32))
        with pytest.raises(PeerFailure, match="node 2"):
            await st[0].pull()


async def test_an_owner_that_cannot_send_its_shard_fails_the_pull_as_a_peer_failure():
    """The owner's pieces go through a relay that dies mid-pull (the coordinator failover test
    under load: owner 3's pieces for node 1 relayed by node 0): the owner's RPC handler raises
    PeerFailure, which reaches the puller as a RemoteError. The pull must fail with PeerFailure
    (the strategy then follows the view and re-shards), not with an error that ends training."""
    async with stores(mesh(2), np.zeros(8, np.float32)) as st:
        async def relay_died(*_: Any, **__: Any) -> bool:
            raise PeerFailure("node 1: node 9 has failed", peers=(9,))

        st[1].fwd.send = relay_died  # type: ignore[method-assign]
        with pytest.raises(PeerFailure, match="node 1 could not serve .*node 9 has failed"):
            await st[0].pull()


async def test_an_owner_whose_process_does_not_serve_the_store_fails_the_pull_as_a_peer_failure():
    """A restarted owner's new process answers before it joined the store: its RPC server has
    no pull method (UnknownMethod). The process that owned the shard is gone: the pull fails
    with PeerFailure (the view then re-shards), not with an error that ended every node's
    training (found by the simulator: ``p2psync sim ring:6 --strategy ssp --faults restart:2@4``)."""
    async with stores(mesh(2), np.zeros(8, np.float32)) as st:
        del st[1].rpc.local.handlers[f"{st[1].name}.pull"]  # (node 1's server, as a new process has it)
        with pytest.raises(PeerFailure, match="node 1 could not serve the pull: no RPC method"):
            await st[0].pull()


async def test_a_malformed_piece_is_refused_counted_and_answered():
    async with stores(mesh(2), np.zeros(8, np.float32)) as st:
        ep0 = st[0].transport
        await ep0.send(1, "ps.push", [np.zeros(3, np.float32)], meta={"o": 0, "ack": "ps.ack.x", "lo": -5, "hi": -2, "e": 0,
                                                                     "g": 0})
        ack = await ep0.recv("ps.ack.x", timeout=2)
        assert "bad piece" in ack.meta["err"] and st[1].malformed == 1
        assert st[1].version == 0 and not st[1].opt.w.any()


class SumOver:
    """The exact sum over a group for the stores' re-shard, in one process (a unit test of the
    store's logic; the ZeroMQ test uses the real collectives)."""

    def __init__(self) -> None:
        self.calls: dict[str, dict[int, np.ndarray]] = {}
        self.done: dict[str, asyncio.Event] = {}

    def for_node(self, me: int) -> Any:
        async def allreduce(vec: np.ndarray, group: list[int], tag: str) -> np.ndarray:
            got = self.calls.setdefault(tag, {})
            ev = self.done.setdefault(tag, asyncio.Event())
            got[me] = vec.copy()
            if set(got) == set(group):
                ev.set()
            await asyncio.wait_for(ev.wait(), 5)
            return np.sum([got[g] for g in sorted(group)], axis=0).astype(vec.dtype)
        return allreduce


async def test_reshard_restores_a_dead_owners_shard_from_the_freshest_copy():
    rng = np.random.default_rng(3)
    n = 30
    w0 = rng.standard_normal(n).astype(np.float32)
    sums = SumOver()
    async with stores(mesh(3), w0, momentum=0.9, piece_bytes=16) as st:
        for _ in range(2):
            await asyncio.gather(*(st[i].push(rng.standard_normal(n).astype(np.float32)) for i in range(3)))
        await asyncio.gather(*(st[i].pull() for i in range(3)))
        await st[1].push(rng.standard_normal(n).astype(np.float32))
        fresh = await st[0].pull()  # node 0 holds the freshest copy of node 2's shard (version 7)
        lo2, hi2 = st[2].bounds[2]
        assert st[0].pulled_versions[2] == 7 and st[1].pulled_versions[2] == 6
        own = {i: (st[i].opt.w.copy(), st[i].opt.export_state()) for i in (0, 1)}
        await st[2].close()
        await st[2].transport.close()
        ws = await asyncio.gather(*(st[i].reshard([0, 1], 5, sums.for_node(i)) for i in (0, 1)))
        want = fresh.copy()
        for i in (0, 1):
            a, b = shard_bounds(n, [0, 1, 2])[i]
            want[a:b] = own[i][0]
        for w in ws:
            assert w.tobytes() == want.tobytes()  # exact: own shards and node 0's copy of node 2's
        assert [st[i].bounds for i in (0, 1)] == [shard_bounds(n, [0, 1])] * 2 and st[0].epoch == 5
        state = np.zeros((2, n), np.float32)  # (has state, momentum buffer) per element
        for i in (0, 1):
            a, b = shard_bounds(n, [0, 1, 2])[i]
            state[:, a:b] = own[i][1]
        assert state[0, :lo2].all() and state[1, :lo2].any()
        for i in (0, 1):  # the momentum of the live shards moved with them; the lost one starts fresh
            a, b = st[i].bounds[i]
            got = st[i].opt.export_state()
            assert np.array_equal(got[1], state[1, a:b])  # exact (the sum makes -0.0 0.0)
            assert (got[0] >= state[0, a:b]).all()  # a piece holding moved state keeps state (zeros for the rest)
        assert not state[:, lo2:hi2].any()
        assert not st[1].opt.export_state()[0, -4:].any()  # a piece of the lost shard alone: fresh
        # the store goes on over two owners: a round of pushes is one SGD step (lr/2 each) on the mean
        g = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
        await asyncio.gather(*(st[i].push(g[i]) for i in (0, 1)))
        pulls = await asyncio.gather(*(st[i].pull() for i in (0, 1)))
        assert pulls[0].tobytes() == pulls[1].tobytes()
        assert st[0].lost_pushes == 0


async def test_pieces_and_pulls_of_another_store_epoch():
    """An owner refuses a piece of an older epoch (the sender's push is lost and reported) and
    applies a newer epoch's piece only once it has re-sharded itself; a pull waits likewise."""
    sums = SumOver()
    async with stores(mesh(2), np.zeros(8, np.float32)) as st:
        ep0 = st[0].transport
        # node 0 re-shards first (epoch 3, same members); node 1 has not yet
        st0 = asyncio.ensure_future(st[0].reshard([0, 1], 3, sums.for_node(0)))
        await until(lambda: st[0]._moving == 3, 5, "node 0 to begin its re-shard")
        await ep0.send(1, "ps.push", [np.ones(4, np.float32)], meta={"o": 0, "ack": "ps.ack.y", "lo": 4, "hi": 8,
                                                                     "c": "none", "e": 3, "g": 0, "h": [[0, 0.1, 0.0, 0.0, 0.0]]})
        await until(lambda: len(st[1]._later) == 1, 5, "node 1 to keep the newer epoch's piece")
        assert st[1].version == 0  # kept for later, not applied
        await asyncio.gather(st0, st[1].reshard([0, 1], 3, sums.for_node(1)))
        ack = await ep0.recv("ps.ack.y", timeout=2)
        assert ack.meta == {} and st[1].opt.w.tolist() == [float(np.float32(-0.05))] * 4  # applied after the move (lr 0.1 / 2)
        await ep0.send(1, "ps.push", [np.ones(4, np.float32)], meta={"o": 0, "ack": "ps.ack.z", "lo": 4, "hi": 8,
                                                                     "c": "none", "e": 1, "g": 0, "h": [[0, 0.1, 0.0, 0.0, 0.0]]})
        assert (await ep0.recv("ps.ack.z", timeout=2)).meta == {"moved": 3}
        st[0].epoch = 1  # a stale caller: its push is reported lost, its pull told to move
        with pytest.raises(PeerFailure, match="moved to store epoch 3"):
            await st[0].push(np.ones(8, np.float32))
        assert st[0].lost_pushes == 1
        with pytest.raises(PeerFailure, match="moved to store epoch 3"):
            await st[0].pull()


async def test_a_barrier_pull_is_the_barrier_state_though_a_faster_worker_pushed_since():
    """The race of a released barrier: worker 0 pulls barrier 1, computes and pushes its next
    gradient (generation 1) before workers 1 and 2 pull: they still get what worker 0 pulled
    (an untagged pull, the control, sees the new push); the owners' copies are dropped once
    everyone pulled, and the next barrier works the same way."""
    rng = np.random.default_rng(4)
    n = 40
    w0 = rng.standard_normal(n).astype(np.float32)
    async with stores(mesh(3), w0, piece_bytes=32) as st:
        for b in (1, 2):
            await asyncio.gather(*(st[i].push(rng.standard_normal(n).astype(np.float32), gen=b - 1) for i in range(3)))
            first = await st[0].pull(barrier=b)  # released: the fast worker pulls, pushes again
            await st[0].push(rng.standard_normal(n).astype(np.float32), gen=b)
            assert (await st[1].pull()).tobytes() != first.tobytes()  # the race is real
            late = await asyncio.gather(st[1].pull(barrier=b), st[2].pull(barrier=b))
            assert all(x.tobytes() == first.tobytes() for x in late)
            assert all(s.barriers._snap is None for s in st.values())  # everyone pulled b: dropped
            await asyncio.gather(*(st[i].push(rng.standard_normal(n).astype(np.float32), gen=b) for i in (1, 2)))
        assert [s.barriers.snapshots for s in st.values()] == [2, 2, 2]
        assert sum(s.barriers.misses for s in st.values()) == 0


async def test_rounds_are_applied_in_origin_order_whatever_the_arrival_order():
    """BSP's rounds: the same gradients pushed in two different orders give bitwise the same
    weights (summed per range in origin order, one SGD step); a pull of barrier b does not see
    a generation-b push that came first; a round is one SGD step on the mean."""
    rng = np.random.default_rng(5)
    n = 50
    w0 = rng.standard_normal(n).astype(np.float32)
    grads = [[rng.standard_normal(n).astype(np.float32) * 10 ** rng.uniform(-3, 3) for _ in range(3)]
             for _ in range(3)]
    results = []
    for order in ([0, 1, 2], [2, 0, 1]):
        async with stores(mesh(3), w0, piece_bytes=24, rounds=True) as st:
            first = order[0]
            for r, g in enumerate(grads):
                for i in order[1:] if r else order:  # one at a time: each arrives (and is acked) in order
                    await st[i].push(g[i], gen=r)
                if r == 0:
                    assert all(s.version == 0 and s.barriers.pending for s in st.values())  # held
                pulled = await st[first].pull(barrier=r + 1)
                if r + 1 < len(grads):
                    await st[first].push(grads[r + 1][first], gen=r + 1)  # the next round begins
                rest = await asyncio.gather(*(st[i].pull(barrier=r + 1) for i in order[1:]))
                assert all(x.tobytes() == pulled.tobytes() for x in rest)
                if r == 0:
                    want = w0 - np.float32(0.1 / 3) * (g[0] + g[1] + g[2])
                    np.testing.assert_allclose(pulled, want, rtol=1e-5, atol=1e-5)
            results.append(await st[0].pull())
    assert results[0].tobytes() == results[1].tobytes()


async def test_a_reshard_after_one_that_ended_on_some_members_only_takes_the_newest_split():
    """A re-shard can end on some members and be given up on others (a newer view superseded it
    as its last pieces arrived): node 1 moved to the new split (epoch 2, members [1, 2]: node 0
    was dropped and came back), nodes 0 and 2 stayed at the old one. The next re-shard must not
    sum overlapping shards: members at an older epoch bring no state, the ranges come from the
    newest split's owners (node 2's range from node 1's pulled copy, its optimizer state fresh),
    and every member ends at the new epoch with the exact weights of the newest split."""
    rng = np.random.default_rng(5)
    n = 24
    w0 = rng.standard_normal(n).astype(np.float32)
    sums = SumOver()
    async with stores(mesh(3), w0, momentum=0.9, piece_bytes=16) as st:
        await asyncio.gather(*(st[i].push(rng.standard_normal(n).astype(np.float32)) for i in range(3)))
        await asyncio.gather(*(st[i].pull() for i in range(3)))
        # node 1 alone installs the split of epoch 2 over [1, 2] from the true state (what the
        # epoch-2 allreduce gave it); nodes 0 and 2 gave that re-shard up
        truth = np.concatenate([st[o].opt.w for o in (0, 1, 2)])
        st[1].bounds = shard_bounds(n, [1, 2])
        st[1].lo, st[1].hi = st[1].bounds[1]
        st[1].opt = st[1]._shard(truth[st[1].lo:st[1].hi].copy())
        st[1].pulled[:] = truth
        st[1].pulled_versions = {1: 0, 2: 0}
        st[1].epoch = 2
        ws = await asyncio.gather(*(st[i].reshard([0, 1, 2], 5, sums.for_node(i), fresh=[0] if i == 1 else [])
                                    for i in range(3)))
        for w in ws:
            assert w.tobytes() == truth.tobytes()  # the newest split's weights, not a sum of overlapping shards
        assert [st[i].epoch for i in range(3)] == [5, 5, 5]
        assert all(st[i].bounds == shard_bounds(n, [0, 1, 2]) for i in range(3))
        pulls = await asyncio.gather(*(st[i].pull() for i in range(3)))
        assert pulls[0].tobytes() == pulls[1].tobytes() == pulls[2].tobytes() == truth.tobytes()

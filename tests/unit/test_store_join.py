"""Members joining the sharded parameter store (ParamStore.reshard with a joiner) over the
in-memory transport: the joiner takes its shard of the new split, weights and optimizer state,
and the whole state after the join is bitwise the state before it; a leave and a join in one
view (a member's process restarted) are one re-shard; a joiner answers older epochs' pieces and
pulls "moved" until it has re-sharded; a re-shard that fails is redone over a newer view."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import numpy as np
import pytest
import torch

from p2psync.coordinator import RpcClient, RpcServer
from p2psync.errors import ConfigError, PeerFailure
from p2psync.params import OptimSpec, ParamStore, shard_bounds
from p2psync.topology import mesh
from p2psync.transport import MemoryHub, Transport
from tests.unit.test_param_store import SumOver

pytestmark = pytest.mark.timeout(60)

N = 37


class Nodes:
    """Stores of a 3-node in-memory mesh; a node can be replaced by a new process (endpoint)."""

    def __init__(self, w0: np.ndarray) -> None:
        self.hub = MemoryHub(mesh(3))
        self.w0 = w0
        self.st: dict[int, ParamStore] = {}
        self.parts: list[tuple[ParamStore, RpcServer, Transport]] = []

    async def add(self, i: int, **kw: Any) -> ParamStore:
        ep = self.hub.endpoint(i, default_timeout=5)
        await ep.start()
        server = RpcServer(ep)
        st = ParamStore(transport=ep, rpc_server=server, rpc=RpcClient(ep, local=server), members=[0, 1, 2],
                        params=self.w0, optim=OptimSpec.of(torch.optim.SGD, N, lr=0.1, momentum=0.9),
                        timeout=5.0, piece_bytes=20, **kw)
        server.start()
        st.start()
        self.st[i] = st
        self.parts.append((st, server, ep))
        return st

    async def kill(self, i: int) -> None:
        part = next(p for p in self.parts if p[0] is self.st[i])
        self.parts.remove(part)
        st, server, ep = part
        await st.close()
        await server.close(grace=0.1)
        await ep.close()

    async def close(self) -> None:
        for st, server, ep in self.parts:
            await st.close()
            await server.close(grace=0.1)
            await ep.close()


@contextlib.asynccontextmanager
async def nodes(w0: np.ndarray) -> AsyncIterator[Nodes]:
    ns = Nodes(w0)
    try:
        for i in range(3):
            await ns.add(i)
        yield ns
    finally:
        await ns.close()


def exact(stores: list[ParamStore]) -> tuple[np.ndarray, np.ndarray]:
    """The store's whole state: weights and per-element optimizer state, from the owners."""
    w = np.zeros(N, np.float32)
    state = np.zeros((stores[0].opt.channels, N), np.float32)
    for s in stores:
        w[s.lo:s.hi] = s.opt.w
        state[:, s.lo:s.hi] = s.opt.export_state()
    return w, state


async def train(rng: np.random.Generator, stores: list[ParamStore], rounds: int) -> None:
    for _ in range(rounds):
        await asyncio.gather(*(s.push(rng.standard_normal(N).astype(np.float32)) for s in stores))
        await asyncio.gather(*(s.pull() for s in stores))


async def test_a_joiner_takes_its_shard_and_the_state_after_the_join_is_bitwise_the_state_before():
    rng = np.random.default_rng(5)
    sums = SumOver()
    async with nodes(rng.standard_normal(N).astype(np.float32)) as ns:
        await train(rng, list(ns.st.values()), 2)
        await ns.kill(2)  # declared failed: the survivors re-split over themselves
        await asyncio.gather(*(ns.st[i].reshard([0, 1], 5, sums.for_node(i), clock=(3, 9 + i)) for i in (0, 1)))
        survivors = [ns.st[0], ns.st[1]]
        await train(rng, survivors, 2)  # momentum state everywhere
        want_w, want_state = exact(survivors)
        gen = {i: ns.st[i].barriers.gen for i in (0, 1)}
        joiner = await ns.add(2, joining=True, epoch=6)  # a new process of node 2, admitted by view 7
        assert not joiner.holds and joiner.members == []
        with pytest.raises(ConfigError, match="holds no shard yet"):
            await joiner.pull()
        # a piece or pull of an older split (meant for node 2's previous process): "moved"
        await ns.st[0].transport.send(2, "ps.push", [np.ones(4, np.float32)], meta={
            "o": 0, "ack": "ps.ack.old", "lo": 0, "hi": 4, "c": "none", "e": 0, "g": 0, "h": [[0, 0.1, 0.9, 0.0, 0.0]]})
        assert (await ns.st[0].transport.recv("ps.ack.old", timeout=5)).meta == {"moved": 6}
        assert await ns.st[0].rpc.call(2, "ps.pull", {"tag": "ps.shard.x", "e": 5, "b": 0}, timeout=5) == {"moved": 6}
        ws = await asyncio.gather(
            ns.st[0].reshard([0, 1, 2], 7, sums.for_node(0), fresh=[2], clock=(4, 20)),
            ns.st[1].reshard([0, 1, 2], 7, sums.for_node(1), fresh=[2], clock=(4, 18)),
            joiner.reshard([0, 1, 2], 7, sums.for_node(2), clock=(0, 0)))
        everyone = [ns.st[0], ns.st[1], joiner]
        for w in ws:
            assert w.tobytes() == want_w.tobytes()
        got_w, got_state = exact(everyone)
        assert got_w.tobytes() == want_w.tobytes()
        assert np.array_equal(got_state, want_state) and got_state[1, joiner.lo:joiner.hi].any()  # its momentum
        assert all(s.bounds == shard_bounds(N, [0, 1, 2]) and s.epoch == 7 for s in everyone)
        assert joiner.holds and joiner.lo < joiner.hi
        assert all(s.clocks == {0: (4, 20), 1: (4, 18)} for s in everyone)
        assert joiner.barriers.gen == max(gen.values())
        # the store goes on over three owners: pushes land everywhere, every pull agrees
        await train(rng, everyone, 2)
        pulls = await asyncio.gather(*(s.pull() for s in everyone))
        assert all(p.tobytes() == pulls[0].tobytes() for p in pulls)
        assert joiner.version == 6 and sum(s.lost_pushes for s in everyone) == 0


async def test_a_leave_and_a_join_in_one_view_restore_the_restarted_members_old_shard():
    """Node 2's process restarts and the survivors see only the view that admits the new one:
    its old shard comes from the freshest pulled copy (as for a departed owner), the rest is
    exact, and the new process takes its shard of the new split."""
    rng = np.random.default_rng(6)
    sums = SumOver()
    async with nodes(rng.standard_normal(N).astype(np.float32)) as ns:
        await train(rng, list(ns.st.values()), 2)
        await ns.st[1].push(rng.standard_normal(N).astype(np.float32))
        fresh = await ns.st[0].pull()  # node 0 holds the freshest copy of node 2's shard
        own = {i: ns.st[i].opt.w.copy() for i in (0, 1)}
        old = shard_bounds(N, [0, 1, 2])
        await ns.kill(2)
        joiner = await ns.add(2, joining=True, epoch=3)
        with pytest.raises(ConfigError, match="not listed as fresh"):
            await ns.st[0].reshard([0, 1, 2, 3], 4, sums.for_node(0), fresh=[2])
        with pytest.raises(ConfigError, match="cannot re-shard as fresh"):
            await ns.st[0].reshard([0, 1, 2], 4, sums.for_node(0), fresh=[0, 2])
        ws = await asyncio.gather(*(ns.st[i].reshard([0, 1, 2], 4, sums.for_node(i), fresh=[2]) for i in (0, 1)),
                                  joiner.reshard([0, 1, 2], 4, sums.for_node(2)))
        want = fresh.copy()
        for i in (0, 1):
            want[old[i][0]:old[i][1]] = own[i]
        assert all(w.tobytes() == want.tobytes() for w in ws)
        lo2, hi2 = old[2]
        assert not joiner.opt.export_state().any()  # node 2's optimizer state was lost with its process
        assert joiner.opt.w.tobytes() == want[lo2:hi2].tobytes() and joiner.epoch == 4
        await train(rng, [ns.st[0], ns.st[1], joiner], 1)


async def test_a_second_view_change_during_a_join_fails_it_and_it_is_redone_over_the_newer_view():
    rng = np.random.default_rng(7)
    sums = SumOver()
    async with nodes(rng.standard_normal(N).astype(np.float32)) as ns:
        await train(rng, list(ns.st.values()), 1)
        await ns.kill(2)
        await asyncio.gather(*(ns.st[i].reshard([0, 1], 2, sums.for_node(i)) for i in (0, 1)))
        want_w, _ = exact([ns.st[0], ns.st[1]])
        joiner = await ns.add(2, joining=True, epoch=2)

        async def failing(vec: np.ndarray, group: list[int], tag: str) -> np.ndarray:
            raise PeerFailure("node 1 failed", peers=(1,))
        with pytest.raises(PeerFailure):  # node 0 alone hears of a failure mid-join (view 3)
            await ns.st[0].reshard([0, 1, 2], 3, failing, fresh=[2])
        with pytest.raises(PeerFailure):
            await joiner.reshard([0, 1, 2], 3, failing)
        with pytest.raises(PeerFailure, match="no member of \\[2\\] held the store's state"):
            await joiner.reshard([2], 3, sums.for_node(2))  # only joiners (the others finished, say)
        assert not joiner.holds and joiner.epoch == 2  # nothing installed
        ws = await asyncio.gather(  # ... which was wrong: view 4 has everyone again
            ns.st[0].reshard([0, 1, 2], 4, sums.for_node(0), fresh=[2]),
            ns.st[1].reshard([0, 1, 2], 4, sums.for_node(1), fresh=[2]),
            joiner.reshard([0, 1, 2], 4, sums.for_node(2)))
        assert all(w.tobytes() == want_w.tobytes() for w in ws) and joiner.epoch == 4

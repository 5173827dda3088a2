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
from p2psync.params import ParamStore, ShardOptimizer, piece_ranges, shard_bounds
from p2psync.topology import mesh
from p2psync.transport import MemoryHub

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
    mine = ShardOptimizer(w0, lr=0.1, momentum=momentum, weight_decay=wd)
    for _ in range(5):
        g = rng.standard_normal(50).astype(np.float32)
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        mine.apply(0, 30, g[:30])
        mine.apply(30, 50, g[30:])
    np.testing.assert_allclose(mine.w, p.detach().numpy(), rtol=1e-5, atol=1e-6)


@contextlib.asynccontextmanager
async def stores(topo: Any, w0: np.ndarray, **kw: Any) -> AsyncIterator[dict[int, ParamStore]]:
    hub = MemoryHub(topo)
    eps = {i: hub.endpoint(i, default_timeout=5) for i in topo.ids}
    servers = {i: RpcServer(eps[i]) for i in topo.ids}
    out = {}
    for i in topo.ids:
        await eps[i].start()
        out[i] = ParamStore(transport=eps[i], rpc_server=servers[i], rpc=RpcClient(eps[i], local=servers[i]),
                            members=topo.ids, params=w0, **{"lr": 0.1, "timeout": 2.0, **kw})
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


async def test_a_malformed_piece_is_refused_counted_and_answered():
    async with stores(mesh(2), np.zeros(8, np.float32)) as st:
        ep0 = st[0].transport
        await ep0.send(1, "ps.push", [np.zeros(3, np.float32)], meta={"o": 0, "ack": "ps.ack.x", "lo": -5, "hi": -2})
        ack = await ep0.recv("ps.ack.x", timeout=2)
        assert "bad piece" in ack.meta["err"] and st[1].malformed == 1
        assert st[1].version == 0 and not st[1].opt.w.any()

"""The sharded parameter store over real ZeroMQ on a ring: owners two hops away are reached by
forwarding over direct links; concurrent pushes all land; every pull agrees afterwards. And
ElasticBSP / BSP on it: every worker pulls identical weights at every barrier."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from p2psync.coordinator import RpcClient, RpcServer
from p2psync.params import OptimSpec, ParamStore
from p2psync.topology import mesh, ring
from tests.helpers import (close_strategies, free_port, record_barrier_pulls, run_until_stop, slowed_trainers,
                           start_strategies, zmq_cluster)

pytestmark = pytest.mark.timeout(60)


async def test_ring_pushes_reach_owners_two_hops_away_and_pulls_agree():
    topo = ring(4, base_port=free_port())
    rng = np.random.default_rng(2)
    w0 = rng.standard_normal(3001).astype(np.float32)
    grads = {i: [rng.standard_normal(3001).astype(np.float32) for _ in range(3)] for i in topo.ids}
    async with zmq_cluster(topo) as eps:
        servers = {i: RpcServer(eps[i]) for i in topo.ids}
        st = {i: ParamStore(transport=eps[i], rpc_server=servers[i], rpc=RpcClient(eps[i], local=servers[i]),
                            members=topo.ids, params=w0,
                            optim=OptimSpec.of(torch.optim.SGD, w0.size, lr=0.1), piece_bytes=1024, timeout=10.0) for i in topo.ids}
        for i in topo.ids:
            servers[i].start()
            st[i].start()
        try:
            async def worker(i: int) -> int:
                fwd = 0
                for g in grads[i]:
                    fwd += (await st[i].push(g)).forwarded
                return fwd
            forwarded = await asyncio.gather(*(worker(i) for i in topo.ids))
            pulls = await asyncio.gather(*(st[i].pull() for i in topo.ids))
            relayed = sum(s.forwarded for s in st.values())
        finally:
            for i in topo.ids:
                await st[i].close()
                await servers[i].close(grace=0.1)
    want = w0 - 0.1 / 4 * np.sum([g for gs in grads.values() for g in gs], axis=0)
    for p in pulls:
        np.testing.assert_allclose(p, want, rtol=1e-4, atol=1e-5)
        assert p.tobytes() == pulls[0].tobytes()
    assert all(f > 0 for f in forwarded) and relayed > 0  # the opposite node's shard is two hops away
    assert all(s.version == 12 for s in st.values())


@pytest.mark.parametrize("name,opts,steps", [("elastic_bsp", {"R": 2}, 120), ("bsp", {}, 20)])
async def test_every_worker_pulls_identical_weights_at_every_barrier(name, opts, steps):
    """Heterogeneous step times, momentum, and node 2's link to node 1 slow: node 2's pull of
    a barrier reaches owner 1 after node 0 (fast) pulled, computed and pushed its next
    gradient. Every worker's pulled vector is recorded at every barrier: all identical; some
    pull of a barrier did come after a push of the next generation (the race happened)."""
    topo = mesh(3, base_port=free_port())
    trainers = slowed_trainers(topo, "0:0.002,1:0.008,2:0.012")
    async with zmq_cluster(topo) as eps:
        strats = await start_strategies(eps, topo, name, options=opts, trainers=trainers)
        try:
            seen = record_barrier_pulls(strats)
            reps = await run_until_stop(strats, steps)
            late = sum(s.store.barriers.late_pulls for s in strats)
            misses = sum(s.store.barriers.misses for s in strats)
            got = [await s.ctx.replica.get_params() for s in strats]
        finally:
            await close_strategies(strats)
    assert len(seen) >= 2 and min(seen) == 1, sorted(seen)
    for b, pulled in seen.items():
        assert len(pulled) == 3 and len(set(pulled.values())) == 1, b
    assert misses == 0 and late >= 1 and all(len(r) >= 3 for r in reps)
    for x in got[1:]:
        assert x.tobytes() == got[0].tobytes()

"""The sharded parameter store over real ZeroMQ on a ring: owners two hops away are reached by
forwarding over direct links; concurrent pushes all land; every pull agrees afterwards."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from p2psync.coordinator import RpcClient, RpcServer
from p2psync.params import ParamStore
from p2psync.topology import ring
from tests.helpers import free_port, zmq_cluster

pytestmark = pytest.mark.timeout(60)


async def test_ring_pushes_reach_owners_two_hops_away_and_pulls_agree():
    topo = ring(4, base_port=free_port())
    rng = np.random.default_rng(2)
    w0 = rng.standard_normal(3001).astype(np.float32)
    grads = {i: [rng.standard_normal(3001).astype(np.float32) for _ in range(3)] for i in topo.ids}
    async with zmq_cluster(topo) as eps:
        servers = {i: RpcServer(eps[i]) for i in topo.ids}
        st = {i: ParamStore(transport=eps[i], rpc_server=servers[i], rpc=RpcClient(eps[i], local=servers[i]),
                            members=topo.ids, params=w0, lr=0.1, piece_bytes=1024, timeout=10.0) for i in topo.ids}
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

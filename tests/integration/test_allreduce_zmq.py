"""Group allreduce over real ZeroMQ: exact results, bitwise-identical replicas, any topology."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from p2psync.collectives import GroupPlan, allreduce
from p2psync.errors import PeerTimeout
from p2psync.topology import bcube, mesh, ring, star
from tests.helpers import free_port, zmq_cluster

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("make", [lambda p: ring(4, base_port=p), lambda p: star(5, base_port=p),
                                  lambda p: bcube(2, 2, base_port=p), lambda p: mesh(3, base_port=p)])
@pytest.mark.parametrize("size", [1, 3, 1001])
async def test_allreduce_matches_numpy(make, size):
    topo = make(free_port())
    rng = np.random.default_rng(size)
    data = {i: rng.standard_normal(size).astype(np.float32) for i in topo.ids}
    plan = GroupPlan.for_group(topo, topo.ids)
    async with zmq_cluster(topo) as eps:
        outs = await asyncio.gather(*(allreduce(eps[i], data[i], plan, tag="ar.0") for i in topo.ids))
    ref = np.sum([data[i] for i in topo.ids], axis=0, dtype=np.float64)
    for o in outs:
        np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-5)
        assert o.tobytes() == outs[0].tobytes()  # bitwise identical everywhere


async def test_group_subset_and_untouched_input():
    topo = mesh(5, base_port=free_port())
    group = [1, 3, 4]
    plan = GroupPlan.for_group(topo, group)
    async with zmq_cluster(topo) as eps:
        xs = {i: np.full(10, float(i), dtype=np.float32) for i in group}
        outs = await asyncio.gather(*(allreduce(eps[i], xs[i], plan, tag="g", average=True) for i in group))
    for i, o in zip(group, outs):
        np.testing.assert_allclose(o, np.full(10, 8 / 3, dtype=np.float32), rtol=1e-6)
        assert xs[i][0] == i  # caller's array untouched


async def test_missing_peer_times_out_without_touching_input():
    topo = ring(3, base_port=free_port())
    plan = GroupPlan.for_group(topo, topo.ids)
    async with zmq_cluster(topo, timeout=1) as eps:
        x = np.ones(8, dtype=np.float32)
        with pytest.raises((PeerTimeout,)):
            await asyncio.gather(allreduce(eps[0], x, plan, tag="t", timeout=0.5),
                                 allreduce(eps[1], x.copy(), plan, tag="t", timeout=0.5))
        assert (x == 1).all()

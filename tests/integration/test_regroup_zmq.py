"""Regroup.average_state over real ZeroMQ: one exact average of the whole state, the step to
go on at, and a flag that rides along (a member that averages because it stops makes the
others stop: Canary's stop meeting a re-synchronization, review M1)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from p2psync.strategies.regroup import Regroup
from p2psync.topology import ring
from tests.helpers import close_replica, free_port, gate_replicas, make_context, make_trainer, zmq_cluster

pytestmark = pytest.mark.timeout(60)


async def test_average_state_agrees_on_the_step_and_carries_a_flag():
    topo = ring(3, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        trainers = gate_replicas({i: make_trainer(topo, i, seed=i) for i in topo.ids})
        ctxs = {i: make_context(topo, eps[i], trainers[i]) for i in topo.ids}
        for c in ctxs.values():
            c.rpc_server.start()
        try:
            before = [await t.get_params() for t in trainers.values()]
            assert before[0].tobytes() != before[1].tobytes()
            groups = [Regroup(ctx=ctxs[i], name="rg") for i in topo.ids]
            got = await asyncio.gather(*(g.average_state(4, step, flag) for g, step, flag
                                         in zip(groups, (7, 9, 8), (False, True, False))))
            after = [await t.get_params() for t in trainers.values()]
        finally:
            for c in ctxs.values():
                await c.rpc_server.close()
            for t in trainers.values():
                await close_replica(t)
    assert got == [(5, 10, True)] * 3  # the next count, the highest step + 1, any flag
    np.testing.assert_allclose(after[0], np.mean(before, axis=0), rtol=1e-6, atol=1e-7)
    assert all(a.tobytes() == after[0].tobytes() for a in after)

"""Coordinator failover for the parameter-store strategies (issue 14) over real ZeroMQ, in one
process: the coordinator (node 0) is also a worker and a shard owner. It crashes mid-run; the
lowest live id (node 1) takes over and starts a fresh scheduler, which adopts the survivors'
push counts (well above 1) from their reports retried there; the store re-shards without node 0;
the survivors finish, within the staleness bound (SSP), in lockstep rounds (BSP, the store in
rounds mode) or through further barriers (ElasticBSP), with one model.

Nodes are built as in :mod:`tests.integration.test_leave_join_zmq` with ``failover=True``:
every node runs a CoordinatorHost, as a node process does."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from p2psync.coordinator.ssp_service import SchedulerService
from p2psync.topology import ring
from tests.helpers import free_port, until
from tests.integration.test_leave_join_zmq import _crash, _finish, _params, _train, cluster

pytestmark = pytest.mark.timeout(90)

STEPS = 50


@pytest.mark.parametrize("strategy,options", [("ssp", {"s": 2}), ("bsp", {}), ("elastic_bsp", {"R": 3})])
async def test_store_coordinator_dies_survivors_take_over_and_end_with_one_model(strategy, options):
    topo = ring(4, base_port=free_port())
    async with cluster(topo, strategy, options=options, failover=True) as nodes:
        await _train(nodes, STEPS, warm=8)
        loop = asyncio.get_running_loop()
        t_kill = loop.time()
        survivors = await _crash(nodes, 0)
        at_crash = {n.id: (n.strategy.count, len(n.reports)) for n in survivors}
        await until(lambda: all(len(n.reports) > at_crash[n.id][1] + 1 for n in survivors), 30,
                    "every survivor to step under the new coordinator")
        print(f"{strategy}: coordinator killed -> every survivor stepped twice under node 1 in "
              f"{loop.time() - t_kill:.2f}s (failure detection floor 1 s)")
        ends = await _finish(survivors)
        params = await _params(survivors)
        host = nodes[1].host
        assert host is not None and host.coordinating
        svc = nodes[1].server.handlers[f"{strategy}.pushed"].__self__  # type: ignore[attr-defined]
        assert isinstance(svc, SchedulerService)
        counts = {n.id: n.strategy.count for n in survivors}
        reshards = [n.strategy.reshards for n in survivors]
        members = [n.strategy.store.members for n in survivors]
        after = {n.id: n.reports[at_crash[n.id][1]:] for n in survivors}
    assert max(ends) == STEPS and all(counts[i] > c + 3 for i, (c, _) in at_crash.items()), (at_crash, counts)
    # the new coordinator's scheduler adopted every survivor's count (none refused), dropped node 0
    assert svc.rejected == 0 and set(svc.sched.counts) == {1, 2, 3} and not svc.sched.unheard
    assert all(svc.sched.counts[i] >= at_crash[i][0] for i in (1, 2, 3)), (svc.sched.counts, at_crash)
    assert reshards == [1, 1, 1] and all(m == [1, 2, 3] for m in members)
    oks: list[dict[str, Any]] = [r for reps in after.values() for r in reps if r.get("gap") is not None]
    assert oks, after
    if strategy == "ssp":
        assert max(r["gap"] for r in oks) <= options["s"]
    elif strategy == "bsp":  # rounds go on in lockstep: every OK a barrier at gap 0
        assert all(r["gap"] == 0 and r["barrier"] for r in oks), oks
    else:  # barriers go on under the new coordinator, every survivor released from each
        assert sum(1 for r in oks if r.get("barrier")) >= 3, oks
    for p in params[1:]:
        assert p.tobytes() == params[0].tobytes()
    assert np.isfinite(params[0]).all()

"""BSP / SSP / DSSP / ElasticBSP on the sharded store over the in-memory transport, with real
trainers, the real scheduler service and RPC (spec §10: "Under plain SGD with eta/n per push:
SSP(0), DSSP(0,0) and the sharded-store BSP give the same final weights as the allreduce ssgd
baseline")."""

from __future__ import annotations

import numpy as np
import pytest

from p2psync.topology import mesh
from tests.helpers import memory_strategies, run_until_stop

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("name,opts", [("bsp", {}), ("ssp", {"s": 0}), ("dssp", {"s_lower": 0, "s_upper": 0})])
async def test_store_bsp_ssp0_dssp00_equal_ssgd_with_plain_sgd(name, opts):
    topo = mesh(3)
    async with memory_strategies(topo, name, opts, momentum=0.0) as st:
        reps = await run_until_stop(st, 6)
        got = [await s.ctx.replica.get_params() for s in st]
    async with memory_strategies(topo, "ssgd", {}, momentum=0.0) as ss:
        await run_until_stop(ss, 6)
        want = await ss[0].ctx.replica.get_params()
    assert [len(r) for r in reps] == [6, 6, 6]
    for x in got:
        np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-6)
        assert x.tobytes() == got[0].tobytes()  # everyone pulled the same weights


async def test_ssp_bounds_the_staleness_the_fast_worker_runs_ahead_and_everyone_ends_equal():
    """Worker 0 is 4x faster: it runs ahead by at most s pushes at every OK (spec §2.2), more
    than BSP would let it, and the stop barrier leaves every node with the same weights."""
    async with memory_strategies(mesh(3), "ssp", {"s": 2}, step_times="0:0.005,1:0.02,2:0.02") as st:
        reps = await run_until_stop(st, 30)
        got = [await s.ctx.replica.get_params() for s in st]
    gaps = [r["gap"] for rs in reps for r in rs if "gap" in r]
    assert max(gaps) <= 2 and max(gaps) >= 1, gaps
    assert len(reps[0]) >= max(len(reps[1]), len(reps[2]))
    for x in got[1:]:
        assert x.tobytes() == got[0].tobytes()


async def test_elastic_bsp_releases_barriers_and_everyone_pulls_identical_weights():
    async with memory_strategies(mesh(3), "elastic_bsp", {"R": 4}, step_times="0:0.004,1:0.01,2:0.016") as st:
        reps = await run_until_stop(st, 40)
        got = [await s.ctx.replica.get_params() for s in st]
    barriers = [r["barrier"] for rs in reps for r in rs if r.get("barrier")]
    assert barriers and min(barriers) == 1  # at least one superstep ended with a barrier
    assert all(sum(1 for r in rs if r.get("barrier")) >= 1 for rs in reps)  # every worker took part
    for x in got[1:]:
        assert x.tobytes() == got[0].tobytes()

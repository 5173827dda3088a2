"""BSP / SSP / DSSP / ElasticBSP on the sharded store over the in-memory transport, with real
trainers, the real scheduler service and RPC (spec §10: "Under plain SGD with eta/n per push:
SSP(0), DSSP(0,0) and the sharded-store BSP give the same final weights as the allreduce ssgd
baseline")."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from p2psync.coordinator.views import View
from p2psync.errors import PeerFailure
from p2psync.tasks import cancel_all
from p2psync.topology import mesh
from tests.helpers import memory_strategies, record_barrier_pulls, run_until_stop, until

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


async def test_store_ssp0_and_dssp00_are_bsp_bitwise_and_every_round_pulls_identical_weights():
    """SSP(s=0) and DSSP(0, 0) with plain SGD equal BSP exactly (same seeds and batches):
    np.array_equal, not allclose; the owners apply a round in origin order whatever the arrival
    order, and every worker pulls identical weights at every round though node 2's pulls reach
    node 1 late (a slow link) and node 0 is fast."""
    runs = {}
    for name, opts in [("bsp", {}), ("ssp", {"s": 0}), ("dssp", {"s_lower": 0, "s_upper": 0})]:
        async with memory_strategies(mesh(3), name, opts, momentum=0.0, step_times="0:0.001,1:0.008,2:0.004") as st:
            seen = record_barrier_pulls(st)
            await run_until_stop(st, 8)
            runs[name] = [await s.ctx.replica.get_params() for s in st]
            late = sum(s.store.barriers.late_pulls for s in st)
        assert late >= 1  # some pull of round b came after a push of round b + 1
        assert sorted(seen) == list(range(1, 8)), sorted(seen)  # every OK but the STOP is a barrier
        for b, got in seen.items():
            assert len(got) == 3 and len(set(got.values())) == 1, b
    for name, got in runs.items():
        for x in got:
            assert np.array_equal(x, runs["bsp"][0]), name


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
    """At every barrier all workers pull identical weights (spec §10), though node 2's pulls
    reach node 1 after node 0 (fast) pulled, computed and pushed again: node 1 serves the
    barrier's copy (at least once here: the race happened)."""
    async with memory_strategies(mesh(3), "elastic_bsp", {"R": 4}, step_times="0:0.004,1:0.01,2:0.016") as st:
        seen = record_barrier_pulls(st)
        reps = await run_until_stop(st, 40)
        got = [await s.ctx.replica.get_params() for s in st]
        late = sum(s.store.barriers.late_pulls for s in st)
        misses = sum(s.store.barriers.misses for s in st)
    barriers = [r["barrier"] for rs in reps for r in rs if r.get("barrier")]
    assert barriers and min(barriers) == 1  # at least one superstep ended with a barrier
    assert all(sum(1 for r in rs if r.get("barrier")) >= 1 for rs in reps)  # every worker took part
    for b, pulled in seen.items():
        assert len(pulled) == 3 and len(set(pulled.values())) == 1, b
    assert late >= 1 and misses == 0
    for x in got[1:]:
        assert x.tobytes() == got[0].tobytes()


async def test_a_worker_held_by_the_scheduler_follows_a_view_that_drops_a_store_member_at_once():
    """The cycle of the coordinator failover (issue 14) under load: node 1 reported its push and
    is held (node 0 has not reported); a view drops node 2; node 0 re-shards the store over
    [0, 1], which needs node 1, and only then reports. Node 1 must re-shard at once, not after
    the scheduler's long poll (held forever here), or neither ever steps."""
    async with memory_strategies(mesh(3), "ssp", {"s": 0}) as st:
        svc = st[0].ctx.rpc_server.handlers["ssp.pushed"].__self__
        svc.hold = 3600.0  # no "wait" answer ends node 1's report
        held = asyncio.ensure_future(st[1].run_step(0, False))
        try:
            await until(lambda: 1 in svc._waiting, 10, "node 1 to be held by the scheduler")
            view = View(epoch=1, members=(0, 1))
            for s in st[:2]:
                s.ctx.membership.views.apply(view)
                s.on_view(view)
            reps = await asyncio.wait_for(asyncio.gather(st[0].run_step(0, False), held), 30)
        finally:
            await cancel_all([held])
        assert [s.reshards for s in st[:2]] == [1, 1] and [s.store.members for s in st[:2]] == [[0, 1]] * 2
        assert [r.extra["gap"] for r in reps] == [0, 0] and set(svc.sched.counts) == {0, 1}


@pytest.mark.parametrize("name,opts", [("bsp", {}), ("asp", {}), ("ssp", {"s": 1}), ("dssp", {"s_lower": 1, "s_upper": 3}),
                                       ("elastic_bsp", {"R": 3})])
async def test_a_schedule_that_sets_lr_to_zero_freezes_every_store_strategy(name, opts):
    """The owners step with the lr the workers' optimizers have when they push: a scheduler
    that sets it to 0 leaves the weights bitwise as they started (momentum 0.9, weight decay)."""
    import torch

    async with memory_strategies(mesh(3), name, opts, weight_decay=1e-3) as st:
        w0 = await st[0].ctx.replica.get_params()
        for s in st:
            torch.optim.lr_scheduler.LambdaLR(s.ctx.replica.flat.optimizer, lambda step: 0.0)
        await run_until_stop(st, 10)
        got = [await s.ctx.replica.get_params() for s in st]
    assert all(g.tobytes() == w0.tobytes() for g in got)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()`")  # the store steps, not the optimizer
async def test_bsp_follows_a_schedule_step_by_step():
    """A scheduler stepped after every round: BSP's weights move while lr > 0 and stop moving
    at the round whose pushes carry lr = 0 (the lr is read at each push, not at the start)."""
    import torch

    async with memory_strategies(mesh(3), "bsp", {}) as st:
        scheds = [torch.optim.lr_scheduler.LambdaLR(s.ctx.replica.flat.optimizer, lambda step: 1.0 if step < 3 else 0.0)
                  for s in st]
        seen = []
        for step in range(6):
            await asyncio.gather(*(s.run_step(step, step == 5) for s in st))
            for sc in scheds:
                sc.step()
            seen.append((await st[0].ctx.replica.get_params()).tobytes())
    assert len(set(seen[:3])) == 3 and len(set(seen[2:])) == 1, [hash(s) for s in seen]


def test_store_changes_name_lost_members_and_joiners_by_incarnation():
    from p2psync.strategies.ps import store_changes

    incs = {0: 10, 1: 11, 2: 12}
    same = View(epoch=3, members=(0, 1, 2), incarnations=dict(incs))
    assert store_changes([0, 1, 2], incs, same) == ([], [])
    left = View(epoch=4, members=(0, 1), incarnations={0: 10, 1: 11})
    assert store_changes([0, 1, 2], incs, left) == ([2], [])
    assert store_changes([0, 1], {0: 10, 1: 11}, View(epoch=5, members=(0, 1, 2), incarnations={**incs, 2: 13})) \
        == ([], [2])  # a join after the leave
    # the leave's view never seen: node 2's new process is a leave and a join in one view
    assert store_changes([0, 1, 2], incs, View(epoch=5, members=(0, 1, 2), incarnations={**incs, 2: 13})) \
        == ([2], [2])
    # a member that finished and left is not lost; unknown incarnations count as unchanged
    assert store_changes([0, 1, 2], incs, View(epoch=6, members=(0, 1), departed=(2,))) == ([], [])
    assert store_changes([0, 1], {}, View(epoch=6, members=(0, 1, 3), incarnations={3: 1})) == ([], [3])


async def test_a_re_shard_over_a_view_one_member_never_saw_gives_way_to_the_newer_view():
    """A partition: the coordinator publishes view 1 (node 3 dropped) that reaches nodes 0 and 1
    but not node 2, which is cut off; after the heal node 2 learns only view 3 (same members).
    Nodes 0 and 1, re-sharding over view 1 (which needs node 2), must give that re-shard up
    when view 3 arrives and re-shard over it with node 2, not wait out their timeout and fail.
    All three end at store epoch 3 with the exact state (identical pulled weights)."""
    async with memory_strategies(mesh(4), "elastic_bsp", {"R": 3}) as st:
        before = [await s.ctx.replica.get_params() for s in st[:3]]
        assert before[0].tobytes() == before[1].tobytes() == before[2].tobytes()
        old = View(epoch=1, members=(0, 1, 2))
        for s in st[:2]:
            s.ctx.membership.views.apply(old)
            s.on_view(old)
        moving = [asyncio.ensure_future(s._follow_view()) for s in st[:2]]
        try:
            await until(lambda: all(s.store._moving == 1 for s in st[:2]), 10, "nodes 0 and 1 to re-shard over view 1")
            new = View(epoch=3, members=(0, 1, 2))
            for s in st[:3]:
                s.ctx.membership.views.apply(new)
                s.on_view(new)
            got = await asyncio.wait_for(asyncio.gather(*moving, st[2]._follow_view()), 8)
        finally:
            await cancel_all(moving)
        assert [s.store.epoch for s in st[:3]] == [3, 3, 3] and [s.reshards for s in st[:3]] == [1, 1, 1]
        for w in got:
            assert w is not None and w.tobytes() == before[0].tobytes()


async def test_a_failed_push_over_a_suspicion_that_healed_goes_on_with_the_store_as_it_is():
    """A partition: node 1 followed another coordinator and took node 0 for failed, so its push
    failed; after the heal a newer view names every member again (no one was declared failed).
    The store has nothing to move: node 1 goes on at once (the push stays lost and counted),
    rather than wait out its timeout for a view that drops node 0 and then fail."""
    async with memory_strategies(mesh(3), "elastic_bsp", {"R": 3}) as st:
        waiting = asyncio.ensure_future(st[1]._follow_view(PeerFailure("elastic_bsp: peer 0 failed", peers=(0,))))
        try:
            await asyncio.sleep(0.3)
            assert not waiting.done()  # no newer view yet: it waits for one
            healed = View(epoch=2, members=(0, 1, 2))
            st[1].ctx.membership.views.apply(healed)
            st[1].on_view(healed)
            assert await asyncio.wait_for(waiting, 3) is None
        finally:
            await cancel_all([waiting])
        assert st[1].reshards == 0 and st[1].store.members == [0, 1, 2] and st[1].store.moving is None

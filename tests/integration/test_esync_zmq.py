"""ESync over real ZeroMQ: 4 nodes with slowdowns 1,1,2,8 (emulated step times); non-blocking
mode against blocking with slowness that really computes."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from p2psync.topology import mesh, ring
from tests.helpers import close_strategies, free_port, slowed_trainers, start_strategies, zmq_cluster
from tests.unit.test_esync import run_esync_rounds

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
async def test_esync_fast_nodes_iterate_more_and_replicas_match(mode):
    topo = ring(4, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        n_local = await run_esync_rounds(eps, topo, rounds=5, mode=mode)
    fast = np.mean(n_local[0] + n_local[1])
    assert fast > np.mean(n_local[2]) >= np.mean(n_local[3]), n_local
    assert fast >= 2 * np.mean(n_local[3])


async def _timed_rounds(mode: str, slowdown_mode: str, rounds: int = 6):
    """Two nodes, step times 0.05 s and 0.4 s, slowness that really computes (or waits)."""
    topo = mesh(2, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        trainers = slowed_trainers(topo, "0:0.05,1:0.4", mode=slowdown_mode)
        strats = await start_strategies(eps, topo, "esync", options={"mode": mode}, trainers=trainers)
        try:
            times, reps = [], []
            for r in range(rounds):
                t0 = time.monotonic()
                reps.append(await asyncio.gather(*(s.run_step(r, r == rounds - 1) for s in strats)))
                times.append(time.monotonic() - t0)
            for i, tr in trainers.items():  # batch test + completed local iterations, nothing else
                done = 1 + sum(rr[i].extra["n_local"] for rr in reps)
                assert tr.batches_done == done and tr.samples == done * tr.sampler.batch_size
        finally:
            await close_strategies(strats)
    return times[1:], reps[1:]


@pytest.mark.parametrize("slowdown_mode", ["compute", "wait"])
async def test_nonblocking_abandons_the_iteration_in_flight(slowdown_mode):
    """Issue 9.2 / paper §4.2: on READY the slow node aborts its iteration at once, so a
    non-blocking round is no slower than a blocking one (it used to take twice as long, the
    aggregation queued behind the abandoned computation), and the fastest node waits less than
    about its own step time for the aggregation."""
    blk, _ = await _timed_rounds("blocking", slowdown_mode)
    nb, reps = await _timed_rounds("nonblocking", slowdown_mode)
    assert np.median(nb) <= 1.25 * np.median(blk) + 0.05, (nb, blk)
    # the aggregation does not queue behind the slow node's abandoned iteration (which would add
    # the rest of its 0.4 s): the fast node waits at most about its own step time. Measured
    # 0.02-0.06 s; the bound, 0.1 s, leaves room for a loaded machine (0.054 with both cores
    # busy beside the suite) and is still a quarter of the slow node's step
    assert np.median([rr[0].extra["blocking_s"] for rr in reps]) < 0.1, reps
    assert sum(rr[1].extra["abandoned"] for rr in reps) >= 1  # the slow node did abandon work

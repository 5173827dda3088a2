"""P-Reduce over real ZeroMQ (issue 13): six nodes, P = 3, three fast and three slow devices
(emulated step times), the controller on the coordinator.

The fast workers must not wait for the slow ones (the point of the paper, Sec. 1 / 3.1): they
form groups among themselves and with whichever slow worker is queued, so they run several
times as many local steps as the slow ones in the same time, and their wait for a group stays
a small fraction of a slow step (all-reduce would make them wait a whole slow step, every
step). The run converges and ends with one model on every node (Alg. 2 line 8).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from p2psync.topology import mesh
from tests.helpers import evaluate, free_port, run_until_stop, slowed_trainers

pytestmark = pytest.mark.timeout(120)

FAST, SLOW = 0.02, 0.12  # emulated seconds per step
STEPS = 60


@pytest.mark.parametrize("weights", ["constant", "dynamic"])
async def test_six_nodes_p3_heterogeneous_fast_workers_do_not_wait(weights, zmq_endpoints, strategies):
    topo = mesh(6, base_port=free_port())
    times = ",".join(f"{i}:{FAST if i < 3 else SLOW}" for i in topo.ids)
    strats = await strategies(await zmq_endpoints(topo), topo, "preduce", options={"P": 3, "weights": weights},
                              trainers=slowed_trainers(topo, times))
    reps = await asyncio.wait_for(run_until_stop(strats, STEPS), 90)
    out = [(len(r), r) for r in reps]
    accs = [(await evaluate(s))[1] for s in strats]
    params = [await s.ctx.replica.get_params() for s in strats]
    steps = [n for n, _ in out]
    groups = [r for _, reps in out for r in reps if "op" in r]
    assert groups and all(r["group"] == 3 and r["applied"] for r in groups)
    assert max(steps) == STEPS and min(steps[:3]) >= STEPS - 5, steps  # the fast ones ran the budget
    assert min(steps[:3]) >= 2 * max(steps[3:]), steps  # and were not held back by the slow ones
    fast_wait = np.mean([r["queue_s"] for _, reps in out[:3] for r in reps])
    print(f"{weights}: steps {steps}, fast workers' mean wait for a group {fast_wait * 1e3:.1f} ms "
          f"(slow step {SLOW * 1e3:.0f} ms), groups {max(r['op'] for r in groups)}, accuracy {accs[0]:.3f}")
    assert fast_wait < 0.4 * SLOW, fast_wait
    assert all(any(r.get("op") for r in reps) for _, reps in out)  # every worker was grouped
    for p in params[1:]:  # the final average
        np.testing.assert_allclose(p, params[0], rtol=1e-6, atol=1e-7)
    assert accs[0] > 0.6, accs

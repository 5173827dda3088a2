"""Resume after a failure: a node of an SSGD run dies, the survivors go on (and checkpoint
further), then the whole run dies. ``p2psync run --resume`` continues at the latest checkpoint
any node has: the node that died first adopts that state, and every node trains to the end
with bitwise the same parameters."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from p2psync.api import checkpoint
from tests.e2e.test_cli_run import agreement, cli, lines, node_logs, ring_run, wait_for

pytestmark = pytest.mark.timeout(240)

STEPS = 200
EVERY = 10


def _ckpt_step(run, i: int) -> int:
    try:
        return int(checkpoint.load(checkpoint.node_checkpoint(run, i))["step"])
    except Exception:  # not written yet
        return -1


def test_a_run_that_died_after_a_node_resumes_at_the_latest_checkpoint_and_finishes(tmp_path) -> None:
    with ring_run(tmp_path, "kr", "--steps", STEPS, "--checkpoint-every", EVERY, step_s=0.05) as (_, run, procs):
        wait_for(lambda: _ckpt_step(run, 2) >= EVERY, 60, "node 2's first checkpoint")
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait(30)
        dead_at = _ckpt_step(run, 2)
        wait_for(lambda: all(_ckpt_step(run, i) >= dead_at + 2 * EVERY for i in (0, 1, 3)), 90,
                 "the survivors to re-form and checkpoint further")
        for i in (0, 1, 3):  # then the whole run dies
            procs[i].send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(30)
    steps = {i: _ckpt_step(run, i) for i in range(4)}
    latest = max(steps.values())
    assert steps[2] < latest and latest < STEPS, steps
    topo = next(tmp_path.glob("r4.json"))
    t0 = time.monotonic()
    r = cli("run", topo, "--strategy", "ssgd", "--steps", STEPS, "--checkpoint-every", EVERY, "--out", tmp_path,
            "--run-id", "kr", "--resume", run, "--eval-every", 1000, "--threads", 1, "--no-progress", timeout=150)
    assert r.returncode == 0, r.stderr[-3000:] + node_logs(run)
    print(f"checkpoints at {steps}; resumed at {latest} and finished in {time.monotonic() - t0:.1f}s")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failed"] == [] and set(summary["nodes"]) == {"0", "1", "2", "3"}
    done, hashes = agreement(summary)
    assert done == {STEPS} and len(hashes) == 1, summary["nodes"]
    donor = min(i for i, s in steps.items() if s == latest)
    for i in range(4):
        log = (run / f"node-{i}.log").read_text()
        said = re.findall(rf"node {i}: resuming at step (\d+)", log)
        assert said == [str(latest)], log[-3000:]
    assert f"node 2: adopted node {donor}'s state at step {latest}" in (run / "node-2.log").read_text()
    assert lines(run / "node-2.jsonl")[-1]["step"] == STEPS

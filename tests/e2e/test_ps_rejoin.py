"""The parameter-store strategies take a fenced node back, over real processes started by the
launcher (``p2psync run TOPOLOGY --strategy elastic_bsp``, as a user runs it): node 2 of a
3-node ring (a member, not the coordinator) is stopped (SIGSTOP) until the majority re-shards the
store without it, then continued; it learns it was removed (fenced), exits 75, the launcher
starts it again, and the new process joins the store (a re-shard over the three) and trains on
with the others. The run ends with exit 0, a summary naming every node, none failed, and one
model (the last pull after the end barrier is the same on every node)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bench.faults import node_pid, run_pids
from p2psync.topology import ring, save
from tests.e2e.test_cli_run import ROOT, lines, node_logs, wait_for, wait_training
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(240)

#: the run's budget: node 2's new process joins well before its end (by step ~110 in runs here)
STEPS = 300


def _reshards(run, node: int) -> int:
    recs = lines(run / f"node-{node}.jsonl")
    return int(recs[-1].get("reshards", 0)) if recs else 0


def test_elastic_bsp_paused_member_is_fenced_restarted_and_rejoins_the_store(tmp_path):
    topo_path = tmp_path / "ring3.json"
    save(ring(3, base_port=free_port()), topo_path)
    run_id = "psjoin"
    cmd = [sys.executable, "-m", "p2psync", "run", str(topo_path), "--strategy", "elastic_bsp", "--opt", "R=3",
           "--steps", str(STEPS), "--step-time", "0:0.05,1:0.05,2:0.05", "--out", str(tmp_path), "--run-id", run_id,
           "--threads", "1", "--eval-every", "1000", "--no-progress"]
    err = tmp_path / "launcher.err"
    with err.open("wb") as err_f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_f, cwd=ROOT, start_new_session=True)
    run = tmp_path / run_id
    try:
        wait_training(run, 3, steps=10)
        pid = node_pid(2, proc.pid, (str(tmp_path), run_id))
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            wait_for(lambda: _reshards(run, 0) >= 1, 40, "the majority to re-shard without node 2")
            time.sleep(max(0.0, 3.0 - (time.monotonic() - t_stop)))
        finally:
            os.kill(pid, signal.SIGCONT)
        rc = proc.wait(timeout=150)
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            for left in run_pids((str(tmp_path), run_id)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(left, sig)
        proc.wait()
    err_text = err.read_text(errors="replace")
    assert rc == 0, (rc, err_text[-4000:], node_logs(run))
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["nodes"]) == {"0", "1", "2"} and summary["failed"] == [], (summary, err_text[-3000:])
    assert summary["rejoined"] == {"2": 1}, summary
    assert len({v["params_sha1"] for v in summary["nodes"].values()}) == 1, summary["nodes"]
    assert "node 2 was removed from the run" in err_text and "starting it again (1/3)" in err_text, err_text[-3000:]
    log2 = (run / "node-2.log").read_text(errors="replace")
    after = log2[log2.index("removed from the run"):]  # the new process, in the same log
    assert "joined the parameter store" in after, log2[-4000:]
    # the new process trained (its records: one re-shard, the join; the paused process made none)
    recs = lines(run / "node-2.jsonl")
    assert sum(1 for r in recs if r.get("reshards") == 1) >= 10, recs[-3:]
    assert max(v["steps"] for v in summary["nodes"].values()) == STEPS, summary["nodes"]  # the run's last step

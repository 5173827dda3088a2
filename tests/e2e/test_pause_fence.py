"""Pauses never split the run: SIGSTOP a member or the coordinator of an SSGD ring for 3 s or
15 s. The majority goes on without it; after SIGCONT the paused node learns that it was removed
(fenced), exits with EXIT_FENCED, and — started again as a launcher would — rejoins with the
majority's state. Every node that finishes holds the same model, and the summary, written by the
majority's coordinator only, names every node."""

from __future__ import annotations

import json
import signal
import time

import pytest

from p2psync.cli.exit_codes import EXIT_FENCED
from tests.e2e.test_cli_run import agreement, exit_0, lines, node_logs, ring_run, wait_for

pytestmark = pytest.mark.timeout(300)


def _members(run, node: int) -> int | None:
    recs = lines(run / f"node-{node}.jsonl")
    return recs[-1].get("members") if recs else None


# a member paused ~4 s through the launcher: tests/e2e/test_partitions.py (runs by default)
@pytest.mark.parametrize("who, pause_s", [pytest.param(2, 3.0, marks=pytest.mark.slow), (0, 15.0)])
def test_paused_node_is_fenced_and_rejoins_one_model(tmp_path, who, pause_s):
    with ring_run(tmp_path, "pz", "--steps", "400", step_s=0.1) as (start, run, procs):
        procs[who].send_signal(signal.SIGSTOP)
        others = [i for i in range(4) if i != who]
        watcher = others[0]
        wait_for(lambda: _members(run, watcher) == 3, 40, "the majority to re-form without the paused node")
        time.sleep(max(0.0, pause_s - 2.0))
        procs[who].send_signal(signal.SIGCONT)
        _, err = procs[who].communicate(timeout=60)
        assert procs[who].returncode == EXIT_FENCED, (err[-4000:], node_logs(run))
        assert "removed from the run" in err, err[-3000:]
        procs.append(start(who))  # what the launcher does with a fenced node
        exit_0(procs, [*others, 4], timeout=180)
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["nodes"]) == {"0", "1", "2", "3"} and summary["failed"] == [], summary
    steps, hashes = agreement(summary)
    assert steps == {400} and len(hashes) == 1, summary["nodes"]
    if who == 0:  # the coordinator was deposed by an election: a newer term coordinates
        assert summary["coordinator"] == 1 and summary["term"] >= 1, summary

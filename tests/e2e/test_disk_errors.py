"""Disk errors never end a run: ``p2psync run`` with ``--checkpoint-every`` whose checkpoints go
to a full filesystem, or to a read-only folder, trains to the end on every node; each node says
once which file it could not write and why, counts the failures in its stats, and a checkpoint
written before the disk filled up stays intact."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from p2psync.api import checkpoint
from p2psync.topology import mesh, save
from tests.e2e.test_cli_run import cli, node_logs
from tests.helpers import free_port, read_only_folder, tiny_filesystem

pytestmark = pytest.mark.timeout(180)

STEPS = 8
#: the built-in job's checkpoint (its MLP and momentum, ~100 KiB) fits once, not twice
DISK_KIB = 160


def _run(tmp_path: Path, run_id: str) -> dict:
    topo = tmp_path / "mesh2.json"
    save(mesh(2, base_port=free_port()), topo)
    r = cli("run", topo, "--steps", STEPS, "--checkpoint-every", 2, "--out", tmp_path, "--run-id", run_id,
            "--no-progress", "--eval-every", 1000, "--threads", 1, timeout=150)
    run = tmp_path / run_id
    assert r.returncode == 0, r.stderr[-3000:] + node_logs(run)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failed"] == [] and {v["steps"] for v in summary["nodes"].values()} == {STEPS}, summary
    return summary


def _said_once(log: str, path: Path, why: str) -> None:
    said = re.findall(rf"cannot write the checkpoint {re.escape(str(path))}: ([^;]*);", log)
    assert said == [why], log[-3000:]


def test_checkpoints_onto_a_full_disk_warn_once_and_the_run_finishes(tmp_path: Path) -> None:
    run = tmp_path / "full"
    with tiny_filesystem(run / "node-0", DISK_KIB) as d0, tiny_filesystem(run / "node-1", DISK_KIB):
        summary = _run(tmp_path, "full")
        for i in (0, 1):
            path = checkpoint.node_checkpoint(run, i)
            _said_once((run / f"node-{i}.log").read_text(), path, "No space left on device (ENOSPC)")
            # steps 2 (written), 4, 6 and 8 (at the end): the first one is kept intact
            assert summary["nodes"][str(i)]["write_failures"] == {"checkpoint": STEPS // 2 - 1}
            assert checkpoint.load(path)["step"] == 2
        # (votes.json: the newest view's key, kept from the first view on, before the disk filled)
        assert sorted(p.name for p in d0.iterdir()) == ["checkpoint.pt", "incarnation", "votes.json"]


def test_checkpoints_into_a_read_only_folder_warn_once_and_the_run_finishes(tmp_path: Path) -> None:
    run = tmp_path / "ro"
    with read_only_folder(run / "node-0"), read_only_folder(run / "node-1"):
        summary = _run(tmp_path, "ro")
        for i in (0, 1):
            log = (run / f"node-{i}.log").read_text()
            _said_once(log, checkpoint.node_checkpoint(run, i),
                       "Read-only file system (EROFS)" if "EROFS" in log else "Permission denied (EACCES)")
            failures = summary["nodes"][str(i)]["write_failures"]
            assert failures["checkpoint"] == STEPS // 2 and failures["incarnation record"] == 1, failures

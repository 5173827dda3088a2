"""A keyed run with checkpoints, resumed, from the CLI in subprocesses (issue 16); the keys'
and options' own checks are in tests/unit/test_keys.py, the bitwise resume in
tests/integration/test_checkpoint_zmq.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from p2psync.cli.main import main
from p2psync.topology import load, mesh, save
from p2psync.transport.keys import ENV_WARNED
from tests.e2e.test_cli_run import cli, lines, node_logs
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(240)


def test_keys_gen_keyed_run_checkpoints_and_resume(tmp_path: Path) -> None:
    topo = tmp_path / "cluster.json"
    save(mesh(2, base_port=free_port()), topo)
    keys = tmp_path / "keys"
    assert main(["keys", "gen", str(topo), "--dir", str(keys)]) == 0  # (tests/unit/test_keys.py)
    assert load(topo).keyed
    r = cli("run", topo, "--steps", "4", "--checkpoint-every", "2", "--out", tmp_path, "--run-id", "k",
            "--keys", keys, "--no-progress")
    assert r.returncode == 0, r.stderr + r.stdout + node_logs(tmp_path / "k")
    assert "unauthenticated" not in r.stderr + node_logs(tmp_path / "k")
    for i in (0, 1):
        assert (tmp_path / "k" / f"node-{i}" / "checkpoint.pt").is_file()

    r = cli("run", topo, "--resume", tmp_path / "k", "--steps", "6", "--no-progress",
            env=_env(P2PSYNC_KEYS=str(keys)))
    assert r.returncode == 0, r.stderr + r.stdout + node_logs(tmp_path / "k")
    summary = json.loads((tmp_path / "k" / "summary.json").read_text())
    assert [summary["nodes"][str(i)]["steps"] for i in (0, 1)] == [6, 6]
    assert summary["nodes"]["0"]["params_sha1"] == summary["nodes"]["1"]["params_sha1"]
    steps = [rec["step"] for rec in lines(tmp_path / "k" / "node-0.jsonl")]
    assert steps[:4] == [1, 2, 3, 4] and steps[4:] == [5, 6], steps  # the second run went on at 4


#: a node's script that checks its keys as a Session does (an unkeyed cluster: the warning)
_CHECK_KEYS = ("import os; from p2psync.topology import load; from p2psync.transport.keys import node_keys; "
               "node_keys(None, load(os.environ['P2PSYNC_TOPOLOGY']), int(os.environ['P2PSYNC_NODE']), "
               "topo_path='t'); print('keys checked')")


def test_unauthenticated_said_once_per_run(tmp_path: Path) -> None:
    """Without keys the launcher says the cluster is unauthenticated, and its nodes (built-in
    job or script) do not say it again in their logs; ``--node K`` alone says it once."""
    topo = tmp_path / "cluster.json"
    save(mesh(2, base_port=free_port()), topo)
    env = {k: v for k, v in _env().items() if k != ENV_WARNED}
    r = cli("run", topo, "--steps", "1", "--out", tmp_path, "--run-id", "job", "--no-progress", env=env)
    assert r.returncode == 0, r.stderr + r.stdout + node_logs(tmp_path / "job")
    assert r.stderr.count("is unauthenticated") == 1, r.stderr
    assert "unauthenticated" not in node_logs(tmp_path / "job")

    r = cli("run", topo, "--out", tmp_path, "--run-id", "script", "--no-progress", "--",
            sys.executable, "-c", _CHECK_KEYS, env=env)  # (fails: the script never joins the run)
    logs = node_logs(tmp_path / "script")
    assert logs.count("keys checked") == 2, r.stderr + logs
    assert r.stderr.count("is unauthenticated") == 1 and "unauthenticated" not in logs, r.stderr + logs

    r = cli("run", topo, "--node", "0", "--out", tmp_path, "--run-id", "one", "--", sys.executable, "-c",
            _CHECK_KEYS, env=env)
    assert r.returncode == 0 and "keys checked" in r.stdout, r.stderr + r.stdout
    assert r.stderr.count("is unauthenticated") == 1, r.stderr


def _env(**extra: str) -> dict[str, str]:
    import os

    return {**os.environ, **extra}

"""Checkpoint and resume of the built-in job over real ZeroMQ (issue 16): two nodes in one
process (each with its own training thread and node runtime), SSGD on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from p2psync.api.checkpoint import load, node_checkpoint
from p2psync.cli.builtin_job import run_builtin
from p2psync.topology import load as load_topology
from p2psync.topology import mesh, save
from p2psync.training.config import RunConfig
from p2psync.training.node import build_trainer
from tests.helpers import free_port, in_threads

pytestmark = pytest.mark.timeout(120)


def _run(tmp_path: Path, topo: Path, run_id: str, steps: int, **opts: Any) -> dict[int, Any]:
    """The built-in job on both nodes; each node's final stats."""
    cfg = RunConfig(topology=str(topo), strategy="ssgd", steps=steps, out=str(tmp_path), run_id=run_id,
                    device="cpu", threads=1, start_timeout=30, peer_timeout=15, eval_every=1000, **opts)
    t = load_topology(topo)
    trainers = {i: build_trainer(cfg, t, i) for i in t.ids}  # in turn: torch's generator is global
    out = in_threads(lambda i: run_builtin(cfg, i, trainers[i]), t.ids, 100)
    for i in t.ids:
        if not isinstance(out.get(i), dict):
            raise AssertionError(f"node {i}: {out.get(i)!r}")
    return out


def test_ssgd_100_steps_equal_50_then_resume_50_bitwise(tmp_path: Path) -> None:
    topo = tmp_path / "mesh2.json"
    save(mesh(2, base_port=free_port()), topo)
    straight = _run(tmp_path, topo, "straight", 100)
    first = _run(tmp_path, topo, "first", 50, checkpoint_every=25)
    for i in (0, 1):
        ck = load(node_checkpoint(tmp_path / "first", i))
        assert ck["step"] == 50 and ck["extra"]["sampler"]["batches_done"] == 50
        assert {"model", "optimizer", "rng", "strategy_state"} <= set(ck)
        assert set(ck["optimizer"]["state"][0]) == {"momentum_buffer"}
    assert first[0]["params_sha1"] != straight[0]["params_sha1"]
    resumed = _run(tmp_path, topo, "first", 100, resume=str(tmp_path / "first"))
    for i in (0, 1):
        assert resumed[i]["steps"] == 100
        assert resumed[i]["params_sha1"] == straight[i]["params_sha1"] == straight[0]["params_sha1"]
    assert load(node_checkpoint(tmp_path / "first", 0))["step"] == 50  # no --checkpoint-every: kept

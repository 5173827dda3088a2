"""Checkpoint and resume over real ZeroMQ (issue 16 and its review): two nodes in one process
(each with its own training thread and node runtime), SSGD on CPU. The built-in job draws no
global random numbers after initialisation, so the RNG restore is checked by
tests/e2e/test_resume_script.py (one process per node, with dropout)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from p2psync.api.checkpoint import load, node_checkpoint, snapshot
from p2psync.api.session import Session
from p2psync.cli.builtin_job import run_builtin
from p2psync.errors import ConfigError
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


def _models(n: int) -> dict[int, tuple[nn.Module, torch.optim.Optimizer]]:
    out = {}
    for i in range(n):  # built here: torch's global generator is shared by threads
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        out[i] = (model, torch.optim.SGD(model.parameters(), lr=0.1))
    return out


def _resume(tmp_path: Path, strategy: str, steps: dict[int, int | None], run_id: str,
            train: bool = False) -> dict[int, Any]:
    """Two nodes of ``strategy``; node i loads a checkpoint of step ``steps[i]`` (None: starts
    fresh) and trains to step 10 if ``train``. Each node's (final step, parameters) or error."""
    topo = tmp_path / f"{run_id}.json"
    save(mesh(2, base_port=free_port()), topo)
    models = _models(2)
    ckpt = {i: snapshot(p2psync={"step": s, "samples": 0, "strategy": strategy, "run_id": "r", "node": i,
                                 "strategy_state": {}}, model=models[i][0], optimizer=models[i][1], extra={})
            for i, s in steps.items() if s is not None}
    with torch.no_grad():
        models[1][0].weight.add_(1.0)  # node 1's own state differs from node 0's
    if 1 in ckpt:
        ckpt[1]["model"] = {k: v.clone() for k, v in models[1][0].state_dict().items()}

    def node(i: int) -> tuple[int, torch.Tensor]:
        with Session(str(topo), i, strategy, out=str(tmp_path), run_id=run_id, steps=10, start_timeout=30,
                     peer_timeout=5) as s:
            if i in ckpt:
                s.load_state_dict(ckpt[i])
            model, opt = models[i]
            opt = s.attach(model, opt)
            while train and not s.should_stop:
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
            return s.step, torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    return in_threads(node, (0, 1), 60)


def test_fresh_and_resumed_nodes_stop_at_start_with_one_clear_error(tmp_path: Path) -> None:
    """Node 0 resumes from a checkpoint, node 1 starts fresh: both stop at attach with a
    ConfigError naming what each does, instead of node 1 waiting for the initial parameters
    node 0 never sends."""
    out = _resume(tmp_path, "ssgd", {0: 4, 1: None}, "fr")
    for i in (0, 1):
        assert isinstance(out.get(i), ConfigError) and "do not agree on how the run starts" in str(out[i]), out
        assert "node 0: checkpoint of step 4, node 1: fresh start" in str(out[i])


def test_checkpoints_of_other_steps_under_ssgd_resume_at_the_latest(tmp_path: Path, caplog) -> None:
    """SSGD's replicas are identical after every step: node 0's checkpoint of step 4 is behind
    node 1's of step 6, so the run resumes at step 6 with node 1's state on both nodes."""
    import logging

    with caplog.at_level(logging.WARNING, "p2psync.session"):
        out = _resume(tmp_path, "ssgd", {0: 4, 1: 6}, "os", train=True)
    for i in (0, 1):
        assert isinstance(out.get(i), tuple), out
    assert out[0][0] == out[1][0] == 10 and torch.equal(out[0][1], out[1][1])
    said = [r.getMessage() for r in caplog.records if "resuming at step" in r.getMessage()]
    assert sorted(m.split(":")[0] for m in said) == ["node 0", "node 1"], said
    assert all("resuming at step 6" in m and "node 1's state; node 0 adopts it" in m for m in said), said
    assert any("node 0: adopted node 1's state at step 6" in r.getMessage() for r in caplog.records)


def test_checkpoints_of_other_steps_of_a_strategy_whose_replicas_differ_are_refused(tmp_path: Path) -> None:
    out = _resume(tmp_path, "asgd", {0: 4, 1: 6}, "oa")
    for i in (0, 1):
        assert isinstance(out.get(i), ConfigError), out
        assert "checkpoints are not of one step (node 0: checkpoint of step 4, node 1: checkpoint of step 6)" \
            in str(out[i]) and "--strategy asgd keeps a different replica on each node" in str(out[i])


def test_state_dict_takes_the_event_loops_parts_on_the_event_loop(tmp_path: Path) -> None:
    """Background exchanges change the strategy's state and the error-feedback residuals on the
    event loop, so a checkpoint copies them there, not on the training thread."""
    topo = tmp_path / "mesh2.json"
    save(mesh(2, base_port=free_port()), topo)
    models = _models(2)
    seen: dict[int, list[str]] = {0: [], 1: []}

    def node(i: int) -> dict[str, Any]:
        with Session(str(topo), i, "ssgd", out=str(tmp_path), run_id="sd", steps=2, start_timeout=30,
                     peer_timeout=15, codec="int8", error_feedback=True) as s:
            model, opt = models[i]
            opt = s.attach(model, opt)
            while not s.should_stop:
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
            assert s.strategy is not None
            real = s.strategy.state_dict
            s.strategy.state_dict = lambda: seen[i].append(threading.current_thread().name) or real()  # type: ignore[method-assign]
            return s.state_dict()

    out = in_threads(node, (0, 1), 60)
    for i in (0, 1):
        assert isinstance(out.get(i), dict), out.get(i)
        assert seen[i] == [f"p2psync-node-{i}"]
        assert out[i]["feedback"]["ef"] and out[i]["step"] == 2


def test_a_resume_whose_latest_checkpoint_spent_the_budget_stops_every_node_alike(tmp_path: Path) -> None:
    """Node 1's checkpoint is at the run's last step, node 0's behind: both stop at start with
    the same error (node 0 used to wait for node 1, which had refused at attach alone)."""
    out = _resume(tmp_path, "ssgd", {0: 4, 1: 10}, "sp")
    for i in (0, 1):
        assert isinstance(out.get(i), ConfigError), out
        assert "resumes at step 10, its budget of 10 steps is spent" in str(out[i])

"""A node process that comes back as the run ends (``RunEnded``): the built-in job exits 0,
its session's marker goes to the run's folder, and a joiner that adopted the stop audits
with the members."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import p2psync.cli.builtin_job as builtin_job
from p2psync.api.driver import StepDriver
from p2psync.api.runtime import NodeRuntime
from p2psync.cli.run_cmd import run_one
from p2psync.errors import Fenced, RunEnded
from p2psync.topology import ring
from p2psync.training.config import RunConfig


def test_the_built_in_job_that_came_back_as_the_run_ended_exits_0(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: Any) -> None:
    def refused(cfg: RunConfig, node_id: int) -> dict[str, Any]:
        raise RunEnded("node 3: the run is ending")

    monkeypatch.setattr(builtin_job, "run_builtin", refused)
    assert issubclass(RunEnded, Fenced)  # (caught before Fenced, which exits 75 or 1)
    assert run_one(RunConfig(topology="t.json"), 3) == 0
    assert "not rejoined" in capsys.readouterr().err


def test_the_run_folder_is_known_before_the_rendezvous_when_the_run_id_is(tmp_path: Path) -> None:
    topo = ring(4)
    rt = NodeRuntime(cfg=RunConfig(topology="t.json", run_id="r1", out=str(tmp_path)), topo=topo, node_id=3)
    assert rt.run_dir == tmp_path / "r1"  # (the launcher reads node-3.ended there)


@pytest.mark.parametrize(("promise", "stop", "moved", "due"), [
    ("end", True, True, True),  # a joiner that adopted the operation carrying the stop audits with them
    ("end", True, False, True),
    ("every_step", False, True, False),  # a step that adopted a peer's state: no audit
    ("never", True, False, False),
])
def test_the_audit_at_the_stop_includes_a_joiner_that_adopted_it(promise: str, stop: bool, moved: bool,
                                                                  due: bool) -> None:
    driver: Any = SimpleNamespace(cfg=SimpleNamespace(audit_every=None), step=7)
    strategy: Any = SimpleNamespace(identical_replicas=promise)
    assert StepDriver._audit_due(driver, strategy, stop, moved) is due

"""A user's own script under ``p2psync run TOPOLOGY -- python script.py``: what the script sees
(``p2psync.session()`` before and after attach) and what the run folder holds afterwards.
One short two-node run serves every test of this module. Real processes, real ZeroMQ."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_attach_script import p2psync
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(240)

#: registers state on the session before attach, checks it is the one attach joins the run with
SCRIPT = """
import sys, torch, p2psync
s = p2psync.session()
assert s is not None and s.replica is None, s
taken = {"batches": 0}
s.register_state("taken", lambda: dict(taken), taken.update)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = p2psync.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
assert p2psync.session() is s and s.replica is not None
while not p2psync.should_stop():
    taken["batches"] += 1
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
print("script done", taken, flush=True)
"""


class Run:
    def __init__(self, folder: Path, result: Any, command: list[str]) -> None:
        self.folder, self.result, self.command = folder, result, command


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    from p2psync.topology import ring, save

    tmp = tmp_path_factory.mktemp("script-run")
    topo = tmp / "r2.json"
    save(ring(2, base_port=free_port()), topo)
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    command = [sys.executable, str(script), "--script-flag"]
    r = p2psync("run", topo, "--steps", "4", "--checkpoint-every", "2", "--out", tmp, "--run-id", "s",
                "--no-progress", "--peer-timeout", "20", "--", *command, timeout=200)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    return Run(tmp / "s", r, command)


def test_state_registered_on_the_session_before_attach_is_checkpointed(run: Run) -> None:
    import torch

    for i in range(2):
        assert "script done" in (run.folder / f"node-{i}.log").read_text()
        state = torch.load(run.folder / f"node-{i}" / "checkpoint.pt", weights_only=True)
        assert state["step"] == 4 and state["extra"]["taken"]["batches"] == 4, state["extra"]
    nodes = json.loads((run.folder / "summary.json").read_text())["nodes"]
    assert [nodes[str(i)]["local_steps"] for i in range(2)] == [4, 4]  # the script's optimizer.step() calls


def test_report_reads_a_script_runs_folder(run: Run) -> None:
    """The script logs no loss and never evaluates: the report shows '-' there, not a crash."""
    r = p2psync("report", run.folder, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| 0 |") or ln.startswith("| 1 |")]
    assert len(rows) == 2 and all(row.split("|")[4].strip() == "-" for row in rows), r.stdout
    assert (run.folder / "report.png").stat().st_size > 1000


def test_the_run_folder_records_the_command_not_the_built_in_jobs_options(run: Run) -> None:
    config = json.loads((run.folder / "config.json").read_text())
    assert config["command"] == run.command and config["steps"] == 4 and config["strategy"] == "ssgd"
    for name in ("model", "lr", "optimizer", "batch_size", "momentum", "data", "eval_every"):
        assert name not in config, name
    agreed = json.loads((run.folder / "summary.json").read_text())["config"]
    assert "lr" not in agreed and "model" not in agreed and agreed["steps"] == 4

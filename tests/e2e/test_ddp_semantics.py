"""DDP semantics for ordinary PyTorch scripts under ``ssgd`` (real processes, real ZeroMQ):
``backward()`` returns with the group's mean gradient (clipping and logged norms see it),
BatchNorm buffers are the lowest member's after every step, every node saves the same
``state_dict``, the result matches torch's own DistributedDataParallel on the same script,
and the replica audit turns a divergence into an error naming the node and the tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from p2psync.cli.exit_codes import EXIT_FAILED
from p2psync.topology import ring, save
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ordinary.py"


def _run(tmp_path: Path, run_id: str, *args: object, script: Path = EXAMPLE, n: int = 2,
         tail: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess[str], Path]:
    topo = tmp_path / f"ring{n}.json"
    if not topo.exists():
        save(ring(n, base_port=free_port()), topo)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "p2psync", "run", str(topo), "--strategy", "ssgd", *map(str, args),
                        "--out", str(tmp_path), "--run-id", run_id, "--no-progress", "--", sys.executable,
                        str(script), "--epochs", "1", *tail],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=200, stdin=subprocess.DEVNULL)
    return r, tmp_path / run_id


def _results(run: Path, n: int = 2) -> list[dict[str, Any]]:
    return [json.loads((run / f"node-{i}" / "result.json").read_text()) for i in range(n)]


def _one_model(run: Path) -> list[dict[str, Any]]:
    """The nodes' results, after checking that they hold one model and clipped one mean."""
    res = _results(run)
    # parameters and BatchNorm buffers bitwise equal (the saved state_dicts)
    assert len({x["state_sha1"] for x in res}) == 1, res
    # clip_grad_norm_ returned the same norm on every node: the norm of the mean gradient
    assert res[0]["grad_norms"] and all(x["grad_norms"] == res[0]["grad_norms"] for x in res)
    nodes = json.loads((run / "summary.json").read_text())["nodes"]
    assert len({nodes[k]["params_sha1"] for k in nodes}) == 1
    assert all(nodes[k]["audits"]["passed"] >= 1 and nodes[k]["audits"]["incomplete"] == 0 for k in nodes), nodes
    return res


def test_one_model_as_torch_ddp_trains_it(tmp_path: Path) -> None:
    """BatchNorm + AdamW + cosine + clipping + DataLoader workers: every node saves the same
    state_dict, and the run matches DistributedDataParallel on the same script and seed."""
    r, run = _run(tmp_path, "p2p")
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    mine = _one_model(run)[0]
    out = tmp_path / "ddp"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PSYNC_")}
    env["PYTHONPATH"] = str(ROOT)
    d = subprocess.run([sys.executable, str(ROOT / "tests" / "e2e" / "scripts" / "ddp_ordinary.py"), "2",
                        str(free_port()), str(out), "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=200, stdin=subprocess.DEVNULL)
    assert d.returncode == 0, d.stderr[-3000:]
    ref = json.loads((out / "rank-0.json").read_text())
    # the first step's clipped norm is the norm of the same mean gradient (summed in another order)
    assert mine["grad_norms"][0] == pytest.approx(ref["grad_norms"][0], rel=1e-4)
    assert len(mine["grad_norms"]) == len(ref["grad_norms"])
    assert abs(mine["accuracy"] - ref["accuracy"]) <= 0.005 + 1e-9, (mine["accuracy"], ref["accuracy"])


def test_gradient_accumulation_averages_every_pass(tmp_path: Path) -> None:
    r, run = _run(tmp_path, "acc", tail=("--accumulate", "2", "--workers", "0"))
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    _one_model(run)


def test_averaging_at_step_and_local_buffers_on_request(tmp_path: Path) -> None:
    """``--opt sync=step``: the norms the script logged are its own gradient's, which differ
    per node; ``--buffers local``: each node keeps its own running statistics, so the saved
    state_dicts differ (and the audit compares parameters only: the run succeeds)."""
    r, run = _run(tmp_path, "step", "--opt", "sync=step", "--buffers", "local", tail=("--workers", "0"))
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    res = _results(run)
    assert res[0]["grad_norms"] != res[1]["grad_norms"]
    assert len({x["state_sha1"] for x in res}) == 2


def test_a_diverged_replica_is_an_error_naming_node_and_tensor(tmp_path: Path) -> None:
    script = tmp_path / "skew.py"
    script.write_text(
        "import os, runpy, sys, torch\n"
        "import p2psync\n"
        "real = p2psync.attach\n"
        "def attach(model, opt):\n"
        "    out = real(model, opt)\n"
        "    if os.environ.get('P2PSYNC_NODE') == '1':\n"
        "        with torch.no_grad():\n"
        "            model.fc.bias.add_(1.0)  # a replica that silently differs\n"
        "    return out\n"
        "p2psync.attach = attach\n"
        f"sys.argv = [{str(EXAMPLE)!r}] + sys.argv[1:]\n"
        f"runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')\n")
    r, run = _run(tmp_path, "skew", script=script, tail=("--workers", "0"))
    assert r.returncode == EXIT_FAILED, r.stderr[-3000:] + r.stdout[-2000:]
    text = r.stdout + r.stderr + "".join((run / f"node-{i}.log").read_text() for i in range(2))
    assert "ReplicaMismatch" in text and "node(s) [1]" in text and "'fc.bias'" in text, text[-3000:]

"""Users' own scripts through ``p2psync run TOPOLOGY -- CMD`` and ``p2psync.attach`` (issue 11):
the shipped example under every strategy, single-node mode, and bad input. Real processes,
real ZeroMQ."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2psync.cli.exit_codes import EXIT_FAILED
from p2psync.strategies import REGISTRY
from p2psync.topology import bcube, ring, save
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "digits.py"
_ACC = re.compile(r"Accuracy: (\d+)/(\d+)")


def p2psync(*args: object, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "p2psync", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _topo(tmp_path: Path, n: int = 3) -> Path:
    path = tmp_path / f"ring{n}.json"
    save(ring(n, base_port=free_port()), path)
    return path


def _final_accuracy(log: Path) -> float:
    hits = _ACC.findall(log.read_text())
    assert hits, log.read_text()[-2000:]
    right, total = hits[-1]
    return int(right) / int(total)


# every strategy through attach over ZeroMQ: tests/integration/test_strategy_matrix.py (runs by
# default); through the launcher and this script, a synchronous and a local-steps strategy do
@pytest.mark.parametrize("strategy", ["ssgd", *(pytest.param(s, marks=pytest.mark.slow)
                                                for s in ("asgd", "esync", "dts", "preduce")), "diloco"])
def test_the_example_trains_under_every_strategy(tmp_path: Path, strategy: str) -> None:
    topo = _topo(tmp_path)
    # ASGD applies every peer's gradient as its own optimizer step (momentum included): three
    # nodes take three momentum steps per round, so the script's momentum 0.9 makes it unstable.
    # Its nodes also end at different times (see the bar below), and 6 epochs left the best node
    # at 0.77 once in a loaded CI run (usually 0.87-0.91): 9 epochs put it at 0.91-0.94 with a
    # busy loop beside (three runs)
    extra = ["--momentum", "0.5"] if strategy == "asgd" else []
    # ESync: 6 epochs gave 0.86-0.97 per node idle and with two busy loops beside (eight runs),
    # but [0.72, 0.86, 0.82] once in the full suite with a type check running beside it (its
    # local steps follow the nodes' measured speeds, which that load skews): 8 epochs
    epochs = {"asgd": "9", "esync": "8"}.get(strategy, "6")
    # DTS: ~90 local steps is short for the default delay 4 and period 4 (the model each node
    # evaluates at its loop's end still lacks up to t + p - 1 steps of averaging)
    opts = ["--opt", "t=2", "--opt", "p=2"] if strategy == "dts" else []
    if strategy == "diloco":  # ~90 local steps: H = 10 (default 100), two fragments in turn, 4-bit, overlapped
        opts = ["--opt", "inner_steps=10", "--opt", "fragments=2", "--opt", "fragment_by=flat", "--opt", "tau=2",
                "--opt", "outer_codec=e3m0"]
    r = p2psync("run", topo, "--strategy", strategy, *opts, "--out", tmp_path, "--run-id", "ex", "--no-progress",
                "--", sys.executable, EXAMPLE, "--epochs", epochs, *extra)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    run = tmp_path / "ex"
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["nodes"]) == {"0", "1", "2"} and summary["failed"] == []
    accs = [_final_accuracy(run / f"node-{i}.log") for i in range(3)]
    # 6 epochs of a third of the digits each (~90 local steps): the built-in job's MLP needs
    # about as many to pass 0.9. ASGD has no barrier: a node whose loop runs ahead ends before
    # most of its peers' gradients reached it (its last evaluation is then mostly its own
    # shard's), so only the run as a whole is held to the bar there
    if strategy == "asgd":
        assert max(accs) > 0.8 and min(accs) > 0.3, accs
    else:
        assert sum(accs) / 3 > 0.8 and min(accs) > 0.6, accs
    steps = [summary["nodes"][str(i)]["steps"] for i in range(3)]
    assert min(steps) > 0
    if strategy in ("ssgd", "preduce"):  # one model: bitwise equal replicas (preduce: the final average)
        assert len({summary["nodes"][str(i)]["params_sha1"] for i in range(3)}) == 1
    recs = [json.loads(ln) for ln in (run / "node-0.jsonl").read_text().splitlines() if ln.strip()]
    assert recs and recs[-1]["nics"], "metrics come from the hooks"


def test_the_example_runs_without_p2psync(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PSYNC_")}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, EXAMPLE, "--epochs", "1"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "running as a single node" in r.stderr and "Test set" in r.stdout


LM_EXAMPLE = ROOT / "examples" / "lm.py"


def test_the_language_model_example_runs_alone_and_under_ssgd(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PSYNC_")}
    env["PYTHONPATH"] = str(ROOT)
    small = ["--steps", "4", "--eval-every", "4", "--eval-windows", "8", "--log-interval", "2"]
    alone = subprocess.run([sys.executable, LM_EXAMPLE, *small], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr
    assert "running as a single node" in alone.stderr and "step 4 validation" in alone.stdout
    r = p2psync("run", _topo(tmp_path, 2), "--strategy", "ssgd", "--out", tmp_path, "--run-id", "lm",
                "--no-progress", "--", sys.executable, LM_EXAMPLE, *small)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    summary = json.loads((tmp_path / "lm" / "summary.json").read_text())
    nodes = summary["nodes"]
    assert [nodes[str(i)]["steps"] for i in (0, 1)] == [4, 4]
    # one model: the same validation loss on both nodes, logged with p2psync.log(val_bpb=...)
    assert nodes["0"]["final_val_bpb"] == nodes["1"]["final_val_bpb"] == summary["final_val_bpb"] < 8.0
    assert "val bpb" in r.stdout


SCRIPT = """
import os, sys, torch, p2psync
node = int(os.environ["P2PSYNC_NODE"])
mode = sys.argv[1]
hidden = 8 + (node == 1 and mode == "mismatch")
model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 2))
opt = p2psync.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
if mode == "twice":
    p2psync.attach(model, opt)
for step in range(200):
    opt.zero_grad()
    (model(torch.ones(2, 4)) ** 2).mean().backward()  # bounded: the survivors train to the end
    opt.step()
    if mode == "crash" and node == 1 and step == 5:
        raise RuntimeError("boom on node 1")
"""


@pytest.mark.parametrize("mode,expect", [
    ("mismatch", "differ in their number of trainable parameters"),
    ("twice", "attach() was called twice"),
    ("crash", "boom on node 1"),
])
def test_bad_scripts_end_with_one_clear_error(tmp_path: Path, mode: str, expect: str) -> None:
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    topo = _topo(tmp_path)
    t0 = time.monotonic()
    r = p2psync("run", topo, "--out", tmp_path, "--run-id", "bad", "--no-progress", "--peer-timeout", "10",
                "--", sys.executable, script, mode, timeout=150)
    assert r.returncode == EXIT_FAILED, r.stdout[-2000:] + r.stderr[-2000:]
    logs = "".join((tmp_path / "bad" / f"node-{i}.log").read_text() for i in range(3))
    assert expect in logs, logs[-3000:]
    assert "node 1" in r.stderr
    assert time.monotonic() - t0 < 120


def test_a_script_that_never_attaches_is_an_error(tmp_path: Path) -> None:
    script = tmp_path / "alone.py"
    script.write_text("import torch\nprint('training alone')\n")
    r = p2psync("run", _topo(tmp_path, 2), "--out", tmp_path, "--run-id", "alone", "--no-progress",
                "--", sys.executable, script, timeout=120)
    assert r.returncode == EXIT_FAILED and "never joined the run" in r.stderr, r.stderr[-2000:]


_CUDA = pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")


def _gpu_run(tmp_path: Path, topo: Path, strategy: str, *tail: str, n: int) -> None:
    r = p2psync("run", topo, "--strategy", strategy, "--device", "cuda", "--out", tmp_path, "--run-id", "gpu",
                "--no-progress", *tail)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu" / "summary.json").read_text())
    assert set(summary["nodes"]) == {str(i) for i in range(n)} and summary["failed"] == []
    assert all(summary["nodes"][str(i)]["steps"] > 0 for i in range(n))
    if strategy in ("ssgd", "bsp"):  # replicas bitwise identical on the GPU too
        assert len({summary["nodes"][str(i)]["params_sha1"] for i in range(n)}) == 1


@_CUDA
@pytest.mark.parametrize("strategy", sorted(REGISTRY))
def test_cuda_nodes_share_one_gpu_under_every_strategy(tmp_path: Path, strategy: str) -> None:
    """The built-in job with --device cuda: four node processes on one GPU (tensors cross to
    the network through pinned host buffers; Canary's colayers leave during a CUDA backward)."""
    topo = tmp_path / "b.json"
    save(bcube(2, 2, base_port=free_port()) if strategy == "canary" else ring(4, base_port=free_port()), topo)
    _gpu_run(tmp_path, topo, strategy, "--steps", "40", n=4)


@_CUDA
@pytest.mark.parametrize("strategy", ["ssgd", "esync", "canary", "dts"])
def test_cuda_script_nodes_share_one_gpu(tmp_path: Path, strategy: str) -> None:
    """Users' scripts (the shipped example) with --device cuda under p2psync.attach."""
    opts = ["--opt", "t=2", "--opt", "p=2"] if strategy == "dts" else []
    _gpu_run(tmp_path, _topo(tmp_path, 2), strategy, *opts, "--", sys.executable, str(EXAMPLE), "--epochs", "2",
             "--device", "cuda", n=2)

SCHEDULED = """
import hashlib, sys, torch, p2psync
name = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.3}]
opt = {"sgd": lambda: torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=1e-3),
       "nesterov": lambda: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True),
       "adamw": lambda: torch.optim.AdamW(groups, lr=0.01)}[name]()
opt = p2psync.attach(model, opt)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)
sha = lambda: hashlib.sha1(torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().tobytes()).hexdigest()
print("START", sha(), flush=True)
x = torch.randn(16, 4)
for step in range(30):
    if p2psync.should_stop():
        break
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    sched.step()
print("END", sha(), flush=True)
"""

#: one run of three processes costs ~25 s on a loaded 2-core machine: every store strategy runs the
#: same check over the in-memory transport (tests/unit/test_ps_strategies.py); here the script path
#: (attach, the user's own scheduler) once, asynchronous pushes with an adaptive optimizer
STORE_RUNS = [("ssp", "adamw")]


@pytest.mark.parametrize("strategy,optimizer", STORE_RUNS, ids=[f"{s}-{o}" for s, o in STORE_RUNS])
def test_a_schedule_that_sets_lr_to_zero_freezes_a_scripts_store_strategy(tmp_path: Path, strategy: str,
                                                                          optimizer: str) -> None:
    """The user's own LambdaLR (lr 0 from the start) on two parameter groups: the shard owners
    follow it, so no node's weights move, whatever the optimizer."""
    script = tmp_path / "s.py"
    script.write_text(SCHEDULED)
    topo = _topo(tmp_path)
    opts = ["--opt", "R=3"] if strategy == "elastic_bsp" else []
    r = p2psync("run", topo, "--strategy", strategy, *opts, "--out", tmp_path, "--run-id", "lr0", "--no-progress",
                "--", sys.executable, script, optimizer, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    logs = [(tmp_path / "lr0" / f"node-{i}.log").read_text() for i in range(3)]
    shas = [dict(ln.split() for ln in log.splitlines() if ln.startswith(("START ", "END "))) for log in logs]
    assert all(set(s) == {"START", "END"} for s in shas), logs
    assert len({s["START"] for s in shas}) == 1  # the identical start
    assert all(s["END"] == s["START"] for s in shas), shas

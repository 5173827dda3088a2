"""A user's script with randomness after initialisation (dropout), BatchNorm and an LR schedule
created after ``attach``, checkpointed and resumed through ``p2psync run ... -- python SCRIPT``:
the resumed run ends bitwise equal to the uninterrupted one only if the checkpoint restored the
RNG states, the script's own data position (which it registers), the buffers and the
scheduler's state (found without the script naming it). One process per node: the RNGs are
global."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from p2psync.topology import mesh, save
from tests.e2e.test_cli_run import cli, node_logs
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(240)

SCRIPT = textwrap.dedent("""
    import os

    import torch
    from torch import nn

    from p2psync import Session
    from p2psync.api.env import from_env

    env = from_env(os.environ)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 3))
    pos = {"k": 0}  # the script's data position: in checkpoints because it is registered (a
    # checkpoint is taken inside optimizer.step(): a batch counts once it is taken)
    with Session(config=env.config, node=env.node_id) as s:
        s.register_state("data", lambda: dict(pos), pos.update)
        opt = s.attach(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))  # restarted: another lr
        while not s.should_stop:
            g = torch.Generator().manual_seed(1000 * env.node_id + pos["k"])
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
            pos["k"] += 1
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()  # dropout draws from torch's RNG
            opt.step()
            sched.step()
""")


def _sha(run: Path) -> list[str]:
    summary = json.loads((run / "summary.json").read_text())
    return [summary["nodes"][str(i)]["params_sha1"] for i in (0, 1)]


def test_a_script_with_dropout_resumed_ends_bitwise_equal(tmp_path: Path) -> None:
    topo = tmp_path / "mesh2.json"
    save(mesh(2, base_port=free_port()), topo)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)

    def run(run_id: str, *opts: object) -> None:
        r = cli("run", topo, "--strategy", "ssgd", "--out", tmp_path, "--no-progress", *opts, "--",
                sys.executable, script, timeout=200)
        assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:] + node_logs(tmp_path / run_id)

    run("straight", "--run-id", "straight", "--steps", "12")
    run("cut", "--run-id", "cut", "--steps", "6", "--checkpoint-every", "3")
    assert _sha(tmp_path / "cut") != _sha(tmp_path / "straight")
    run("cut", "--resume", tmp_path / "cut", "--steps", "12")
    straight = _sha(tmp_path / "straight")
    assert straight[0] == straight[1] and _sha(tmp_path / "cut") == straight


DILOCO_SCRIPT = textwrap.dedent("""
    import os

    import torch
    from torch import nn

    from p2psync import Session
    from p2psync.api.env import from_env

    env = from_env(os.environ)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))
    pos = {"k": 0}
    with Session(config=env.config, node=env.node_id) as s:
        s.register_state("data", lambda: dict(pos), pos.update)
        opt = s.attach(model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
        while not s.should_stop:
            g = torch.Generator().manual_seed(1000 * env.node_id + pos["k"])
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
            pos["k"] += 1
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
""")


def test_diloco_adamw_batchnorm_cosine_clipping_ends_with_one_model_and_resumes_bitwise(tmp_path: Path) -> None:
    """DiLoCo under a user's script (AdamW, BatchNorm, a cosine schedule, clipping): every node
    ends with the same model (the final sync and --buffers; the end-of-run audit compares
    parameters and buffers), and a checkpoint taken with a fragment's sum in flight (step 10:
    fragment 0 sent at inner step 10, merged at 11) resumes to the same bits."""
    topo = tmp_path / "mesh2.json"
    save(mesh(2, base_port=free_port()), topo)
    script = tmp_path / "train.py"
    script.write_text(DILOCO_SCRIPT)
    opts = ["--opt", "inner_steps=4", "--opt", "fragments=2", "--opt", "fragment_by=flat", "--opt", "tau=1"]

    def run(*more: object) -> None:
        r = cli("run", topo, "--strategy", "diloco", *opts, "--out", tmp_path, "--no-progress", "--steps", "14",
                *more, "--", sys.executable, script, timeout=200)
        assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:] + node_logs(tmp_path / "d")

    run("--run-id", "d", "--checkpoint-every", "10")
    first = _sha(tmp_path / "d")
    assert first[0] == first[1]
    summary = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert summary["failed"] == []
    run("--resume", tmp_path / "d")
    assert _sha(tmp_path / "d") == first

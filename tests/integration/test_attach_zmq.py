"""``Session.attach`` with real training loops over real ZeroMQ (issue 11): two nodes in one
process, each with its own training thread and its own node runtime.

SSGD through the hooks must be exactly data-parallel SGD: the replicas stay bitwise equal and
equal (allclose) to one process training on the union of the nodes' batches. The loop uses what
users' loops use: an LR scheduler stepping the attached optimizer, gradient accumulation (two
backward passes per step), and ``state_dict()`` of the optimizer and of the session.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import StepLR

from p2psync.api.session import Session
from p2psync.errors import ConfigError
from p2psync.topology import ring, save
from p2psync.training.config import RunConfig
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(120)

STEPS = 6


def _batches(node: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7 + node)
    return [[(torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(2)]
            for _ in range(STEPS)]


def _loop(model: nn.Module, opt: torch.optim.Optimizer, batches: list[list[Any]]) -> StepLR:
    sched = StepLR(opt, step_size=2, gamma=0.5)
    for k in range(STEPS):
        opt.zero_grad()
        for x, y in batches[k]:  # gradient accumulation: two backward passes per step
            (nn.functional.cross_entropy(model(x), y) / 2).backward()
        opt.step()
        sched.step()
    return sched


def _model(seed: int) -> nn.Module:
    """Built on the calling thread (torch's global generator is shared by threads)."""
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def _run_node(cfg: RunConfig, i: int, model: nn.Module, out: dict[int, Any]) -> None:
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        if i == 0:
            s = Session(config=cfg, node=i)
        else:  # the explicit form: topology, node, strategy, options
            s = Session(cfg.topology, i, "ssgd", out=cfg.out, run_id=cfg.run_id, start_timeout=30,
                        peer_timeout=15)
        assert s.attach(model, opt) is opt  # the user's own optimizer object
        with pytest.raises(ConfigError, match="twice"):
            s.attach(model, opt)
        _loop(model, opt, _batches(i))
        params = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()
        out[i] = {"params": params, "lr": opt.param_groups[0]["lr"], "session": s.state_dict(),
                  "opt_state": opt.state_dict(), "stats": s.close()}
    except BaseException as exc:  # reported by the test
        out[i] = exc


def test_session_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="unknown option"):
        Session("t.json", 0, "ssgd", learning_rate=0.1)
    with pytest.raises(ConfigError, match="node"):
        Session("t.json", None, "ssgd")


def test_ssgd_through_attach_is_data_parallel_sgd(tmp_path: Path) -> None:
    topo = tmp_path / "ring2.json"
    save(ring(2, base_port=free_port()), topo)
    cfg = RunConfig(topology=str(topo), strategy="ssgd", out=str(tmp_path), run_id="attach",
                    start_timeout=30, peer_timeout=15)
    out: dict[int, Any] = {}
    # seeded differently: the identical start must give both node 0's parameters
    models = [_model(100 + i) for i in (0, 1)]
    threads = [threading.Thread(target=_run_node, args=(cfg, i, models[i], out), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    for i in (0, 1):
        if isinstance(out.get(i), BaseException):
            raise out[i]
    a, b = out[0], out[1]
    assert a["params"].tobytes() == b["params"].tobytes()  # replicas bitwise equal
    assert a["lr"] == pytest.approx(0.1 * 0.5 ** 3)  # the scheduler drove the attached optimizer
    assert a["session"]["step"] == STEPS and a["stats"]["steps"] == STEPS
    # one process on the union of the batches, from node 0's initial parameters
    ref = _model(100)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    both = [[*_batches(0)[k], *_batches(1)[k]] for k in range(STEPS)]
    sched = StepLR(ref_opt, step_size=2, gamma=0.5)
    for k in range(STEPS):
        ref_opt.zero_grad()
        for x, y in both[k]:
            (nn.functional.cross_entropy(ref(x), y) / 4).backward()
        ref_opt.step()
        sched.step()
    expect = torch.nn.utils.parameters_to_vector(ref.parameters()).detach().numpy()
    np.testing.assert_allclose(a["params"], expect, atol=1e-6)
    # the optimizer's own state_dict round-trips (momentum buffers, scheduled lr)
    fresh = torch.optim.SGD(nn.Linear(4, 3).parameters(), lr=1.0, momentum=0.5)
    fresh.load_state_dict(a["opt_state"])
    assert fresh.param_groups[0]["lr"] == pytest.approx(a["lr"]) and len(fresh.state) == 2

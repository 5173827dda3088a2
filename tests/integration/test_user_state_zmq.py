"""The user's LR schedule drives every strategy whose optimizer step is the user's, over real
ZeroMQ through ``Session.attach``: a scheduler that sets lr = 0 freezes the parameters.

SGD (and AdamW) multiply the whole update by lr, weight decay and momentum included, so with
lr = 0 every local step leaves the weights as they are; what a strategy does outside the
optimizer (model averages, DTS's error compensation, ASGD's remote gradients, Canary's final
average, a stale worker adopting the fastest one's model) acts on identical models and must not
move them either. The nodes are seeded differently: every node starts from node 0's (the
coordinator's) parameters, read right after ``attach``; the final ones must be those, bitwise,
on every node. The parameter-store family (whose shard owners run the optimizer) has the same
check in tests/unit/test_ps_strategies.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from p2psync.api.session import Session
from p2psync.topology import Topology, ring, save
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(120)

STEPS = 6

#: (strategy, nodes, strategy options): two nodes and three (P-Reduce's groups of P = 2 are then
#: partial; a float32 mean of three equal values would round: whole-state means sum in float64).
#: DTS: windows of 2 steps applied 2 steps later, so compensations happen within the budget
CASES: list[tuple[str, int, tuple[tuple[str, str], ...]]] = [
    (strategy, nodes, (("t", "2"), ("p", "2")) if strategy == "dts" else ())
    for strategy in ("ssgd", "asgd", "esync", "dts", "preduce", "canary") for nodes in (2, 3)]


def _model(seed: int) -> nn.Module:
    """Built on the test's thread (torch's global generator is shared by threads)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(node: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * node + k)
    return torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)


def run_nodes(tmp_path: Path, topo: Topology, strategy: str, body: Callable[[Session, int], Any],
              tag: str = "", **opts: Any) -> dict[int, Any]:
    """``body(session, node)`` on every node of ``topo`` (one thread each) of one run over real
    ZeroMQ; returns their results, raising the first error a node stored."""
    path = tmp_path / f"topo-{tag}.json"
    save(topo, path)
    out: dict[int, Any] = {}

    ended = threading.Event()  # set whenever a node's body returns or raises

    def node(i: int) -> None:
        try:
            s = Session(str(path), i, strategy, out=str(tmp_path), run_id=f"{strategy}-{tag}", start_timeout=30,
                        peer_timeout=30, **opts)
            out[i] = body(s, i)
        except BaseException as exc:  # reported by the test
            out[i] = exc
        finally:
            ended.set()

    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in topo.ids]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 100
    while len(out) < len(threads) and time.monotonic() < deadline:
        ended.wait(deadline - time.monotonic())
        ended.clear()
        failed = [(i, v) for i, v in list(out.items()) if isinstance(v, BaseException)]
        if failed:  # at once: the others may wait on the failed node for a long time
            raise AssertionError(f"node {failed[0][0]} failed: {failed[0][1]!r}") from failed[0][1]
    for i in topo.ids:
        if i not in out:
            raise AssertionError(f"node {i} did not finish within 100 s")
        if isinstance(out[i], BaseException):
            raise out[i]
    return out


def _vector(model: nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def _frozen_body(models: dict[int, nn.Module], optimizer: str) -> Callable[[Session, int], Any]:
    def body(s: Session, i: int) -> Any:
        model = models[i]
        if optimizer == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        opt = s.attach(model, opt)
        initial = _vector(model)  # the coordinator's parameters, on every node
        sched = LambdaLR(opt, lambda step: 0.0)  # after attach: found among the optimizer's referrers
        k = 0
        while not s.should_stop:
            opt.zero_grad()
            x, y = _batch(i, k)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
            k += 1
        lr = opt.param_groups[0]["lr"]
        moved = any(st for st in opt.state.values())  # the optimizer did step (momentum / moments)
        counters = {"windows_applied": getattr(s.strategy, "windows_applied", None)}
        stats = s.close()  # ASGD: the last remote gradients are applied during close
        return initial, _vector(model), k, lr, moved, stats, counters

    return body


def _check_frozen(out: dict[int, Any]) -> None:
    reference = out[0][0]
    for i, (initial, final, k, lr, moved, stats, _) in sorted(out.items()):
        assert lr == 0.0 and k >= 1 and moved, (i, lr, k, moved)
        assert torch.equal(initial, reference), f"node {i} did not start from node 0's parameters"
        diff = (final - reference).abs()
        assert torch.equal(final, reference), (
            f"node {i} moved with lr=0 after {k} local steps ({stats.get('steps')} strategy steps): "
            f"{int((diff > 0).sum())} of {diff.numel()} entries differ, max |diff| {float(diff.max()):.3g}")


@pytest.mark.parametrize("strategy,nodes,options", [pytest.param(s, n, o, id=f"{s}-{n}nodes") for s, n, o in CASES])
def test_a_schedule_that_sets_lr_to_zero_freezes_every_user_optimizer_strategy(
        tmp_path: Path, strategy: str, nodes: int, options: tuple[tuple[str, str], ...]) -> None:
    models = {i: _model(50 + i) for i in range(nodes)}
    assert not torch.equal(_vector(models[0]), _vector(models[1]))
    out = run_nodes(tmp_path, ring(nodes, base_port=free_port()), strategy, _frozen_body(models, "sgd"),
                    strategy_options=options, steps=STEPS)
    _check_frozen(out)
    if strategy in ("ssgd", "dts", "esync"):  # every node runs the whole budget (ESync: rounds of one or more
        assert [out[i][5]["steps"] for i in sorted(out)] == [STEPS] * nodes  # local iterations each)
    if strategy == "dts":  # the error compensation ran: windows were averaged and applied
        assert all(out[i][6]["windows_applied"] >= 2 for i in out), {i: out[i][6] for i in out}


@pytest.mark.parametrize("strategy", ["ssgd", "preduce"])
def test_a_zero_schedule_freezes_adamw_too(tmp_path: Path, strategy: str) -> None:
    """AdamW's decoupled weight decay (p *= 1 - lr wd) and its update both scale with lr."""
    models = {i: _model(60 + i) for i in range(2)}
    out = run_nodes(tmp_path, ring(2, base_port=free_port()), strategy, _frozen_body(models, "adamw"),
                    steps=STEPS, tag="adamw")
    _check_frozen(out)

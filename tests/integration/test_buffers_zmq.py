"""Module buffers (BatchNorm's running statistics) across the nodes of a run, over real ZeroMQ
through ``Session.attach``.

Every node trains on its own data (shifted per node, so its running statistics are its own).
Strategies that end with one model (``ssgd`` at every step, ``preduce`` and ``canary`` at the
agreed stop of a ``steps`` budget) end with one ``state_dict`` on every node, bitwise:
parameters and buffers (``running_mean``, ``running_var``, ``num_batches_tracked``).
``--buffers broadcast`` (the default) gives everyone the lowest member's, ``average`` the mean of
the floating-point ones, ``local`` leaves each node its own (the parameters still equal).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from p2psync.api.session import Session
from p2psync.topology import ring
from tests.helpers import free_port
from tests.integration.test_user_state_zmq import run_nodes

pytestmark = pytest.mark.timeout(120)

STEPS = 6
NODES = 3
BUFFERS = ("0.1.running_mean", "0.1.running_var", "0.1.num_batches_tracked")


def _model() -> nn.Module:
    """One per node, seeded differently (every node starts from node 0's parameters);
    built on the test's thread (torch's global generator is shared by threads)."""
    return nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), nn.ReLU(), nn.Linear(8, 3))


def _models() -> dict[int, nn.Module]:
    out = {}
    for i in range(NODES):
        torch.manual_seed(70 + i)
        out[i] = _model()
    return out


def _batch(node: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Node ``node``'s data: its own samples, shifted by the node's id (its own statistics)."""
    g = torch.Generator().manual_seed(100 * node + k)
    return torch.randn(8, 4, generator=g) * (1 + node) + 2.0 * node, torch.randint(0, 3, (8,), generator=g)


def _body(models: dict[int, nn.Module]) -> Callable[[Session, int], Any]:
    def body(s: Session, i: int) -> Any:
        model = models[i]
        opt = s.attach(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        k = 0
        while not s.should_stop:
            opt.zero_grad()
            x, y = _batch(i, k)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            k += 1
        s.close()
        return {name: t.detach().clone() for name, t in model.state_dict().items()}, k

    return body


def _run(tmp_path: Path, strategy: str, tag: str, **opts: Any) -> dict[int, dict[str, torch.Tensor]]:
    out = run_nodes(tmp_path, ring(NODES, base_port=free_port()), strategy, _body(_models()), tag=tag,
                    steps=STEPS, **opts)
    assert max(k for _, k in out.values()) == STEPS, {i: k for i, (_, k) in out.items()}
    return {i: sd for i, (sd, _) in out.items()}


def _params(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t for name, t in sd.items() if name not in BUFFERS}


def _assert_one_state_dict(out: dict[int, dict[str, torch.Tensor]]) -> None:
    ref = out[0]
    assert set(BUFFERS) <= set(ref)
    for i, sd in sorted(out.items()):
        assert sd.keys() == ref.keys()
        for name in BUFFERS:  # the buffers, explicitly
            assert sd[name].dtype == ref[name].dtype and torch.equal(sd[name], ref[name]), (i, name, sd[name],
                                                                                           ref[name])
        for name, t in sd.items():  # and everything else: parameters
            assert torch.equal(t, ref[name]), (i, name)


CASES = [("ssgd", ()), ("ssgd", (("sync", "step"),)), ("preduce", ()), ("canary", ())]


@pytest.mark.parametrize("strategy,options", CASES, ids=["ssgd", "ssgd-sync-step", "preduce", "canary"])
def test_one_model_with_its_buffers_on_every_node(tmp_path: Path, strategy: str,
                                                  options: tuple[tuple[str, str], ...]) -> None:
    out = _run(tmp_path, strategy, "one", strategy_options=options)
    _assert_one_state_dict(out)
    # every node's own batches moved its statistics: what they all hold is not a fresh layer's
    assert not torch.equal(out[0]["0.1.running_mean"], torch.zeros(8))
    if strategy == "ssgd":  # synchronized at every step: every node counted every step
        assert int(out[0]["0.1.num_batches_tracked"]) == STEPS


def test_ssgd_buffer_modes(tmp_path: Path) -> None:
    """``broadcast``: node 0's own statistics everywhere; ``local``: each node's own, with one set
    of parameters; ``average``: one mean everywhere, the mean of the nodes' own statistics (the
    running-statistics update is linear in the batch statistics, which every mode computes
    with the same parameters), unlike node 0's."""
    broadcast = _run(tmp_path, "ssgd", "broadcast")
    local = _run(tmp_path, "ssgd", "local", buffers="local")
    average = _run(tmp_path, "ssgd", "average", buffers="average")
    _assert_one_state_dict(broadcast)
    _assert_one_state_dict(average)
    # local: parameters equal (bitwise), and equal to the other modes' (training-mode BatchNorm
    # normalizes with the batch's statistics, never with the running ones)
    for i, sd in sorted(local.items()):
        for name, t in _params(sd).items():
            assert torch.equal(t, local[0][name]) and torch.equal(t, broadcast[0][name]), (i, name)
    # local: every node's running statistics its own
    means = [local[i]["0.1.running_mean"] for i in range(NODES)]
    assert all(not torch.equal(means[i], means[j]) for i in range(NODES) for j in range(i)), means
    assert all(int(local[i]["0.1.num_batches_tracked"]) == STEPS for i in range(NODES))
    # broadcast: node 0's own chain of running statistics, bitwise
    for name in BUFFERS:
        assert torch.equal(broadcast[1][name], local[0][name]), name
    # average: the mean of the nodes' own (up to rounding), not node 0's
    for name in ("0.1.running_mean", "0.1.running_var"):
        mean = torch.stack([local[i][name] for i in range(NODES)]).mean(0)
        torch.testing.assert_close(average[0][name], mean, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(average[0][name], local[0][name], rtol=1e-3), name
    assert int(average[0]["0.1.num_batches_tracked"]) == STEPS


@pytest.mark.parametrize("strategy", ["preduce", "canary"])
def test_local_buffers_stay_each_nodes_own_through_the_final_average(tmp_path: Path, strategy: str) -> None:
    """The contrast that makes the case above mean something: without the buffers' exchange the
    final average leaves one set of parameters and each node's own statistics."""
    out = _run(tmp_path, strategy, "local", buffers="local")
    for i, sd in sorted(out.items()):
        for name, t in _params(sd).items():
            assert torch.equal(t, out[0][name]), (i, name)
    means = [out[i]["0.1.running_mean"] for i in range(NODES)]
    assert all(not torch.equal(means[i], means[j]) for i in range(NODES) for j in range(i)), means

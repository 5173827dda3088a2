"""The parameter store runs the user's optimizer: the owners' update is bitwise what torch does
locally (one worker; BSP on the averaged gradient), whatever the parameter groups and pieces,
with the hyperparameters each push carries, and its state moves with its elements."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import numpy as np
import pytest
import torch

from p2psync.errors import ConfigError
from p2psync.params import OptimSpec, ShardOptimizer, piece_ranges, read_hypers, read_spec
from p2psync.topology import mesh

from tests.unit.test_param_store import stores

pytestmark = pytest.mark.timeout(60)

#: (optimizer class, options of group 0, of group 1): two groups with different numbers
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}, {"lr": 0.05, "weight_decay": 0.01}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, {"lr": 0.03, "momentum": 0.9,
                                                                      "weight_decay": 1e-3}),
    "sgd-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True},
                     {"lr": 0.2, "momentum": 0.5, "nesterov": True, "dampening": 0.0}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}, {"lr": 3e-3, "betas": (0.8, 0.99), "amsgrad": True}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, {"lr": 5e-3, "weight_decay": 0.0}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5}, {"lr": 1e-3, "centered": True}),
}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _local(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer: group 0 = the first layer's weight and the last layer, group 1 = the
    first layer's bias (so group 0's elements are not contiguous in the flat vector)."""
    cls, g0, g1 = OPTIMIZERS[name]
    l1, l2 = model[0], model[2]
    return cls([{"params": [l1.weight, l2.weight, l2.bias], **g0}, {"params": [l1.bias], **g1}], **g0)


def _flat(model: torch.nn.Module) -> np.ndarray:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()


def _set_grads(model: torch.nn.Module, g: np.ndarray) -> None:
    off = 0
    for p in model.parameters():
        p.grad = torch.from_numpy(g[off:off + p.numel()].copy()).view_as(p)
        off += p.numel()


def _schedule(opt: torch.optim.Optimizer, step: int) -> None:
    """An LR schedule the owners must follow: every group's lr decays, group 0's momentum or
    beta1 moves too where the optimizer has one."""
    for g in opt.param_groups:
        g["lr"] = g["lr"] * 0.7
    g0 = opt.param_groups[0]
    if "betas" in g0:
        g0["betas"] = (0.85 + 0.01 * step, g0["betas"][1])
    elif g0.get("momentum"):
        g0["momentum"] = 0.8 + 0.02 * step


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_shard_optimizer_is_the_users_optimizer_bitwise_across_groups_pieces_and_a_schedule(name):
    model, ref = _model(), _model()
    opt, ref_opt = _local(name, model), _local(name, ref)
    params = list(model.parameters())
    spec = read_spec(opt, params)
    n = spec.numel
    assert n == 5 * 7 + 7 + 7 * 3 + 3 and spec.groups == 2 and len(spec.runs) == 3  # group 0, 1, 0
    shards = [(0, 30), (30, n)]  # two owners; pieces of 8 cross the group boundaries (35, 42)
    owners = [ShardOptimizer(spec, _flat(model)[lo:hi], lo=lo, pieces=piece_ranges(lo, hi, 8))
              for lo, hi in shards]
    rng = np.random.default_rng(1)
    for step in range(6):
        g = rng.standard_normal(n).astype(np.float32)
        hypers = read_hypers(ref_opt, spec)
        for (lo, hi), own in zip(shards, owners):
            for a, b in piece_ranges(lo, hi, 8):
                own.apply(a - lo, b - lo, g[a:b], hypers)
        _set_grads(ref, g)
        ref_opt.step()
        _schedule(ref_opt, step)
    got = np.concatenate([o.w for o in owners])
    assert got.tobytes() == _flat(ref).tobytes()


def test_optimizer_state_moves_with_its_elements_to_another_split():
    """Export after 3 steps under one split, import into another (other shard bounds and
    pieces), 3 more steps: bitwise what one uninterrupted owner computes."""
    model = _model()
    opt = _local("adamw", model)
    spec = read_spec(opt, list(model.parameters()))
    n = spec.numel
    rng = np.random.default_rng(2)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(6)]
    hyp = read_hypers(opt, spec)
    one = ShardOptimizer(spec, _flat(model), lo=0, pieces=piece_ranges(0, n, 16))

    def run(owners: list[tuple[int, ShardOptimizer]], g: np.ndarray) -> None:
        for lo, own in owners:
            for a, b in own.pieces:
                own.apply(a, b, g[lo + a:lo + b], hyp)

    before = [(lo, ShardOptimizer(spec, _flat(model)[lo:hi], lo=lo, pieces=piece_ranges(lo, hi, 16)))
              for lo, hi in ((0, 22), (22, n))]
    for g in grads[:3]:
        run([(0, one)], g)
        run(before, g)
    w = np.concatenate([o.w for _, o in before])
    state = np.concatenate([o.export_state() for _, o in before], axis=1)
    assert state.shape == (1 + len(spec.state), n) and state[0].all()
    after = [(lo, ShardOptimizer(spec, w[lo:hi], lo=lo, pieces=piece_ranges(lo, hi, 5), state=state[:, lo:hi]))
             for lo, hi in ((0, 40), (40, 50), (50, n))]
    for g in grads[3:]:
        run([(0, one)], g)
        run(after, g)
    assert np.concatenate([o.w for _, o in after]).tobytes() == one.w.tobytes()


def test_an_optimizer_that_cannot_be_sharded_is_refused_by_name():
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ConfigError, match="LBFGS is not one whose update is elementwise"):
        read_spec(torch.optim.LBFGS([p]), [p])
    q = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigError, match="1 trainable parameter tensor"):
        read_spec(torch.optim.SGD([p], lr=0.1), [p, q])


async def _run_stores(n_workers: int, name: str, steps: int, rounds: bool,
                      schedule: Callable[[torch.optim.Optimizer, int], None]) -> tuple[np.ndarray, np.ndarray]:
    """``steps`` rounds of every worker pushing its gradient (with the schedule's hypers) to
    stores on a mesh; returns (the pulled weights, torch's own on the averaged gradients)."""
    model, ref = _model(), _model()
    opt, ref_opt = _local(name, model), _local(name, ref)
    spec = read_spec(opt, list(model.parameters()))
    n = spec.numel
    rng = np.random.default_rng(3)
    async with stores(mesh(n_workers), _flat(model), optim=spec, piece_bytes=40, rounds=rounds) as st:
        for r in range(steps):
            grads = [rng.standard_normal(n).astype(np.float32) for _ in range(n_workers)]
            hypers = read_hypers(ref_opt, spec)
            await asyncio.gather(*(st[i].push(grads[i], gen=r, hypers=hypers) for i in range(n_workers)))
            pulled = await asyncio.gather(*(st[i].pull(barrier=r + 1) for i in range(n_workers)))
            assert all(p.tobytes() == pulled[0].tobytes() for p in pulled)
            mean = np.zeros(n, np.float32)
            for g in grads:
                mean += g
            mean /= np.float32(n_workers)
            _set_grads(ref, mean)
            ref_opt.step()
            schedule(ref_opt, r)
        return pulled[0], _flat(ref)


@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov"])
async def test_one_worker_store_is_the_users_optimizer_bitwise(name):
    got, want = await _run_stores(1, name, 5, rounds=False, schedule=_schedule)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
async def test_a_bsp_store_steps_the_users_optimizer_on_the_mean_gradient_bitwise(name):
    got, want = await _run_stores(3, name, 4, rounds=True, schedule=_schedule)
    assert got.tobytes() == want.tobytes()


async def test_an_lr_of_zero_freezes_the_store_whatever_the_optimizer():
    def zero(opt: torch.optim.Optimizer, step: int) -> None:
        for g in opt.param_groups:
            g["lr"] = 0.0

    model = _model()
    w0 = _flat(model)  # Adam's step with lr 0 is w + (-0.0) * u: bitwise w; AdamW's decay is w * (1 - 0)
    for name in ("adamw", "sgd-momentum"):
        for rounds in (False, True):
            opt = _local(name, model)
            zero(opt, 0)
            spec = read_spec(opt, list(model.parameters()))
            assert all(v[0] == 0.0 for v in spec.initial)
            async with stores(mesh(2), w0, optim=spec, piece_bytes=40, rounds=rounds) as st:
                hyp = read_hypers(opt, spec)
                rng = np.random.default_rng(4)
                for r in range(3):
                    await asyncio.gather(*(st[i].push(rng.standard_normal(w0.size).astype(np.float32), gen=r,
                                                      hypers=hyp) for i in range(2)))
                    pulled = await asyncio.gather(*(st[i].pull(barrier=r + 1) for i in range(2)))
                assert all(p.tobytes() == w0.tobytes() for p in pulled), (name, rounds)

"""The replica protocol: a small core every replica implements, and the capabilities a strategy
declares (``Strategy.requires``), checked when the strategy is built."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from p2psync.api.gate import StepGate
from p2psync.api.replica import HookedReplica
from p2psync.errors import ConfigError
from p2psync.model import (LAYERED, MODEL_BUFFERS, OPTIMIZER_SHARDS, PARAM_RANGES, SGD_COMPENSATION, STEP_AS_IS,
                           STEP_EACH, Replica, check_replica)
from p2psync.model.flat import FlatModel
from p2psync.strategies.base import REGISTRY, get_strategy
from p2psync.topology import ring
from p2psync.transport.memory import MemoryHub
from tests.helpers import make_context

EVERY = (STEP_EACH, STEP_AS_IS, SGD_COMPENSATION, PARAM_RANGES, OPTIMIZER_SHARDS, MODEL_BUFFERS, LAYERED)


class CoreOnly:
    """A replica with the core protocol and nothing else."""

    numel = 4
    samples = 0

    async def compute_gradients(self, abort: threading.Event | None = None) -> tuple[float, np.ndarray]:
        return 0.0, np.zeros(4, np.float32)

    async def apply_gradients(self, vec: np.ndarray) -> None: ...

    async def get_params(self) -> np.ndarray:
        return np.zeros(4, np.float32)

    async def set_params(self, vec: np.ndarray) -> None: ...

    async def export_state(self) -> np.ndarray:
        return np.zeros(4, np.float32)

    async def import_state(self, vec: np.ndarray) -> None: ...

    async def export_meta(self) -> bytes:
        return b""

    async def import_meta(self, raw: bytes) -> None: ...

    def state_size(self) -> int:
        return 4


def _hooked() -> HookedReplica:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return HookedReplica(flat=FlatModel(model=model, optimizer=opt), gate=StepGate(asyncio.new_event_loop()),
                         step=opt.step)


def test_the_gate_path_replica_has_the_core_and_every_capability() -> None:
    rep = _hooked()
    assert isinstance(rep, Replica)
    assert all(c.held_by(rep) for c in EVERY)
    check_replica(rep, EVERY, "everything")
    for name in sorted(REGISTRY):  # so every strategy runs on it
        check_replica(rep, get_strategy(name).requires, name)


def test_a_core_replica_has_no_capability() -> None:
    core = CoreOnly()
    assert isinstance(core, Replica)
    assert not any(c.held_by(core) for c in EVERY)
    with pytest.raises(ConfigError, match="dts needs plain SGD.s compensation"):
        SGD_COMPENSATION.of(core, "dts")


@pytest.mark.parametrize("name,missing", [("dts", "plain SGD's compensation"), ("canary", "layers"),
                                          ("diloco", "parameter ranges"), ("asgd", "apply_each"),
                                          ("ssp", "optimizer's spec"), ("ssgd", "buffers"),
                                          ("preduce", "step_as_is")])
def test_a_strategy_refuses_a_replica_without_what_it_requires_when_it_is_built(name, missing) -> None:
    topo = ring(2)
    ctx = make_context(topo, MemoryHub(topo).endpoint(0), CoreOnly())
    with pytest.raises(ConfigError, match=f"--strategy {name} cannot run on a CoreOnly replica: it needs .*{missing}"):
        get_strategy(name)(ctx)


def test_an_object_without_the_core_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="the core replica protocol"):
        check_replica(object(), (), "--strategy ssgd")

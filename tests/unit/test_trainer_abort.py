"""The trainer's iteration: abortable, and the two device-emulation modes (issue 9 items 2
and 3)."""

from __future__ import annotations

import threading
import time

import pytest

from p2psync.errors import Aborted, ConfigError
from p2psync.model.flat import FlatModel
from p2psync.topology import mesh
from p2psync.training.hetero import Slowdown, parse_profiles
from tests.helpers import make_trainer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def trainer():
    return make_trainer(mesh(1), 0)


def _iteration(tr, abort=None):
    """One iteration (forward, backward, the emulated device's time): (loss, flat gradient)."""
    loss, _ = tr.forward_backward(abort)
    return loss, FlatModel(model=tr.model, optimizer=tr.optimizer).grads()


async def test_an_abandoned_iteration_leaves_no_trace(trainer):
    trainer.slowdown = Slowdown(step_time=5.0)  # the pad dominates: abort lands inside it
    abort = threading.Event()
    t0 = time.monotonic()
    threading.Timer(0.2, abort.set).start()
    with pytest.raises(Aborted):
        _iteration(trainer, abort)
    assert time.monotonic() - t0 < 2.0  # cut short, not 5 s
    assert trainer.batches_done == 0 and trainer.samples == 0
    trainer.slowdown = Slowdown()
    loss_after_abort, g1 = _iteration(trainer)
    assert trainer.batches_done == 1 and trainer.samples == trainer.sampler.batch_size
    # the next iteration took the batch the abandoned one would have used
    loss_ref, g2 = _iteration(make_trainer(mesh(1), 0))
    assert loss_after_abort == loss_ref and (g1 == g2).all()


async def test_abort_before_start(trainer):
    abort = threading.Event()
    abort.set()
    with pytest.raises(Aborted):
        _iteration(trainer, abort)
    assert trainer.batches_done == 0


@pytest.mark.parametrize("mode", ["wait", "compute"])
async def test_slowdown_modes_wait_or_compute(trainer, mode):
    """Both modes hold the compute thread for the step time; only ``compute`` burns CPU."""
    trainer.slowdown = Slowdown(step_time=0.6, mode=mode)
    _iteration(trainer)  # warm-up
    cpu0, wall0 = time.process_time(), time.monotonic()
    _iteration(trainer)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    assert wall >= 0.6
    if mode == "compute":
        assert cpu > 0.2, cpu  # a share of one core for the pad even on a loaded machine
    else:
        assert cpu < 0.15, cpu  # the real step only (a few ms)


def test_slowdown_mode_is_validated():
    assert parse_profiles(slowdown="1:2", mode="compute")[1].mode == "compute"
    with pytest.raises(ConfigError, match="slowdown-mode"):
        parse_profiles(slowdown="1:2", mode="spin")
    with pytest.raises(ConfigError, match="slowdown-mode"):
        Slowdown(mode="spin")  # type: ignore[arg-type]

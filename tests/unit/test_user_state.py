"""training/user_state.py: which GradScaler belongs to the run, found without scanning every
live object (``gc.get_objects()`` breaks tuples that other threads are still building)."""

from __future__ import annotations

import gc
import threading
from typing import Any

import torch
from torch import nn

from p2psync.training.user_state import UserState, calling_scalers


def _optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_the_scaler_that_steps_the_optimizer_is_found_and_another_is_not() -> None:
    model, opt = _optimizer()
    state = UserState(opt)
    own = opt.step
    bystander = torch.amp.GradScaler("cpu")  # alive, never steps this optimizer
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    seen: list[list[Any]] = []

    def hooked(*args: Any, **kwargs: Any) -> Any:  # as attach hooks optimizer.step
        state.on_step()
        seen.append(list(state.scalers))
        return own(*args, **kwargs)

    opt.step = hooked  # type: ignore[method-assign]
    opt.zero_grad()
    scaler.scale(model(torch.ones(4, 3)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert seen == [[scaler]] and all(s is not bystander for s in state.scalers)
    assert state.capture()["scalers"][0]["scale"] == scaler.state_dict()["scale"]
    opt.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()  # a plain step after one through the scaler keeps the scaler found
    assert seen[-1] == [scaler]


def test_a_plain_step_finds_no_scaler_and_the_search_goes_on() -> None:
    model, opt = _optimizer()
    state = UserState(opt)
    keep = torch.amp.GradScaler("cpu")
    state.on_step()  # called from no scaler
    assert state.scalers == [] and calling_scalers(None) == []
    assert keep is not None


def test_finding_the_scaler_holds_no_reference_to_another_threads_objects(monkeypatch: Any) -> None:
    """The search reads the calling thread's frames only: ``gc.get_objects`` is never called
    (it would hand out objects other threads are still building)."""
    def forbidden(*_: Any, **__: Any) -> Any:
        raise AssertionError("gc.get_objects() called")

    monkeypatch.setattr(gc, "get_objects", forbidden)
    model, opt = _optimizer()
    state = UserState(opt)
    own = opt.step
    errors: list[BaseException] = []

    def hooked(*args: Any, **kwargs: Any) -> Any:
        try:
            state.on_step()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        return own(*args, **kwargs)

    opt.step = hooked  # type: ignore[method-assign]
    scaler = torch.amp.GradScaler("cpu")

    def train() -> None:
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()
        scaler.step(opt)

    t = threading.Thread(target=train)
    t.start()
    t.join(30)
    assert not errors and state.scalers == [scaler]

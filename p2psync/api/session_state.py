"""The checkpointable state of a :class:`~p2psync.api.session.Session` (split from
:mod:`p2psync.api.session`: what a checkpoint holds, apart from the step loop).

Threads: :meth:`SessionState.state_dict` is called on the training thread (between steps),
which owns the model, the optimizer, the RNGs the user's loop draws from and the script's
registered state. The strategy's state and the error feedback residuals belong to the event
loop (background exchanges change them while the training thread runs), so that part is copied
on the loop (:meth:`SessionState._loop_state_now`) and handed over; reading them from the
training thread could see a dict change size under it.

What a checkpoint holds for a user's script: the model, the optimizer, the RNG states and the
step. Where the script is in its data (its sampler's position) is only in it if the script
registers it (:meth:`SessionState.register_state`); the built-in job does.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from typing import Any, Callable, Coroutine, TypeVar

from p2psync.api import checkpoint
from p2psync.api.gate import StepGate
from p2psync.api.replica import HookedReplica
from p2psync.api.runtime import NodeRuntime
from p2psync.errors import ConfigError
from p2psync.strategies.base import Strategy
from p2psync.training.config import RunConfig

T = TypeVar("T")


class SessionState:
    """Mixin of :class:`~p2psync.api.session.Session` (which sets these attributes)."""

    cfg: RunConfig
    node_id: int
    step: int
    gate: StepGate
    runtime: NodeRuntime | None
    strategy: Strategy | None
    replica: HookedReplica | None
    _loop: asyncio.AbstractEventLoop
    _thread: threading.Thread
    _resume_step: int
    _strategy_state: dict[str, Any]
    _loaded: dict[str, Any] | None
    _loaded_from: str
    _extras: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """This node's whole state, what ``--checkpoint-every`` writes (see
        :mod:`p2psync.api.checkpoint`): the step reached, the run it belongs to, the strategy's
        state, copies of the attached model's and optimizer's state, error feedback residuals,
        the RNG states and what :meth:`register_state` added. Call it on the training thread
        (between steps); the parts that background exchanges change (strategy state, residuals)
        are copied on the event loop. Save it with ``torch.save``, load it with
        ``weights_only=True``."""
        loop_part = (self._call(self._loop_state()) if self._loop.is_running()
                     and threading.current_thread() is not self._thread else self._loop_state_now())
        return self._snapshot(loop_part)

    async def _loop_state(self) -> dict[str, Any]:
        return self._loop_state_now()

    def _loop_state_now(self) -> dict[str, Any]:
        """The event loop's part of :meth:`state_dict`, copied at once (on the loop)."""
        coll = self.runtime.collectives if self.runtime is not None else None
        return {"step": self.step, "samples": self.gate.samples, "strategy": self.cfg.strategy,
                "run_id": self.runtime.run_id if self.runtime is not None else self.cfg.run_id,
                "node": self.node_id,
                "strategy_state": copy.deepcopy(self.strategy.state_dict()) if self.strategy is not None else {},
                "feedback": checkpoint.feedback_states((coll.feedback, coll.sparse_feedback) if coll else (None, None))}

    def _snapshot(self, loop_part: dict[str, Any], *, user: bool = True) -> dict[str, Any]:
        """:meth:`state_dict` from its event loop part (on the training thread); ``user``:
        with the LR schedulers, scaler and hyperparameters as they are now."""
        flat = self.replica.flat if self.replica is not None else None
        snap = checkpoint.snapshot(p2psync=loop_part, model=flat.model if flat else None,
                                   optimizer=flat.optimizer if flat else None,
                                   extra={name: get() for name, (get, _) in self._extras.items()})
        if user and self.replica is not None:
            snap["user_state"] = self.replica.user_state.capture()
        return snap

    def register_state(self, name: str, get: Callable[[], Any], set_: Callable[[Any], None]) -> None:
        """Script state that checkpoints carry under ``extra[name]`` (tensors, numbers, strings,
        lists, dicts), e.g. the data sampler's position: ``get()`` when one is written,
        ``set_(value)`` at :meth:`attach` when resuming. Register before :meth:`attach`.
        ``--checkpoint-every`` calls ``get()`` while the training thread is inside the
        ``optimizer.step()`` of the step it saves: count a batch as consumed when it is taken,
        before that call, so a resumed script does not take it again."""
        self._extras[name] = (get, set_)

    def _restore_extras(self, extra: Any) -> None:
        if isinstance(extra, dict):
            for name, (_, set_) in self._extras.items():
                if name in extra:
                    set_(extra[name])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (before :meth:`attach`, which puts the model, optimizer,
        RNG and registered state back): training resumes at its step."""
        if self.replica is not None:
            raise ConfigError("Session.load_state_dict: call it before attach()")
        step = state.get("step")
        if type(step) is not int or step < 0:
            raise ConfigError(f"Session.load_state_dict: bad step {step!r}")
        if state.get("strategy") not in (None, self.cfg.strategy):
            raise ConfigError(f"Session.load_state_dict: the checkpoint is of strategy {state.get('strategy')!r}, "
                              f"this run uses {self.cfg.strategy!r}")
        self._resume_step = step
        st = state.get("strategy_state", {})
        if not isinstance(st, dict):
            raise ConfigError(f"Session.load_state_dict: bad strategy_state {type(st).__name__}")
        self._strategy_state = st
        self._loaded = state


__all__ = ["SessionState"]

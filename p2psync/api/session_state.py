"""The checkpointable state of a :class:`~p2psync.api.session.Session`: what a checkpoint
holds apart from the step loop, what was loaded before ``attach``, and the checkpoint waiting to
be written.

Threads: :meth:`Checkpoints.snapshot` runs on the training thread (between steps), which owns
the model, the optimizer, the RNGs the user's loop draws from and the script's registered
state. The strategy's state and the error feedback residuals belong to the event loop
(background exchanges change them while the training thread runs), so that part is copied on
the loop (:meth:`~p2psync.api.driver.StepDriver.loop_state`) and handed over; reading them
from the training thread could see a dict change size under it.

What a checkpoint holds for a user's script: the model, the optimizer, the RNG states and the
step. Where the script is in its data (its sampler's position) is only in it if the script
registers it (:meth:`Checkpoints.register`); the built-in job does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from p2psync.api import checkpoint
from p2psync.api.replica import HookedReplica
from p2psync.errors import ConfigError
from p2psync.files import WriteFailures

#: ``(get, set)`` of one piece of the script's state that checkpoints carry
Extra = tuple[Callable[[], Any], Callable[[Any], None]]


class Checkpoints:
    """One session's checkpoint state (training thread, except :attr:`pending`, which the
    driver sets while the training thread is parked)."""

    def __init__(self, *, strategy: str) -> None:
        #: the run's strategy: a loaded checkpoint must be of it
        self.strategy = strategy
        #: a checkpoint loaded before attach (load_state_dict, or --resume), applied by attach
        self.loaded: dict[str, Any] | None = None
        #: where :attr:`loaded` came from (its file), for errors
        self.loaded_from = "the state given to Session.load_state_dict"
        #: --resume was asked for (this node may have no checkpoint of its own)
        self.resuming = False
        #: the step :attr:`loaded` was taken at
        self.resume_step = 0
        #: the strategy's state in :attr:`loaded`
        self.strategy_state: dict[str, Any] = {}
        #: name -> (get, set) of script state that checkpoints carry (register)
        self.extras: dict[str, Extra] = {}
        #: a checkpoint waiting for the next step's start (path, state without the user's part)
        self.pending: tuple[Path, dict[str, Any]] | None = None

    def snapshot(self, loop_part: dict[str, Any], replica: HookedReplica | None, *,
                 user: bool = True) -> dict[str, Any]:
        """A whole checkpoint from its event loop part (on the training thread); ``user``: with
        the LR schedulers, scaler and hyperparameters as they are now."""
        flat = replica.flat if replica is not None else None
        snap = checkpoint.snapshot(p2psync=loop_part, model=flat.model if flat else None,
                                   optimizer=flat.optimizer if flat else None,
                                   extra={name: get() for name, (get, _) in self.extras.items()})
        if user and replica is not None:
            snap["user_state"] = replica.user_state.capture()
        return snap

    def register(self, name: str, get: Callable[[], Any], set_: Callable[[Any], None]) -> None:
        """See :meth:`p2psync.api.session.Session.register_state`."""
        self.extras[name] = (get, set_)

    def restore_extras(self, extra: Any) -> None:
        """Hand each registered piece of script state its value in ``extra`` (when there)."""
        if isinstance(extra, dict):
            for name, (_, set_) in self.extras.items():
                if name in extra:
                    set_(extra[name])

    def load(self, state: dict[str, Any]) -> None:
        """Check and keep ``state`` (a checkpoint) for attach; ConfigError when it is not one of
        this run's strategy."""
        step = state.get("step")
        if type(step) is not int or step < 0:
            raise ConfigError(f"Session.load_state_dict: bad step {step!r}")
        if state.get("strategy") not in (None, self.strategy):
            raise ConfigError(f"Session.load_state_dict: the checkpoint is of strategy {state.get('strategy')!r}, "
                              f"this run uses {self.strategy!r}")
        st = state.get("strategy_state", {})
        if not isinstance(st, dict):
            raise ConfigError(f"Session.load_state_dict: bad strategy_state {type(st).__name__}")
        self.resume_step = step
        self.strategy_state = st
        self.loaded = state

    def write_pending(self, replica: HookedReplica | None, failures: WriteFailures | None) -> None:
        """Write the checkpoint taken at the last step, completed with the user's training
        state as it is now (the start of the next step; training thread). A disk error is
        said once per node and counted in ``failures`` (``write_failures`` in the node's
        stats), never fatal: the previous checkpoint stays as it was (the write is atomic)."""
        pending, self.pending = self.pending, None
        if pending is None or replica is None:
            return
        path, snap = pending
        try:
            checkpoint.save_atomic(path, {**snap, "user_state": replica.user_state.capture()})
        except OSError as exc:  # a full disk, a read-only folder: the run goes on without it
            if failures is None:
                raise
            failures.failed("checkpoint", path, exc, "the previous checkpoint (if any) is kept")


__all__ = ["Checkpoints", "Extra"]

"""The user's training state beyond the model and the optimizer's buffers: the optimizer's
per-group hyperparameters (a manual ``param_groups[i]["lr"] = ...`` included), its LR
schedulers and an AMP ``GradScaler``. Checkpoints, ``--resume``, joiners and members that
adopt a peer's state carry it, so a resumed or rejoined node runs the same schedule as the
others (and SSGD ends bitwise equal).

Which objects: the schedulers of the attached optimizer are found without the user naming
them (every ``torch.optim.lr_scheduler.LRScheduler`` whose ``optimizer`` is it, looked up among
the optimizer's referrers), at ``attach`` and again at the first ``optimizer.step()`` (a
script usually creates its scheduler after ``attach``); a ``GradScaler`` is the one on the call
stack of ``optimizer.step()`` (``GradScaler.step`` calls it), looked for at every step until
one is found. (Not among all live objects: ``gc.get_objects()`` would hold a reference to a
tuple another thread is still building, and that thread's ``_PyTuple_Resize`` then fails.) ``p2psync.attach(model, optimizer, scheduler=..., scaler=...)``
names them explicitly.

When: the state is what holds *at the start of a step*, i.e. when an iteration arrives at
``optimizer.step()`` (the user's ``scheduler.step()`` for the previous step has run). A
checkpoint therefore takes it at the next arrival after the step it saves (or at close), and
a state given to a peer is taken while the donor is parked in ``optimizer.step()``. A node
that takes a peer's state while parked in an iteration that is then skipped (a joiner's first
iteration, a member that fell a step behind) absorbs the ``scheduler.step()`` its loop makes
before the next ``optimizer.step()``: the taken state already counts it. (A scheduler stepped
once per epoch whose epoch ends exactly there loses that one step; per-iteration schedules
are exact.)

State that a scheduler's own class holds outside ``state_dict()`` (a lambda's closure) is the
user's code and is the same on every node already.

Threads: every method runs on the training thread (or as a model job).
"""

from __future__ import annotations

import copy
import functools
import gc
import io
import logging
import sys
import types
import weakref
from typing import Any, Callable, Mapping

import torch
from torch.optim.lr_scheduler import LRScheduler

from p2psync.errors import ConfigError, ProtocolError, translate
from p2psync.model import MAX_META_BYTES

log = logging.getLogger("p2psync.state")



#: how many frames above ``optimizer.step()`` are searched for the GradScaler that called it
SCALER_FRAMES = 32
#: the GradScaler methods on the way to ``optimizer.step()`` (``step`` -> ``_maybe_opt_step``)
_SCALER_CALLS = frozenset({"step", "_maybe_opt_step"})


@functools.cache
def _scaler_kinds() -> tuple[type, ...]:
    return tuple(k for k in (getattr(torch.amp, "GradScaler", None),
                             getattr(getattr(torch.cuda, "amp", None), "GradScaler", None)) if isinstance(k, type))


def calling_scalers(frame: types.FrameType | None) -> list[Any]:
    """The GradScalers whose ``step`` is on the call stack from ``frame`` up (at most
    :data:`SCALER_FRAMES` frames), innermost first, each once. Reads only the frames of the
    calling thread."""
    kinds = _scaler_kinds()
    out: list[Any] = []
    for _ in range(SCALER_FRAMES):
        if frame is None or not kinds:
            break
        if frame.f_code.co_name in _SCALER_CALLS and frame.f_code.co_argcount > 0:
            me = frame.f_locals.get(frame.f_code.co_varnames[0])
            # by type, not isinstance: that would read __class__ (some objects warn)
            if me is not None and issubclass(type(me), kinds) and all(me is not o for o in out):
                out.append(me)
        frame = frame.f_back
    return out


class UserState:
    """The schedulers, scalers and hyperparameters of one attached optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, schedulers: tuple[Any, ...] = (),
                 scalers: tuple[Any, ...] = ()) -> None:
        self.optimizer = optimizer
        self._explicit_schedulers = list(schedulers)
        self.schedulers: list[Any] = []
        self._known: list[weakref.ref[Any]] = []
        self.scalers: list[Any] = list(scalers)
        self._pending: dict[str, Any] | None = None
        self._absorb: set[int] = set()
        self._wrapped: weakref.WeakSet[Any] = weakref.WeakSet()
        self._scanned_scalers = bool(scalers)
        self.discover()

    # -- which objects ---------------------------------------------------------------------

    def discover(self) -> None:
        """Find the optimizer's schedulers (explicit ones first, then those found before, then
        new ones among its referrers) and wrap their ``step`` so an adopted state can absorb
        one call. Found schedulers are held weakly: one the script dropped is forgotten."""
        known = [s for s in (r() for r in self._known) if s is not None]
        found = [s for s in self._explicit_schedulers if s not in known] + known
        mine = {id(vars(s)) for s in found}
        fresh: list[Any] = []
        for obj in gc.get_referrers(self.optimizer):
            if isinstance(obj, LRScheduler):
                if obj.optimizer is self.optimizer and obj not in found and obj not in fresh:
                    fresh.append(obj)
            elif type(obj) is dict and obj.get("optimizer") is self.optimizer and "last_epoch" in obj \
                    and id(obj) not in mine:
                # an object whose __dict__ was materialized refers through that dict
                fresh.extend(o for o in gc.get_referrers(obj) if isinstance(o, LRScheduler) and vars(o) is obj
                             and o not in found and o not in fresh)
        fresh.sort(key=lambda s: type(s).__qualname__)  # stable: creation order within a class
        self.schedulers = found + fresh
        self._known = [weakref.ref(s) for s in self.schedulers]
        for s in self.schedulers:
            if s not in self._wrapped:
                self._wrap(s)

    def _scan_scalers(self) -> None:
        """Look for the GradScaler that is stepping the optimizer now; once one is found the
        search ends (the scalers named at attach end it before it starts)."""
        if self._scanned_scalers:
            return
        found = calling_scalers(sys._getframe(1))
        if found:
            self.scalers = found
            self._scanned_scalers = True

    def _wrap(self, sched: Any) -> None:
        own: Callable[..., Any] = sched.step
        state = self

        def step(self_sched: Any, *args: Any, **kwargs: Any) -> Any:
            if id(self_sched) in state._absorb:
                state._absorb.discard(id(self_sched))
                return None
            return own(*args, **kwargs)

        sched.step = types.MethodType(step, sched)
        self._wrapped.add(sched)

    # -- the training loop ---------------------------------------------------------------

    def on_step(self) -> None:
        """An iteration arrives at ``optimizer.step()``: absorbing ends, and a state taken
        before the script created its schedulers is put into them now."""
        self._absorb.clear()
        if self._pending is not None:
            self.discover()
            self._scan_scalers()
            pending, self._pending = self._pending, None
            self._load(pending, defer=False)
        elif not self._scanned_scalers:
            self._scan_scalers()

    # -- capture and restore ---------------------------------------------------------------

    def capture(self) -> dict[str, Any]:
        """The state now: hyperparameters per group, every scheduler's and scaler's
        ``state_dict()``."""
        self.discover()
        return {
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "schedulers": [_plain(s.state_dict()) for s in self.schedulers],
            "scalers": [_plain(s.state_dict()) for s in self.scalers],
        }

    def restore(self, state: Mapping[str, Any], *, absorb: bool) -> None:
        """Put a :meth:`capture` back. Hyperparameters at once; schedulers now if the script
        has created them, else at the next arrival. ``absorb``: the iteration parked now is
        skipped, so the ``scheduler.step()`` that follows it must not count."""
        self.discover()
        self._load(dict(state), defer=True)
        if absorb:
            self._absorb = {id(s) for s in self.schedulers}

    def _load(self, state: dict[str, Any], *, defer: bool) -> None:
        groups = state.get("groups", [])
        scheds = state.get("schedulers", [])
        scalers = state.get("scalers", [])
        if not (isinstance(groups, list) and isinstance(scheds, list) and isinstance(scalers, list)):
            raise ConfigError("p2psync: malformed training state (groups, schedulers, scalers must be lists)")
        if len(groups) != len(self.optimizer.param_groups):
            raise ConfigError(f"p2psync: the state has {len(groups)} parameter group(s), this optimizer "
                              f"{len(self.optimizer.param_groups)}")
        self._apply_groups(groups)
        if defer and len(self.schedulers) < len(scheds):
            self._pending = state  # created after attach: loaded at the first optimizer.step()
            return
        if len(self.schedulers) != len(scheds):
            raise ConfigError(f"p2psync: the state holds {len(scheds)} LR scheduler(s), this script has "
                              f"{len(self.schedulers)} on its optimizer (create the same schedulers on every node)")
        with translate({(KeyError, TypeError, ValueError, AttributeError, RuntimeError): lambda e: ConfigError(
                f"p2psync: a scheduler or scaler state does not fit ({type(e).__name__}: {str(e)[:200]})")}):
            for s, sd in zip(self.schedulers, scheds):
                s.load_state_dict(sd)
            for sc, sd in zip(self.scalers, scalers):
                sc.load_state_dict(sd)
        self._apply_groups(groups)  # a scheduler created since set its own lr

    def _apply_groups(self, groups: list[Any]) -> None:
        for g, saved in zip(self.optimizer.param_groups, groups):
            if not isinstance(saved, dict):
                raise ConfigError("p2psync: malformed training state (a parameter group is not a dict)")
            for k, v in saved.items():
                if k != "params":
                    g[k] = v


def encode(state: Mapping[str, Any]) -> bytes:
    """A :meth:`UserState.capture` as bytes (``torch.save``; read back without pickle)."""
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getvalue()


def decode(raw: bytes) -> dict[str, Any]:
    """:func:`encode`'s bytes from a peer (weights-only loading: no code runs); ProtocolError
    when they are not such a state."""
    if len(raw) > MAX_META_BYTES:
        raise ProtocolError("state", f"training state of {len(raw)} bytes (limit {MAX_META_BYTES})")
    with translate({Exception: lambda e: ProtocolError("state", f"unreadable training state: {type(e).__name__}")}):
        out = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    if not isinstance(out, dict):
        raise ProtocolError("state", "training state is not a dict")
    return out


def _plain(sd: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of a state dict with tensors on the CPU (the object goes on changing),
    without functions: a scheduler's ``state_dict()`` is its ``__dict__``, which holds the
    ``step`` wrapper :class:`UserState` installed (code, not state; never sent)."""
    return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in sd.items()
            if not isinstance(v, (types.MethodType, types.FunctionType))}


__all__ = ["UserState", "decode", "encode"]

"""The user's optimizer, run by the shard owners of the parameter store.

Three parts:

* :class:`OptimSpec` (read once from the user's optimizer by :func:`read_spec`): the optimizer
  class, each parameter group's fixed options (``nesterov``, ``amsgrad``, ``maximize``, ...),
  which flat elements belong to which group (:attr:`OptimSpec.runs`), the names of the numeric
  hyperparameters that may change during training (:attr:`OptimSpec.hyper_keys`: ``lr``,
  ``momentum``, ``betas``, ``eps``, ``weight_decay``, ... whatever the class uses) and the
  optimizer's per-parameter state entries (:attr:`OptimSpec.state`), found by stepping a
  two-element probe with the same configuration.
* :func:`read_hypers`: every group's current numeric hyperparameters, read from the user's
  optimizer (whose ``param_groups`` the user's LR scheduler updates) at the time of a push;
  they travel with each push piece (:func:`encode_hypers` / :func:`decode_hypers`) and the
  owner steps with them.
* :class:`ShardOptimizer`: one owner's shard. Its weights are one float32 vector; every
  *segment* (a push piece cut at parameter-group boundaries) is a view of it with its own
  instance of the user's optimizer class, so a piece is stepped on its own with its group's
  options. Per-element arithmetic is torch's own: with the same gradient and hyperparameters
  the result is bitwise what the user's optimizer does locally.

Only optimizers whose update is elementwise can be sharded (:data:`ELEMENTWISE_NAMES`): each element's
new value depends on that element's weight, gradient and state, plus per-tensor scalars (the
step count). LBFGS (a closure and a global line search), SparseAdam (sparse gradients) and
Adafactor (factored row / column state) are not.

Optimizer state moves with its elements (:meth:`ShardOptimizer.export_state`,
``ShardOptimizer(state=...)``): every state entry is exported per element (a scalar such as
Adam's ``step`` is repeated over its segment's elements), with a first channel marking the
elements whose segment had state; a new segment made of elements with no state starts fresh,
otherwise takes each per-element entry (zero for its elements that had none: a lost shard's
elements that share a piece with moved ones) and, for a scalar entry, the largest value among
its elements that had state (segments of one shard are stepped together, so their step counts
differ only after a lost push).
"""

from __future__ import annotations

import bisect
import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from p2psync.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where it runs: the launcher imports this module without it
    import torch

#: the ``torch.optim`` classes whose update is elementwise (each element's new value depends on
#: its weight, gradient and state and on per-tensor scalars only), so shards of the flat vector
#: can be stepped apart
ELEMENTWISE_NAMES: tuple[str, ...] = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta",
                                      "RMSprop", "Rprop")


def elementwise() -> tuple[type["torch.optim.Optimizer"], ...]:
    """The classes of :data:`ELEMENTWISE_NAMES`."""
    import torch

    return tuple(getattr(torch.optim, n) for n in ELEMENTWISE_NAMES)


#: options that choose an implementation, not the arithmetic: the owners use torch's defaults
#: (their tensors are CPU float32 vectors whatever the user's device)
IMPL_OPTIONS = frozenset({"foreach", "fused", "capturable", "differentiable"})

#: one group's numeric hyperparameters, flattened in :attr:`OptimSpec.hyper_keys` order
HyperValues = tuple[float, ...]
#: group index -> its values (a push carries the groups its pieces touch)
Hypers = Mapping[int, HyperValues]


@dataclass(frozen=True)
class StateEntry:
    """One per-parameter state entry of the optimizer: ``elementwise`` (a tensor shaped like
    the parameter) or a scalar (``tensor``: a 0-d float32 tensor, else a Python float)."""

    key: str
    elementwise: bool
    tensor: bool = True


@dataclass(frozen=True)
class OptimSpec:
    """What the owners need to run the user's optimizer (see the module docstring).

    ``runs``: ``(lo, hi, group)`` covering the flat vector in order; ``static``: each group's
    fixed constructor options; ``hyper_keys``: ``(name, width)`` (width 0: a plain number,
    k >= 1: a tuple of k numbers such as ``betas``); ``initial``: every group's values at the
    time the spec was read."""

    cls: type[torch.optim.Optimizer]
    numel: int
    runs: tuple[tuple[int, int, int], ...]
    static: tuple[Mapping[str, Any], ...]
    hyper_keys: tuple[tuple[str, int], ...]
    initial: tuple[HyperValues, ...]
    state: tuple[StateEntry, ...] = field(default=())

    @property
    def groups(self) -> int:
        return len(self.static)

    @property
    def width(self) -> int:
        """Numbers per group in :data:`HyperValues`."""
        return sum(max(1, w) for _, w in self.hyper_keys)

    def values(self, vals: HyperValues) -> dict[str, Any]:
        """A group's hyperparameters as ``param_groups`` keys them."""
        out: dict[str, Any] = {}
        i = 0
        for k, w in self.hyper_keys:
            if w == 0:
                out[k] = vals[i]
                i += 1
            else:
                out[k] = tuple(vals[i:i + w])
                i += w
        return out

    def groups_in(self, a: int, b: int) -> list[int]:
        """The groups owning elements of ``[a, b)``, in order of appearance (no repeats)."""
        out: list[int] = []
        for s, e, g in self.runs_in(a, b):
            if g not in out:
                out.append(g)
        return out

    def runs_in(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """``runs`` clipped to ``[a, b)``."""
        starts = [r[0] for r in self.runs]
        i = max(0, bisect.bisect_right(starts, a) - 1)
        out = []
        while i < len(self.runs) and self.runs[i][0] < b:
            s, e, g = self.runs[i]
            if e > a:
                out.append((max(s, a), min(e, b), g))
            i += 1
        return out

    @classmethod
    def of(cls, opt_cls: type[torch.optim.Optimizer], numel: int, **options: Any) -> "OptimSpec":
        """The spec of ``opt_cls(params, **options)`` over one group of ``numel`` elements."""
        import torch

        p = torch.zeros(max(1, numel))
        return read_spec(opt_cls([p], **options), [p] if numel else [])


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _hyper_width(v: Any) -> int | None:
    """0 for a number, k for a tuple of k numbers, None for anything else."""
    import torch

    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return 0
    if _is_number(v):
        return 0
    if isinstance(v, (tuple, list)) and v and all(_is_number(x) for x in v):
        return len(v)
    return None


def read_spec(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> OptimSpec:
    """The :class:`OptimSpec` of ``optimizer`` over ``params`` (the model's trainable
    parameters in flat-vector order). ConfigError when the optimizer cannot be sharded: not an
    elementwise ``torch.optim`` class, a trainable parameter in no group, or a state entry that
    is neither elementwise nor a scalar."""
    import torch

    cls = type(optimizer)
    if cls not in elementwise():
        raise ConfigError(f"the parameter store runs the optimizer on shards of the flat parameter vector: "
                          f"{cls.__module__}.{cls.__name__} is not one whose update is elementwise (supported: "
                          f"{', '.join(ELEMENTWISE_NAMES)})")
    groups = optimizer.param_groups
    of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
    outside = sum(1 for p in params if id(p) not in of)
    if outside:
        raise ConfigError(f"{outside} trainable parameter tensor(s) of the model are in no parameter group of the "
                          "optimizer: give the optimizer every trainable parameter, or set requires_grad=False "
                          "on the frozen ones")
    runs: list[tuple[int, int, int]] = []
    off = 0
    for p in params:
        n, g = p.numel(), of[id(p)]
        if n and runs and runs[-1][2] == g and runs[-1][1] == off:
            runs[-1] = (runs[-1][0], off + n, g)
        elif n:
            runs.append((off, off + n, g))
        off += n
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k not in IMPL_OPTIONS}
    keys: list[tuple[str, int]] = []
    for k in defaults:
        widths = {_hyper_width(g.get(k, defaults[k])) for g in groups}
        if len(widths) == 1 and (w := widths.pop()) is not None:
            keys.append((k, w))
    hk = {k for k, _ in keys}
    static = tuple({k: g.get(k, v) for k, v in defaults.items() if k not in hk} for g in groups)
    spec = OptimSpec(cls=cls, numel=off, runs=tuple(runs), static=static, hyper_keys=tuple(keys),
                     initial=tuple(_flatten(g, keys) for g in groups))
    return dataclasses.replace(spec, state=_probe_state(spec))


def _flatten(group: Mapping[str, Any], keys: Iterable[tuple[str, int]]) -> HyperValues:
    out: list[float] = []
    for k, w in keys:
        v = group[k]
        if w == 0:
            out.append(float(v))
        else:
            out.extend(float(x) for x in v)
    return tuple(out)


def read_hypers(optimizer: torch.optim.Optimizer, spec: OptimSpec) -> dict[int, HyperValues]:
    """Every group's numeric hyperparameters as they are now (ConfigError if the optimizer's
    groups no longer match ``spec``)."""
    groups = optimizer.param_groups
    if len(groups) != spec.groups:
        raise ConfigError(f"the optimizer has {len(groups)} parameter groups, it had {spec.groups} when the run "
                          "started (adding groups during a run is not supported)")
    return {gi: _flatten(g, spec.hyper_keys) for gi, g in enumerate(groups)}


def _make(spec: OptimSpec, gi: int, tensor: torch.Tensor, vals: HyperValues) -> torch.optim.Optimizer:
    kw = {**spec.static[gi], **spec.values(vals)}
    return spec.cls([tensor], **kw)


def _probe_state(spec: OptimSpec) -> tuple[StateEntry, ...]:
    """The per-parameter state entries of the optimizer, from one step of a two-element probe
    per group (momentum, where the class has it, set non-zero so its buffer shows)."""
    import torch

    seen: dict[str, StateEntry] = {}
    for gi in range(spec.groups):
        vals = dict(spec.values(spec.initial[gi]))
        if "momentum" in vals and not vals["momentum"]:
            vals["momentum"] = 0.5
        p = torch.zeros(2)
        opt = spec.cls([p], **{**spec.static[gi], **vals})
        p.grad = torch.ones(2)
        opt.step()
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                entry = StateEntry(k, True)
            elif isinstance(v, torch.Tensor) and v.numel() == 1:
                entry = StateEntry(k, False, True)
            elif _is_number(v):
                entry = StateEntry(k, False, False)
            else:
                raise ConfigError(f"{spec.cls.__name__} keeps state {k!r} that is neither per element nor a scalar: "
                                  "the parameter store cannot shard it")
            seen.setdefault(k, entry)
    return tuple(seen[k] for k in sorted(seen))


def encode_hypers(hypers: Hypers, groups: Iterable[int]) -> list[list[float]]:
    """Wire form of ``groups``' values: ``[[group, v1, v2, ...], ...]``."""
    return [[float(g), *hypers[g]] for g in groups]


def decode_hypers(raw: Any, spec: OptimSpec, need: Iterable[int]) -> dict[int, HyperValues] | None:
    """The values a push piece carries, or None when they are malformed, not finite, or miss a
    group of ``need``."""
    if not isinstance(raw, list):
        return None
    out: dict[int, HyperValues] = {}
    for row in raw:
        if not isinstance(row, list) or len(row) != 1 + spec.width:
            return None
        if not all(_is_number(x) and math.isfinite(x) for x in row):
            return None
        g = row[0]
        if g != int(g) or not 0 <= int(g) < spec.groups:
            return None
        out[int(g)] = tuple(float(x) for x in row[1:])
    if any(g not in out for g in need):
        return None
    return out


@dataclass
class _Segment:
    lo: int  # shard offsets
    hi: int
    group: int
    param: torch.Tensor
    opt: torch.optim.Optimizer


class ShardOptimizer:
    """The user's optimizer on one owner's shard ``[lo, hi)`` of the flat vector, stepped one
    push piece at a time (see the module docstring). ``pieces``: the shard's push pieces
    (absolute ranges); ``state``: an :meth:`export_state` array to start from."""

    def __init__(self, spec: OptimSpec, w: np.ndarray, *, lo: int, pieces: Sequence[tuple[int, int]],
                 state: np.ndarray | None = None) -> None:
        import torch

        self.spec = spec
        self.lo = lo
        self.w = np.array(w, dtype=np.float32, copy=True)
        self._t = torch.from_numpy(self.w)
        self.version = 0  # gradient pieces applied (the store counts them)
        self._segs: dict[tuple[int, int], list[_Segment]] = {}
        for a, b in pieces:
            segs = []
            for s, e, g in spec.runs_in(a, b):
                p = self._t[s - lo:e - lo]
                segs.append(_Segment(s - lo, e - lo, g, p, _make(spec, g, p, spec.initial[g])))
            self._segs[(a - lo, b - lo)] = segs
        if state is not None:
            self._import(state)

    @property
    def pieces(self) -> list[tuple[int, int]]:
        """The shard's pieces, shard offsets."""
        return list(self._segs)

    def apply(self, a: int, b: int, g: np.ndarray, hypers: Hypers, lr_scale: float = 1.0) -> None:
        """One optimizer step of the piece ``[a, b)`` (shard offsets: one of :attr:`pieces`)
        with gradient ``g``, each segment with its group's ``hypers`` and the learning rate
        times ``lr_scale``."""
        import torch

        segs = self._segs.get((a, b))
        if segs is None:
            raise ValueError(f"[{a}, {b}) is not a piece of this shard")
        if g.dtype != np.float32 or not g.flags.writeable or not g.flags.c_contiguous:
            g = np.array(g, dtype=np.float32)
        grad = torch.from_numpy(g)
        for s in segs:
            group = s.opt.param_groups[0]
            group.update(self.spec.values(hypers[s.group]))
            if lr_scale != 1.0:
                group["lr"] = group["lr"] * lr_scale
            s.param.grad = grad[s.lo - a:s.hi - a]
            s.opt.step()
            s.param.grad = None

    @property
    def channels(self) -> int:
        """Rows of :meth:`export_state`: the "has state" flag and one per state entry."""
        return 1 + len(self.spec.state)

    def export_state(self) -> np.ndarray:
        """The optimizer state per element, ``(channels, shard size)`` float32 (see the module
        docstring)."""
        import torch

        out = np.zeros((self.channels, self.w.size), np.float32)
        for segs in self._segs.values():
            for s in segs:
                st = s.opt.state.get(s.param)
                if not st:
                    continue
                out[0, s.lo:s.hi] = 1.0
                for k, entry in enumerate(self.spec.state, start=1):
                    v = st.get(entry.key)
                    if v is None:
                        continue
                    if entry.elementwise:
                        out[k, s.lo:s.hi] = v.detach().reshape(-1).to(torch.float32).numpy()
                    else:
                        out[k, s.lo:s.hi] = float(v)
        return out

    def _import(self, state: np.ndarray) -> None:
        import torch

        if state.shape != (self.channels, self.w.size):
            raise ValueError(f"state of shape {state.shape}, this shard needs {(self.channels, self.w.size)}")
        for segs in self._segs.values():
            for s in segs:
                flag = state[0, s.lo:s.hi]
                if s.hi == s.lo or not flag.any():
                    continue
                st: dict[str, Any] = {}
                for k, entry in enumerate(self.spec.state, start=1):
                    row = state[k, s.lo:s.hi]
                    if entry.elementwise:
                        st[entry.key] = torch.from_numpy(np.array(row, dtype=np.float32))
                    else:
                        v = float(row[flag > 0].max())
                        st[entry.key] = torch.tensor(v, dtype=torch.float32) if entry.tensor else v
                s.opt.state[s.param] = st

"""A model and its optimizer seen as flat float32 vectors (what crosses the network).

Synchronous methods; call them on the thread that owns the model (the training thread).
Vectors are host numpy arrays; on a GPU, tensors cross to the host through a pinned
(page-locked) staging buffer of the model's size, copied asynchronously and synchronized once,
and back from pinned memory.

:meth:`FlatModel.export_state` / :meth:`FlatModel.import_state` move the whole replica —
parameters and the torch optimizer's state (momentum buffers; Adam's moments and step counts) —
as one flat float32 vector whose layout depends only on the model and the optimizer's
configuration, so it has the same length on every node of a run (a joiner's optimizer has no
state yet: missing buffers export as zeros, which the optimizers treat exactly like fresh state).
A joining node takes its state from a live peer.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from p2psync.errors import ConfigError
from p2psync.params.optim import HyperValues, OptimSpec, read_hypers, read_spec
from p2psync.model.values import Buffers, Layer, PerElement, SgdHyper, SgdStep



def _write_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """``g`` into ``p.grad``: copied into the existing gradient, else a clone of ``g``."""
    if p.grad is None:
        p.grad = g.clone()
    else:
        p.grad.copy_(g)

class FlatModel:
    """A torch model and its optimizer read and written as flat float32 vectors: gradients,
    parameters, and the whole state (parameters + optimizer buffers).

    Built by ``Session.attach`` (api/session.py: ``flat = FlatModel(model=model,
    optimizer=optimizer)``, wrapped by :class:`~p2psync.api.replica.HookedReplica`). Call its
    methods on the thread that owns the model. ConfigError when the model has no trainable
    parameters.
    """

    def __init__(self, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        if self.numel == 0:
            raise ConfigError("the model has no trainable parameters")
        #: every buffer of the model (BatchNorm's running statistics and batch counts), in
        #: ``named_buffers`` order; what DDP synchronizes too
        self.buffers = [b for _, b in model.named_buffers()]
        self._pinned: torch.Tensor | None = None
        self._per_element_cache: dict[str, tuple[tuple[object, ...], np.ndarray]] = {}

    def layers(self) -> list[Layer]:
        """The modules with trainable parameters of their own, in the flat vector's order
        (Canary's colayers group them)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        offsets = np.concatenate([[0], np.cumsum([p.numel() for p in self.params])]).tolist()
        out: list[Layer] = []
        for name, mod in self.model.named_modules():
            own = [index[id(p)] for p in mod.parameters(recurse=False) if id(p) in index]
            own = [i for i in own if not any(i in layer.params for layer in out)]  # tied weights: once
            if own:
                kind = "fc" if isinstance(mod, nn.Linear) else "conv"
                out.append(Layer(name=name or type(mod).__name__, kind=kind, offset=int(offsets[min(own)]),
                                 numel=sum(self.params[i].numel() for i in own), params=tuple(own)))
        if sorted(i for layer in out for i in layer.params) != list(range(len(self.params))) \
                or any(b.offset != a.offset + a.numel for a, b in zip(out, out[1:])):
            raise ConfigError("the model's parameters are not laid out module by module (parameters "
                              "registered outside modules?): layer groups need them consecutive")
        return out

    def _to_host(self, flat: torch.Tensor) -> np.ndarray:
        """``flat`` as a host float32 array. ``flat``: a tensor nothing else holds (a fresh
        concatenation): off a GPU the array takes its memory instead of copying it."""
        flat = flat.detach()
        if flat.device.type != "cuda":
            return flat.to("cpu", torch.float32).numpy()
        if self._pinned is None or self._pinned.numel() != flat.numel():
            self._pinned = torch.empty(flat.numel(), dtype=torch.float32, pin_memory=True)
        self._pinned.copy_(flat.to(torch.float32), non_blocking=True)
        torch.cuda.current_stream(flat.device).synchronize()
        return self._pinned.numpy().copy()

    def _to_device(self, vec: np.ndarray) -> torch.Tensor:
        src = torch.from_numpy(np.ascontiguousarray(vec, dtype=np.float32))
        if self.device.type != "cuda":
            return src
        return src.pin_memory().to(self.device, non_blocking=True)

    @property
    def device(self) -> torch.device:
        """The device of the model's (first) trainable parameter."""
        return self.params[0].device

    def grads(self) -> np.ndarray:
        """The parameters' ``.grad`` as one host float32 vector (zeros where a gradient is
        missing). Called from api/session.py at ``optimizer.step()``:
        ``grads = self.replica.flat.grads()``."""
        return self._to_host(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                        for p in self.params]))

    def _per_param(self, vec: np.ndarray, what: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, its part of ``vec`` on the parameter's device and dtype) for each one."""
        if vec.size != self.numel:
            raise ValueError(f"{what} vector has {vec.size} elements, model has {self.numel}")
        src = self._to_device(vec)
        off = 0
        for p in self.params:
            n = p.numel()
            yield p, src[off: off + n].view_as(p).to(p.device, p.dtype)
            off += n

    def set_grads(self, vec: np.ndarray) -> None:
        """Copy the flat ``vec`` into the parameters' ``.grad`` (ValueError on a length
        mismatch); the optimizer step that follows uses them. Called from api/replica.py:
        ``self.flat.set_grads(vec)``."""
        for p, g in self._per_param(vec, "gradient"):
            _write_grad(p, g)

    def set_grads_parts(self, parts: Sequence[tuple[int, np.ndarray]]) -> None:
        """Copy each ``(offset, values)`` of ``parts`` into the ``.grad`` of the parameters it
        covers in the flat vector (whole parameters, ValueError otherwise): :meth:`set_grads`
        of the parts together, without a vector of the whole model. Gradients outside the
        parts are left alone."""
        for lo, vec in parts:
            src = self._to_device(vec.reshape(-1))
            for p, a, b, at in self._slices([(lo, lo + vec.size)]):
                if a != 0 or b != p.numel():
                    raise ValueError(f"gradient part at {lo} ({vec.size} elements) splits a parameter")
                _write_grad(p, src[at:at + b - a].view_as(p).to(p.device, p.dtype))

    def get_params(self) -> np.ndarray:
        """A host copy of the trainable parameters as one float32 vector."""
        return self._to_host(torch.nn.utils.parameters_to_vector(self.params))

    def set_params(self, vec: np.ndarray) -> None:
        """Copy the flat ``vec`` into the parameters (optimizer state untouched; ValueError on
        a length mismatch)."""
        # copied into the parameters' own storage: vector_to_parameters would make them views
        # of ``vec`` (on the CPU, of the caller's numpy array: two replicas given the same
        # array, as nodes in one process are, then trained one shared set of weights)
        with torch.no_grad():
            for p, v in self._per_param(vec, "parameter"):
                p.copy_(v)

    def _slices(self, ranges: Sequence[tuple[int, int]]) -> Iterator[tuple[torch.Tensor, int, int, int]]:
        """(parameter, first, end within it, position in the ranges' concatenation) for every
        piece of a parameter the ``ranges`` of the flat vector cover, in order."""
        pos = 0
        for lo, hi in ranges:
            if not 0 <= lo <= hi <= self.numel:
                raise ValueError(f"range [{lo}, {hi}) outside the {self.numel} parameters")
            off = 0
            for p in self.params:
                n = p.numel()
                a, b = max(lo, off), min(hi, off + n)
                if a < b:
                    yield p, a - off, b - off, pos + a - lo
                off += n
            pos += hi - lo

    def get_params_range(self, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
        """A host float32 copy of the flat vector's ``ranges`` (lo, hi), concatenated: what
        :meth:`get_params` holds there, without a copy of the whole vector."""
        parts = [p.detach().reshape(-1)[a:b] for p, a, b, _ in self._slices(ranges)]
        if not parts:
            return np.zeros(0, np.float32)
        return self._to_host(torch.cat(parts))

    def set_params_range(self, ranges: Sequence[tuple[int, int]], vec: np.ndarray) -> None:
        """Copy ``vec`` (the ranges' values, concatenated) into the parameters there; the rest
        of the model and the optimizer state untouched (ValueError on a length mismatch)."""
        size = sum(hi - lo for lo, hi in ranges)
        if vec.size != size:
            raise ValueError(f"parameter range vector has {vec.size} elements, the ranges hold {size}")
        src = self._to_device(vec)
        with torch.no_grad():
            for p, a, b, at in self._slices(ranges):
                part = src[at:at + b - a].to(p.device, p.dtype)
                if p.is_contiguous():
                    p.view(-1)[a:b].copy_(part)
                else:  # (a strided parameter: written back whole)
                    whole = p.detach().reshape(-1).clone()
                    whole[a:b] = part
                    p.copy_(whole.view_as(p))

    # -- module buffers (BatchNorm statistics) -----------------------------------------------

    @property
    def buffer_bytes(self) -> int:
        """Bytes of all buffers together (0: the model has none, nothing to synchronize)."""
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def get_buffers(self) -> np.ndarray:
        """Every buffer's raw bytes, concatenated in ``named_buffers`` order (uint8): bitwise
        what the model holds, whatever the buffers' dtypes."""
        if not self.buffers:
            return np.zeros(0, np.uint8)
        return np.concatenate([_raw(b) for b in self.buffers])

    def set_buffers(self, raw: np.ndarray) -> None:
        """Copy :meth:`get_buffers` bytes into the buffers (ValueError on a length mismatch)."""
        if raw.size != self.buffer_bytes:
            raise ValueError(f"buffer bytes: got {raw.size}, the model's buffers hold {self.buffer_bytes}")
        off = 0
        with torch.no_grad():
            for b in self.buffers:
                n = b.numel() * b.element_size()
                src = torch.from_numpy(np.array(raw[off:off + n], dtype=np.uint8)).view(b.dtype).view_as(b)
                b.copy_(src.to(b.device))
                off += n

    def float_buffers(self) -> np.ndarray:
        """The floating-point buffers (running means and variances) as one float32 vector."""
        parts = [b.detach().reshape(-1).to("cpu", torch.float32).numpy() for b in self.buffers
                 if b.is_floating_point()]
        return np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)

    def set_float_buffers(self, vec: np.ndarray) -> None:
        """Write a :meth:`float_buffers` vector back (each buffer keeps its dtype)."""
        off = 0
        with torch.no_grad():
            for b in self.buffers:
                if b.is_floating_point():
                    n = b.numel()
                    b.copy_(torch.from_numpy(np.asarray(vec[off:off + n], np.float32)).view_as(b).to(b.device, b.dtype))
                    off += n
        if off != vec.size:
            raise ValueError(f"float buffers: got {vec.size} values, the model's hold {off}")

    def read_buffers(self, floats: bool = False) -> Buffers:
        """The buffers as :class:`~p2psync.model.values.Buffers` (``floats``: with the
        floating-point ones as float32 too)."""
        return Buffers(raw=self.get_buffers(), floats=self.float_buffers() if floats else None)

    def write_buffers(self, buffers: Buffers) -> None:
        """Write :class:`~p2psync.model.values.Buffers` back: raw bytes, then floats."""
        self.set_buffers(buffers.raw)
        if buffers.floats is not None:
            self.set_float_buffers(buffers.floats)

    def digests(self, buffers: bool = True) -> list[tuple[str, bytes]]:
        """(name, 8-byte BLAKE2b digest of its raw bytes) of every parameter and (``buffers``)
        buffer, in ``named_parameters`` then ``named_buffers`` order: the replica audit compares
        them across members (gradients and the optimizer state are not included)."""
        named = [*self.model.named_parameters(), *(self.model.named_buffers() if buffers else ())]
        return [(name, hashlib.blake2b(_raw(t).data, digest_size=8).digest()) for name, t in named]

    # -- plain SGD's own numbers (DTS) ----------------------------------------------------

    def sgd_hyper(self) -> SgdHyper:
        """The optimizer's learning rate, momentum and weight decay, read now (a scheduler may
        have changed them). Only plain SGD qualifies: Nesterov and dampening change the
        coefficients DTS's compensation relies on, and Adam is not linear in the gradients."""
        opt = self.optimizer
        if type(opt) is not torch.optim.SGD:
            raise ConfigError(f"this strategy needs torch.optim.SGD (plain or with momentum), not "
                              f"{type(opt).__name__}: it does SGD's arithmetic itself (DTS's compensation is exact "
                              "only for an optimizer linear in the gradients)")
        groups = opt.param_groups
        for g in groups:
            if g.get("nesterov", False) or g.get("dampening", 0) != 0:
                raise ConfigError("this strategy needs SGD without nesterov and with dampening 0 "
                                  f"(got nesterov={g.get('nesterov')}, dampening={g.get('dampening')})")
            if g.get("maximize", False):
                raise ConfigError("this strategy does not support SGD(maximize=True)")
        held = {id(p) for g in groups for p in g["params"]}
        outside = sum(1 for p in self.params if id(p) not in held)
        if outside:
            raise ConfigError(f"{outside} trainable parameter tensor(s) of the model are in no parameter group "
                              "of the optimizer: give the optimizer every trainable parameter, or set "
                              "requires_grad=False on the frozen ones")
        moms = {float(g.get("momentum", 0.0)) for g in groups}
        if len(moms) != 1:
            raise ConfigError(f"every parameter group must use the same momentum (got {sorted(moms)})")
        return SgdHyper(lr=self._per_element("lr"), momentum=moms.pop(),
                        weight_decay=self._per_element("weight_decay"))

    def sgd_step(self, vec: np.ndarray, step: Callable[[], object]) -> SgdStep:
        """Set the gradients to ``vec`` and run ``step`` (the optimizer's own step), reporting
        what SGD fed to its buffer."""
        hyper = self.sgd_hyper()
        wd = hyper.weight_decay
        g = vec if isinstance(wd, float) and wd == 0.0 else vec + np.float32(1) * wd * self.get_params()
        self.set_grads(vec)
        step()
        return SgdStep(grad=np.asarray(g, dtype=np.float32), hyper=hyper)

    def _per_element(self, key: str) -> PerElement:
        groups = self.optimizer.param_groups
        values = {float(g.get(key, 0.0)) for g in groups}
        if len(values) == 1:
            return values.pop()
        sig = (key, tuple(float(g.get(key, 0.0)) for g in groups))
        cached = self._per_element_cache.get(key)
        if cached is None or cached[0] != sig:  # built once per change (a scheduler's step)
            of = {id(p): float(g.get(key, 0.0)) for g in groups for p in g["params"]}
            vec = np.concatenate([np.full(p.numel(), of[id(p)], np.float32) for p in self.params])
            vec.setflags(write=False)
            cached = self._per_element_cache[key] = (sig, vec)
        return cached[1]

    def optim_spec(self) -> OptimSpec:
        """The optimizer as the parameter store's owners run it (:func:`p2psync.params.read_spec`)."""
        return read_spec(self.optimizer, self.params)

    def optim_hypers(self, spec: OptimSpec) -> dict[int, HyperValues]:
        """Every parameter group's numeric hyperparameters, read now (:func:`p2psync.params.read_hypers`)."""
        return read_hypers(self.optimizer, spec)

    def correct(self, dw: np.ndarray, du: np.ndarray | None) -> None:
        """A compensation: parameters += dw, SGD momentum buffers += du (if given)."""
        self.add_to_params(dw)
        if du is not None:
            self.add_to_momentum(du)

    def add_to_params(self, delta: np.ndarray) -> None:
        """w += delta (flat, float32)."""
        with torch.no_grad():
            for p, d in self._per_param(delta, "parameter delta"):
                p.add_(d)

    def add_to_momentum(self, delta: np.ndarray) -> None:
        """SGD's momentum buffers += delta (a missing buffer starts from zero)."""
        for p, d in self._per_param(delta, "momentum delta"):
            st = self.optimizer.state[p]
            buf = st.get("momentum_buffer")
            if buf is None:
                st["momentum_buffer"] = d.clone()
            else:
                buf.add_(d)

    # -- whole state (joins) -------------------------------------------------------------

    def _state_keys(self) -> list[str]:
        """Per-parameter optimizer state entries, in export order."""
        opt = self.optimizer
        if isinstance(opt, torch.optim.SGD):
            return ["momentum_buffer"] if any(g.get("momentum", 0) for g in opt.param_groups) else []
        if isinstance(opt, torch.optim.Adam):
            amsgrad = any(g.get("amsgrad", False) for g in opt.param_groups)
            return ["exp_avg", "exp_avg_sq", *(["max_exp_avg_sq"] if amsgrad else []), "step"]
        raise ConfigError(f"cannot export the state of optimizer {type(opt).__name__} "
                          "(supported: SGD, Adam)")

    def state_size(self) -> int:
        """The length of :meth:`export_state`'s vector (ConfigError for an optimizer other
        than SGD or Adam)."""
        keys = self._state_keys()
        per_param = sum(1 for k in keys if k == "step")
        return self.numel * (1 + len(keys) - per_param) + per_param * len(self.params)

    def export_state(self) -> np.ndarray:
        """Parameters, then each optimizer state entry per parameter, as one float32 vector
        (missing buffers as zeros; see the module docstring), a fresh one: each part is
        copied straight into its place (off a GPU), no vector of the parameters first."""
        out = np.empty(self.state_size(), np.float32)
        if self.device.type == "cuda":
            out[:self.numel] = self.get_params()  # (through the pinned staging buffer)
        else:
            into = torch.from_numpy(out[:self.numel])
            with torch.no_grad():
                for p, a, b, at in self._slices([(0, self.numel)]):
                    into[at:at + b - a].copy_(p.detach().reshape(-1))
        off = self.numel
        for key in self._state_keys():
            for p in self.params:
                t = self.optimizer.state.get(p, {}).get(key)
                n = 1 if key == "step" else p.numel()
                if t is None:
                    out[off:off + n] = 0.0
                elif key == "step":
                    out[off] = float(t)
                else:
                    out[off:off + n] = t.detach().reshape(-1).to("cpu", torch.float32).numpy()
                off += n
        return out

    def import_state(self, vec: np.ndarray) -> None:
        """Load an :meth:`export_state` vector into the parameters and the optimizer state
        (ValueError when its length is not :meth:`state_size`)."""
        if vec.size != self.state_size():
            raise ValueError(f"state vector has {vec.size} elements, this replica has {self.state_size()}")
        self.set_params(vec[:self.numel])
        off = self.numel
        for key in self._state_keys():
            for p in self.params:
                st = self.optimizer.state[p]
                if key == "step":
                    st["step"] = torch.tensor(float(vec[off]), dtype=torch.float32)
                    off += 1
                    continue
                n = p.numel()
                src = torch.from_numpy(np.array(vec[off:off + n], dtype=np.float32)).view_as(p)
                st[key] = src.to(p.device, p.dtype).clone()
                off += n


def _raw(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes on the host (uint8, C order): a view of a contiguous CPU tensor, so the
    caller copies (``np.concatenate``) or only reads (a digest) them."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    if flat.numel() == 0:
        return np.zeros(0, np.uint8)
    return flat.view(torch.uint8).numpy()


__all__ = ["FlatModel"]

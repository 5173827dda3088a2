"""A simulated node's model: a tiny replica in numpy whose compute takes virtual time.

:class:`SimReplica` implements the core :class:`~p2psync.model.replica.Replica` protocol and
the capabilities the simulated strategies declare (:data:`~p2psync.model.replica.MODEL_BUFFERS`,
:data:`~p2psync.model.replica.SGD_COMPENSATION`, :data:`~p2psync.model.replica.PARAM_RANGES`,
:data:`~p2psync.model.replica.STEP_EACH`, :data:`~p2psync.model.replica.STEP_AS_IS`,
:data:`~p2psync.model.replica.LAYERED`, :data:`~p2psync.model.replica.OPTIMIZER_SHARDS`), so a strategy
runs its real decisions and collectives on it unchanged; there is no thread and no gate, and
no torch but a parameter store's. What it computes:

* **Model**: two small layers of float32 (:data:`LAYERS`: 16 parameters in all) and one float32
  buffer of 4 running statistics (as BatchNorm's), all equal on every node at the start (drawn
  from the seed alone: the identical start a real run broadcasts).
* **An iteration** (``compute_gradients``): the node's actor waits ``step_time`` virtual
  seconds (the emulated forward and backward; a held node waits longer), then returns the
  gradient of ``0.5 * |w - c_i|^2`` at the current parameters plus noise, where the target
  ``c_i`` and the noise come from the seed and the node id alone: deterministic. The buffer
  moves towards the gradient's mean (a forward pass updates running statistics). An ``abort``
  event set first ends the wait with :class:`~p2psync.errors.Aborted` (ESync's READY).
* **Optimizer**: ``torch.optim.SGD``'s arithmetic with momentum and dampening 0 (the first
  step's buffer is the gradient itself), in float32; its state is the momentum buffer. Its
  spec (``optim_spec``: the class, learning rate and momentum) is what a parameter store's
  shard owners run with torch itself, on their slices.
* **Digests** (:meth:`SimReplica.digests`): the replica audit's (``FlatModel.digests``,
  :mod:`p2psync.strategies.audit`): an 8-byte BLAKE2b of each tensor's raw bytes, per
  layer then buffer.

Every coroutine runs on the node's actor of the virtual-time loop; nothing blocks.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from typing import Sequence

import msgpack
import numpy as np

from p2psync.errors import Aborted, ConfigError, ProtocolError
from p2psync.model import Buffers, Layer, SgdHyper, SgdStep
from p2psync.model.values import MAX_META_BYTES
from p2psync.params.optim import HyperValues, OptimSpec

#: (name, elements) of every parameter tensor, in the flat vector's order: two modules, 16
#: float32 in all. Small on purpose: a collective cuts a vector into at most one piece per
#: element, and every piece crosses the ring alone (2 (N - 1) messages each), so on a large
#: ring the simulation's cost per step grows with the model's size
LAYERS: tuple[tuple[str, int], ...] = (("l0.weight", 8), ("l0.bias", 4), ("l1.weight", 3), ("l1.bias", 1))
#: float32 values of the running-statistics buffer
BUFFER = ("bn.running_mean", 4)
#: samples one iteration counts (``Replica.samples``)
BATCH = 16
#: how far the noise moves each gradient element (its standard deviation)
NOISE = 0.1


def _blake(a: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(a).view(np.uint8).data, digest_size=8).digest()


class SimReplica:
    """One node's simulated model (see the module docstring). ``seed`` and ``node_id`` fix
    every number it computes; ``step_time``: virtual seconds per iteration (>= 0); ``lr`` and
    ``momentum``: plain SGD's."""

    def __init__(self, *, node_id: int, seed: int, step_time: float, lr: float = 0.05,
                 momentum: float = 0.9) -> None:
        if not step_time >= 0:
            raise ConfigError(f"step time {step_time!r}: must be >= 0 seconds")
        self.node_id = node_id
        self.step_time = float(step_time)
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.numel = sum(n for _, n in LAYERS)
        start = np.random.default_rng([seed, 0x5EED])
        self.params = start.standard_normal(self.numel).astype(np.float32)
        self.buffer = np.zeros(BUFFER[1], np.float32)
        self.momentum_buf = np.zeros(self.numel, np.float32)
        own = np.random.default_rng([seed, 1 + node_id])
        #: this node's optimum (its "data")
        self.target = own.standard_normal(self.numel).astype(np.float32)
        self._noise = np.random.default_rng([seed, 1 + node_id, 1])
        #: iterations computed (aborted ones not counted) and optimizer steps taken
        self.iterations = 0
        self.steps_taken = 0
        self._samples = 0
        #: the latest iteration's gradient, as ``.grad`` holds it in torch (:meth:`step_as_is`)
        self.grad = np.zeros(self.numel, np.float32)

    # -- the core protocol ------------------------------------------------------------------

    @property
    def samples(self) -> int:
        """Samples of the iterations computed so far (:data:`BATCH` each)."""
        return self._samples

    async def compute_gradients(self, abort: threading.Event | None = None) -> tuple[float, np.ndarray]:
        """One iteration: ``step_time`` virtual seconds, then (loss, gradient) at the parameters
        as they are then; Aborted when ``abort`` is set before it is done."""
        if abort is not None and abort.is_set():
            raise Aborted(f"node {self.node_id}: iteration abandoned")
        if self.step_time > 0:
            await self._wait(abort)
        diff = self.params - self.target
        noise = self._noise.standard_normal(self.numel).astype(np.float32)
        grad = (diff + np.float32(NOISE) * noise).astype(np.float32)
        self.buffer = (np.float32(0.9) * self.buffer + np.float32(0.1) * np.float32(grad.mean())).astype(np.float32)
        self.iterations += 1
        self._samples += BATCH
        self.grad = grad
        return float(0.5 * np.mean(diff.astype(np.float64) ** 2)), grad.copy()

    async def _wait(self, abort: threading.Event | None) -> None:
        """Sleep ``step_time`` virtual seconds; Aborted as soon as ``abort`` is set (an event
        with ``listen``, as :class:`~p2psync.tasks.AbortEvent`, wakes the wait; a plain one
        is checked at the end)."""
        listen = getattr(abort, "listen", None)
        if listen is None:
            await asyncio.sleep(self.step_time)
        else:
            loop = asyncio.get_running_loop()
            woken: asyncio.Future[None] = loop.create_future()

            def wake() -> None:
                if not woken.done():
                    woken.set_result(None)
            timer = loop.call_later(self.step_time, wake)
            unlisten = listen(lambda: loop.call_soon(wake))
            try:
                await woken
            finally:
                timer.cancel()
                unlisten()
        if abort is not None and abort.is_set():
            raise Aborted(f"node {self.node_id}: iteration abandoned")

    def _step(self, vec: np.ndarray) -> None:
        """torch's SGD step (momentum, dampening 0, no weight decay) with gradient ``vec``."""
        g = self._vector(vec, "gradient")
        if self.momentum:
            self.momentum_buf = (np.float32(self.momentum) * self.momentum_buf + g).astype(np.float32)
            g = self.momentum_buf
        self.params = (self.params - np.float32(self.lr) * g).astype(np.float32)
        self.steps_taken += 1

    def _vector(self, vec: np.ndarray, what: str, size: int | None = None) -> np.ndarray:
        n = self.numel if size is None else size
        out = np.asarray(vec, dtype=np.float32).reshape(-1)
        if out.size != n:
            raise ValueError(f"{what} vector has {out.size} elements, expected {n}")
        return out

    async def apply_gradients(self, vec: np.ndarray) -> None:
        """One SGD step with gradient ``vec``."""
        self._step(vec)

    async def get_params(self) -> np.ndarray:
        return self.params.copy()

    async def set_params(self, vec: np.ndarray) -> None:
        self.params = self._vector(vec, "parameter").copy()

    async def export_state(self) -> np.ndarray:
        """Parameters, then the momentum buffer."""
        return np.concatenate([self.params, self.momentum_buf]).astype(np.float32)

    async def import_state(self, vec: np.ndarray) -> None:
        v = self._vector(vec, "state", self.state_size())
        self.params = v[:self.numel].copy()
        self.momentum_buf = v[self.numel:].copy()

    async def export_meta(self) -> bytes:
        """The optimizer's hyperparameters, encoded (msgpack)."""
        return bytes(msgpack.packb({"lr": self.lr, "momentum": self.momentum}, use_bin_type=True))

    async def import_meta(self, raw: bytes) -> None:
        """Take :meth:`export_meta`'s hyperparameters; ProtocolError when malformed."""
        if len(raw) > MAX_META_BYTES:
            raise ProtocolError("state", f"training state of {len(raw)} bytes (limit {MAX_META_BYTES})")
        try:
            got = msgpack.unpackb(raw, raw=False)
        except (ValueError, msgpack.ExtraData) as exc:
            raise ProtocolError("state", f"unreadable training state: {type(exc).__name__}") from None
        if not isinstance(got, dict) or not all(isinstance(got.get(k), float) for k in ("lr", "momentum")):
            raise ProtocolError("state", "training state is not {lr, momentum}")
        self.lr, self.momentum = float(got["lr"]), float(got["momentum"])

    def state_size(self) -> int:
        return 2 * self.numel

    # -- capabilities -----------------------------------------------------------------------

    @property
    def buffer_bytes(self) -> int:
        return int(self.buffer.nbytes)

    async def get_buffers(self, floats: bool = False) -> Buffers:
        return Buffers(raw=self.buffer.view(np.uint8).copy(), floats=self.buffer.copy() if floats else None)

    async def set_buffers(self, buffers: Buffers) -> None:
        raw = np.asarray(buffers.raw, np.uint8).reshape(-1)
        if raw.size != self.buffer.nbytes:
            raise ValueError(f"buffer bytes: got {raw.size}, the model's buffers hold {self.buffer.nbytes}")
        self.buffer = raw.copy().view(np.float32)
        if buffers.floats is not None:
            self.buffer = self._vector(buffers.floats, "float buffer", self.buffer.size).copy()

    async def optim_spec(self) -> OptimSpec:
        """The optimizer as a parameter store's owners run it: ``torch.optim.SGD`` with this
        replica's learning rate and momentum over one group of every parameter (the store runs
        torch's own, on its slices)."""
        import torch  # the parameter store's owners run torch's optimizer; nothing else here needs it

        return OptimSpec.of(torch.optim.SGD, self.numel, lr=self.lr, momentum=self.momentum)

    async def optim_hypers(self, spec: OptimSpec) -> dict[int, HyperValues]:
        """The one group's hyperparameters now (no scheduler changes them)."""
        return {0: spec.initial[0]}

    async def sgd_hyper(self) -> SgdHyper:
        return SgdHyper(lr=self.lr, momentum=self.momentum, weight_decay=0.0)

    async def sgd_step(self, vec: np.ndarray) -> SgdStep:
        """:meth:`apply_gradients`, reporting what SGD fed to its buffer (no weight decay: the
        gradient itself)."""
        hyper = await self.sgd_hyper()
        g = self._vector(vec, "gradient").copy()
        self._step(g)
        return SgdStep(grad=g, hyper=hyper)

    async def correct(self, dw: np.ndarray, du: np.ndarray | None) -> None:
        self.params = (self.params + self._vector(dw, "parameter delta")).astype(np.float32)
        if du is not None:
            self.momentum_buf = (self.momentum_buf + self._vector(du, "momentum delta")).astype(np.float32)

    async def apply_each(self, vecs: Sequence[np.ndarray], scale: float = 1.0) -> None:
        for v in vecs:
            self._step(self._vector(v, "gradient") * np.float32(scale) if scale != 1.0 else v)

    async def step_as_is(self) -> None:
        """One SGD step with the latest iteration's gradient (what ``.grad`` holds)."""
        self._step(self.grad)

    def _ranges(self, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
        for lo, hi in ranges:
            if not 0 <= lo <= hi <= self.numel:
                raise ValueError(f"range [{lo}, {hi}) outside the {self.numel} parameters")
        idx = [np.arange(lo, hi) for lo, hi in ranges]
        out: np.ndarray = np.concatenate(idx) if idx else np.zeros(0, np.int64)
        return out

    async def get_params_range(self, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
        out: np.ndarray = self.params[self._ranges(ranges)].copy()
        return out

    async def set_params_range(self, ranges: Sequence[tuple[int, int]], vec: np.ndarray) -> None:
        idx = self._ranges(ranges)
        params = self.params.copy()
        params[idx] = self._vector(vec, "parameter range", idx.size)
        self.params = params

    def layers(self) -> list[Layer]:
        """One layer per module (its weight and bias together), in the flat vector's order."""
        out: list[Layer] = []
        off = 0
        for i, (name, n) in enumerate(LAYERS):
            mod = name.split(".")[0]
            if out and out[-1].name == mod:
                last = out[-1]
                out[-1] = Layer(name=mod, kind="fc", offset=last.offset, numel=last.numel + n,
                                params=(*last.params, i))
            else:
                out.append(Layer(name=mod, kind="fc", offset=off, numel=n, params=(i,)))
            off += n
        return out

    async def digests(self, buffers: bool = True) -> list[tuple[str, bytes]]:
        """(name, 8-byte BLAKE2b of its raw bytes) of every parameter tensor and (``buffers``)
        the buffer, as ``FlatModel.digests``: what the replica audit compares."""
        return self.digests_now(buffers)

    def digests_now(self, buffers: bool = True) -> list[tuple[str, bytes]]:
        """:meth:`digests`, outside a coroutine (the simulation's summary)."""
        out: list[tuple[str, bytes]] = []
        off = 0
        for name, n in LAYERS:
            out.append((name, _blake(self.params[off:off + n])))
            off += n
        if buffers:
            out.append((BUFFER[0], _blake(self.buffer)))
        return out

    def model_hash(self) -> str:
        """16 hex digits of a BLAKE2b over :meth:`digests_now` in order (the summary's per-node
        hash: equal hashes, equal digests)."""
        return hashlib.blake2b(b"".join(d for _, d in self.digests_now()), digest_size=8).hexdigest()


__all__ = ["BATCH", "BUFFER", "LAYERS", "NOISE", "SimReplica"]

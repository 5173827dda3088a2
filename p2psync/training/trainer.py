"""The local replica: model, optimizer, batches, and atomic operations on them.

Every operation that touches the model runs on a one-thread executor, off the event loop, so
communication progresses while the device computes, and operations never interleave (an
incoming gradient is never applied between another gradient's computation and its step).
Vectors that cross the network are flat float32 numpy arrays in host memory.

One local iteration (forward, backward, and the emulated device's extra time, see
:mod:`~p2psync.training.hetero`) is one compute job. It can be abandoned through a
``threading.Event``: the job checks it between forward and backward, after backward and
throughout the pad, and then raises :class:`~p2psync.errors.Aborted`. An abandoned iteration
leaves no trace: the sampler does not advance (the next iteration takes the same batch) and its
samples are not counted.

:meth:`Trainer.export_state` / :meth:`Trainer.import_state` move the whole replica — parameters
and the torch optimizer's state (momentum buffers; Adam's moments and step counts) — as one flat
float32 vector whose layout depends only on the model and the optimizer's configuration, so it
has the same length on every node of a run (a joiner's optimizer has no state yet: missing
buffers export as zeros, which the optimizers treat exactly like fresh state). A joining node
takes its state from a live peer.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import torch
from torch import nn

from p2psync.params.optim import HyperValues, OptimSpec
from p2psync.model import SgdHyper, SgdStep
from p2psync.model import Buffers
from p2psync.model.flat import FlatModel
from p2psync.training.user_state import UserState, decode, encode
from p2psync.model import Layer
from p2psync.errors import Aborted, ConfigError, Diverged
from p2psync.transport import all_finite
from p2psync.training.corpus import TokenData
from p2psync.training.data import Dataset
from p2psync.training.hetero import Slowdown
from p2psync.training.partition import BatchSampler

T = TypeVar("T")


def resolve_device(spec: str) -> torch.device:
    """The torch device for ``--device`` (``auto``: CUDA when available, else CPU); ConfigError
    for an unknown or unavailable one. Called from training/node.py:
    ``device = resolve_device(cfg.device)``."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {spec}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {spec}: only cpu and cuda are supported")
    return dev


def make_optimizer(name: str, params: Any, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    """The built-in job's optimizer for ``--optimizer``: ``sgd``, ``nesterov`` (SGD with
    Nesterov momentum: ``momentum`` must be > 0), ``adam`` or ``adamw`` (both ignore
    ``momentum``). Called from training/node.py's ``build_trainer``."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "nesterov":
        if momentum <= 0:
            raise ConfigError("--optimizer nesterov needs --momentum > 0")
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ConfigError(f"unknown optimizer {name!r} (choose sgd, nesterov, adam or adamw)")


#: the warm-up share of a ``warmup-cosine`` schedule's steps, and the floor of its decay
WARMUP_FRACTION = 0.05
COSINE_FLOOR = 0.1


def warmup_cosine(step: int, total: int) -> float:
    """The ``warmup-cosine`` schedule's multiplier of the peak learning rate at optimizer step
    ``step`` (0-based) of ``total``: a linear rise over the first :data:`WARMUP_FRACTION` of the
    steps (at least one), then a cosine from 1 down to :data:`COSINE_FLOOR` at the last step."""
    warm = max(1, round(WARMUP_FRACTION * total))
    if step < warm:
        return (step + 1) / warm
    span = max(1, total - warm)
    progress = min(1.0, (step - warm) / span)
    return COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    """The built-in job's local replica: model, optimizer, this node's data shard and the
    emulated device (see the module docstring). It also implements
    :class:`~p2psync.strategies.base.Replica` on its own compute thread (tests drive
    strategies with it directly).

    Built by :func:`~p2psync.training.node.build_trainer`; the built-in job
    (cli/builtin_job.py) attaches its model and optimizer and calls
    ``trainer.forward_backward(session.gate.abandon)`` per iteration.
    """

    def __init__(self, *, model: nn.Module, optimizer: torch.optim.Optimizer, data: Dataset | TokenData,
                 indices: np.ndarray, batch_size: int, seed: int, device: torch.device,
                 eval_batch: int = 2048, slowdown: Slowdown | None = None, clip_norm: float | None = None) -> None:
        """``data``: a classification set (samples: images) or a token corpus (samples: windows
        of ``data.context`` tokens; the model then maps tokens to next-token logits, runs under
        bf16 autocast on CUDA, and evaluates to the mean loss per token and the next-token
        accuracy). ``clip_norm``: every iteration clips the gradient's global norm to it after
        backward (under a strategy that averages during backward: the group's mean)."""
        self.device = device
        self.model = model.to(device)
        self.optimizer = optimizer
        self.data = data
        self.sampler = BatchSampler(indices, batch_size, seed=seed)
        self.flat = FlatModel(model=self.model, optimizer=optimizer)
        self.user_state = UserState(optimizer)
        self.numel = self.flat.numel
        self.loss_fn = nn.CrossEntropyLoss()
        self.eval_batch = eval_batch if not isinstance(data, TokenData) else min(eval_batch, 16)
        self.clip_norm = clip_norm
        self.batches_done = 0
        self.compute_s = 0.0
        self.samples = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.slowdown = slowdown or Slowdown()
        self._jitter = random.Random(seed)  # the emulated device's step-time variation
        self.t0 = time.monotonic()
        self.padded_s = 0.0
        self._burn: torch.Tensor | None = None

    @property
    def n_train(self) -> int:
        """Training samples of the whole data set (all nodes' partitions together)."""
        if isinstance(self.data, TokenData):
            return self.data.n_train
        return len(self.data.y_train)

    @property
    def tokens_per_sample(self) -> int:
        """Tokens in one sample: a language model's context, else 1."""
        return self.data.context if isinstance(self.data, TokenData) else 1

    def batch_tensors(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the training samples ``idx``, on the device."""
        if isinstance(self.data, TokenData):
            xs, ys = self.data.train_batch(idx)
        else:  # (rows picked by numpy, as torch's indexing of the same arrays would)
            xs, ys = self.data.x_train[idx], self.data.y_train[idx]
        dev = self.device
        return torch.from_numpy(xs).to(dev, non_blocking=True), torch.from_numpy(ys).to(dev, non_blocking=True)

    def loss_of(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss, model output) of one batch (a language model: logits per token, under
        bf16 autocast on CUDA)."""
        if not isinstance(self.data, TokenData):
            out = self.model(x)
            return self.loss_fn(out, y), out
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16,
                            enabled=self.device.type == "cuda"):
            out = self.model(x)
        return self.loss_fn(out.float().flatten(0, 1), y.flatten()), out

    # -- executor plumbing ---------------------------------------------------------------

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the compute thread; its wall time counts as compute time."""
        def timed() -> T:
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                self.compute_s += time.perf_counter() - t0
        return await asyncio.get_running_loop().run_in_executor(self._pool, timed)

    def _pad(self, seconds: float, abort: threading.Event | None) -> None:
        """Keep the compute thread busy for ``seconds`` as the emulated device would be: idle
        (``wait`` mode) or doing real matrix products (``compute`` mode). Raises Aborted."""
        if self.slowdown.mode == "wait":
            if abort is None:
                time.sleep(seconds)
            elif abort.wait(seconds):
                raise Aborted("iteration abandoned during the emulated device time")
            return
        end = time.perf_counter() + seconds
        if self._burn is None:
            self._burn = torch.randn(128, 128, device=self.device)
        m = self._burn
        while time.perf_counter() < end:
            if abort is not None and abort.is_set():
                raise Aborted("iteration abandoned during the emulated device time")
            m = torch.tanh(m @ self._burn)  # ~4 MFLOP: abort checked every ~0.1-1 ms
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def factor(self) -> float:
        """The emulated device's slowdown factor now (logged per step by the built-in job)."""
        return self.slowdown.factor_at(time.monotonic() - self.t0)

    def close(self) -> None:
        """Shut the compute thread down (pending jobs cancelled); the built-in job calls it at
        the end."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    # -- operations ----------------------------------------------------------------------

    def forward_backward(self, abort: threading.Event | None = None) -> tuple[float, int]:
        """Forward + backward on the next batch, then the emulated device's extra time; returns
        (loss, batch size). Call on the thread that owns the model. Raises :class:`Aborted`
        when ``abort`` is set before the iteration completes; the batch is then not consumed."""
        def check() -> None:
            if abort is not None and abort.is_set():
                raise Aborted("iteration abandoned")

        t0 = time.perf_counter()
        check()
        idx = self.sampler.batch(self.batches_done)
        x, y = self.batch_tensors(idx)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        loss, _ = self.loss_of(x, y)
        check()
        torch.autograd.backward(loss)
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        check()
        pad = self.slowdown.pad(time.perf_counter() - t0, time.monotonic() - self.t0,
                                self._jitter.uniform(-1.0, 1.0))
        if pad > 0:
            p0 = time.perf_counter()
            try:
                self._pad(pad, abort)
            finally:
                self.padded_s += time.perf_counter() - p0
        self.batches_done += 1  # only a completed iteration consumes its batch
        self.samples += len(idx)
        return float(loss.detach()), len(idx)

    def _iteration(self, abort: threading.Event | None) -> tuple[float, np.ndarray]:
        loss, _ = self.forward_backward(abort)
        grad = self.flat.grads()
        if not all_finite(grad):  # checked before any strategy can send it
            raise Diverged(f"training diverged after {self.batches_done} batches: the gradient holds NaN or "
                           "infinity (nothing was sent; no peer is blamed)")
        return loss, grad

    async def compute_gradients(self, abort: threading.Event | None = None) -> tuple[float, np.ndarray]:
        """Next batch: forward + backward (+ emulated device time). Returns (loss, flat gradient
        copy). Raises :class:`Aborted` if ``abort`` is set before the iteration completes."""
        return await self.run(lambda: self._iteration(abort))

    async def apply_gradients(self, vec: np.ndarray) -> None:
        """Set the gradients to ``vec`` and take one optimizer step, atomically."""
        def go() -> None:
            self.flat.set_grads(vec)
            self.optimizer.step()
        await self.run(go)

    async def sgd_step(self, vec: np.ndarray) -> SgdStep:
        """Like :meth:`apply_gradients`, reporting what plain SGD fed to its buffer (DTS)."""
        return await self.run(lambda: self.flat.sgd_step(vec, self.optimizer.step))

    async def sgd_hyper(self) -> SgdHyper:
        """The optimizer's plain-SGD numbers (ConfigError for any other optimizer)."""
        return await self.run(self.flat.sgd_hyper)

    async def optim_spec(self) -> OptimSpec:
        """The optimizer as the parameter store's owners run it."""
        return await self.run(self.flat.optim_spec)

    async def optim_hypers(self, spec: OptimSpec) -> dict[int, HyperValues]:
        """Every parameter group's numeric hyperparameters, read now."""
        return await self.run(lambda: self.flat.optim_hypers(spec))

    async def correct(self, dw: np.ndarray, du: np.ndarray | None) -> None:
        """Add ``dw`` to the parameters and ``du`` to SGD's momentum buffers."""
        await self.run(lambda: self.flat.correct(dw, du))

    async def apply_each(self, vecs: Sequence[np.ndarray]) -> None:
        """One optimizer step per gradient in ``vecs``, in order, in a single compute job."""
        def go() -> None:
            for v in vecs:
                self.flat.set_grads(v)
                self.optimizer.step()
        await self.run(go)

    async def get_params(self) -> np.ndarray:
        """A copy of the parameters as one flat float32 vector (a compute job)."""
        return await self.run(self.flat.get_params)

    def state_size(self) -> int:
        """The length of :meth:`export_state`'s vector."""
        return self.flat.state_size()

    def layers(self) -> list[Layer]:
        """The modules with trainable parameters, in the flat vector's order (Canary)."""
        return self.flat.layers()

    async def export_meta(self) -> bytes:
        """The optimizer's hyperparameters (the built-in job's trainer has no scheduler)."""
        return await self.run(lambda: encode(self.user_state.capture()))

    async def import_meta(self, raw: bytes) -> None:
        """Take a peer's hyperparameters."""
        state = decode(raw)
        await self.run(lambda: self.user_state.restore(state, absorb=False))

    async def export_state(self) -> np.ndarray:
        """Parameters + optimizer state as one float32 vector (see the module docstring)."""
        return await self.run(self.flat.export_state)

    async def import_state(self, vec: np.ndarray) -> None:
        """Replace parameters and optimizer state with an :meth:`export_state` vector."""
        await self.run(lambda: self.flat.import_state(vec))

    async def set_params(self, vec: np.ndarray) -> None:
        """Replace the parameters with the flat ``vec`` (a compute job)."""
        await self.run(lambda: self.flat.set_params(vec))

    async def get_params_range(self, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
        """The parameters in ``ranges``, concatenated (a compute job)."""
        return await self.run(lambda: self.flat.get_params_range(ranges))

    async def set_params_range(self, ranges: Sequence[tuple[int, int]], vec: np.ndarray) -> None:
        """Replace the parameters in ``ranges`` (a compute job)."""
        await self.run(lambda: self.flat.set_params_range(ranges, vec))

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the model's buffers."""
        return self.flat.buffer_bytes

    async def get_buffers(self, floats: bool = False) -> Buffers:
        """A copy of the model's buffers (a compute job)."""
        return await self.run(lambda: self.flat.read_buffers(floats))

    async def set_buffers(self, buffers: Buffers) -> None:
        """Write buffers back (a compute job)."""
        await self.run(lambda: self.flat.write_buffers(buffers))

    async def digests(self, buffers: bool = True) -> list[tuple[str, bytes]]:
        """Digests of every parameter and buffer (a compute job)."""
        return await self.run(lambda: self.flat.digests(buffers))

    def evaluate_now(self) -> tuple[float, float]:
        """(test loss, test accuracy); call on the thread that owns the model. A language
        model: (mean loss per validation token in nats, next-token accuracy) on the corpus's
        fixed evaluation windows."""
        self.model.eval()
        total, correct, loss_sum = 0, 0, 0.0
        if isinstance(self.data, TokenData):
            with torch.no_grad():
                for xs, ys in self.data.eval_batches(self.eval_batch):
                    x, y = torch.from_numpy(xs).to(self.device), torch.from_numpy(ys).to(self.device)
                    loss, logits = self.loss_of(x, y)
                    loss_sum += float(loss) * y.numel()
                    correct += int((logits.argmax(-1) == y).sum())
                    total += y.numel()
            return loss_sum / max(total, 1), correct / max(total, 1)
        with torch.no_grad():
            for s in range(0, len(self.data.y_test), self.eval_batch):
                x = torch.from_numpy(self.data.x_test[s: s + self.eval_batch]).to(self.device)
                y = torch.from_numpy(self.data.y_test[s: s + self.eval_batch]).to(self.device)
                out = self.model(x)
                loss_sum += float(self.loss_fn(out, y)) * len(y)
                correct += int((out.argmax(1) == y).sum())
                total += len(y)
        return loss_sum / max(total, 1), correct / max(total, 1)

    async def evaluate(self) -> tuple[float, float]:
        """(test loss, test accuracy) on the held-out split. Not counted as compute time."""
        before = self.compute_s
        out = await self.run(self.evaluate_now)
        self.compute_s = before
        return out

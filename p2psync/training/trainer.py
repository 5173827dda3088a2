"""The built-in job's local training: model, optimizer, this node's batches, the emulated
device, and evaluation.

It is no replica: the job attaches its model and optimizer to a session like any user's
script, and strategies reach the model only through the gate path
(:class:`~p2psync.api.replica.HookedReplica`). Its methods run on the thread that owns the
model (the training thread).

One local iteration (:meth:`Trainer.forward_backward`: forward, backward, and the emulated
device's extra time, see :mod:`~p2psync.training.hetero`) can be abandoned through a
``threading.Event``: it checks it between forward and backward, after backward and throughout
the pad, and then raises :class:`~p2psync.errors.Aborted`. An abandoned iteration leaves no
trace: the sampler does not advance (the next iteration takes the same batch) and its samples
are not counted.
"""

from __future__ import annotations

import math
import random
import threading
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from p2psync.errors import Aborted, ConfigError
from p2psync.training.corpus import TokenData
from p2psync.training.cpu_quota import Throttle
from p2psync.training.data import Dataset
from p2psync.training.hetero import Slowdown
from p2psync.training.partition import BatchSampler

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
    """The built-in job's model, optimizer, this node's data shard and the emulated device (see
    the module docstring).

    Built by :func:`~p2psync.training.node.build_trainer`; the built-in job
    (cli/builtin_job.py) attaches its model and optimizer and calls
    ``trainer.forward_backward(session.gate.abandon)`` per iteration.
    """

    def __init__(self, *, model: nn.Module, optimizer: torch.optim.Optimizer, data: Dataset | TokenData,
                 indices: np.ndarray, batch_size: int, seed: int, device: torch.device,
                 eval_batch: int = 2048, slowdown: Slowdown | None = None, clip_norm: float | None = None,
                 throttle: Throttle | None = None) -> None:
        """``data``: a classification set (samples: images) or a token corpus (samples: windows
        of ``data.context`` tokens; the model then maps tokens to next-token logits, runs under
        bf16 autocast on CUDA, and evaluates to the mean loss per token and the next-token
        accuracy). ``clip_norm``: every iteration clips the gradient's global norm to it after
        backward (under a strategy that averages during backward: the group's mean).
        ``throttle``: the process's CPU cap of ``--slowdown-mode quota``, set to the slowdown's
        factor before every iteration (:meth:`close` removes it)."""
        self.device = device
        self.model = model.to(device)
        self.optimizer = optimizer
        self.data = data
        self.sampler = BatchSampler(indices, batch_size, seed=seed)
        self.loss_fn = nn.CrossEntropyLoss()
        self.eval_batch = eval_batch if not isinstance(data, TokenData) else min(eval_batch, 16)
        self.clip_norm = clip_norm
        self.batches_done = 0
        self.samples = 0
        self.slowdown = slowdown or Slowdown()
        self._jitter = random.Random(seed)  # the emulated device's step-time variation
        self.t0 = time.monotonic()
        self.padded_s = 0.0
        self._burn: torch.Tensor | None = None
        self.throttle = throttle

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

    # -- the emulated device ------------------------------------------------------------

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

    def close(self) -> None:
        """Give back what the emulated device holds (the CPU cap's control group)."""
        if self.throttle is not None:
            self.throttle.close()
            self.throttle = None

    @property
    def factor(self) -> float:
        """The emulated device's slowdown factor now (logged per step by the built-in job)."""
        return self.slowdown.factor_at(time.monotonic() - self.t0)

    # -- operations ----------------------------------------------------------------------

    def forward_backward(self, abort: threading.Event | None = None) -> tuple[float, int]:
        """Forward + backward on the next batch, then the emulated device's extra time; returns
        (loss, batch size). Call on the thread that owns the model. Raises :class:`Aborted`
        when ``abort`` is set before the iteration completes; the batch is then not consumed."""
        def check() -> None:
            if abort is not None and abort.is_set():
                raise Aborted("iteration abandoned")

        if self.throttle is not None:
            self.throttle.follow(self.factor)
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

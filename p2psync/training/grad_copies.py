"""Gradients handed from the backward pass to the event loop as they become ready (Canary's
colayers start their exchange during backward).

A hook runs on the autograd thread as soon as a parameter's gradient is accumulated. On the
CPU it copies the gradient and posts it to the loop at once. On a CUDA device a blocking copy
to the host would wait for every kernel queued so far, so the autograd thread could not queue
the rest of backward meanwhile: the GPU would idle once per parameter. Instead the hook starts
an asynchronous copy into pinned host memory and records a CUDA event behind it; a copy is
posted to the loop once its event has completed, in the order the hooks ran (checked at every
later hook), and :meth:`GradCopies.flush` (called at ``optimizer.step()``, before the iteration
is handed to the loop) waits for the rest, so every gradient of an iteration reaches the loop
before the iteration does.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any, Callable

import numpy as np
import torch

#: ``callback(index, offset, grad)``: a parameter's index, its offset in the flat vector, and a
#: host float32 copy of its gradient
GradCallback = Callable[[int, int, np.ndarray], None]


class GradCopies:
    """Ready gradients on their way to ``callback`` on ``loop`` (see the module docstring).
    :meth:`ready` is the hook body (autograd thread); :meth:`flush` and :meth:`drop` are called
    on the training thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: GradCallback) -> None:
        self.loop = loop
        self.callback = callback
        self._lock = threading.Lock()
        # (event, pinned host copy, index, offset), in hook order
        self._inflight: collections.deque[tuple[Any, torch.Tensor, int, int]] = collections.deque()

    def ready(self, index: int, offset: int, grad: torch.Tensor | None) -> None:
        """Parameter ``index``'s gradient ``grad`` is accumulated: copy it to the host and post it."""
        if grad is None or self.loop.is_closed():
            return
        g = grad.detach().reshape(-1)
        if g.device.type != "cuda":
            self._post(index, offset, g.to(torch.float32).numpy().copy())
            return
        host = torch.empty(g.numel(), dtype=torch.float32, pin_memory=True)
        host.copy_(g, non_blocking=True)  # widens 16-bit gradients on the way
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()  # on the stream backward queued this gradient's kernels on
        with self._lock:
            self._inflight.append((done, host, index, offset))
        self._deliver(wait=False)

    def flush(self) -> None:
        """Post every copy still in flight, waiting for each (``optimizer.step()``)."""
        if self._inflight:
            self._deliver(wait=True)

    def drop(self) -> None:
        """Forget the copies in flight (the hooks are being removed)."""
        with self._lock:
            self._inflight.clear()

    @property
    def inflight(self) -> int:
        """Copies started and not yet posted."""
        return len(self._inflight)

    def _deliver(self, *, wait: bool) -> None:
        with self._lock:  # in hook order: a copy is posted only after every earlier one
            while self._inflight:
                done, host, index, offset = self._inflight[0]
                if wait:
                    done.synchronize()
                elif not done.query():
                    return
                self._inflight.popleft()
                self._post(index, offset, host.numpy())

    def _post(self, index: int, offset: int, arr: np.ndarray) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.callback, index, offset, arr)


__all__ = ["GradCallback", "GradCopies"]

"""Gradients handed from the backward pass to the event loop as they become ready (Canary's
colayers start their exchange during backward).

A hook runs on the autograd thread as soon as a parameter's gradient is accumulated. Off a
CUDA device it copies the gradient to the host and posts it to the loop at once. On a CUDA
device a blocking copy to the host would wait for every kernel queued so far, so the autograd
thread could not queue the rest of backward meanwhile: the GPU would idle once per parameter.
Instead the hook starts an asynchronous copy into pinned host memory and records a CUDA event
behind it; a delivery thread (one per :class:`GradCopies`, started with the first copy) waits
for the events in hook order and posts each copy as soon as it has landed, while backward goes
on. :meth:`GradCopies.flush` (called at ``optimizer.step()``, before the iteration is handed to
the loop) waits until every copy is posted, so every gradient of an iteration reaches the loop
before the iteration does. :meth:`GradCopies.close` ends the thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Callable

import numpy as np
import torch

from p2psync.errors import TrainingError

#: ``callback(index, offset, grad)``: a parameter's index, its offset in the flat vector, and a
#: host float32 copy of its gradient
GradCallback = Callable[[int, int, np.ndarray], None]
#: how long :meth:`GradCopies.flush` waits for the GPU to finish the copies of one backward pass
FLUSH_TIMEOUT_S = 120.0
_JOIN_S = 5.0  # close() on the event loop: nothing is normally in flight by then


class GradCopies:
    """Ready gradients on their way to ``callback`` on ``loop`` (see the module docstring).
    :meth:`ready` is the hook body (autograd thread); :meth:`flush` and :meth:`close` are
    called on the training thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: GradCallback) -> None:
        self.loop = loop
        self.callback = callback
        self._cond = threading.Condition()
        self._inflight = 0  # copies started and not yet posted (under _cond)
        self._gen = 0  # close() moves it on: copies of an older generation are not posted
        # (generation, event, pinned host copy, index, offset), or None: stop
        self._queue: queue.SimpleQueue[tuple[int, Any, torch.Tensor, int, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def hook(self, index: int, offset: int) -> Callable[[torch.Tensor], None]:
        """The ``register_post_accumulate_grad_hook`` of parameter ``index`` at ``offset`` in
        the flat vector."""
        return lambda p: self.ready(index, offset, p.grad)

    def ready(self, index: int, offset: int, grad: torch.Tensor | None) -> None:
        """Parameter ``index``'s gradient ``grad`` is accumulated: copy it to the host and post it."""
        if grad is None or self.loop.is_closed():
            return
        g = grad.detach().reshape(-1)
        if g.device.type != "cuda":
            if self._inflight:  # a model spread over devices: still in hook order
                self.flush()
            self._post(index, offset, g.to("cpu", torch.float32).numpy().copy())
            return
        self._track(index, offset, *self._copy_async(g))

    @staticmethod
    def _copy_async(g: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Start copying the CUDA tensor ``g`` into pinned host memory: (event behind the copy, host tensor)."""
        host = torch.empty(g.numel(), dtype=torch.float32, pin_memory=True)
        stream = torch.cuda.current_stream(g.device)  # the one backward queued this gradient on
        host.copy_(g, non_blocking=True)  # widens 16-bit gradients on the way
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(stream)
        return done, host

    def _track(self, index: int, offset: int, done: Any, host: torch.Tensor) -> None:
        """Hand a started copy (``done.synchronize()`` waits for it) to the delivery thread."""
        with self._cond:
            self._inflight += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._deliver, name="p2psync-grad-copies", daemon=True)
                self._thread.start()
            self._queue.put((self._gen, done, host, index, offset))

    def flush(self) -> None:
        """Wait until every copy started so far is posted (``optimizer.step()``); TrainingError
        after :data:`FLUSH_TIMEOUT_S`."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._inflight == 0, timeout=FLUSH_TIMEOUT_S):
                raise TrainingError(f"gradient copies from the GPU did not finish within {FLUSH_TIMEOUT_S:g} s")

    def close(self) -> None:
        """Forget the copies in flight and end the delivery thread (the hooks are removed)."""
        with self._cond:
            self._gen += 1
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=_JOIN_S)

    @property
    def inflight(self) -> int:
        """Copies started and not yet posted."""
        return self._inflight

    def _deliver(self) -> None:
        while (item := self._queue.get()) is not None:
            gen, done, host, index, offset = item
            try:
                done.synchronize()  # releases the GIL while it waits
                if gen == self._gen:
                    self._post(index, offset, host.numpy())
            finally:
                with self._cond:
                    self._inflight -= 1
                    self._cond.notify_all()

    def _post(self, index: int, offset: int, arr: np.ndarray) -> None:
        try:
            self.loop.call_soon_threadsafe(self.callback, index, offset, arr)
        except RuntimeError:  # the loop closed meanwhile: the run is over
            pass


__all__ = ["FLUSH_TIMEOUT_S", "GradCallback", "GradCopies"]

"""Where the user's training loop and the strategy meet: the optimizer step.

Why: a strategy never owns the training loop (docs/architecture.md, "One training path"). The user's thread
runs forward and backward; when it calls ``optimizer.step()`` it *arrives* at the gate and
parks there. While it is parked, the strategy (a coroutine on the node's event loop) works on
the model through *jobs*: reading the gradients, replacing them, running the local optimizer
step (or not: a skipped step), replacing parameters and optimizer state. Jobs always run on
the training thread, so the model is only ever touched by one thread and never while the
user's code computes; a job sent while the user computes (ASGD applying a gradient that
arrived, a joiner asking for this node's state) runs when the thread parks next. The strategy
releases the parked thread when it is done with the step; background exchanges then overlap
the next forward and backward.

Per arrival the strategy asks for the next iteration (:meth:`StepGate.next_iteration`); an
*abandoned* iteration (ESync's READY came while it was being computed, §4.2) is released
without a step when it arrives, and :attr:`StepGate.abandon` tells a cooperative loop (the
built-in job's emulated device time) to cut it short. When the user's loop ends
(:meth:`StepGate.end`), a strategy waiting for an iteration gets :class:`TrainingEnded`.

Threads: ``arrive``, ``serve`` and ``end`` are called on the training thread; everything else
on the event loop thread.

Waits: nothing here polls. The training thread blocks on its inbox, and everything that can
end its wait puts an item there: a job, a release, the session's failure (:meth:`fail`), a
nudge (:meth:`nudge`, for a caller of ``serve(until=...)`` whose condition changed) and the end
of the event loop (:meth:`loop_stopped`, called by the loop's thread when ``run_forever``
returns). The loop side waits on an :class:`asyncio.Event` that arrivals, the end of the
user's loop (:meth:`end`) and an :class:`~p2psync.tasks.AbortEvent` set.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from p2psync import clock
from p2psync.errors import Aborted, P2PSyncError, TrainingEnded, TrainingError
from p2psync.tasks import AbortEvent

T = TypeVar("T")


@dataclass
class Arrival:
    """One local iteration that reached ``optimizer.step()``."""

    loss: float
    samples: int
    #: the flat gradient, copied when the iteration arrived (before any job can touch it)
    grads: Any
    #: seconds the user's code computed since the thread left the gate last
    compute_s: float
    #: how many times the parameters had been replaced (not stepped) when it arrived
    params_gen: int = 0


class _Release:
    """Lets the training thread leave the gate; ``gen``: the park it belongs to (None: any)."""

    __slots__ = ("gen",)

    def __init__(self, gen: int | None) -> None:
        self.gen = gen


class _Nudge:
    """Wakes a thread in ``serve(until=...)`` so that it looks at its condition again."""


class _LoopGone:
    """The event loop stopped: nothing will release or serve the training thread any more."""


class StepGate:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        #: set by the strategy when the iteration being computed is abandoned
        self.abandon = threading.Event()
        self._pending: Arrival | None = None  # arrived, not taken by the strategy yet
        self._parked = False  # the thread waits at the gate (taken or not)
        self._taken = False  # the strategy took the parked iteration
        self._skip = 0
        self._ended = False
        self._wake = asyncio.Event()
        self._failure: BaseException | None = None
        self.arrivals = 0
        self.skipped = 0
        self.samples = 0
        self.compute_s = 0.0
        self.parked_s = 0.0
        self._left_at = time.perf_counter()
        self._gen = 0  # parks so far (training thread's count)
        self._park_gen = 0  # the park the loop knows of
        self._finished = False  # the strategy's driver ended: arrivals pass at once
        self._loop_gone = False  # the event loop stopped (loop_stopped)
        #: set once a strategy waits for an iteration that has not arrived (event loop)
        self.wanted = asyncio.Event()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    # -- training thread -----------------------------------------------------------------

    def arrive(self, *, loss: float, samples: int, grads: Any, params_gen: int = 0) -> None:
        """The user's loop reached ``optimizer.step()``: park until the strategy releases it,
        running its jobs meanwhile. ``grads``: a copy of the iteration's gradient, handed over:
        the gate keeps no reference to it while the thread is parked, so it is freed once the
        strategy is done with it (pass it without keeping one either)."""
        t = time.perf_counter()
        self._gen += 1
        gen = self._gen
        a = Arrival(loss=loss, samples=samples, grads=grads, compute_s=t - self._left_at, params_gen=params_gen)
        self._loop.call_soon_threadsafe(self._on_arrival, a, gen)
        del a, grads  # the loop's now (the jobs run while parked, an optimizer step among them, need memory)
        try:
            self.serve(gen)
        except BaseException:  # interrupted while parked: the loop must not think it still is
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._on_left, gen)
            raise
        finally:
            self._left_at = time.perf_counter()
            self.parked_s += self._left_at - t

    def serve(self, gen: int | None = None, *, until: Callable[[], bool] | None = None,
              timeout: float | None = None) -> None:
        """Run jobs until released (a release of park ``gen``; tokens of other parks are
        stale and ignored) or, with ``until``, until it holds (releases and the session's
        failure are then ignored: the caller waits for its own future, and whatever makes
        ``until`` hold must :meth:`nudge` the gate). ``timeout`` (with ``until`` only) bounds
        the wait: seconds, after which it returns whether or not ``until`` holds. Raises the
        session's failure (parked), or P2PSyncError when the event loop stopped."""
        if timeout is not None and until is None:
            raise TrainingError("StepGate.serve: a timeout bounds a wait for a condition (until=...)")
        deadline = None if timeout is None else clock.now() + timeout
        while until is None or not until():
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                if until is None and self._failure is not None:
                    raise self._failure from None
                if self._loop_gone or self._loop.is_closed():
                    raise P2PSyncError("the node's event loop stopped while the training thread waited") from None
                left = None if deadline is None else deadline - clock.now()
                if left is not None and left <= 0:
                    return
                try:
                    item = self._inbox.get(timeout=left)
                except queue.Empty:
                    return  # the bound passed
            if isinstance(item, _LoopGone):
                raise P2PSyncError("the node's event loop stopped while the training thread waited")
            if isinstance(item, _Nudge):
                continue
            if isinstance(item, _Release):
                if until is None and (item.gen is None or item.gen == gen):
                    return
                continue
            if isinstance(item, BaseException):
                if until is None:
                    raise item
                continue
            self._run_job(item)
            del item  # (the job and what it holds are not kept while the thread waits again)

    def _run_job(self, item: tuple[Callable[[], Any], asyncio.Future[Any]]) -> None:
        """Run one job on this (the training) thread and hand its result or exception to the
        coroutine awaiting it."""
        fn, fut = item
        try:
            res = fn()
        except Exception as exc:  # handed to the awaiting coroutine
            self._loop.call_soon_threadsafe(_fail, fut, exc)
        except BaseException:  # KeyboardInterrupt, SystemExit: the job did not run
            self._loop.call_soon_threadsafe(fut.cancel)
            raise
        else:
            self._loop.call_soon_threadsafe(_done, fut, res)

    @property
    def failure(self) -> BaseException | None:
        """The session's failure (:meth:`fail`), if it failed."""
        return self._failure

    def nudge(self) -> None:
        """Wake a thread in :meth:`serve` ``(until=...)`` so it looks at its condition now
        (any thread; a parked thread ignores it)."""
        self._inbox.put(_Nudge())

    def loop_stopped(self) -> None:
        """The event loop stopped (any thread; the loop's own thread calls it when
        ``run_forever`` returns): a training thread waiting at the gate, or arriving later,
        raises P2PSyncError instead of waiting for a loop that is gone."""
        self._loop_gone = True
        self._inbox.put(_LoopGone())

    def end(self) -> None:
        """The user's loop is over: a strategy waiting for an iteration gets TrainingEnded."""
        self._loop.call_soon_threadsafe(self._on_end)

    # -- event loop ----------------------------------------------------------------------

    def _on_arrival(self, a: Arrival, gen: int) -> None:
        self.arrivals += 1
        self._park_gen = gen
        if self._finished:  # nobody will take it: let it pass (the run is over: no step follows)
            self._inbox.put(_Release(gen))
            return
        self._pending = a
        self._parked = True
        self._wake.set()

    def _on_left(self, gen: int) -> None:
        """The thread left park ``gen`` by an exception (an interrupt)."""
        if gen == self._park_gen:
            self._pending = None
            self._parked = self._taken = False

    def finish(self) -> None:
        """The strategy's driver ended: drop what is pending, let the thread go, and let every
        later arrival pass at once."""
        self._finished = True
        if self._pending is not None:
            self.skipped += 1
            self._pending = None
        self._skip = 0
        self._taken = False
        if self._parked:
            self._parked = False
            self._inbox.put(_Release(self._park_gen))

    def _on_end(self) -> None:
        self._ended = True
        self._wake.set()

    def fail(self, exc: BaseException) -> None:
        """The session failed: a parked (or next parking) training thread raises ``exc``."""
        self._failure = exc
        self._inbox.put(exc)

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the training thread (now if it is parked, else when it parks next)."""
        fut: asyncio.Future[T] = self._loop.create_future()
        self._inbox.put((fn, fut))
        return await fut

    def release(self) -> None:
        """Let the parked training thread go on (the strategy is done with its step)."""
        if self._parked and self._pending is None:
            self._parked = False
            self._taken = False
            self._inbox.put(_Release(self._park_gen))

    async def next_iteration(self, abort: threading.Event | None = None) -> Arrival:
        """Release the iteration taken before (if any) and take the next one. Raises Aborted
        when ``abort`` is set first (that iteration will be released unstepped when it arrives),
        TrainingEnded when the user's loop ended. An ``abort`` that may be set while this
        waits must be an :class:`~p2psync.tasks.AbortEvent` (it wakes the wait); a plain
        :class:`threading.Event` is accepted only already set."""
        if self._taken:
            self.release()
        unlisten: Callable[[], None] | None = None
        if isinstance(abort, AbortEvent):
            unlisten = abort.listen(self._wake_threadsafe)
        elif abort is not None and not abort.is_set():
            raise TrainingError("StepGate.next_iteration: an abort event set later must be a "
                                "p2psync.tasks.AbortEvent (a plain threading.Event cannot wake the wait)")
        try:
            while True:
                while self._pending is None:
                    if self._ended:
                        raise TrainingEnded("the training loop ended")
                    if abort is not None and abort.is_set():
                        self._skip += 1
                        self.abandon.set()
                        raise Aborted("iteration abandoned before it reached optimizer.step()")
                    self._wake.clear()
                    self.wanted.set()
                    await self._wake.wait()
                a, self._pending = self._pending, None
                self.abandon.clear()
                if self._skip:
                    self._skip -= 1
                    self.skipped += 1
                    self.release()
                    continue
                self._taken = True
                self.samples += a.samples
                self.compute_s += a.compute_s
                return a
        finally:
            if unlisten is not None:
                unlisten()

    def _wake_threadsafe(self) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)


def _done(fut: asyncio.Future[Any], res: Any) -> None:
    if not fut.done():
        fut.set_result(res)


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


__all__ = ["Arrival", "StepGate"]

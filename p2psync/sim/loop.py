"""An asyncio event loop in virtual time: the real runtime's code, many nodes, one process.

:class:`VirtualLoop` is an :class:`asyncio.AbstractEventLoop` (the stdlib's base loop) whose
:meth:`~VirtualLoop.time` is a number it keeps itself. When no callback is ready it does not
block: it moves its time to the next scheduled timer at once. A thousand virtual seconds of
heartbeats and timeouts take as long as running their callbacks does. It is also the clock of
its thread (:mod:`p2psync.clock`: ``p2psync_clock``), so every ``clock.now()`` of the runtime
reads the virtual time.

Contract:

* **Deterministic.** Ready callbacks run first in, first out; timers run in the order of their
  time, timers due at the same time in the order they were scheduled. The loop draws no
  random numbers and reads no real clock: the same program (the same seed for whatever it
  draws) runs the same callbacks in the same order at the same virtual times.
  :attr:`~VirtualLoop.steps` counts the callbacks run and :meth:`~VirtualLoop.digest` hashes
  their sequence (virtual time, actor, callback name): equal digests, equal runs.
* **No I/O and no foreign threads.** It has no selector: sockets, pipes and subprocesses are
  not supported (the in-memory transport needs none). ``run_in_executor`` (and so
  ``asyncio.to_thread``) runs the function at once on the loop's thread, taking no virtual
  time. ``call_soon_threadsafe`` from another thread raises :class:`SimulationError` in that
  thread and ends the loop's run with it: a callback arriving at a wall-clock moment would make
  the run irreproducible.
* **Deadlock.** When nothing is ready, no timer is scheduled and the awaited result is not
  done, nothing can ever happen: the run ends with :class:`SimulationError` naming the actors
  held (below), instead of hanging.
* **Livelock.** When more than ``livelock_steps`` callbacks run in a row without the virtual
  time moving on, the code is spinning (e.g. a failure that is retried at once, forever): the
  run ends with :class:`SimulationError` naming the time and the callbacks that ran most,
  instead of running for ever in no virtual time.
* **Actors.** Code started under an actor (:meth:`~VirtualLoop.spawn` with ``actor=``, or any
  task created while :data:`ACTOR` is set) carries it in its context, and so does every
  callback and task it schedules. :meth:`~VirtualLoop.hold` parks every callback of an actor
  when it comes up (timers that fall due included) until :meth:`~VirtualLoop.release`, which
  puts them back on the ready queue in the order they were parked: the actor stood still, as
  a process under ``SIGSTOP`` does, and its timers fire late. :meth:`~VirtualLoop.cpu`
  (``clock.cpu()``) is the virtual time an actor was not held.

Use :func:`run` (``asyncio.run`` for this loop), or build one and ``run_until_complete``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import gc
import hashlib
import heapq
import itertools
import logging
import threading
import time
from asyncio import base_events, events
from collections import defaultdict
from typing import Any, Callable, Coroutine, Hashable, Iterator, TypeVar

from p2psync.clock import offer
from p2psync.errors import SimulationError

T = TypeVar("T")

#: the simulated actor (a node) the running code belongs to; None: the simulation itself
ACTOR: contextvars.ContextVar[Hashable | None] = contextvars.ContextVar("p2psync_sim_actor", default=None)
#: what :meth:`VirtualLoop.wall` adds to the virtual time (a fixed, plausible epoch second)
WALL_EPOCH = 1.7e9


def _name(cb: Any) -> str:
    """A callback's name that is the same in every run (no ids, no addresses)."""
    return str(getattr(cb, "__qualname__", None) or type(cb).__qualname__)


@contextlib.contextmanager
def quiet_logs(quiet: bool = True, name: str = "p2psync") -> Iterator[None]:
    """While it lasts, the ``name`` logger reports only CRITICAL (every simulated node logs each
    failure it sees); its level is restored after, so the rest of the process (a test, a
    benchmark) keeps its logging. ``quiet=False``: no change."""
    log = logging.getLogger(name)
    level = log.level
    if quiet:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


#: callbacks in a row at one virtual time after which a :class:`VirtualLoop` ends the run as a livelock
LIVELOCK_STEPS = 5_000_000
#: the same for the cleanup of a run that ended with a :class:`SimulationError` (:func:`run`)
CLEANUP_LIVELOCK_STEPS = 100_000
#: of those, the last ones counted by name for the error
LIVELOCK_SAMPLE = 10_000
#: the collector's thresholds while :func:`sparse_gc` lasts
SPARSE_GC_THRESHOLDS = (50_000, 50, 1_000)


@contextlib.contextmanager
def sparse_gc() -> Iterator[None]:
    """While it lasts, the cyclic garbage collector runs about a hundred times less often (its
    thresholds: :data:`SPARSE_GC_THRESHOLDS`); restored after. A simulation of a thousand
    nodes holds millions of long-lived objects that every full collection walks again: a
    quarter of its CPU went to the collector (ring-1024, 20 virtual s: 24 s of 114 s),
    for a few percent more memory. The thresholds are the same in every run, so the runs stay
    deterministic."""
    old = gc.get_threshold()
    gc.set_threshold(*SPARSE_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def _run_admitted(handle: events.Handle, run: Callable[[], None]) -> None:
    """Run a ready callback or timer (``run``: its own ``_run``) unless its actor is held (then
    the loop parks it); with ``actor_cpu`` the CPU it took is added to its actor's."""
    loop: VirtualLoop = handle._loop  # type: ignore[attr-defined]
    if loop._admit(handle, handle._context):  # type: ignore[attr-defined]
        if loop.actor_cpu is None:
            run()
        else:
            t = time.process_time()
            run()
            loop.actor_cpu[handle._context.get(ACTOR)] += time.process_time() - t  # type: ignore[attr-defined]


class _Handle(events.Handle):
    """A ready callback that may be parked while its actor is held."""

    __slots__ = ()

    def _run(self) -> None:
        _run_admitted(self, super()._run)


class _Timer(events.TimerHandle):
    """A timer ordered by (time, sequence): equal times run in the order they were scheduled."""

    __slots__ = ("_seq",)

    def __init__(self, when: float, callback: Callable[..., object], args: tuple[Any, ...],
                 loop: "VirtualLoop", context: contextvars.Context | None, seq: int) -> None:
        super().__init__(when, callback, args, loop, context)
        self._seq = seq

    def __lt__(self, other: object) -> bool:
        if type(other) is _Timer:  # (the heap compares timers most of the time the loop runs)
            when, other_when = self._when, other._when  # type: ignore[attr-defined]
            return when < other_when or (when == other_when and self._seq < other._seq)
        return NotImplemented

    def _run(self) -> None:
        _run_admitted(self, super()._run)


class _Jump:
    """The loop's "selector": waiting for ``timeout`` means moving the virtual time to the
    next timer, at once."""

    def __init__(self, loop: "VirtualLoop") -> None:
        self.loop = loop

    def select(self, timeout: float | None) -> list[Any]:
        loop = self.loop
        if loop._foreign is not None:
            raise loop._foreign
        if timeout is None:
            held = sorted(map(str, loop._held))
            raise SimulationError(f"deadlock at virtual time {loop._now:.6f}s: no callback is ready and no "
                                  "timer is scheduled" + (f" (actors held: {', '.join(held)})" if held else ""))
        if timeout > 0:
            scheduled: list[_Timer] = loop._scheduled  # type: ignore[attr-defined]
            loop._now = max(loop._now, scheduled[0].when())
        return []

    def close(self) -> None:
        pass


class VirtualLoop(base_events.BaseEventLoop):
    """The virtual-time event loop (see the module docstring). ``start``: its time at first
    (seconds); ``trace``: keep the hash of every callback run (:meth:`digest`); ``actor_cpu``:
    add up the CPU time of every actor's callbacks (:attr:`actor_cpu`, for benchmarks)."""

    def __init__(self, *, start: float = 0.0, trace: bool = True, actor_cpu: bool = False,
                 livelock_steps: int = LIVELOCK_STEPS) -> None:
        super().__init__()
        #: callbacks in a row at one virtual time that end the run as a livelock
        self.livelock_steps = livelock_steps
        self._instant = float(start)
        self._at_instant = 0
        self._instant_names: collections.Counter[str] | None = None
        #: with ``actor_cpu``: actor -> the CPU seconds its callbacks took (None: not measured)
        self.actor_cpu: defaultdict[Hashable, float] | None = defaultdict(float) if actor_cpu else None
        self._now = float(start)
        self._selector = _Jump(self)
        self._seq = itertools.count()
        self._held: set[Hashable] = set()
        self._parked: dict[Hashable, list[events.Handle]] = defaultdict(list)
        self._held_since: dict[Hashable, float] = {}
        self._held_total: dict[Hashable, float] = defaultdict(float)
        self._foreign: SimulationError | None = None
        self._trace = hashlib.sha256() if trace else None
        #: callbacks run so far
        self.steps = 0
        offer(self, self)

    # -- the clock ------------------------------------------------------------------------

    def time(self) -> float:
        return self._now

    def now(self) -> float:
        """The virtual time (:class:`p2psync.clock.Clock`)."""
        return self._now

    def wall(self) -> float:
        """:data:`WALL_EPOCH` plus the virtual time: timestamps that are the same in every run."""
        return WALL_EPOCH + self._now

    def cpu(self) -> float:
        """The virtual time the current actor (:data:`ACTOR`) was not held."""
        actor = ACTOR.get()
        held = self._held_total.get(actor, 0.0)
        since = self._held_since.get(actor)
        return self._now - held - (self._now - since if since is not None else 0.0)

    # -- scheduling -----------------------------------------------------------------------

    def _call_soon(self, callback: Callable[..., object], args: tuple[Any, ...],
                   context: contextvars.Context | None) -> events.Handle:
        handle = _Handle(callback, args, self, context)
        self._ready.append(handle)  # type: ignore[attr-defined]
        return handle

    def call_at(self, when: float, callback: Callable[..., object], *args: Any,  # type: ignore[override]
                context: contextvars.Context | None = None) -> events.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        resolution: float = self._clock_resolution  # type: ignore[attr-defined]
        if self._now < when < self._now + resolution:
            # asyncio runs a timer due within the resolution at once, without moving the time: a
            # wait for what is left until a deadline (a sum of earlier waits, rounded) fired again
            # and again at one virtual time, a livelock. It is due at the resolution instead
            when = self._now + resolution
        self._check_closed()  # type: ignore[attr-defined]
        timer = _Timer(when, callback, args, self, context, next(self._seq))
        heapq.heappush(self._scheduled, timer)  # type: ignore[attr-defined]
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: Any,  # type: ignore[override]
                             context: contextvars.Context | None = None) -> events.Handle:
        thread = self._thread_id  # type: ignore[attr-defined]
        if thread is not None and thread != threading.get_ident():
            err = SimulationError(f"a thread ({threading.current_thread().name}) scheduled {_name(callback)} on the "
                                  "virtual-time loop: its arrival would not be reproducible")
            if self._foreign is None:
                self._foreign = err
            raise err
        return self.call_soon(callback, *args, context=context)

    def run_in_executor(self, executor: Any, func: Callable[..., T],  # type: ignore[override]
                        *args: Any) -> asyncio.Future[T]:
        """Run ``func(*args)`` now, on this thread, in no virtual time; a done future."""
        self._check_closed()  # type: ignore[attr-defined]
        fut: asyncio.Future[T] = self.create_future()
        try:
            fut.set_result(func(*args))
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            fut.set_exception(exc)
        return fut

    def _process_events(self, event_list: list[Any]) -> None:
        pass

    def _write_to_self(self) -> None:
        pass

    # -- actors ---------------------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, T], *, actor: Hashable | None = None,
              name: str | None = None) -> asyncio.Task[T]:
        """A task running ``coro`` as ``actor`` (None: as the code calling this): it and
        everything it schedules carry the actor."""
        ctx = contextvars.copy_context()
        if actor is not None:
            ctx.run(ACTOR.set, actor)
        return self.create_task(coro, name=name, context=ctx)

    def hold(self, actor: Hashable) -> None:
        """From now on park every callback of ``actor`` until :meth:`release`."""
        if actor is None:
            raise ValueError("the simulation itself cannot be held")
        if actor not in self._held:
            self._held.add(actor)
            self._held_since[actor] = self._now

    def release(self, actor: Hashable) -> None:
        """Run ``actor`` again: its parked callbacks go back on the ready queue, in order."""
        if actor not in self._held:
            return
        self._held.discard(actor)
        self._held_total[actor] += self._now - self._held_since.pop(actor)
        ready = self._ready  # type: ignore[attr-defined]
        for handle in self._parked.pop(actor, []):
            if not handle.cancelled():
                ready.append(handle)

    def held(self, actor: Hashable) -> bool:
        """Whether ``actor`` is held now."""
        return actor in self._held

    def _admit(self, handle: events.Handle, context: contextvars.Context) -> bool:
        """Whether ``handle`` runs now (else it is parked with its held actor); traces it."""
        actor = context.get(ACTOR)
        if actor is not None and actor in self._held:
            self._parked[actor].append(handle)
            return False
        self.steps += 1
        if self._now != self._instant:
            self._instant, self._at_instant, self._instant_names = self._now, 0, None
        else:
            self._at_instant += 1
            if self._at_instant >= self.livelock_steps - LIVELOCK_SAMPLE:
                self._livelock(handle)
        if self._trace is not None:
            self._trace.update(f"{self._now!r} {actor!r} {_name(handle._callback)}\n".encode())  # type: ignore[attr-defined]
        return True

    def _livelock(self, handle: events.Handle) -> None:
        """Count the last :data:`LIVELOCK_SAMPLE` callbacks of a livelock by name, then end
        the run (see the module docstring)."""
        names = self._instant_names = self._instant_names or collections.Counter()
        names[_name(handle._callback)] += 1  # type: ignore[attr-defined]
        if self._at_instant >= self.livelock_steps:
            top = ", ".join(f"{n} ({k})" for n, k in names.most_common(5))
            err = SimulationError(f"livelock at virtual time {self._now:.6f}s: {self._at_instant} callbacks ran "
                                  f"without the time moving on; the most frequent of the last {LIVELOCK_SAMPLE}: {top}")
            self._at_instant, self._instant_names = 0, None  # (the run's cleanup cancels the tasks next)
            raise err

    def digest(self) -> str:
        """The hash of every callback run so far (virtual time, actor, callback name)."""
        if self._trace is None:
            raise ValueError("this loop keeps no trace (trace=False)")
        return self._trace.copy().hexdigest()


def _cancel_all(loop: VirtualLoop, rounds: int = 3) -> bool:
    """Cancel every task left and run them to their end, again for the tasks their ends
    started (at most ``rounds`` times; a round that livelocks is cut short by the next).
    Whether none is left."""
    for _ in range(rounds):
        tasks = asyncio.all_tasks(loop)
        if not tasks:
            return True
        for held in list(loop._held):
            loop.release(held)
        for t in tasks:
            t.cancel()
        try:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        except SimulationError:
            continue
    return not asyncio.all_tasks(loop)


def run(coro: Coroutine[Any, Any, T], *, start: float = 0.0, loop: VirtualLoop | None = None) -> T:
    """``asyncio.run`` on a :class:`VirtualLoop` (a new one unless ``loop`` is given): run
    ``coro`` to its end, then cancel the tasks left (held actors released first), finish the
    async generators and close the loop."""
    loop = loop if loop is not None else VirtualLoop(start=start)
    try:
        events.set_event_loop(loop)
        return loop.run_until_complete(coro)
    except SimulationError:  # the cleanup below may spin as the run did: cut it short
        loop.livelock_steps = min(loop.livelock_steps, CLEANUP_LIVELOCK_STEPS)
        raise
    finally:
        try:
            if not _cancel_all(loop):  # what a livelocked run leaves is dropped without a word per task
                loop.set_exception_handler(lambda _loop, _context: None)
            else:
                loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            events.set_event_loop(None)
            loop.close()


__all__ = ["ACTOR", "LIVELOCK_STEPS", "SPARSE_GC_THRESHOLDS", "VirtualLoop", "WALL_EPOCH", "run", "sparse_gc"]

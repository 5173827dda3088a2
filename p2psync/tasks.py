"""Task lifecycle helpers shared by every layer (no p2psync imports).

Every task p2psync creates is owned (docs/architecture.md, "Every task is owned"): a component that starts background
work spawns it into its :class:`TaskSet` and closes the set when it closes, so nothing outlives
its owner and nobody writes the cancel-and-reap loop by hand::

    class Service:
        def __init__(self) -> None:
            self._tasks = TaskSet("service")

        def start(self) -> None:
            self._tasks.spawn(self._serve(), name="serve")

        async def close(self) -> None:
            await self._tasks.close()  # cancelled and awaited; a child's failure is raised

A task set is a nursery: the first child that fails (an exception other than cancellation)
cancels its siblings, and its error reaches the owner: passed to ``on_error`` at once (logged
when there is none), raised by :meth:`TaskSet.wait` and :meth:`TaskSet.close`, kept in
:attr:`TaskSet.error`. Children that are
independent of each other (one per request, per peer, per reply) go into an ``isolated`` set
instead: a failure there ends that child alone and is handed to ``on_error`` (logged when there
is none); the set's other children, :meth:`TaskSet.wait` and :meth:`TaskSet.close` go on as if
it had returned.

:func:`gather_or_cancel` runs awaitables together and cancels the rest when one fails;
:func:`wait_or_event` waits for a future or an event, whichever comes first.
:class:`AbortEvent` is a :class:`threading.Event` that also tells listeners when it is set, so
a coroutine can wait for it without polling. :class:`Conditions` lets many coroutines wait for
predicates over one owner's state, each predicate judged once per change for all its waiters.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Awaitable, Callable, Coroutine, Iterable, Iterator, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

#: ``on_error(exc)``: told of a child's failure as it happens (on the event loop; must not raise)
ErrorHook = Callable[[BaseException], None]


async def cancel_all(tasks: Iterable[asyncio.Future[Any] | None]) -> None:
    """Cancel ``tasks`` (None entries are skipped) and wait until each has ended; their
    cancellation and any exception they ended with are consumed (a closing owner has no one
    left to report them to). ``await cancel_all([t])`` cancels and reaps one task."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    if live:
        await asyncio.gather(*live, return_exceptions=True)


class TaskSet:
    """The tasks one component owns: :meth:`spawn` starts one (a finished one is dropped at
    once), :meth:`close` cancels and reaps every one still running. After :meth:`close`, a
    spawned coroutine is cancelled before it runs (a callback firing during shutdown cannot
    leave an orphan).

    Failures (see the module docstring): by default the set is a nursery, whose first failed
    child cancels the others and every later spawn, and is raised by :meth:`wait` and
    :meth:`close`; with ``isolated`` each child fails alone. Either way ``on_error`` hears of
    a failure when it happens, and no failure goes unretrieved."""

    def __init__(self, name: str = "", *, isolated: bool = False, on_error: ErrorHook | None = None) -> None:
        self.name = name
        self.isolated = isolated
        self.on_error = on_error
        #: insertion-ordered (a dict, not a set): closing cancels in the order tasks were
        #: spawned, the same in every run (a set of tasks iterates in memory-address order)
        self._tasks: dict[asyncio.Task[Any], None] = {}
        self._closed = False
        #: the first child failure (nursery sets only; None while every child is fine)
        self.error: BaseException | None = None

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
        """Start ``coro`` as a task of this set (call on the event loop). Once the set is
        closed, or a nursery set has failed, the task is cancelled before it runs."""
        task = asyncio.get_running_loop().create_task(coro, name=name or self.name or None)
        self._tasks[task] = None
        task.add_done_callback(self._ended)
        if self._closed or self.error is not None:
            task.cancel()
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.pop(task, None)
        if task.cancelled():
            return
        exc = task.exception()  # retrieved here: never "exception was never retrieved"
        if exc is None:
            return
        if self.isolated:
            if self.on_error is not None:
                self.on_error(exc)
            else:
                log.error("task %s of %s failed", task.get_name(), self.name or "a task set", exc_info=exc)
            return
        if self.error is not None:  # a sibling failed first (or failed while being cancelled)
            return
        self.error = exc
        for t in self._tasks:
            t.cancel()
        if self.on_error is not None:
            self.on_error(exc)
        else:  # the owner hears of it at wait() or close(); the log tells it now
            log.error("task %s of %s failed; its siblings are cancelled", task.get_name(),
                      self.name or "a task set", exc_info=exc)

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    @property
    def closed(self) -> bool:
        """:meth:`close` was called: tasks spawned from now on are cancelled at once."""
        return self._closed

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    async def wait(self, timeout: float | None = None) -> None:
        """Wait (at most ``timeout`` seconds) until every task now running has ended, without
        cancelling any (e.g. replies still being computed get a grace period). A nursery
        set's child failure is raised."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
        self._raise()

    async def close(self, grace: float | None = None) -> None:
        """Give the running tasks ``grace`` seconds to end (None: none), then cancel and reap
        them; spawning afterwards starts nothing. Raises a nursery set's child failure, after
        every task has ended. Safe to call more than once (each call raises it)."""
        self._closed = True
        if grace and self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace)
        while live := [t for t in self._tasks if not t.done()]:  # one may spawn as it unwinds
            await cancel_all(live)
        self._raise()


async def gather_or_cancel(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Every result of ``aws`` (in order); when one fails or this call is cancelled, the others
    are cancelled and reaped before the error propagates (no orphan waits)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await cancel_all(tasks)
        raise


async def wait_or_event(fut: asyncio.Future[Any], event: asyncio.Event) -> bool:
    """Wait until ``fut`` is done or ``event`` is set; True when ``fut`` is done. ``fut`` is
    left as it is (the caller decides whether to cancel it); the event's waiter never
    outlives the call."""
    if fut.done():
        return True
    if event.is_set():
        return False
    woke = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({fut, woke}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_all([woke])
    return fut.done()


def resolve(fut: asyncio.Future[None]) -> None:
    """Set ``fut``'s result to None unless it is done (a wake-up that may come twice)."""
    if not fut.done():
        fut.set_result(None)


class Conditions:
    """Waits for predicates over an owner's state. The owner calls :meth:`changed` after every
    change; each predicate that has waiters is then judged once, in a loop callback of its own
    (never inside the owner's change: a predicate may change the state in turn), and its
    waiters return when it holds. A wait also looks again every ``recheck`` seconds (a
    predicate may turn true as time passes). A thousand callers waiting on one predicate cost
    one judgement per change, not a thousand wake-ups.

    Predicates are told apart by equality: pass the same callable (a bound method, or one
    function kept by the owner) for waits on one condition."""

    def __init__(self, recheck: float = 0.5) -> None:
        self.recheck = recheck
        self._waits: dict[Callable[[], bool], list[asyncio.Future[None]]] = {}
        self._due = False

    def changed(self) -> None:
        """The owner's state changed: judge every predicate waited on, soon."""
        if self._waits and not self._due:
            self._due = True
            asyncio.get_running_loop().call_soon(self._judge)

    def _judge(self) -> None:
        self._due = False
        for pred, futs in list(self._waits.items()):
            if any(not f.done() for f in futs) and pred():
                for f in futs:
                    resolve(f)

    async def wait(self, pred: Callable[[], bool], deadline: float, now: Callable[[], float]) -> bool:
        """Wait until ``pred()`` holds (True) or ``now()`` reaches ``deadline`` (False)."""
        loop = asyncio.get_running_loop()
        while not pred():
            remaining = deadline - now()
            if remaining <= 0:
                return False
            fut: asyncio.Future[None] = loop.create_future()
            futs = self._waits.setdefault(pred, [])
            futs.append(fut)
            timer = loop.call_later(min(remaining, self.recheck), resolve, fut)
            try:
                await fut
            finally:
                timer.cancel()
                futs.remove(fut)
                if not futs and self._waits.get(pred) is futs:
                    del self._waits[pred]
        return True


class AbortEvent(threading.Event):
    """A :class:`threading.Event` that calls its listeners once when it is set (on the thread
    that sets it; a listener must be quick and must not raise). A thread waits on it as on any
    event; a coroutine subscribes with :meth:`listen` and is woken, never polls."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def set(self) -> None:
        with self._lock:
            if self.is_set():
                return
            super().set()
            listeners, self._listeners = self._listeners, []
        for fn in listeners:
            fn()

    def listen(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn`` when the event is set (at once when it already is); returns a function
        that unsubscribes it."""
        with self._lock:
            if not self.is_set():
                self._listeners.append(fn)
                return lambda: self._forget(fn)
        fn()
        return lambda: None

    def _forget(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

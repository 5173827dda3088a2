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
            await self._tasks.close()  # cancelled, awaited, their outcomes consumed

:func:`gather_or_cancel` runs awaitables together and cancels the rest when one fails;
:func:`wait_or_event` waits for a future or an event, whichever comes first.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Coroutine, Iterable, Iterator, TypeVar

T = TypeVar("T")


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
    leave an orphan)."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        #: insertion-ordered (a dict, not a set): closing cancels in the order tasks were
        #: spawned, the same in every run (a set of tasks iterates in memory-address order)
        self._tasks: dict[asyncio.Task[Any], None] = {}
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
        """Start ``coro`` as a task of this set (call on the event loop)."""
        task = asyncio.get_running_loop().create_task(coro, name=name or self.name or None)
        self._tasks[task] = None
        task.add_done_callback(self._discard)
        if self._closed:
            task.cancel()
        return task

    def _discard(self, task: asyncio.Task[Any]) -> None:
        self._tasks.pop(task, None)

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    @property
    def closed(self) -> bool:
        """:meth:`close` was called: tasks spawned from now on are cancelled at once."""
        return self._closed

    async def wait(self, timeout: float | None = None) -> None:
        """Wait (at most ``timeout`` seconds) until every task now running has ended, without
        cancelling any (e.g. replies still being computed get a grace period)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)

    async def close(self, grace: float | None = None) -> None:
        """Give the running tasks ``grace`` seconds to end (None: none), then cancel and reap
        them; spawning afterwards starts nothing. Safe to call more than once."""
        self._closed = True
        if grace:
            await self.wait(grace)
        while live := [t for t in self._tasks if not t.done()]:  # one may spawn as it unwinds
            await cancel_all(live)


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

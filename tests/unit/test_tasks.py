"""p2psync.tasks: owned task sets and the two waits every layer uses."""

from __future__ import annotations

import asyncio

import pytest

from p2psync.tasks import TaskSet, cancel_all, gather_or_cancel, wait_or_event


async def test_a_task_set_drops_finished_tasks_and_cancels_the_rest_on_close():
    ts = TaskSet("t")
    release = asyncio.Event()
    cancelled = []

    async def forever(i: int) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def quick() -> int:
        await release.wait()
        return 7

    q = ts.spawn(quick())
    for i in range(3):
        ts.spawn(forever(i))
    assert len(ts) == 4
    release.set()
    assert await q == 7
    await asyncio.sleep(0)  # the done callback runs
    assert len(ts) == 3
    await ts.close()
    assert sorted(cancelled) == [0, 1, 2] and len(ts) == 0 and ts.closed
    late = ts.spawn(quick())  # after close: cancelled before it runs (no orphan)
    with pytest.raises(asyncio.CancelledError):
        await late
    await ts.close()  # twice: fine


async def test_close_with_grace_lets_running_tasks_finish_first():
    ts = TaskSet()
    done = asyncio.Event()

    async def reply() -> None:
        await asyncio.sleep(0.01)
        done.set()

    ts.spawn(reply())
    await ts.close(grace=5.0)
    assert done.is_set()


async def test_gather_or_cancel_cancels_the_others_when_one_fails():
    other_cancelled = asyncio.Event()

    async def fails() -> None:
        raise ValueError("boom")

    async def waits() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            other_cancelled.set()
            raise

    with pytest.raises(ValueError, match="boom"):
        await gather_or_cancel([waits(), fails()])
    assert other_cancelled.is_set()

    async def value(x: int) -> int:
        return x

    assert await gather_or_cancel(value(i) for i in range(3)) == [0, 1, 2]


async def test_wait_or_event_returns_which_came_first_and_leaves_the_future_alone():
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()
    ev = asyncio.Event()
    loop.call_soon(ev.set)
    assert await wait_or_event(fut, ev) is False and not fut.cancelled()
    fut.set_result(1)
    assert await wait_or_event(fut, asyncio.Event()) is True
    await cancel_all([None, asyncio.ensure_future(asyncio.sleep(10))])  # None entries are skipped

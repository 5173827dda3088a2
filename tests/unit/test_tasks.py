"""p2psync.tasks: owned task sets and the two waits every layer uses."""

from __future__ import annotations

import asyncio

import pytest

from p2psync.tasks import AbortEvent, Conditions, TaskSet, cancel_all, gather_or_cancel, wait_or_event


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


async def _forever(cancelled: list[str], name: str) -> None:
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.append(name)
        raise


async def test_a_nursery_childs_failure_cancels_its_siblings_and_reaches_the_owner():
    heard: list[BaseException] = []
    ts = TaskSet("n", on_error=heard.append)
    cancelled: list[str] = []
    ts.spawn(_forever(cancelled, "a"))
    ts.spawn(_forever(cancelled, "b"))

    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("boom")

    ts.spawn(fails())
    with pytest.raises(ValueError, match="boom"):
        await ts.wait(5)  # the owner waiting on its children gets the failure
    assert sorted(cancelled) == ["a", "b"]
    assert isinstance(ts.error, ValueError) and heard == [ts.error]
    late = ts.spawn(_forever(cancelled, "late"))  # a failed nursery starts nothing more
    with pytest.raises(asyncio.CancelledError):
        await late
    with pytest.raises(ValueError, match="boom"):
        await ts.close()
    assert len(ts) == 0


async def test_only_the_first_failure_is_kept_and_told():
    heard: list[BaseException] = []
    ts = TaskSet("n", on_error=heard.append)

    async def fails(msg: str, after_cancel: bool) -> None:
        try:
            await asyncio.sleep(0 if not after_cancel else 10)
        except asyncio.CancelledError:
            raise RuntimeError(msg) from None  # fails again while being cancelled
        raise RuntimeError(msg)

    ts.spawn(fails("second", True))
    ts.spawn(fails("first", False))
    with pytest.raises(RuntimeError, match="first"):
        await ts.close(grace=5)
    assert [str(e) for e in heard] == ["first"]


async def test_an_isolated_childs_failure_is_its_own(caplog):
    heard: list[BaseException] = []
    ts = TaskSet("iso", isolated=True, on_error=heard.append)
    cancelled: list[str] = []
    sibling = ts.spawn(_forever(cancelled, "sibling"))

    async def fails() -> None:
        raise KeyError("one request")

    bad = ts.spawn(fails())
    await asyncio.wait({bad})
    await asyncio.sleep(0)
    assert not sibling.done() and ts.error is None
    assert len(heard) == 1 and isinstance(heard[0], KeyError)
    await ts.wait(0.01)  # does not raise
    ok = ts.spawn(asyncio.sleep(0, result=3))  # still takes new work
    assert await ok == 3
    await ts.close()  # does not raise
    assert cancelled == ["sibling"]
    # without a hook the failure is logged, never left unretrieved
    quiet = TaskSet("quiet", isolated=True)
    with caplog.at_level("ERROR", logger="p2psync.tasks"):
        t = quiet.spawn(fails())
        await asyncio.wait({t})
        await asyncio.sleep(0)
    assert any("quiet" in r.getMessage() and r.exc_info for r in caplog.records)
    await quiet.close()


async def test_a_nursery_without_a_hook_logs_the_failure_at_once(caplog):
    ts = TaskSet("loops")

    async def fails() -> None:
        raise OSError("loop crashed")

    with caplog.at_level("ERROR", logger="p2psync.tasks"):
        t = ts.spawn(fails(), name="heartbeats")
        await asyncio.wait({t})
        await asyncio.sleep(0)
    assert any("heartbeats" in r.getMessage() and "loops" in r.getMessage() for r in caplog.records)
    with pytest.raises(OSError):
        await ts.close()


async def test_a_cancelled_child_is_no_failure():
    ts = TaskSet("n")
    t = ts.spawn(asyncio.Event().wait())
    await asyncio.sleep(0)
    t.cancel()
    await asyncio.gather(t, return_exceptions=True)
    assert ts.error is None
    await ts.close()


def test_an_abort_event_tells_its_listeners_once() -> None:
    ev = AbortEvent()
    heard: list[str] = []
    ev.listen(lambda: heard.append("a"))
    forget = ev.listen(lambda: heard.append("b"))
    forget()
    ev.set()
    ev.set()
    assert heard == ["a"] and ev.is_set() and ev.wait(0)
    ev.listen(lambda: heard.append("late"))  # already set: told at once
    assert heard == ["a", "late"]


def test_conditions_judge_each_predicate_once_per_change_for_all_its_waiters() -> None:
    """A thousand waiters on one predicate cost one judgement per change (not a wake-up each);
    a predicate that turns true only as time passes is found by the owner's next change or by
    the waiters' own recheck; a deadline ends a wait with False."""
    from p2psync.sim.loop import run

    async def main() -> None:
        loop = asyncio.get_running_loop()
        state = {"n": 0}
        judged = 0

        def ready() -> bool:
            nonlocal judged
            judged += 1
            return state["n"] >= 3

        cond = Conditions(recheck=10.0)
        waits = [asyncio.ensure_future(cond.wait(ready, loop.time() + 60, loop.time)) for _ in range(1000)]
        await asyncio.sleep(0)
        assert judged == 1000  # (each waiter's own first look)
        for _ in range(3):
            state["n"] += 1
            cond.changed()
            cond.changed()  # (two changes before the judgement: judged once)
            await asyncio.sleep(0.001)
        assert all(w.done() and w.result() is True for w in waits)
        assert judged <= 1000 + 3 + 1000  # one judgement per change, then each waiter's last look
        assert not cond._waits  # nothing left behind

        late = {"at": loop.time() + 2.0}
        cond = Conditions(recheck=0.5)
        t0 = loop.time()
        assert await cond.wait(lambda: loop.time() >= late["at"], t0 + 60, loop.time)
        assert 2.0 <= loop.time() - t0 <= 2.5  # found by the recheck, no change told
        assert not await cond.wait(lambda: False, loop.time() + 1.2, loop.time)

    run(main())

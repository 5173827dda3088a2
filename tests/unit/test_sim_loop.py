"""The virtual-time event loop (p2psync/sim/loop.py): time jumps, exact timeouts, determinism,
held actors, and clear refusals (deadlock, foreign threads)."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from p2psync import clock
from p2psync.errors import SimulationError
from p2psync.sim.loop import ACTOR, VirtualLoop, WALL_EPOCH, run


def test_a_thousand_virtual_seconds_take_milliseconds():
    async def main() -> float:
        await asyncio.gather(*(asyncio.sleep(1000 - k) for k in range(100)))
        return asyncio.get_running_loop().time()

    t0 = time.perf_counter()
    assert run(main()) == 1000.0
    assert time.perf_counter() - t0 < 1.0


def test_wait_for_times_out_at_the_virtual_deadline_and_the_clock_follows_the_loop():
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        seen = []
        await asyncio.sleep(2.5)
        for timeout in (0.25, 3.0, 60.0):
            t = loop.time()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.Event().wait(), timeout)
            seen.append(loop.time() - t)
        assert clock.now() == loop.time() and clock.wall() == WALL_EPOCH + loop.time()
        return seen

    assert run(main()) == [0.25, 3.0, 60.0]
    assert clock.current() is clock.SYSTEM  # off the loop: the system's clocks again


async def _workload(order: list[tuple[float, str]]) -> None:
    """Tasks sleeping on shared and distinct times, waking each other through events."""
    loop = asyncio.get_running_loop()
    ev = asyncio.Event()

    async def sleeper(name: str, delays: list[float]) -> None:
        for d in delays:
            await asyncio.sleep(d)
            order.append((loop.time(), name))
        if name == "c":
            ev.set()

    async def waiter(name: str) -> None:
        await ev.wait()
        order.append((loop.time(), name))

    await asyncio.gather(sleeper("a", [1, 1, 1]), sleeper("b", [2, 1]), sleeper("c", [0.5, 2.5]),
                         *(waiter(f"w{k}") for k in range(5)), sleeper("d", [3]))


def test_the_same_program_runs_the_same_callbacks_in_the_same_order():
    runs = []
    for _ in range(3):
        order: list[tuple[float, str]] = []
        loop = VirtualLoop()
        run(_workload(order), loop=loop)
        runs.append((order, loop.digest(), loop.steps))
    assert runs[0] == runs[1] == runs[2]
    order = runs[0][0]
    # timers due at the same time run in the order they were scheduled: at t=3, d's (scheduled
    # at 0), c's (at 0.5), b's and a's (both at 2, b woken first); the waiters once c set the event
    assert order == [(0.5, "c"), (1.0, "a"), (2.0, "b"), (2.0, "a"),
                     (3.0, "d"), (3.0, "c"), (3.0, "b"), (3.0, "a"), *((3.0, f"w{k}") for k in range(5))]
    other: list[tuple[float, str]] = []
    loop = VirtualLoop()

    async def different() -> None:
        await asyncio.sleep(0)
        await _workload(other)

    run(different(), loop=loop)
    assert other == order and loop.digest() != runs[0][1]  # one callback more: another trace


def test_equal_times_run_first_scheduled_first():
    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        out: list[int] = []
        for k in range(50):
            loop.call_at(7.0, out.append, k)
        await asyncio.sleep(8)
        return out

    assert run(main()) == list(range(50))


def test_a_held_actor_stands_still_and_its_timers_fire_late():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualLoop)
        ticks: list[tuple[float, float]] = []

        async def node() -> None:
            assert ACTOR.get() == "n1"
            while True:
                await asyncio.sleep(1.0)
                ticks.append((loop.time(), clock.cpu()))

        task = loop.spawn(node(), actor="n1")
        await asyncio.sleep(2.5)
        loop.hold("n1")
        assert loop.held("n1")
        await asyncio.sleep(10.0)  # its wake-up at 3.0 is parked
        assert [t for t, _ in ticks] == [1.0, 2.0]
        loop.release("n1")
        await asyncio.sleep(0)
        await asyncio.sleep(1.1)
        # the parked wake-up ran at 12.5 (late), then one every second from there
        assert [t for t, _ in ticks] == [1.0, 2.0, 12.5, 13.5]
        assert [c for _, c in ticks] == [1.0, 2.0, 2.5, 3.5]  # no CPU time while held
        task.cancel()

    run(main())


def test_nothing_ready_nothing_scheduled_is_a_deadlock_not_a_hang():
    async def main() -> None:
        await asyncio.Event().wait()

    with pytest.raises(SimulationError, match="deadlock"):
        run(main())

    async def held() -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualLoop)
        loop.hold(3)
        await loop.spawn(asyncio.sleep(1), actor=3)

    with pytest.raises(SimulationError, match="actors held: 3"):
        run(held())


def test_threads_run_inline_and_a_foreign_thread_is_refused():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        me = threading.get_ident()
        assert await asyncio.to_thread(threading.get_ident) == me  # inline, no virtual time
        assert loop.time() == 0.0
        errors: list[BaseException] = []

        def foreign() -> None:
            try:
                loop.call_soon_threadsafe(print, "never")
            except SimulationError as exc:
                errors.append(exc)

        th = threading.Thread(target=foreign)
        th.start()
        th.join()
        assert errors
        await asyncio.sleep(1)  # the loop ends its run with the same error

    with pytest.raises(SimulationError, match="reproducible"):
        run(main())


def test_callbacks_that_never_let_the_time_move_on_are_a_livelock_not_a_hang():
    """Code that retries at once, for ever, runs no virtual time: after ``livelock_steps``
    callbacks at one instant the run ends with SimulationError naming the instant and the
    busiest callback; the same count spread over moving time is no livelock."""
    async def spin() -> None:
        await asyncio.sleep(1.5)
        while True:
            await asyncio.sleep(0)

    with pytest.raises(SimulationError, match=r"livelock at virtual time 1\.500000s: 3000 callbacks.*Task") as info:
        run(spin(), loop=VirtualLoop(livelock_steps=3000))
    assert "without the time moving on" in str(info.value)

    async def ticking() -> int:
        n = 0
        for _ in range(5000):
            await asyncio.sleep(0.001)
            n += 1
        return n

    assert run(ticking(), loop=VirtualLoop(livelock_steps=3000)) == 5000


def test_a_wait_shorter_than_the_clock_s_resolution_moves_the_time_on() -> None:
    # the membership service's bounded wait (coordinator/membership.py _wait_until) in slices
    # until a deadline: once what was left was one floating-point step (7e-15 s at 38 s),
    # asyncio ran the timer at once (due within the clock's resolution) without moving the
    # time, so the same wait began again and again: a livelock at 38.127 s (a simulated finish
    # barrier's end)
    async def wait_out(deadline: float) -> float:
        ev = asyncio.Event()
        while (remaining := deadline - clock.now()) > 0:
            try:
                await asyncio.wait_for(ev.wait(), min(remaining, 0.5))
            except asyncio.TimeoutError:
                pass
        return clock.now()

    async def go() -> float:
        await asyncio.sleep(38.12699999999997)
        return await wait_out(math.nextafter(clock.now(), math.inf))

    assert run(go(), loop=VirtualLoop()) == pytest.approx(38.127)

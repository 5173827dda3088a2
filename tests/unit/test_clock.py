"""The one clock (p2psync/clock.py): the system's clocks unless the running loop has its own."""

from __future__ import annotations

import asyncio
import threading
import time

from p2psync import clock


class _Fixed:
    """A clock that always answers the same: proves which clock a read went to."""

    def now(self) -> float:
        return 1234.5

    def wall(self) -> float:
        return 99.0

    def cpu(self) -> float:
        return 7.0


def test_off_loop_reads_are_the_system_clocks():
    a = time.monotonic()
    t = clock.now()
    b = time.monotonic()
    assert a <= t <= b
    w0 = time.time()
    assert w0 - 1 <= clock.wall() <= time.time() + 1
    assert clock.current() is clock.SYSTEM
    assert isinstance(clock.SYSTEM, clock.Clock)


def test_on_the_stdlib_loop_now_is_its_time_and_time_monotonic():
    async def reads() -> tuple[float, float, float, float]:
        loop = asyncio.get_running_loop()
        return time.monotonic(), loop.time(), clock.now(), time.monotonic()

    before, loop_t, now, after = asyncio.run(reads())
    assert before <= loop_t <= now <= after  # the stdlib loop's time() is time.monotonic()


def test_a_loop_with_its_own_clock_answers_every_read_on_its_thread_only():
    loop = asyncio.new_event_loop()
    clock.offer(loop, _Fixed())
    seen: list[float] = []

    def other_thread() -> None:
        seen.append(clock.now())

    async def reads() -> tuple[float, float, float]:
        th = threading.Thread(target=other_thread)
        th.start()
        th.join()
        return clock.now(), clock.wall(), clock.cpu()

    try:
        assert loop.run_until_complete(reads()) == (1234.5, 99.0, 7.0)
    finally:
        loop.close()
    assert seen and seen[0] != 1234.5  # a thread without that loop reads the system's clock
    assert clock.now() != 1234.5  # and so does this one once the loop stopped

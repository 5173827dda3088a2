"""The in-process shaper's lanes in virtual time: a message that goes at once costs a timer,
not a task; a failed try is retried by a worker that keeps the lane's order; close flushes the
control messages due within its grace and drops the rest."""

from __future__ import annotations

import asyncio

from p2psync.errors import PeerUnreachable
from p2psync.sim.loop import run
from p2psync.transport.shaping import InprocShaper, LinkSpec


def test_due_messages_go_in_order_from_a_timer_and_a_failed_try_is_retried_in_order() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        sh = InprocShaper({1: LinkSpec(latency_s=0.1)})
        got: list[tuple[float, int]] = []
        refuse = {2}  # message 2's first try fails

        def attempt(i: int):
            def go() -> bool:
                if i in refuse:
                    refuse.discard(i)
                    return False
                got.append((round(loop.time(), 3), i))
                return True
            return go

        def retry(i: int):
            async def again() -> None:
                await asyncio.sleep(0.05)
                got.append((round(loop.time(), 3), i))
            return again

        tasks_before = len(asyncio.all_tasks())
        await sh.submit(1, 10, attempt(0), retry(0))
        await sh.submit(1, 10, attempt(1), retry(1))
        assert len(asyncio.all_tasks()) == tasks_before  # (a timer, no task)
        await asyncio.sleep(0.2)
        assert got == [(0.1, 0), (0.1, 1)]
        got.clear()
        t0 = loop.time()
        for i in (2, 3, 4):
            await sh.submit(1, 10, attempt(i), retry(i))
        await asyncio.sleep(0.3)
        d = round(t0 + 0.1, 3)
        assert got == [(round(d + 0.05, 3), 2), (round(d + 0.05, 3), 3), (round(d + 0.05, 3), 4)]
        assert sh.delivered == 5 and sh.dropped == 0

        def fails() -> bool:
            raise PeerUnreachable("gone")

        await sh.submit(1, 10, fails, retry(9))
        await asyncio.sleep(0.2)
        assert sh.dropped == 1
        await sh.close()

    run(main())


def test_close_flushes_control_due_within_its_grace_and_drops_the_rest() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        sh = InprocShaper({1: LinkSpec(latency_s=0.5), 2: LinkSpec(latency_s=5.0)})
        got: list[int] = []

        def attempt(i: int):
            def go() -> bool:
                got.append(i)
                return True
            return go

        async def never() -> None:
            raise AssertionError("not retried")

        await sh.submit(1, 10, attempt(1), never, control=True)
        await sh.submit(2, 10, attempt(2), never, control=True)  # due after the grace
        await sh.submit(2, 10, attempt(3), never)  # bulk due after the grace: dropped at close
        t0 = loop.time()
        await sh.close(flush_s=2.0)
        assert got == [1] and 0.5 <= loop.time() - t0 < 1.0
        assert sh.dropped == 2
        await asyncio.sleep(10)
        assert got == [1]

    run(main())

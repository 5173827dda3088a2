"""Flow-control windows, control priority in the shaper and retired RPC replies (in-memory)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from p2psync.coordinator import RpcClient, RpcServer
from p2psync.errors import PeerTimeout, PeerUnreachable
from p2psync.topology import mesh
from p2psync.transport import MemoryHub
from p2psync.transport.flow import ByteWindow
from p2psync.transport.shaping import InprocShaper, LinkSpec
from tests.helpers import until

pytestmark = pytest.mark.timeout(30)


async def test_byte_window_fifo_oversize_and_timeout():
    w = ByteWindow(100)
    assert await w.acquire(60, None) == 60
    big = asyncio.create_task(w.acquire(500, None))  # oversize: waits for an empty window
    small = asyncio.create_task(w.acquire(10, None))  # FIFO: queued behind the big one
    await asyncio.sleep(0)
    assert not big.done() and not small.done() and w.used == 60
    with pytest.raises(asyncio.TimeoutError):
        await w.acquire(1, 0.01)
    w.release(60)
    assert await big == 100
    await asyncio.sleep(0)
    assert not small.done()
    w.release(100)
    assert await small == 10 and w.used == 10


async def test_try_acquire_takes_room_only_when_nobody_waits_ahead():
    w = ByteWindow(100)
    assert w.try_acquire(60) == 60 and w.try_acquire(50) is None and w.used == 60
    waiting = asyncio.create_task(w.acquire(50, None))
    await asyncio.sleep(0)
    assert w.try_acquire(10) is None  # it fits, but a waiter is ahead (FIFO)
    w.release(60)
    assert await waiting == 50
    assert w.try_acquire(40) == 40 and w.used == 90
    assert w.try_acquire(500) is None  # oversize takes the whole window: only when it is empty
    w.release(90)
    assert w.try_acquire(500) == 100 and w.used == 100


@pytest.fixture
async def pair():
    hub = MemoryHub(mesh(2))
    eps = [hub.endpoint(i, window_bytes=64 * 1024) for i in range(2)]
    for e in eps:
        await e.start()
    yield eps
    for e in eps:
        await e.close()


async def test_bulk_waits_for_window_and_control_overtakes_it(pair):
    a, b = pair
    link = LinkSpec(latency_s=0.005, bandwidth_bps=8e6)  # 1 MB/s: 32 KiB = 33 ms
    a.shaper = InprocShaper({1: link})
    piece = np.ones(32 * 1024, dtype=np.uint8)
    bulk = asyncio.gather(*(a.send(1, f"d.{i}", [piece], timeout=10) for i in range(10)))
    await until(lambda: a.window(1).used > 0, 2, "bulk to start")
    t0 = time.monotonic()
    await a.send(1, "ev", kind="event", timeout=5)
    await b.recv("ev", timeout=5)
    assert time.monotonic() - t0 < 0.1  # not behind ~330 ms of bulk
    assert a.window(1).used <= a.window(1).capacity
    await bulk
    for i in range(10):
        await b.recv(f"d.{i}", timeout=5)
    assert a.window(1).waits > 0 and a.window(1).used == 0


async def test_bulk_send_times_out_when_window_stays_full(pair):
    a, _ = pair
    a.shaper = InprocShaper({1: LinkSpec(bandwidth_bps=8e3)})  # 1 KB/s
    big = asyncio.create_task(a.send(1, "d.big", [np.ones(64 * 1024, dtype=np.uint8)], timeout=30))
    await until(lambda: a.window(1).used > 0, 2, "big send to take the window")
    with pytest.raises(PeerUnreachable, match="flow-control window"):
        await a.send(1, "d.next", [np.ones(10, dtype=np.uint8)], timeout=0.05)
    big.cancel()
    with pytest.raises(asyncio.CancelledError):
        await big


async def test_late_rpc_replies_are_retired_not_accumulated(pair):
    a, b = pair
    gate = asyncio.Event()

    async def slow(_c, _a, _x):
        await gate.wait()
        return 1

    server = RpcServer(b)
    server.register("slow", slow)
    server.start()
    client = RpcClient(a)
    try:
        for _ in range(20):
            with pytest.raises(PeerTimeout):
                await client.call(1, "slow", timeout=0.01)
        gate.set()  # now all 20 replies come, late
        await until(lambda: a.rejected["retired"] == 20, 5, "late replies to be dropped")
        assert a.mailbox.pending == 0 and a.mailbox.bytes_pending == 0
        assert await client.call(1, "slow", timeout=2) == 1
    finally:
        await server.close()

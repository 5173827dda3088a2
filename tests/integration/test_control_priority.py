"""Issue 10 items 1 and 7 over real ZeroMQ on loopback: control traffic does not wait behind
bulk, bulk is flow-controlled, a flooded node keeps bounded memory and stays responsive."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from p2psync.coordinator import RpcClient, RpcServer
from p2psync.topology import mesh
from p2psync.transport.shaping import InprocShaper, LinkSpec
from tests.helpers import free_port, until, zmq_cluster

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20



async def _ping(_caller, _args, _arrays):
    return "pong"


async def test_rpc_round_trip_stays_at_link_latency_while_40_MiB_of_bulk_is_queued():
    """100 Mb/s, 10 ms one way: 40 MiB of pieces need 3.4 s of link time. Before, the RPC and
    its reply queued behind them (seconds); now a round trip costs about the 20 ms RTT."""
    topo = mesh(2, base_port=free_port())
    async with zmq_cluster(topo, timeout=30) as eps:
        server = RpcServer(eps[1])
        server.register("ping", _ping)
        server.start()
        client = RpcClient(eps[0])
        try:
            assert await client.call(1, "ping", timeout=5) == "pong"  # connections are up
            link = LinkSpec(latency_s=0.010, bandwidth_bps=100e6)
            eps[0].shaper = InprocShaper({1: link})
            eps[1].shaper = InprocShaper({0: link})
            piece = np.ones(MiB, dtype=np.uint8)
            t_bulk = time.monotonic()
            bulk = asyncio.gather(*(eps[0].send(1, f"bulk.{i}", [piece], timeout=30) for i in range(40)))
            win = eps[0].window(1)
            await until(lambda: win.used > 0, 5, "bulk sends to start")
            rtts = []
            for _ in range(5):
                t0 = time.monotonic()
                assert await client.call(1, "ping", timeout=10) == "pong"
                rtts.append(time.monotonic() - t0)
                assert win.used <= win.capacity
            assert not bulk.done(), "the bulk transfer should still be running"
            assert max(rtts) < 0.2, f"RPC round trips under load: {rtts}"
            assert min(rtts) >= 0.019  # the link latency is still charged, both ways
            await bulk
            for i in range(40):
                await eps[1].recv(f"bulk.{i}", timeout=10)
            elapsed = time.monotonic() - t_bulk
            assert 40 * MiB * 8 / 100e6 * 0.95 <= elapsed < 40 * MiB * 8 / 100e6 * 1.5
            assert win.waits > 0 and win.used == 0  # backpressure happened, all released
        finally:
            await server.close()


async def test_flooded_node_keeps_bounded_mailbox_and_answers_rpc():
    """2000 unread 256 KiB data messages (500 MiB): before, the mailbox grew by ~504 MiB and at
    the message cap RPC replies were rejected. Now the peer's budget caps it, the oldest data is
    dropped and counted, and RPCs to the flooded node are answered throughout."""
    budget = 16 * MiB
    topo = mesh(2, base_port=free_port())
    async with zmq_cluster(topo, timeout=30, mailbox_budget_bytes=budget) as eps:
        server = RpcServer(eps[1])
        server.register("ping", _ping)
        server.start()
        client = RpcClient(eps[0])
        try:
            assert await client.call(1, "ping", timeout=5) == "pong"
            mb = eps[1].mailbox
            msg = np.ones(256 * 1024, dtype=np.uint8)
            n = 2000
            peak = 0

            async def flood():
                for i in range(n):
                    await eps[0].send(1, f"flood.{i}", [msg], timeout=20)

            task = asyncio.create_task(flood())
            rtts = []
            while not task.done():
                t0 = time.monotonic()
                assert await client.call(1, "ping", timeout=5) == "pong"
                rtts.append(time.monotonic() - t0)
                peak = max(peak, mb.bytes_pending)
            await task
            await until(lambda: mb.pending + eps[1].rejected["mailbox_budget"] >= n, 20,
                         "every flood message to be queued or dropped")
            peak = max(peak, mb.bytes_pending)
            assert peak <= budget
            assert mb.bytes_pending_from(0) <= budget
            assert eps[1].rejected["mailbox_budget"] == n - mb.pending >= n - budget // msg.nbytes
            assert mb.get_nowait(f"flood.{n - 1}") is not None  # the newest is kept
            assert rtts and max(rtts) < 2.0, rtts
            assert await client.call(1, "ping", timeout=5) == "pong"
        finally:
            await server.close()

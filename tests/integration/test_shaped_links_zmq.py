"""The in-process shaper over real ZeroMQ when a connection is down: a send over it fails as an
unshaped one would instead of vanishing in the shaper, so a relay takes its other next hop."""

from __future__ import annotations

import asyncio
import time

import pytest

from p2psync.errors import PeerUnreachable, TransportError
from p2psync.topology import ring
from p2psync.transport.shaping import InprocShaper, LinkSpec
from p2psync.wire import encode
from tests.helpers import free_port, until, zmq_cluster

pytestmark = pytest.mark.timeout(60)


async def test_a_shaped_send_over_a_dropped_connection_fails_and_the_relay_goes_around() -> None:
    """Ring-4 with 50 ms links from node 0; node 1's process is gone (its connections drop,
    nobody has declared it failed). Before, node 0's shaper took a message for node 1 at once
    and dropped it at delivery, so the relay reported it sent, never tried node 3, and a
    control message for node 2 was lost."""
    topo = ring(4, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        src = eps[0]
        src.shaper = InprocShaper({n: LinkSpec(latency_s=0.05) for n in (1, 2, 3)})
        await src.send(2, "before", kind="event")  # (every connection up, through either relay)
        assert (await eps[2].recv("before", timeout=10)).src == 0
        await eps[1].close()
        assert await src.wait_gone([1], 10.0), "node 0 never saw node 1's connections drop"
        frames = encode(kind="event", src=0, tag="direct", run=src.run_id, inc=src.incarnation)
        with pytest.raises(PeerUnreachable):
            await src._send_direct(1, src.route(1), 0.0, frames)  # one try, as a relay's first pass
        with pytest.raises(PeerUnreachable):
            await src._send_direct(1, src.route(1), 0.3, frames)  # waited 0.3 s for it: still down
        await src.send(2, "around", kind="event", timeout=5.0)
        msg = await eps[2].recv("around", timeout=5)
        assert msg.src == 0 and msg.header.hops == 1  # through node 3
        assert eps[3].relayed >= 1


async def test_a_relay_passes_a_message_on_to_no_node_it_passed_already() -> None:
    """Ring-6: node 1 relays node 2's event for node 4 through node 0 (the only way not back
    to node 2). When the event says it passed node 0 already (its ``path``), node 1 has no
    way left and drops it: a relay never sends a message round a loop."""
    topo = ring(6, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        src = eps[2]
        for tag, path in (("loop", [0]), ("fine", [])):
            frames = encode(kind="event", src=2, dst=4, hops=0, tag=tag, path=path, run=src.run_id,
                            inc=src.incarnation)
            await src._send_direct(1, src.route(1), 5.0, frames)
        assert (await eps[4].recv("fine", timeout=10)).header.path == (2, 1, 0)  # the relays before node 5
        assert eps[0].relayed == 1 and eps[4].recv_nowait("loop") is None


async def test_a_send_waiting_for_its_connection_ends_when_the_transport_closes() -> None:
    topo = ring(3, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        src = eps[0]
        src.shaper = InprocShaper({n: LinkSpec(latency_s=0.05) for n in (1, 2)})
        await eps[1].close()
        assert await src.wait_gone([1], 10.0)
        frames = encode(kind="event", src=0, tag="x", run=src.run_id, inc=src.incarnation)
        waiting = asyncio.ensure_future(src._send_direct(1, src.route(1), 30.0, frames))
        await until(lambda: bool(src._link_waiters), 10, "the send to wait for its connection")
        assert not waiting.done()
        t0 = time.monotonic()
        await src.close()
        with pytest.raises(TransportError, match="closed"):
            await waiting
        assert time.monotonic() - t0 < 5.0

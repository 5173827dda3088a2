"""Mailbox tag matching and the in-memory transport (logic only; ZeroMQ is tested in integration)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from p2psync.errors import PeerTimeout, PeerUnreachable, TransportError
from p2psync.topology import mesh, star
from p2psync.transport import Mailbox, MemoryHub
from p2psync.wire import decode, encode


def _msg(tag, src=0):
    return decode(encode(kind="data", src=src, tag=tag))


async def test_exact_and_prefix_matching_never_steal():
    mb = Mailbox()
    a = asyncio.create_task(mb.get("op1.x", timeout=2))
    b = asyncio.create_task(mb.get_prefix("op2.", timeout=2))
    await asyncio.sleep(0)
    mb.deliver(_msg("op2.y"))
    mb.deliver(_msg("op1.x"))
    assert (await a).tag == "op1.x"
    assert (await b).tag == "op2.y"


async def test_queued_messages_in_arrival_order():
    mb = Mailbox()
    for t in ("p.b", "p.a", "q", "p.b"):
        mb.deliver(_msg(t))
    assert (await mb.get_prefix("p.")).tag == "p.b"
    assert (await mb.get_prefix("p.")).tag == "p.a"
    assert (await mb.get("p.b")).tag == "p.b"
    assert mb.pending == 1


async def test_timeout_and_no_lost_message_after_timeout():
    mb = Mailbox()
    with pytest.raises(PeerTimeout):
        await mb.get("t", timeout=0.01)
    mb.deliver(_msg("t"))  # the timed-out waiter must not swallow it
    assert (await mb.get("t", timeout=0.1)).tag == "t"


async def test_abort_and_close_fail_waiters():
    mb = Mailbox()
    w = asyncio.create_task(mb.get("a.1", timeout=5))
    await asyncio.sleep(0)
    assert mb.abort(TransportError("x"), match=lambda t: t.startswith("a.")) == 1
    with pytest.raises(TransportError):
        await w
    mb.close(TransportError("closed"))
    with pytest.raises(TransportError):
        await mb.get("b", timeout=1)


async def test_memory_transport_roundtrip_and_counters():
    hub = MemoryHub(mesh(3))
    eps = [hub.endpoint(i) for i in range(3)]
    for e in eps:
        await e.start()
    await eps[0].send(2, "g", [np.arange(4, dtype=np.float32)], step=7, meta={"r": 1})
    m = await eps[2].recv("g", timeout=1)
    assert m.src == 0 and m.header.step == 7 and m.meta == {"r": 1}
    np.testing.assert_array_equal(m.arrays[0], np.arange(4, dtype=np.float32))
    assert eps[0].nic_stats["eth0"].msgs_sent == 1 and eps[2].nic_stats["eth0"].msgs_recv == 1
    for e in eps:
        await e.close()


async def test_memory_transport_rejects_garbage_and_unreachable():
    hub = MemoryHub(star(3))
    eps = [hub.endpoint(i) for i in range(3)]
    for e in eps[:2]:
        await e.start()
    eps[1]._ingest("eth0", 0, "0/leaf1", [b"\xc1"])
    assert eps[1].rejected["header_msgpack"] == 1
    with pytest.raises(TransportError, match="shares no network"):
        await eps[1].send(2, "x")
    with pytest.raises(PeerUnreachable):
        await eps[0].send(2, "x", timeout=0.05)


async def test_a_subscriber_takes_queued_then_arriving_messages_of_its_tag_only():
    mb = Mailbox()
    mb.deliver(_msg("s.call", src=1))
    mb.deliver(_msg("other"))
    got: list = []
    mb.subscribe("s.call", got.append)
    assert [m.src for m in got] == [1] and mb.pending == 1  # the queued one at once
    mb.deliver(_msg("s.call", src=2))
    mb.deliver(_msg("s.call.x"))  # exact tags only
    assert [m.src for m in got] == [1, 2] and mb.subscribed("s.call", got.append)
    with pytest.raises(ValueError):
        mb.subscribe("s.call", got.append)
    mb.unsubscribe("s.call", [].append)  # not its subscriber: left alone
    assert mb.subscribed("s.call", got.append) and not mb.subscribed("s.call", [].append)
    mb.unsubscribe("s.call", got.append)
    mb.deliver(_msg("s.call", src=3))  # queues again
    assert len(got) == 2 and (await mb.get("s.call", timeout=1)).src == 3
    mb.subscribe("s.call", got.append)
    mb.close(TransportError("closed"))
    assert not mb.subscribed("s.call", got.append)
    with pytest.raises(TransportError):
        mb.subscribe("t", got.append)


async def test_a_subscriber_that_raises_on_the_queued_messages_is_undone():
    mb = Mailbox()
    mb.deliver(_msg("s", src=1))

    def boom(msg):
        raise RuntimeError("no loop")

    with pytest.raises(RuntimeError):
        mb.subscribe("s", boom)
    assert not mb.subscribed("s", boom)
    mb.deliver(_msg("s", src=2))  # queues, as for any tag without a subscriber
    assert (await mb.get("s", timeout=1)).src == 2

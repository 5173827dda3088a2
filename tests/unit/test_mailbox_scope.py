"""Scopes own the receives of an operation: abort fails exactly the waits registered with
them (optionally those expecting one peer), retire/cancel drop the operation's late pieces,
and a scope neither reaches waits outside its roots nor waits begun before it was opened."""

from __future__ import annotations

import asyncio
import gc

import pytest

from p2psync.errors import PeerFailure, PeerTimeout
from p2psync.transport import Mailbox, MemoryHub
from p2psync.topology import mesh
from p2psync.wire import decode, encode


def _msg(tag: str, src: int = 0):
    return decode(encode(kind="data", src=src, tag=tag))


async def _started(*coros):
    tasks = [asyncio.ensure_future(c) for c in coros]
    await asyncio.sleep(0)
    return tasks


async def test_abort_fails_the_registered_waits_only():
    mb = Mailbox()
    op = mb.scope("op.1.")
    inside, prefix, outside, sibling = await _started(
        mb.get("op.1.rs0.2.0", timeout=5), mb.get_prefix("op.1.ag", timeout=5),
        mb.get("op.2.rs0.2.0", timeout=5), mb.get("op.10.x", timeout=5))
    assert op.waiting == 2
    assert op.abort(PeerFailure("gone", peers=(2,))) == 2
    for t in (inside, prefix):
        with pytest.raises(PeerFailure):
            await t
    assert op.waiting == 0 and op.open  # abort leaves the scope open: later waits register
    later, = await _started(mb.get("op.1.rs1.2.0", timeout=5))
    assert op.waiting == 1
    mb.deliver(_msg("op.1.rs1.2.0"))
    assert (await later).tag == "op.1.rs1.2.0"
    assert op.waiting == 0  # a wait that ended leaves its scope
    mb.deliver(_msg("op.2.rs0.2.0"))
    mb.deliver(_msg("op.10.x"))
    assert (await outside).tag == "op.2.rs0.2.0"
    assert (await sibling).tag == "op.10.x"


async def test_abort_by_peer_fails_that_peers_waits_only():
    mb = Mailbox()
    replies = mb.scope("c.r.")
    from1, from12 = await _started(mb.get("c.r.1.p1", timeout=5, peer=1), mb.get("c.r.2.p12", timeout=5, peer=12))
    assert replies.abort(PeerFailure("1 failed", peers=(1,)), peer=1) == 1
    with pytest.raises(PeerFailure):
        await from1
    assert not from12.done()
    mb.deliver(_msg("c.r.2.p12", src=12))
    assert (await from12).src == 12


async def test_a_wait_begun_before_the_scope_or_after_close_is_not_registered():
    mb = Mailbox()
    early, = await _started(mb.get("s.a", timeout=0.2))
    sc = mb.scope("s.")
    assert sc.abort(PeerFailure("x")) == 0
    sc.close()
    late, = await _started(mb.get("s.b", timeout=0.2))
    assert sc.abort(PeerFailure("x")) == 0
    for t in (early, late):
        with pytest.raises(PeerTimeout):
            await t


async def test_retire_drops_queued_and_late_pieces_and_leaves_pending_waits():
    mb = Mailbox()
    sc = mb.scope("w.3.", "w.flag.3.")
    mb.deliver(_msg("w.3.rs0.1.0"))
    mb.deliver(_msg("w.other"))
    pending, = await _started(mb.get("w.flag.3.x", timeout=5))
    assert sc.retire() == 1  # the queued piece
    assert not sc.open and not pending.done()
    mb.deliver(_msg("w.flag.3.x"))  # a waiter still takes its message
    assert (await pending).tag == "w.flag.3.x"
    mb.deliver(_msg("w.3.ag0.1.0"))  # late: dropped on arrival
    mb.deliver(_msg("w.flag.3.y"))
    assert mb.pending == 1 and mb.dropped["retired"] == 3
    assert (await mb.get("w.other", timeout=1)).tag == "w.other"


async def test_cancel_fails_the_waits_and_retires():
    mb = Mailbox()
    sc = mb.scope("k.")
    w, = await _started(mb.get("k.1", timeout=5))
    assert sc.cancel(PeerFailure("view replaced")) == 1
    with pytest.raises(PeerFailure, match="view replaced"):
        await w
    mb.deliver(_msg("k.1"))
    assert mb.pending == 0 and mb.is_retired("k.2")
    assert sc.cancel(PeerFailure("again")) == 0  # idempotent


async def test_a_dropped_scope_is_forgotten_by_the_mailbox():
    mb = Mailbox()
    mb.scope("gone.")
    gc.collect()
    w, = await _started(mb.get("gone.1", timeout=5))
    assert mb._scopes_over("gone.1") == ()
    w.cancel()
    await asyncio.gather(w, return_exceptions=True)


def test_a_scope_needs_roots():
    with pytest.raises(ValueError):
        Mailbox().scope()
    with pytest.raises(ValueError):
        Mailbox().scope("")


async def test_transport_recv_registers_with_the_transports_scopes():
    hub = MemoryHub(mesh(2))
    a, b = hub.endpoint(0), hub.endpoint(1)
    for e in (a, b):
        await e.start()
    sc = b.scope("x.")
    w, = await _started(b.recv("x.1", timeout=5, peer=0))
    assert sc.abort(PeerFailure("0 failed", peers=(0,)), peer=0) == 1
    with pytest.raises(PeerFailure):
        await w
    await a.close()
    await b.close()


async def test_abort_fails_the_waits_in_the_order_they_were_registered():
    """The same order in every run (the simulator's event digest depends on it): not the
    order of the waiters' memory addresses."""
    mb = Mailbox()
    op = mb.scope("op.1.")
    tasks = await _started(*(mb.get(f"op.1.p{i}", timeout=5) for i in range(64)))
    failed: list[int] = []
    for i, t in enumerate(tasks):
        t.add_done_callback(lambda _t, i=i: failed.append(i))
    assert op.abort(PeerFailure("gone", peers=(2,))) == 64
    await asyncio.gather(*tasks, return_exceptions=True)
    assert failed == list(range(64))

"""Mailbox: O(1) matching (issue 9 item 6), byte budgets, control caps, expiry, retire (issue 10)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from p2psync.errors import PeerTimeout, ProtocolError, TransportError
from p2psync.transport import Mailbox
from p2psync.wire import decode, encode

pytestmark = pytest.mark.timeout(60)


def _msg(tag, src=0, kind="data", nbytes=0):
    arrays = [np.zeros(nbytes, dtype=np.uint8)] if nbytes else []
    return decode(encode(kind=kind, src=src, tag=tag, arrays=arrays))


async def test_ten_thousand_pending_receives_are_matched_in_linear_time():
    """10^4 pending exact receives, then 10^4 deliveries in the opposite order. The old mailbox
    scanned every waiter per delivery (and again on removal): ~10^8 comparisons, tens of
    seconds. Indexed by tag, it is a few tens of ms; the bound leaves 25x headroom."""
    n = 10_000
    mb = Mailbox()
    tags = [f"op.{i}.piece" for i in range(n)]
    tasks = [asyncio.create_task(mb.get(t, timeout=60)) for t in tags]
    other = asyncio.create_task(mb.get_prefix("never.", timeout=60))  # a prefix waiter too
    await asyncio.sleep(0)  # one loop turn: every task registers its waiter
    msgs = [_msg(t) for t in reversed(tags)]
    t0 = time.perf_counter()
    for m in msgs:
        mb.deliver(m)
    results = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    assert [m.tag for m in results] == tags
    assert mb.pending == 0
    assert elapsed < 2.0, f"matching 10^4 receives took {elapsed:.2f}s"
    other.cancel()
    with pytest.raises(asyncio.CancelledError):
        await other


async def test_oldest_waiter_wins_between_exact_and_prefix():
    mb = Mailbox()
    p = asyncio.create_task(mb.get_prefix("a.", timeout=2))
    await asyncio.sleep(0)
    e = asyncio.create_task(mb.get("a.1", timeout=2))
    await asyncio.sleep(0)
    mb.deliver(_msg("a.1"))
    mb.deliver(_msg("a.1", src=1))
    assert (await p).src == 0 and (await e).src == 1
    assert mb.waiting == 0


async def test_prefix_take_in_arrival_order_across_families():
    mb = Mailbox()
    for t in ("x.2", "y.1", "x.1", "zz", "x.2"):
        mb.deliver(_msg(t))
    assert [(await mb.get_prefix("x.")).tag for _ in range(3)] == ["x.2", "x.1", "x.2"]
    assert (await mb.get_prefix("z")).tag == "zz"
    assert (await mb.get_prefix("")).tag == "y.1"
    assert mb.pending == 0 and mb.bytes_pending == 0


async def test_abort_with_match_only_hits_matching_waiters():
    mb = Mailbox()
    a = asyncio.create_task(mb.get("s.1", timeout=5))
    b = asyncio.create_task(mb.get_prefix("s.", timeout=5))
    c = asyncio.create_task(mb.get("t.1", timeout=5))
    await asyncio.sleep(0)
    assert mb.abort(TransportError("x"), match=lambda t: t.startswith("s.")) == 2
    for t in (a, b):
        with pytest.raises(TransportError):
            await t
    mb.deliver(_msg("t.1"))
    assert (await c).tag == "t.1"
    assert mb.waiting == 0


async def test_byte_budget_drops_oldest_data_of_that_peer_only():
    drops = []
    mb = Mailbox(budget_bytes=10_000, on_drop=lambda m, r: drops.append((m.tag, m.src, r)))
    mb.deliver(_msg("other", src=1, nbytes=9_000))
    for i in range(5):
        mb.deliver(_msg(f"d.{i}", src=0, nbytes=3_000))
    assert mb.bytes_pending_from(0) == 9_000 and mb.bytes_pending_from(1) == 9_000
    assert mb.bytes_pending == 18_000
    assert drops == [("d.0", 0, "mailbox_budget"), ("d.1", 0, "mailbox_budget")]
    assert mb.dropped["mailbox_budget"] == 2
    assert mb.get_nowait("d.0") is None and mb.get_nowait("d.4") is not None
    assert mb.get_nowait("other") is not None


async def test_control_is_never_dropped_for_data_and_has_its_own_cap():
    mb = Mailbox(budget_bytes=1_000, max_pending=3, max_control_pending=2)
    mb.deliver(_msg("rpc.ret.1", kind="reply"))
    for i in range(3):
        mb.deliver(_msg(f"d.{i}", nbytes=600))  # each evicts the previous one, never the reply
    assert mb.dropped["mailbox_budget"] == 2
    mb.deliver(_msg("rpc.ret.2", kind="reply"))  # data did not use up the control room
    with pytest.raises(ProtocolError, match="mailbox_control_full"):
        mb.deliver(_msg("rpc.ret.3", kind="reply"))  # 2 per peer
    mb.deliver(_msg("rpc.ret.4", kind="reply", src=5))  # another peer has its own cap
    assert mb.get_nowait("rpc.ret.1") is not None
    mb.deliver(_msg("rpc.ret.3", kind="reply"))  # room again


async def test_data_count_cap_rejects_new_data_but_not_control():
    mb = Mailbox(max_pending=2)
    mb.deliver(_msg("a"))
    mb.deliver(_msg("b"))
    with pytest.raises(ProtocolError, match="mailbox_full"):
        mb.deliver(_msg("c"))
    mb.deliver(_msg("rpc.call", kind="rpc"))  # still accepted
    assert mb.pending == 3


async def test_ttl_expires_unclaimed_messages_on_delivery_and_sweep():
    now = [0.0]
    mb = Mailbox(ttl=10.0, clock=lambda: now[0])
    mb.deliver(_msg("old", nbytes=100))
    mb.deliver(_msg("ev", kind="event"))
    now[0] = 5.0
    mb.deliver(_msg("young", nbytes=100))
    now[0] = 10.5
    mb.deliver(_msg("new"))  # sweeps "old" and "ev"
    assert mb.dropped["expired"] == 2 and mb.pending == 2 and mb.bytes_pending == 100
    now[0] = 16.0
    assert mb.sweep() == 1
    assert mb.get_nowait("young") is None and mb.get_nowait("new") is not None


async def test_expire_by_prefix_or_predicate():
    mb = Mailbox()
    for t in ("g.1.a", "g.1.b", "g.2.a", "h"):
        mb.deliver(_msg(t))
    assert mb.expire("g.1.") == 2
    assert mb.expire(lambda t: t == "h") == 1
    assert mb.pending == 1 and mb.dropped["expired"] == 3


async def test_retire_drops_queued_and_future_arrivals_but_not_waited_ones():
    mb = Mailbox(max_retired=2)
    mb.deliver(_msg("op.7.x", nbytes=10))
    mb.deliver(_msg("op.8.x"))
    assert mb.retire("op.7.") == 1
    mb.deliver(_msg("op.7.y"))  # nobody waits: dropped
    assert mb.pending == 1 and mb.dropped["retired"] == 2
    w = asyncio.create_task(mb.get("op.7.z", timeout=2))  # a waiter still gets its message
    await asyncio.sleep(0)
    mb.deliver(_msg("op.7.z"))
    assert (await w).tag == "op.7.z"
    # exact tags: bounded memory, oldest forgotten
    for i in range(3):
        mb.retire(f"rpc.ret.{i}", exact=True)
    assert not mb.is_retired("rpc.ret.0") and mb.is_retired("rpc.ret.2")
    mb.deliver(_msg("rpc.ret.2", kind="reply"))
    assert mb.get_nowait("rpc.ret.2") is None
    mb.unretire("op.7.")
    mb.deliver(_msg("op.7.q"))
    assert mb.get_nowait("op.7.q") is not None


async def test_timeout_then_late_message_still_queued_and_close():
    mb = Mailbox()
    with pytest.raises(PeerTimeout):
        await mb.get("t", timeout=0.01)
    assert mb.waiting == 0
    mb.deliver(_msg("t"))
    assert (await mb.get("t", timeout=0.1)).tag == "t"
    mb.close(TransportError("closed"))
    assert mb.pending == 0 and mb.bytes_pending == 0


async def test_lazy_indexes_stay_bounded_under_churn():
    mb = Mailbox()
    mb.deliver(_msg("stuck", nbytes=1))  # an old unclaimed message at the head
    for i in range(20_000):
        mb.deliver(_msg(f"c.{i % 7}", nbytes=1))
        assert mb.get_nowait(f"c.{i % 7}") is not None
    assert len(mb._arrivals) < 3000 and mb.pending == 1

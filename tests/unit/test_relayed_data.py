"""Relayed data over the in-memory transport: a data message to a node that is not adjacent
goes hop by hop only when its sender asks; a relay holds what its next hop cannot take yet
within its byte budget and drops (and counts) the rest; relays pass data on unscanned and its
destination blames a NaN on the origin, not on the relay."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import numpy as np
import pytest

from p2psync.errors import NonFinitePiece, PeerFailure, TransportError
from p2psync.topology import ring
from p2psync.transport.memory import MemoryHub, MemoryTransport
from tests.helpers import until

pytestmark = pytest.mark.timeout(30)


@contextlib.asynccontextmanager
async def ring4(**kw: Any) -> AsyncIterator[dict[int, MemoryTransport]]:
    hub = MemoryHub(ring(4))
    eps = {i: hub.endpoint(i, default_timeout=5, **kw) for i in range(4)}
    for e in eps.values():
        await e.start()
    try:
        yield eps
    finally:
        for e in eps.values():
            await e.close()


async def test_data_to_a_node_that_is_not_adjacent_is_relayed_only_when_asked() -> None:
    async with ring4() as eps:
        x = np.arange(10, dtype=np.float32)
        with pytest.raises(TransportError, match="shares no network"):
            await eps[1].send(3, "t", [x])
        await eps[1].send(3, "t", [x], meta={"k": 1}, step=4, relay=True)
        msg = await eps[3].recv("t", timeout=5)
        assert msg.src == 1 and msg.header.hops == 1 and msg.meta == {"k": 1} and msg.header.step == 4
        np.testing.assert_array_equal(msg.arrays[0], x)
        assert eps[0].relayed == 1 and eps[2].relayed == 0  # the lowest-id shortest path
        await eps[1].send(0, "d", [x], relay=True)  # adjacent: a plain direct send
        assert (await eps[0].recv("d", timeout=5)).header.dst is None
        eps[1].mark_dead(0)
        await eps[1].send(3, "t2", [x], relay=True)  # around the dead relay
        assert (await eps[3].recv("t2", timeout=5)).src == 1 and eps[2].relayed == 1
        eps[1].mark_dead(2)
        with pytest.raises(PeerFailure, match="no live path to node 3"):
            await eps[1].send(3, "t3", [x], relay=True)
        eps[1].mark_dead(3)
        with pytest.raises(PeerFailure, match="node 3 has failed"):
            await eps[1].send(3, "t4", [x], relay=True)


async def test_a_relay_holds_what_it_cannot_pass_on_within_its_budget_and_drops_the_rest() -> None:
    async with ring4(relay_budget_bytes=1500) as eps:
        relay = eps[0]
        win = relay.window(3)
        held = win.try_acquire(win.capacity)  # the link to node 3 is busy: nothing goes at once
        assert held is not None
        x = np.ones(250, np.float32)  # 1000 payload bytes
        await eps[1].send(3, "a", [x], relay=True)
        await eps[1].send(3, "b", [x], relay=True)  # would be 2000 held: over the budget
        await until(lambda: relay.rejected["relay_budget"] == 1, 5, "the relay to drop what is over its budget")
        assert relay.rejected["relay_budget"] == 1 and relay.relaying.held > 1000
        win.release(held)
        assert (await eps[3].recv("a", timeout=5)).arrays[0].sum() == 250
        assert eps[3].recv_nowait("b") is None
        await until(lambda: relay.relaying.held == 0, 5, "the relay to let go of what it passed on")
        assert relay.relaying.held == 0 and relay.relayed == 1


async def test_a_nan_relayed_is_blamed_on_its_origin_at_its_destination() -> None:
    async with ring4() as eps:
        bad = np.array([1.0, np.nan], np.float32)
        waiter = asyncio.ensure_future(eps[3].recv("n", timeout=5))
        await asyncio.sleep(0)  # waiting before the piece arrives (the in-memory relay is instant)
        await eps[1].send(3, "n", [bad], relay=True, checked=True)  # (checked: skip the own-NaN guard)
        with pytest.raises(NonFinitePiece) as info:
            await waiter
        assert info.value.peers == (1,)
        assert dict(eps[3].offences) == {1: 1} and not eps[0].offences and eps[0].relayed == 1


async def test_preduce_final_average_over_members_joined_through_other_nodes() -> None:
    """P-Reduce's final average over the view {1, 3} of ring-4 (nodes 0 and 2 up, not
    members): exact, through the relays, both members ending with the same state."""
    from p2psync.coordinator import View
    from p2psync.strategies.failure import Reform
    from tests.helpers import memory_strategies

    async with memory_strategies(ring(4), "preduce", {}) as strats:
        pair = [strats[1], strats[3]]
        before = [await s.ctx.replica.export_state() for s in pair]
        for s in pair:
            s.ctx.membership.views.apply(View(epoch=1, members=(1, 3)))
            s.final.failure = s.failure = Reform(s.ctx)  # (re-forming over views: no rendezvous in this test)
            s.on_view(s.ctx.view)
        await asyncio.gather(*(s._final_average() for s in pair))
        after = [await s.ctx.replica.export_state() for s in pair]
        assert strats[0].ctx.transport.relayed + strats[2].ctx.transport.relayed > 0
    assert after[0].tobytes() == after[1].tobytes()
    np.testing.assert_allclose(after[0], np.mean(before, axis=0), rtol=1e-6, atol=1e-6)


async def test_an_operation_whose_relays_die_meanwhile_says_the_group_is_cut_apart() -> None:
    """Node 1 waits for node 3's pieces (which never come) while both relays are declared dead:
    the operation's failure names the cut, not just the silent peer."""
    from p2psync.errors import GroupCutOff
    from tests.helpers import memory_collectives

    async with memory_collectives(ring(4), timeout=0.5) as cs:
        op = asyncio.ensure_future(cs[1].allreduce(np.ones(8, np.float32), [1, 3], tag="x"))
        await until(lambda: cs[1].transport.mailbox.waiting > 0, 5, "node 1 to wait for node 3's pieces")
        cs[1].transport.mark_dead(0)
        cs[1].transport.mark_dead(2)
        with pytest.raises(GroupCutOff, match="any one of dead nodes \\[0, 2\\]") as info:
            await op
        assert isinstance(info.value.__cause__, PeerFailure)

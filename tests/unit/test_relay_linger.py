"""Which nodes linger after the finish barrier (those that relay for others), and for how long:
until the nodes behind them are gone (``Transport.wait_gone``), at most RELAY_LINGER_S."""

from __future__ import annotations

import asyncio
import time

from p2psync.api.runtime import relay_wanted, relayed_neighbours, reply_relays
from p2psync.coordinator.views import View
from p2psync.topology import bcube, mesh, ring, star
from p2psync.transport import MemoryHub
from tests.helpers import free_port, until, zmq_cluster


def test_relay_nodes_linger_after_the_finish_barrier():
    assert [bool(relayed_neighbours(ring(4), i)) for i in range(4)] == [False, True, False, True]
    assert [relayed_neighbours(ring(4), i) for i in range(4)] == [[], [2], [], [2]]
    # on ring(6) node 3 is the farthest: nobody waits for its neighbours' sake, and 2 and 4 wait
    # for it (never two nodes for each other)
    assert [relayed_neighbours(ring(6), i) for i in range(6)] == [[], [2], [3], [], [3], [4]]
    assert relayed_neighbours(ring(4), 1, coordinator=2) == [0]  # after a takeover
    # node 1 of ring(6) failed: the coordinator reaches 2 only the long way round (5, 4, 3), so 3
    # relays for 2 (it used to leave as soon as it had its reply, and 2 then heard nothing from
    # the coordinator, declared it failed and took over alone)
    assert [relayed_neighbours(ring(6), i, gone={1}) for i in (0, 2, 3, 4, 5)] == [[], [], [2], [3], [4]]
    for topo in (ring(7), bcube(3, 2), bcube(2, 3)):
        waits = {(a, b) for a in topo.ids for b in relayed_neighbours(topo, a)}
        assert not any((b, a) in waits for a, b in waits), topo.kind
    assert not any(relayed_neighbours(mesh(4), i) for i in range(4))
    assert not any(relayed_neighbours(star(5), i) for i in range(5))


def test_departed_nodes_still_wait_for_their_finish_reply_and_are_relayed_for():
    """Ring-4, nodes 0 (the coordinator) and 2 ended their loops first and departed; 1 and 3
    train on through them. At the end node 2, opposite the coordinator, gets its finish reply
    through 1 or 3: both must stay until it is gone. They did not (a departed node was counted
    gone, like a failed one), and under load 1 and 3 closed before relaying the reply: node 2
    waited out its barrier's timeout (30 s) and took over as coordinator of nobody."""
    view = View(epoch=6, members=(1, 3), coordinator=0, departed=(0, 2))
    assert [reply_relays(ring(4), i, view, 0) for i in range(4)] == [[], [2], [], [2]]
    failed = View(epoch=6, members=(0, 1, 3), coordinator=0)  # node 2 failed: nobody waits for it
    assert [reply_relays(ring(4), i, failed, 0) for i in range(4)] == [[], [], [], []]
    assert reply_relays(ring(4), 1, None, 0) == [2]


async def test_wait_gone_ends_when_the_nodes_behind_are_gone_or_at_its_limit():
    async with zmq_cluster(ring(4, base_port=free_port())) as eps:
        await until(lambda: 2 not in eps[1].down and 2 not in eps[1].control_down, 10, "node 1 connected to 2")
        t0 = time.monotonic()
        assert not await eps[1].wait_gone([2], 0.1)  # node 2 is alive: the whole limit
        assert 0.1 <= time.monotonic() - t0 < 2.0
        closing = asyncio.create_task(eps[2].close())  # node 2 leaves
        t0 = time.monotonic()
        assert await eps[1].wait_gone([2], 5.0)
        assert time.monotonic() - t0 < 2.0  # not the limit
        await closing
        assert await eps[1].wait_gone([2], 0.0)  # already gone: no wait at all
        assert not await eps[1].wait_gone([2, 0], 0.1)  # node 0 is still there


async def test_wait_gone_on_the_in_memory_medium_sees_a_peer_leave() -> None:
    """The same contract without ZeroMQ (what the simulator's nodes linger on): a peer is gone
    once its transport closed (it left the medium), and the close wakes the wait."""
    hub = MemoryHub(ring(4))
    eps = {i: hub.endpoint(i) for i in range(4)}
    for ep in eps.values():
        await ep.start()
    try:
        assert not eps[1].gone(2) and not eps[1].half_down(2)
        assert not await eps[1].wait_gone([2], 0.05)
        waiting = asyncio.create_task(eps[1].wait_gone([2], 5.0))
        await asyncio.sleep(0)
        t0 = time.monotonic()
        await eps[2].close()
        assert await waiting and time.monotonic() - t0 < 1.0 and eps[1].gone(2) and eps[1].half_down(2)
        assert not await eps[1].wait_gone([2, 0], 0.05)  # node 0 is still there
    finally:
        for ep in eps.values():
            await ep.close()


async def test_a_node_leaving_the_medium_wakes_only_the_waits_for_it() -> None:
    """At a run's end every node of a large simulation lingers for the nodes behind it: each
    leave woke every lingering wait (a thousand nodes: half a million wake-ups); it wakes
    those that wait for the node that left."""
    hub = MemoryHub(ring(6))
    eps = {i: hub.endpoint(i) for i in range(6)}
    for ep in eps.values():
        await ep.start()
    woken = {i: 0 for i in eps}
    for i, ep in eps.items():
        def count(i: int = i, ep=ep, wake=ep._peers_changed) -> None:
            woken[i] += 1
            wake()
        ep._peers_changed = count  # type: ignore[method-assign]
    try:
        waits = [asyncio.create_task(eps[1].wait_gone([2], 5.0)), asyncio.create_task(eps[4].wait_gone([3], 5.0))]
        await asyncio.sleep(0)
        assert eps[1].watches_gone(2) and not eps[1].watches_gone(3)
        await eps[5].close()
        await eps[2].close()
        assert await waits[0] and not waits[1].done()
        assert woken[1] == 1 and woken[4] == 0 and not eps[1].watches_gone(2)
        await eps[3].close()
        assert await waits[1] and woken[4] == 1
    finally:
        for ep in eps.values():
            await ep.close()


def test_a_departed_node_stays_while_the_members_left_pass_tensors_through_it():
    """Ring-4 whose members 1 and 3 train on after 0 and 2 departed: both 0 and 2 lie on a
    shortest path between them, so each stays (in the finish barrier) while they train; with
    node 2 dead, node 0 is the only way. A group its own links join needs nobody."""
    assert relay_wanted(ring(4), 0, [1, 3]) and relay_wanted(ring(4), 2, [1, 3])
    assert relay_wanted(ring(4), 0, [1, 3], dead={2})
    assert not relay_wanted(ring(4), 0, [1, 2, 3])  # 1-2-3: their own links
    assert not relay_wanted(ring(4), 0, [1]) and not relay_wanted(ring(4), 0, [])
    assert relay_wanted(ring(6), 0, [1, 3, 5]) and not relay_wanted(ring(6), 0, [1, 2, 3, 4, 5])
    assert not relay_wanted(ring(8), 0, [2, 5])  # not on a shortest path between them (2-3-4-5)
    assert relay_wanted(star(5), 0, [2, 4]) and not relay_wanted(mesh(4), 0, [1, 3])
    assert relay_wanted(bcube(3, 2), 1, [0, 4]) and not relay_wanted(bcube(3, 2), 2, [0, 4])

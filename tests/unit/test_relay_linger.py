"""Which nodes linger after the finish barrier (those that relay for others), and for how long:
until the nodes behind them are gone, at most RELAY_LINGER_S."""

from __future__ import annotations

import asyncio
import time

from p2psync.api.runtime import linger, relayed_neighbours, relays_for_others
from p2psync.topology import bcube, mesh, ring, star


def test_relay_nodes_linger_after_the_finish_barrier():
    assert [relays_for_others(ring(4), i) for i in range(4)] == [False, True, False, True]
    assert [relayed_neighbours(ring(4), i) for i in range(4)] == [[], [2], [], [2]]
    # on ring(6) node 3 is the farthest: nobody waits for its neighbours' sake, and 2 and 4 wait
    # for it (never two nodes for each other)
    assert [relayed_neighbours(ring(6), i) for i in range(6)] == [[], [2], [3], [], [3], [4]]
    assert relayed_neighbours(ring(4), 1, coordinator=2) == [0]  # after a takeover
    for topo in (ring(7), bcube(3, 2), bcube(2, 3)):
        waits = {(a, b) for a in topo.ids for b in relayed_neighbours(topo, a)}
        assert not any((b, a) in waits for a, b in waits), topo.kind
    assert not any(relays_for_others(mesh(4), i) for i in range(4))
    assert not any(relays_for_others(star(5), i) for i in range(5))


async def test_linger_ends_when_the_nodes_behind_are_gone_or_at_its_limit():
    down: set[int] = set()
    asyncio.get_running_loop().call_later(0.05, down.add, 2)
    t0 = time.monotonic()
    assert await linger(lambda: down.issuperset([2]), 5.0)
    assert time.monotonic() - t0 < 2.0  # not the limit
    t0 = time.monotonic()
    assert not await linger(lambda: down.issuperset([2, 4]), 0.1)
    assert 0.1 <= time.monotonic() - t0 < 2.0
    assert await linger(lambda: True, 0.0)  # already gone: no wait at all

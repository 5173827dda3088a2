"""The end of a run, with processes that come back as it ends: the finish barrier does not wait
for a process whose strategy is still joining the training (it departs and ends with RunEnded),
waits for one that joined it, and a process that asks to rejoin once the members agreed to stop
is refused with RunEnded (nothing is left to join). The scenarios only wait, so they run in
virtual time over the simulator's medium (the same nodes, only the endpoints differ); the first
runs over real ZeroMQ on loopback too."""

from __future__ import annotations

import asyncio

import pytest

from p2psync import clock
from p2psync.errors import RunEnded
from p2psync.topology import Topology, ring
from tests.helpers import MEDIA, HostNode, free_port, full_views, medium_for, member_cluster, run_on, until, virtual

pytestmark = pytest.mark.timeout(90)


Node = HostNode


async def _rejoined(topo: Topology, nodes: dict[int, Node]) -> Node:
    """Node 3 dies, is declared failed, and a new process of it registers again (a join)."""
    await until(lambda: full_views(nodes), 10, "full views")
    await nodes[3].close()
    svc = nodes[0].host.service
    assert svc is not None
    await until(lambda: 3 in svc.state.failed, 10, "node 3 declared failed")
    joiner = Node(topo, 3, medium=nodes[3].medium)
    await joiner.start()
    info = await joiner.client.register("fp", timeout=20)
    joiner.client.start()
    assert info["joined"] and joiner.client.joining
    return joiner


async def _barrier_ends_a_joiner(medium: str) -> None:
    topo = ring(4, base_port=free_port())
    where = medium_for(medium, topo)
    async with member_cluster(topo, lambda i: Node(topo, i, medium=where)) as nodes:
        joiner = await _rejoined(topo, nodes)
        late = None
        try:
            # the members agree to stop; the joiner's strategy never joins the training
            t0 = clock.now()
            calls = [nodes[i].client.finish({"node": i}, timeout=20) for i in (0, 1, 2)]
            reps = await asyncio.wait_for(asyncio.gather(*calls), 15)
            took = clock.now() - t0
            assert all(r == {"finished": [0, 1, 2], "failed": [], "ended": [3]} for r in reps), reps
            assert took < 10, took  # a failure timeout and two heartbeats, not the barrier's 20 s
            await until(lambda: joiner.client.fenced is not None, 5, "the joiner to learn that the run ended")
            assert isinstance(joiner.client.fenced, RunEnded) and not joiner.client.fenced.rejoin
            await joiner.close()
            late = Node(topo, 3, medium=where)  # yet another process of node 3: refused at once
            await late.start()
            t0 = clock.now()
            with pytest.raises(RunEnded, match="run is ending"):
                await late.client.register("fp", timeout=20)
            assert clock.now() - t0 < 5
        finally:
            await joiner.close()
            if late is not None:
                await late.close()


@pytest.mark.parametrize("medium", MEDIA)
def test_the_barrier_ends_a_joiner_still_joining_and_refuses_a_later_one(medium: str):
    run_on(medium, _barrier_ends_a_joiner(medium))


def test_the_barrier_waits_for_a_joiner_that_joined_the_training():
    virtual(_barrier_waits_for_a_joiner())


async def _barrier_waits_for_a_joiner() -> None:
    topo = ring(4, base_port=free_port())
    where = medium_for("virtual", topo)
    async with member_cluster(topo, lambda i: Node(topo, i, medium=where)) as nodes:
        joiner = await _rejoined(topo, nodes)
        try:
            joiner.client.joined_training()  # its strategy started: it takes part in the stop
            calls = [asyncio.ensure_future(nodes[i].client.finish({"node": i}, timeout=20)) for i in (0, 1, 2)]
            await asyncio.sleep(5.0)  # observation: more than the grace (3 s) passes
            assert not any(c.done() for c in calls)  # still waiting for node 3
            rep = await joiner.client.finish({"node": 3}, timeout=20)
            assert rep == {"finished": [0, 1, 2, 3], "failed": []}
            assert all(r == rep for r in await asyncio.wait_for(asyncio.gather(*calls), 10))
            assert joiner.client.fenced is None
        finally:
            await joiner.close()

"""Partitions of a 4-node ring's membership, healed: each node's endpoint sends nothing over a
cut link (a send there is never ready, as on a link that is down), and everything again after
the heal. The scenarios only wait, so they run in virtual time over the simulator's medium (the
same nodes, only the endpoints differ); the lone node's runs over real ZeroMQ on loopback too.
(The same over real processes in network namespaces: tests/e2e/test_partitions.py.)

* 3|1: the majority declares the lone node failed; after the heal the lone node, which deposed
  every coordinator it could not hear and ran for coordinator alone, still learns that it was
  removed (it is fenced), and the majority keeps its coordinator.
* 2|2: neither half holds a majority, nobody is declared failed; after the heal the four nodes
  follow one coordinator again, every one in its view, with a majority, and nobody is fenced.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

import pytest

from p2psync import clock

from p2psync.topology import ring
from p2psync.transport.base import NotReady
from tests.helpers import MEDIA, free_port, run_on, until, virtual
from tests.integration.test_failover_zmq import Node, cluster

pytestmark = pytest.mark.timeout(120)


def cut(nodes: dict[int, Node], pairs: Iterable[tuple[int, int]]) -> set[tuple[int, int]]:
    """Stop everything crossing the links ``pairs`` (both ways); returns the set of cut
    (from, to) pairs, which :func:`heal` empties."""
    blocked: set[tuple[int, int]] = set()
    for a, b in pairs:
        blocked |= {(a, b), (b, a)}
    for i, n in nodes.items():
        orig = n.ep._transmit

        def transmit(peer: int, *args: Any, _i: int = i, _orig: Any = orig, **kw: Any) -> Any:
            if (_i, peer) in blocked:
                raise NotReady
            return _orig(peer, *args, **kw)
        n.ep._transmit = transmit  # type: ignore[method-assign]
    return blocked


def _one_coordinator(nodes: dict[int, Node], ids: Iterable[int], members: tuple[int, ...]) -> bool:
    ids = list(ids)
    coords = {nodes[i].client.coordinator for i in ids}
    if len(coords) != 1:
        return False
    (c,) = coords
    return nodes[c].host.coordinating and all(
        nodes[i].client.has_quorum and nodes[i].client.view is not None
        and nodes[i].client.view.members == members and nodes[i].client.fenced is None for i in ids)


async def _lone_node_learns(medium: str) -> None:
    topo = ring(4, base_port=free_port())
    async with cluster(topo, medium=medium) as nodes:
        blocked = cut(nodes, [(2, 3), (3, 0)])
        await until(lambda: _one_coordinator(nodes, (0, 1, 2), (0, 1, 2)), 15,
                    "the majority to remove node 3 and go on")
        await until(lambda: len(nodes[3].host._election) > 0 and not nodes[3].client.has_quorum, 15,
                    "node 3 to run for coordinator alone")
        await asyncio.sleep(1.0)
        blocked.clear()  # heal
        healed = clock.now()
        await until(lambda: nodes[3].client.fenced is not None, 15, "node 3 to learn that it was removed")
        if medium == "virtual":
            # its probe applies each view as it comes: node 1, which it marked dead and no live
            # path reaches, never answers, and held the others' answers back a probe's timeout
            assert clock.now() - healed < 2.5
        assert nodes[3].host.service is None
        await until(lambda: _one_coordinator(nodes, (0, 1, 2), (0, 1, 2)), 10, "the majority to go on")
        assert nodes[0].client.coordinator == 0


@pytest.mark.parametrize("medium", MEDIA)
def test_a_lone_node_learns_after_the_heal_that_it_was_removed(medium: str):
    run_on(medium, _lone_node_learns(medium))


def test_two_halves_merge_after_the_heal_under_one_coordinator():
    virtual(_two_halves_merge())


async def _two_halves_merge() -> None:
    topo = ring(4, base_port=free_port())
    async with cluster(topo, medium="virtual") as nodes:
        blocked = cut(nodes, [(1, 2), (3, 0)])
        await until(lambda: not any(n.client.has_quorum for n in nodes.values()), 15,
                    "both halves to lose the majority")
        await until(lambda: any(len(nodes[i].host._election) > 0 for i in (2, 3)), 15,
                    "node 2 or 3 to depose nodes 0 and 1 and run for coordinator")
        assert all(n.client.fenced is None for n in nodes.values())
        svc = nodes[0].host.service
        assert svc is not None and svc.state.failed == set()  # no majority: nobody declared
        blocked.clear()  # heal
        await until(lambda: _one_coordinator(nodes, range(4), (0, 1, 2, 3)), 20,
                    "the four nodes to follow one coordinator with a majority")
        assert all(n.client.fenced is None for n in nodes.values())


def test_coordinator_calls_wait_for_a_majority_and_a_fenced_answer_fences():
    """Regression (bench/faults.py, esync split-3-1 and split-2-2): a node cut off from the
    majority kept calling the coordinator's services within its step and failed (UnknownMethod
    from the candidate it followed, or PeerTimeout), exit 1, instead of waiting for the
    majority. Now :meth:`call_coordinator` waits (NoQuorum after the quorum timeout), and a
    service's 'Fenced' answer fences the node."""
    virtual(_coordinator_calls_wait())


async def _coordinator_calls_wait() -> None:
    from p2psync.errors import Fenced, NoQuorum, RemoteError

    topo = ring(4, base_port=free_port())
    async with cluster(topo, medium="virtual") as nodes:
        calls: list[int] = []

        async def echo(caller: int, args: Any, arrays: Any) -> Any:
            calls.append(caller)
            if args.get("fence"):
                raise RemoteError("Fenced", f"device {caller} was removed from the run")
            return {"ok": caller}

        for n in nodes.values():
            n.server.register("svc.echo", echo)
        lone = nodes[3].client
        assert await lone.call_coordinator("svc.echo", {}, timeout=5) == {"ok": 3}
        blocked = cut(nodes, [(2, 3), (3, 0)])
        await until(lambda: not lone.has_quorum, 15, "node 3 to lose the majority")
        lone.quorum_timeout = 1.0
        with pytest.raises(NoQuorum):  # not UnknownMethod / PeerTimeout: it waited, then gave up
            await lone.call_coordinator("svc.echo", {}, timeout=5)
        lone.quorum_timeout = 60.0
        call = asyncio.ensure_future(nodes[1].client.call_coordinator("svc.echo", {}, timeout=5))
        assert await asyncio.wait_for(call, 10) == {"ok": 1}  # the majority is served meanwhile
        blocked.clear()
        n_calls = len(calls)
        with pytest.raises(Fenced):
            await nodes[1].client.call_coordinator("svc.echo", {"fence": True}, timeout=5)
        assert nodes[1].client.fenced is not None and len(calls) == n_calls + 1


def test_a_node_that_leaves_while_cut_off_ends_its_finish_barrier_without_running_for_coordinator():
    """A node whose loop ended first asks to leave (finish with ``depart``) and then hears
    nobody (its links drop: under load, or a partition). It is no member any more: it neither
    runs for coordinator nor waits for a majority, and its finish barrier ends within its bound
    instead of after the quorum timeout (before, it deposed every coordinator, campaigned alone
    and hung its training thread)."""
    virtual(_leaves_while_cut_off())


async def _leaves_while_cut_off() -> None:
    topo = ring(4, base_port=free_port())
    async with cluster(topo, medium="virtual") as nodes:
        cut(nodes, [(2, 1), (2, 3)])
        t0 = asyncio.get_running_loop().time()
        rep = await asyncio.wait_for(nodes[2].client.finish({"steps": 1}, timeout=2.0, depart=True), 30)
        assert rep == {}  # the barrier failed: nobody to wait for
        assert asyncio.get_running_loop().time() - t0 < 20
        assert nodes[2].client.left and not nodes[2].host.coordinating
        await asyncio.sleep(3.0)  # the detector has deposed everyone it cannot hear by now
        assert not nodes[2].host.coordinating and not len(nodes[2].host._election)

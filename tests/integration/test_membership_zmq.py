"""Membership: WAN latency, dead relays, run ids, incarnations, a stalled process. The scenarios
that only wait run in virtual time over the simulator's medium (the same nodes, only the
endpoints differ); one dead-relay scenario runs over real ZeroMQ on loopback too (the WAN soak
with ``pytest --slow``), and the run-id and incarnation checks run over real ZeroMQ only."""

from __future__ import annotations

import asyncio
from typing import AsyncContextManager

import numpy as np
import pytest

from p2psync import clock
from p2psync.coordinator import MembershipService, RpcClient, RpcServer
from p2psync.sim.loop import VirtualLoop
from p2psync.topology import Topology, mesh, ring, topology_from_dict, topology_to_dict
from p2psync.transport.shaping import ShaperName, make_shaper
from tests.helpers import (MEDIA, Medium, MemberNode, VirtualMedium, free_port, full_views, medium_for,
                           member_cluster, run_on, until, virtual, zmq_cluster)

pytestmark = pytest.mark.timeout(90)


class Node(MemberNode):
    """A member; the coordinator hosts the membership service."""

    def __init__(self, topo: Topology, i: int, *, shaper: ShaperName = "none", run_id: int = 0,
                 failure_timeout: float = 2.0, medium: Medium | None = None) -> None:
        super().__init__(topo, i, shaper=make_shaper(shaper, topo, i), medium=medium)
        self.ep.run_id = run_id
        self.service = (MembershipService(server=self.server, expected=topo.ids, start_timeout=20,
                                          failure_timeout=failure_timeout)
                        if i == topo.coordinator else None)

    def start_hosted(self) -> None:
        if self.service is not None:
            self.service.start()

    async def close_hosted(self) -> None:
        if self.service is not None:
            await self.service.close()


def cluster(topo: Topology, *, medium: str, shaper: ShaperName = "none", run_id: int = 0,
            failure_timeout: float = 2.0) -> AsyncContextManager[dict[int, Node]]:
    """Every node started and registered over ``medium`` (:data:`~tests.helpers.MEDIA`; ``shaper``,
    ``run_id``: every node's; ``failure_timeout``: the membership service's, on the coordinator)."""
    where = medium_for(medium, topo)
    return member_cluster(topo, lambda i: Node(topo, i, shaper=shaper, run_id=run_id,
                                               failure_timeout=failure_timeout, medium=where))


async def _until(pred, timeout: float, what: str) -> float:
    t0 = clock.now()
    while not pred():
        if clock.now() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
    return clock.now() - t0


async def _latency_no_false_failure(seconds: float, medium: str) -> None:
    d = topology_to_dict(mesh(2, base_port=free_port()))
    d["links"] = [{"a": 0, "b": 1, "latency_ms": 600}]
    topo = topology_from_dict(d)
    async with cluster(topo, medium=medium, shaper="inproc") as nodes:
        t0 = clock.now()
        t = clock.now()
        await nodes[1].rpc.call(0, "membership.heartbeat", timeout=5)
        rpc_latency = clock.now() - t
        await asyncio.sleep(seconds)  # observation period: nothing may be declared failed
        for n in nodes.values():
            assert n.client.failed == set() and not n.client.coordinator_suspected
            assert n.client.view is not None and n.client.view.members == (0, 1)
        assert nodes[0].service is not None and nodes[0].service.state.failed == set()
        est = nodes[1].rpc.estimator(0)
        assert est.srtt is not None and 1.15 < est.srtt < 1.6, est.srtt  # RTT = 2 x 600 ms
        assert 1.15 < rpc_latency < 1.8, rpc_latency
        assert clock.now() - t0 >= seconds


def test_600ms_one_way_latency_no_false_failure():
    """60 s in virtual time: 120 heartbeats, 50 round trips of 1.2 s, 30 failure timeouts (the
    same over real ZeroMQ in real time runs with ``pytest --slow``)."""
    virtual(_latency_no_false_failure(60.0, "virtual"))


@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_600ms_one_way_latency_no_false_failure_60s_zmq():  # the 60 s, in real time
    await _latency_no_false_failure(60.0, "zmq")


async def _ring6_dead_relay(medium: str) -> None:
    topo = ring(6, base_port=free_port())
    async with cluster(topo, medium=medium) as nodes:
        await _until(lambda: full_views(nodes), 10, "full views and RTT estimates")
        # the coordinator's neighbour dies: nodes 2 and 3 reach node 0 through it
        await nodes[1].close()
        survivors = [n for i, n in nodes.items() if i != 1]
        elapsed = await _until(lambda: all(n.client.failed == {1} for n in survivors), 10,
                               "every survivor to declare node 1 failed")
        assert elapsed < 3.0 + 0.5, elapsed  # 3 s + 2 x RTT (loopback) + scheduling slack
        await asyncio.sleep(3.0)  # observation period: nobody else is declared failed
        for n in survivors:
            assert n.client.failed == {1}, (n.ep.node_id, n.client.failed)
            assert n.client.view is not None and n.client.view.members == (0, 2, 3, 4, 5)
            assert 1 in n.ep.dead
        assert nodes[0].service is not None and nodes[0].service.state.failed == {1}
        print(f"ring6 ({medium}): node 1 declared failed by every survivor {elapsed:.2f}s after it died")


@pytest.mark.parametrize("medium", MEDIA)
def test_ring6_dead_relay_only_it_is_declared_failed(medium: str):
    run_on(medium, _ring6_dead_relay(medium))


def test_ring8_nodes_behind_a_dead_relay_keep_hearing_the_coordinator():
    """Node 3 reaches coordinator 0 through node 2 (3 hops against 5), and node 0's replies took
    the same way back. Once node 2 dies, node 3's heartbeats go round the other way, and so
    must their replies: nobody suspects the live coordinator, only node 2 is declared failed.
    The coordinator declares node 2 after 4 s of silence, twice the members' own failure
    timeout: node 3 would suspect the coordinator long before if its replies were lost."""
    async def main() -> None:
        topo = ring(8, base_port=free_port())
        async with cluster(topo, medium="virtual", failure_timeout=4.0) as nodes:
            await _until(lambda: full_views(nodes), 10, "full views and RTT estimates")
            await nodes[2].close()
            survivors = [n for i, n in nodes.items() if i != 2]
            suspected: set[int] = set()

            def settled() -> bool:
                suspected.update(n.ep.node_id for n in survivors
                                 if n.client.coordinator_suspected or n.client.coordinator != 0)
                return all(n.client.failed == {2} for n in survivors)

            elapsed = await _until(settled, 10, "every survivor to declare node 2 failed")
            t0 = clock.now()
            while clock.now() - t0 < 3.0:  # observation period: the coordinator stays followed
                settled()
                await asyncio.sleep(0.02)
            assert suspected == set(), suspected
            for n in survivors:
                assert n.client.failed == {2} and n.client.coordinator == 0, (n.ep.node_id, n.client.failed)
                assert n.client.view is not None and n.client.view.members == (0, 1, 3, 4, 5, 6, 7)
            assert nodes[0].service is not None and nodes[0].service.state.failed == {2}
            print(f"ring8: node 2 declared failed by every survivor {elapsed:.2f}s after it died; nobody "
                  "suspected the coordinator")

    virtual(main())


async def test_traffic_of_another_run_or_older_incarnation_is_rejected(caplog):
    topo = mesh(2, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        eps[1].run_id = 0xBEEF
        eps[0].run_id = 0xDEAD  # a process of a previous run still bound to these ports
        await eps[0].send(1, "old", [np.ones(3)], timeout=5)
        await eps[0].send(1, "old", kind="rpc", meta={"id": 1, "method": "x", "args": {}}, timeout=5)
        eps[0].run_id = 0xBEEF
        await eps[0].send(1, "ok", timeout=5)
        await eps[1].recv("ok", timeout=5)
        # (the rpc came over the control connection, which "ok" does not queue behind)
        await until(lambda: eps[1].rejected["wrong_run"] >= 2, 5, "both messages of the other run rejected")
        assert eps[1].rejected["wrong_run"] == 2
        assert eps[1].recv_nowait("old") is None
        # node 0 re-registered with a newer incarnation: its older life is rejected
        eps[1].peer_incarnations[0] = eps[0].incarnation + 1
        await eps[0].send(1, "stale", timeout=5)
        eps[0].incarnation += 1
        await eps[0].send(1, "new", timeout=5)
        await eps[1].recv("new", timeout=5)
        assert eps[1].rejected["stale_incarnation"] == 1
        assert eps[1].recv_nowait("stale") is None
        assert eps[1].stats()["rejected"] == {"wrong_run": 2, "stale_incarnation": 1}
        # the log says what happened, not just two numbers
        assert (f"node 0's incarnation {eps[0].incarnation - 1} is older than the one this node already knows, "
                f"{eps[0].incarnation}: a message of its previous process, or a restarted process with a "
                "stepped-back clock?") in caplog.text


async def test_relayed_traffic_of_another_run_is_not_forwarded():
    topo = ring(4, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        for e in eps.values():
            e.run_id = 7
        eps[0].run_id = 8
        await eps[0].send(2, "ev", kind="event", timeout=5)  # relayed by 1 or 3
        eps[0].run_id = 7
        await eps[0].send(2, "ev2", kind="event", timeout=5)
        await eps[2].recv("ev2", timeout=5)
        assert eps[1].rejected["wrong_run"] + eps[3].rejected["wrong_run"] == 1
        assert eps[1].relayed + eps[3].relayed == 1
        assert eps[2].recv_nowait("ev") is None


def test_rpc_retried_around_a_dead_relay():
    async def main() -> None:
        medium = VirtualMedium(ring(6))
        eps = {i: medium.endpoint(i, default_timeout=10.0) for i in range(6)}
        server = RpcServer(eps[0])
        try:
            for e in eps.values():
                await e.start()
            calls = []

            async def echo(caller, args, arrays):
                calls.append(caller)
                return args

            server.register("echo", echo)
            server.start()
            client = RpcClient(eps[3])  # two shortest paths: 3-2-1-0 (tried first) and 3-4-5-0
            assert await client.call(0, "echo", {"a": 1}, timeout=5) == {"a": 1}
            await eps[1].close()  # nobody marks it dead: node 2 drops what it cannot forward
            t0 = clock.now()
            assert await client.call(0, "echo", {"a": 2}, timeout=8) == {"a": 2}
            assert clock.now() - t0 < 4.0  # one RTO (3 s before any RTT sample) + the detour
            assert client.retries >= 1 and calls == [3, 3]  # the handler ran once per call
            t0 = clock.now()
            assert await client.call(0, "echo", {"a": 3}, timeout=5) == {"a": 3}
            assert clock.now() - t0 < 0.5  # the working first hop is remembered
        finally:
            await server.close()
            for e in eps.values():
                await e.close()

    virtual(main())


def test_a_stalled_process_declares_nobody_failed():
    """A process whose event loop stalled for longer than the failure timeout (a loaded machine,
    a long synchronous call) must not wake up to stale arrival times and declare its peers, or
    even its own host, failed. Here every node stands still for 3 s at once (> the 2 s floor),
    without CPU, as one process whose loop every node shares would: the silence was the
    process's, not the peers', and nobody may be declared failed."""
    async def main() -> None:
        async with cluster(mesh(3, base_port=free_port()), medium="virtual") as nodes:
            service = nodes[0].service
            assert service is not None

            def sampled() -> bool:  # every detector has measured three heartbeat intervals (2 are seeded)
                dets = [service.state.detector, nodes[1].client.detector, nodes[2].client.detector]
                return all(d.peers and all(len(p.intervals) >= 5 for p in d.peers.values()) for d in dets)

            await until(sampled, 15, "every detector to have samples")
            # every failure declared or coordinator suspected from the stall on, however briefly
            seen: list[tuple[int, str, int]] = []
            for i, n in nodes.items():
                n.client.peers.listeners.append(lambda p, i=i: seen.append((i, "declared", p)))
                n.client.coordinator_listeners.append(lambda c, i=i: seen.append((i, "follows", c)))

            def watch() -> None:
                seen.extend((0, "declared", p) for p in service.state.failed)
                seen.extend((i, "suspects", n.client.coordinator) for i, n in nodes.items()
                            if n.client.coordinator_suspected)

            loop = asyncio.get_running_loop()
            assert isinstance(loop, VirtualLoop)
            for i in nodes:  # the whole process stalls
                loop.hold(i)
            await asyncio.sleep(3.0)
            for i in nodes:
                loop.release(i)
            t0 = clock.now()
            while clock.now() - t0 < 2.0:  # observation period: nobody may be declared failed
                watch()
                await asyncio.sleep(0.02)
            assert seen == [], seen
            assert service.state.failed == set()
            for n in nodes.values():
                assert n.client.failed == set() and not n.client.coordinator_suspected
                assert n.client.view is not None and n.client.view.members == (0, 1, 2)

    virtual(main())

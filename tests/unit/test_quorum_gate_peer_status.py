"""The two parts the membership client is composed of, alone: the quorum gate (a fresh
majority, waits, fencing, self-fencing after a stop) in virtual time, and the peer status
(declare, depart, heard again, readmit) over the in-memory transport."""

from __future__ import annotations

import asyncio

import pytest

from p2psync import clock
from p2psync.coordinator.peer_status import PeerStatus
from p2psync.coordinator.quorum_gate import QuorumGate
from p2psync.coordinator.views import View
from p2psync.errors import Fenced, NoQuorum
from p2psync.sim.loop import run
from p2psync.topology import ring
from p2psync.transport import Transport
from p2psync.transport.memory import MemoryHub


def gate(window: float = 2.5, recheck: float = 0.5, failure_timeout: float = 2.0) -> QuorumGate:
    return QuorumGate(me=3, window=lambda: window, recheck=recheck, failure_timeout=failure_timeout)


def test_a_majority_claim_holds_for_its_window_then_expires() -> None:
    async def main() -> list[bool]:
        g = gate()
        seen = [g.held]
        g.set(True, coordinator=0)
        seen.append(g.held)
        await asyncio.sleep(2.4)
        seen.append(g.held)
        await asyncio.sleep(0.2)
        seen.append(g.held)
        g.set(True, coordinator=0)
        g.set(False, coordinator=0)
        seen.append(g.held)
        return seen

    assert run(main()) == [False, True, True, False, False]


def test_a_wait_ends_on_the_claim_it_waited_for_not_at_the_next_recheck() -> None:
    async def main() -> tuple[float, float]:
        g = gate(recheck=10.0)
        asyncio.get_running_loop().call_later(0.3, lambda: g.set(True, coordinator=0))
        waited = await g.wait(5.0, lambda: "test")
        return waited, clock.now()

    waited, now = run(main())
    assert waited == pytest.approx(0.3) and now == pytest.approx(0.3)


def test_a_wait_times_out_with_no_quorum_naming_what_it_follows() -> None:
    async def main() -> None:
        await gate().wait(1.2, lambda: "it follows coordinator 7")

    with pytest.raises(NoQuorum, match=r"node 3: no majority of the run for 1.2s \(it follows coordinator 7\)"):
        run(main())


def test_fencing_wakes_a_waiter_once_and_calls_the_listeners_once() -> None:
    async def main() -> tuple[list[Fenced], float, Fenced | None]:
        g = gate(recheck=100.0)
        got: list[Fenced] = []
        g.listeners.append(got.append)
        loop = asyncio.get_running_loop()
        loop.call_later(0.5, g.fence, "a newer view does not name it")
        loop.call_later(0.6, g.fence, "again")
        try:
            await g.wait(60.0, lambda: "")
        except Fenced:
            pass
        await asyncio.sleep(1.0)
        g.set(True, coordinator=0)
        assert not g.held  # fenced for good
        return got, clock.now(), g.fenced

    got, _, fenced = run(main())
    assert len(got) == 1 and got[0] is fenced
    assert fenced is not None and fenced.rejoin and "a newer view does not name it" in str(fenced)


def test_an_exclusion_fences_without_rejoining() -> None:
    g = gate()
    g.fence("it sent NaN values", rejoin=False)
    assert g.fenced is not None and not g.fenced.rejoin and "rejoins" not in str(g.fenced)


def test_a_long_stop_without_cpu_fences_only_if_no_majority_is_heard_two_detections_later() -> None:
    g = gate(failure_timeout=2.0, recheck=0.5)
    g.after_stop(stall=5.0, cpu_used=0.01, now=100.0)  # stopped: judged 4.5 s later, not now
    assert g.fenced is None
    g.after_stop(stall=0.0, cpu_used=0.5, now=104.4)
    assert g.fenced is None
    g.after_stop(stall=0.0, cpu_used=0.5, now=104.6)
    assert g.fenced is not None and "stopped for 5.0s" in str(g.fenced)


def test_a_stop_followed_by_a_majority_clears_and_a_busy_stall_is_no_stop() -> None:
    async def main() -> Fenced | None:
        g = gate(failure_timeout=2.0, recheck=0.5)
        g.after_stop(stall=5.0, cpu_used=0.01, now=clock.now())
        await asyncio.sleep(3.0)
        g.set(True, coordinator=0)
        await asyncio.sleep(1.6)
        g.after_stop(stall=0.0, cpu_used=0.5, now=clock.now())  # window over, majority held: cleared
        g.set(False, coordinator=0)
        await asyncio.sleep(10.0)
        g.after_stop(stall=0.0, cpu_used=0.5, now=clock.now())
        g.after_stop(stall=5.0, cpu_used=4.0, now=clock.now())  # the process ran (CPU-bound): no stop
        await asyncio.sleep(10.0)
        g.after_stop(stall=0.0, cpu_used=0.5, now=clock.now())
        return g.fenced

    assert run(main()) is None


def status(node: int = 0) -> tuple[PeerStatus, Transport]:
    ep = MemoryHub(ring(4)).endpoint(node)
    return PeerStatus(ep), ep


def test_declared_peers_are_counted_once_routed_around_and_reported_to_the_listeners() -> None:
    ps, ep = status()
    calls: list[int] = []
    ps.listeners.append(calls.append)
    ps.declare([1, 2, 0, 1], coordinator=2)
    assert ps.failed == {1, 2} and calls == [1, 2]
    assert 1 in ep.dead and 2 not in ep.dead  # the coordinator followed: failover decides
    ps.declare([3], coordinator=2, reborn=[3])
    assert 3 in ps.failed and 3 not in ep.dead  # its new process relays


def test_a_departed_peer_is_reported_once_and_only_routed_around_when_it_fails() -> None:
    ps, ep = status()
    calls: list[int] = []
    ps.listeners.append(calls.append)
    ps.depart([2, 2, 0])
    ps.declare([2], coordinator=1)
    assert calls == [2] and ps.departed == {2} and 2 not in ps.failed and 2 in ep.dead


def test_a_peer_heard_after_it_was_marked_is_routed_through_again_while_a_member() -> None:
    async def main() -> None:
        ps, ep = status()
        ps.declare([1, 3], coordinator=2)
        await asyncio.sleep(1.0)
        ep.last_arrival[1] = clock.now()
        ep.last_arrival[3] = clock.now()
        view = View(epoch=2, members=(0, 1, 2), coordinator=2)  # 3 is no member
        ps.reroute(view)
        assert 1 not in ps.failed and 1 not in ep.dead
        assert 3 in ps.failed and 3 in ep.dead
        assert ps.suspected_members(view) == {1}  # heard again: readmitted by the next view
        ps.readmit(1)
        assert ps.suspected_members(view) == set()
        ps.declare([1], coordinator=2)  # its next failure is declared again
        assert 1 in ps.failed

    run(main())

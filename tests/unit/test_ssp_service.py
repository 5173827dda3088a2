"""The parameter-server scheduler's RPC shell (p2psync.coordinator.ssp_service) over the
in-memory transport: a report asked again is not counted twice, an OK asked again is the same
OK, a count out of order is refused and counted, a restarted worker counts from 1 again, a
fresh service (the coordinator failed over) adopts the counts of first reports."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from p2psync.coordinator import RpcClient
from p2psync.coordinator.ssp import StalenessScheduler
from p2psync.coordinator.ssp_service import SchedulerService
from p2psync.errors import RemoteError

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def service(memory_server):
    """``make(sched)``: a scheduler service on node 0 of a 3-node in-memory ring (every node
    adjacent; held reports answered "wait" after 0.05 s) and ``report(node, count, inc=1)``."""

    async def make(sched: StalenessScheduler):
        eps, server = await memory_server(3)
        svc = SchedulerService(server, [0, 1, 2], sched, name="t", hold=0.05)
        server.start()
        clients = {i: RpcClient(eps[i], local=server if i == 0 else None) for i in eps}

        async def report(node: int, count: int, inc: int = 1) -> dict[str, Any]:
            rep: dict[str, Any] = await clients[node].call(0, "t.pushed", {"count": count, "inc": inc}, timeout=5)
            return rep
        return svc, report

    return make


async def until_ok(report: Any, node: int, count: int, inc: int = 1) -> dict[str, Any]:
    """Poll (each poll bounded by the service's hold) until the answer is not "wait"."""
    for _ in range(200):
        rep = await report(node, count, inc)
        if not rep.get("wait"):
            return rep
    raise AssertionError(f"node {node}: no answer to push {count}")


async def test_reports_asked_again_are_counted_once_and_answered_the_same(service):
    sched = StalenessScheduler(workers=[0, 1, 2], s_lower=0)  # BSP
    svc, report = await service(sched)
    assert await report(1, 1) == {"wait": True}  # held: nobody else pushed
    assert await report(1, 1) == {"wait": True}  # asked again: the same push
    assert sched.counts == {0: 0, 1: 1, 2: 0}
    got = await asyncio.gather(until_ok(report, 1, 1), until_ok(report, 2, 1), until_ok(report, 0, 1))
    assert [g["ok"]["barrier"] for g in got] == [1, 1, 1]  # BSP: every OK is a barrier
    assert await report(1, 1) == got[0]  # an OK asked again is the same OK, not a new push
    assert sched.counts == {0: 1, 1: 1, 2: 1}
    for bad in (3, 0):  # a gap in the counts, a count below 1: refused and counted
        with pytest.raises(RemoteError, match="ProtocolError"):
            await report(1, bad)
    assert svc.rejected == 2 and sched.counts == {0: 1, 1: 1, 2: 1}


async def test_a_restarted_worker_counts_from_one_again_and_keeps_its_hold(service):
    sched = StalenessScheduler(workers=[0, 1, 2], s_lower=2)
    svc, report = await service(sched)
    assert "ok" in await report(1, 1)  # gap 1 <= s
    assert "ok" in await report(1, 1, inc=2)  # restarted: push 1 of the new incarnation is a push
    assert sched.counts[1] == 2
    with pytest.raises(RemoteError, match="ProtocolError"):
        await report(1, 3, inc=2)
    assert await report(1, 2, inc=2) == {"wait": True}  # gap 3: held
    assert sched.counts[1] == 3 and sched.waiting == [1]
    # restarted again while held: its first report waits for the OK it never got (not a push)
    assert await report(1, 1, inc=3) == {"wait": True}
    assert sched.counts[1] == 3
    for c in (1, 2):
        others = await asyncio.gather(until_ok(report, 0, c), until_ok(report, 2, c))
        assert all("ok" in o for o in others)
    ok = await until_ok(report, 1, 1, inc=3)
    assert ok["ok"]["count"] == 3 and await report(1, 1, inc=3) == ok  # the same OK when asked again
    assert "ok" in await report(1, 2, inc=3) and sched.counts[1] == 4  # and it goes on from there
    assert svc.rejected == 1


async def test_fresh_service_adopts_a_first_report_above_one(service):
    """The regression: a scheduler service started on the new coordinator took a worker's
    first report, count 7, as a gap in the counts (ProtocolError) and the run could not go on.
    Now it is adopted; a count that then goes backwards or skips is still refused."""
    sched = StalenessScheduler(workers=[0, 1, 2], s_lower=3)
    svc, report = await service(sched)
    assert await report(1, 7) == {"wait": True}  # adopted; held: 0 and 2 not heard from (count 0)
    assert await report(2, 5) == {"wait": True} and svc.rejected == 0
    assert sched.counts == {0: 0, 1: 7, 2: 5}
    got = await asyncio.gather(until_ok(report, 0, 6), until_ok(report, 1, 7), until_ok(report, 2, 5))
    assert [(g["ok"]["count"], g["ok"]["gap"]) for g in got] == [(6, 1), (7, 2), (5, 0)]
    for bad in (6, 9):  # backwards, skipping: refused and counted
        with pytest.raises(RemoteError, match="ProtocolError"):
            await report(1, bad)
    assert svc.rejected == 2 and sched.counts == {0: 6, 1: 7, 2: 5}


async def test_a_joiner_counts_on_from_the_count_it_joined_at(service):
    """A new process of a worker the view removed joins at the slowest member's count (the
    scheduler admits it there from the view); its first report, that count plus one, is one
    push, and it goes on from there (a scheduler rebuilt later adopts a count in line with the
    others', not one restarted from 1)."""
    sched = StalenessScheduler(workers=[0, 1, 2], s_lower=2)
    svc, report = await service(sched)
    for c in (1, 2, 3):
        for w in (0, 1, 2):
            assert "ok" in await until_ok(report, w, c)
    sched.set_workers([0, 1], 0.0)  # node 2 failed
    for c in (4, 5):
        for w in (0, 1):
            assert "ok" in await until_ok(report, w, c)
    sched.set_workers([0, 1, 2], 0.0)  # its new process joined: at the slowest count, 5
    assert sched.counts == {0: 5, 1: 5, 2: 5}
    assert "ok" in await report(2, 6, inc=2)  # its first report: one push
    assert sched.counts[2] == 6 and "ok" in await report(2, 7, inc=2) and sched.counts[2] == 7
    with pytest.raises(RemoteError, match="ProtocolError"):
        await report(2, 9, inc=2)
    assert svc.rejected == 1


async def test_a_joiner_at_a_fresh_service_counts_on_from_its_first_report(service):
    """The coordinator failed over while node 2 was out: the new service never heard of node
    2's processes; the views dropped it, then admitted its new process at the slowest count;
    its first report (that count plus one) is one push there too, not a gap."""
    sched = StalenessScheduler(workers=[0, 1, 2], s_lower=2)
    svc, report = await service(sched)
    sched.set_workers([0, 1], 0.0)
    held = asyncio.ensure_future(until_ok(report, 0, 7))  # adopted (a fresh scheduler), held by 1
    assert "ok" in await report(1, 8) and "ok" in await held
    sched.set_workers([0, 1, 2], 0.0)
    assert sched.counts[2] == 7 and 2 not in sched.unheard
    assert "ok" in await report(2, 8, inc=5) and sched.counts[2] == 8 and svc.rejected == 0

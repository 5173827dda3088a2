"""Coordinator failover decisions (issue 10 item 6), pure: successor choice, cascading takeover,
stale views of a deposed coordinator, the rebuilt membership state, the View's coordinator
field, and ESync's State Server rebuilt with empty records."""

from __future__ import annotations

import math
from typing import Any

import pytest

from p2psync.coordinator import MembershipState
from p2psync.coordinator.failover import rebuild_state
from p2psync.coordinator.state_server import StateServer
from p2psync.coordinator.takeover import Succession, probe_next, probe_until, silent_ahead, successor
from p2psync.coordinator.views import View
from p2psync.errors import ProtocolError


def _view(epoch: int, members: tuple[int, ...], coordinator: int) -> View:
    return View(epoch=epoch, members=members, incarnations={m: 100 + m for m in members},
                coordinator=coordinator)


def test_successor_is_the_lowest_member_not_deposed():
    assert successor([3, 1, 2, 0], {0}) == 1
    assert successor([3, 1, 2, 0], {0, 1}) == 2
    assert successor([0], {0}) is None
    assert successor([], ()) is None


def test_suspecting_the_coordinator_follows_the_successor_and_cascades():
    v = _view(5, (0, 1, 2, 3), 0)
    s = Succession(me=3, coordinator=0)
    assert s.suspect(2, v) is None and s.coordinator == 0  # not the coordinator: deposed only
    assert 2 in s.deposed
    assert s.suspect(0, v) == 1 and s.coordinator == 1
    assert s.suspect(0, v) is None  # once
    # the successor is dead too: the next lowest live one (2 was deposed above: 3 itself)
    assert s.suspect(1, v) == 3 and s.coordinator == 3
    s2 = Succession(me=3, coordinator=0)
    assert s2.suspect(0, v) == 1 and s2.suspect(1, v) == 2
    assert s2.suspect(3, v) is None  # never itself
    # without a view (before rendezvous) the fallback members decide
    s3 = Succession(me=2, coordinator=0)
    assert s3.suspect(0, None, [0, 1, 2]) == 1


def test_contacted_successor_takes_over_others_do_not():
    v = _view(5, (0, 1, 2, 3), 0)
    one = Succession(me=1, coordinator=0)
    assert one.contacted([0], v)
    assert one.take_over([0]) == [0] and one.coordinator == 1 and one.deposed == {0}
    assert not one.contacted([0], v)  # already coordinating
    two = Succession(me=2, coordinator=0)
    assert not two.contacted([0], v)  # 1 is the successor
    assert not two.contacted([5], v)  # not the coordinator it follows
    assert two.contacted([0, 1], v)  # cascade: 0 and 1 deposed by the caller
    assert not Succession(me=2, coordinator=1).contacted([0, 2], v)  # the caller deposed this node


def test_a_deposition_in_a_lower_term_does_not_count_against_a_coordinator_elected_since():
    # node 2 won term 1 (view epoch 18); node 15, cut off meanwhile with the view of term 0, passed
    # over 0 and 2..9 and contacts node 10: node 10 hears of the election and does not take over
    elected = View(epoch=18, members=tuple(range(2, 16)), incarnations={m: 100 + m for m in range(2, 16)},
                   coordinator=2, term=1)
    ten = Succession(me=10, coordinator=2, key=(1, 18))
    theirs = [0, *range(2, 10)]
    assert not ten.contacted(theirs, elected, their_term=0)
    assert ten.contacted(theirs, elected, their_term=1)  # deposed in the term it was elected in
    assert ten.contacted(theirs, elected)  # the caller's term unknown: its word counts
    # following a successor not elected yet (not the view's coordinator): the term does not matter
    assert Succession(me=10, coordinator=3, deposed={2}).contacted(theirs, elected, their_term=0)


def test_views_of_a_deposed_coordinator_are_ignored_and_newer_views_move_the_coordinator():
    s = Succession(me=3, coordinator=0)
    v5 = _view(5, (0, 1, 2, 3), 0)
    assert s.accepts(v5) and s.adopt(v5) is None and s.epoch == 5
    assert not s.accepts(v5)  # duplicate
    assert s.suspect(0, v5) == 1
    late = _view(6, (0, 1, 2, 3), 0)  # the dead coordinator's last view, arriving late
    assert not s.accepts(late)
    v6 = _view(6, (1, 2, 3), 1)
    assert s.accepts(v6) and s.adopt(v6) is None  # already following 1
    # a node that had not suspected 0 yet follows the view naming 1 and deposes 0
    t = Succession(me=2, coordinator=0)
    t.adopt(v5)
    assert t.accepts(v6) and t.adopt(v6) == 0 and t.coordinator == 1 and 0 in t.deposed
    assert not t.accepts(_view(9, (0, 1, 2, 3), 0))  # even with a higher epoch
    assert not t.accepts(_view(5, (1, 2, 3), 1))  # older epoch
    # the deposed coordinator itself follows the newer view and does not depose itself
    z = Succession(me=0, coordinator=0)
    assert z.adopt(v6) == 0 and z.coordinator == 1 and z.deposed == set()


def test_view_names_its_coordinator_strictly():
    v = _view(4, (1, 2), 1)
    w = v.to_wire()
    assert w["coord"] == 1 and View.from_wire(w) == v
    for bad in ({**w, "coord": None}, {**w, "coord": True}, {**w, "coord": -1}, {**w, "coord": "1"},
                {k: x for k, x in w.items() if k != "coord"}):
        with pytest.raises(ProtocolError):
            View.from_wire(bad)
    st = MembershipState(expected=frozenset({0, 1, 2}))
    assert st.coordinator == 0 and st.view().coordinator == 0
    assert MembershipState(expected=frozenset({0, 1}), coordinator=1).view().coordinator == 1


def test_rebuilt_state_from_the_last_view():
    v = View(epoch=7, members=(0, 1, 2, 3), incarnations={0: 10, 1: 11, 2: 12, 3: 13}, coordinator=0)
    st = rebuild_state(expected=[0, 1, 2, 3, 4], view=v, failed={0}, me=1, fingerprint="fp", now=100.0,
                       grace=2.0, failure_timeout=2.0, term=1)
    assert st.coordinator == 1 and st.epoch == 8 and st.term == 1
    assert st.failed == {0, 4}  # the deposed coordinator and a node that had left before
    assert st.alive_nodes == [1, 2, 3] and st.complete
    view = st.view()
    assert view.coordinator == 1 and view.members == (1, 2, 3) and view.incarnations == {1: 11, 2: 12, 3: 13}
    assert view.term == 1 and view.key == (1, 8)
    # the election was counted over the last view: its members agree on the new one
    assert st.agreement is not None and st.agreement.members == {0, 1, 2, 3} and st.agreement.pending
    st.heartbeat(2, 102.5, applied=(1, 8))
    assert st.agreement.pending  # 1 and 2: not a majority of four
    st.heartbeat(3, 102.5, applied=(0, 8))  # a view of another term acknowledges nothing
    assert st.agreement.pending
    st.heartbeat(3, 102.6, applied=(1, 8))
    assert not st.agreement.pending and st.agreement.members == {1, 2, 3}
    # members get the grace period to find the new coordinator, then the usual detection
    for t in (103.0, 103.5):  # 2 heard throughout: with 1, a majority of [1, 2, 3]
        st.heartbeat(2, t)
    assert st.check(103.9) == []
    st.heartbeat(1, 104.0)
    st.heartbeat(2, 104.0)
    assert st.check(104.7) == [3] and st.has_quorum(104.7)
    # 1 and 2 are a majority of the agreed view [1, 2, 3]; removing 2 as well would not be
    assert st.declare_failed([2, 1, 7]) == []  # never itself, nor unknown nodes, nor a majority
    assert not st.all_finished
    assert st.finish(2, {"acc": 1.0}) and st.finish(1, {"acc": 1.0})  # departures: not failures
    assert st.all_finished and st.epoch == 11
    assert st.view().members == () and st.view().departed == (1, 2) and 1 not in st.failed
    assert not st.finish(1, {"acc": 1.0})  # re-sent after a failover: no new view


def test_a_coordinator_without_a_majority_declares_nobody_failed():
    v = View(epoch=3, members=(0, 1, 2, 3), coordinator=0)
    st = rebuild_state(expected=[0, 1, 2, 3], view=v, failed={0}, me=1, fingerprint="", now=0.0,
                       grace=0.0, failure_timeout=2.0, term=2)
    st.heartbeat(2, 1.0, applied=(2, 4))  # node 3 never acknowledged the takeover's view, then fell silent
    for t in (1.5, 2.0, 2.5, 3.0):
        st.heartbeat(2, t)
    assert st.check(3.2) == [] and st.blocked == [3]
    assert not st.has_quorum(3.2)  # 1 and 2 are two of the agreed four
    assert st.alive_nodes == [1, 2, 3] and st.epoch == 4  # nothing published
    st.heartbeat(3, 3.3, applied=(2, 4))  # heard again (a healed partition): quorum again
    assert st.check(3.4) == [] and st.has_quorum(3.4) and st.blocked == []


    # a node the last view lists as departed stays departed (not failed) after a takeover
    v3 = View(epoch=9, members=(0, 2), incarnations={0: 10, 2: 12}, coordinator=0, departed=(1,))
    st3 = rebuild_state(expected=[0, 1, 2], view=v3, failed={0}, me=2, fingerprint="", now=0.0, grace=0.0)
    assert st3.failed == {0} and st3.departed == {1} and st3.alive_nodes == [2]
    assert View.from_wire(v3.to_wire()) == v3
    # no view at all: every expected node but the failed ones
    st2 = rebuild_state(expected=[0, 1, 2], view=None, failed=[0], me=1, fingerprint="", now=0.0, grace=0.0)
    assert st2.alive_nodes == [1, 2] and st2.epoch == 1


def test_state_server_rebuilt_with_empty_records_answers_not_ready_until_every_device_is_heard():
    """A State Server started by the node taking over knows nothing: every query is NOT-READY
    (never a hang: the devices train on) until every device has been heard from once; the
    rounds come from the queries; then Alg. 2 decides as before."""
    s = StateServer([0, 1, 2], epsilon=0.0)
    now = 50.0
    # devices 1 and 2 are in round 7, doing iterations of 0.1 s and 0.4 s
    assert s.query_state(1, 3, 0.1, now - 0.05, now, round_=7) is False
    assert s.query_state(2, 1, 0.4, now - 0.05, now, round_=7) is False
    assert s.records[1].round == 7 and s.records[2].round == 7
    assert math.isinf(s.slowest().capability) and s.slowest().rank == 0  # unheard: slowest
    assert s.query_state(1, 4, 0.1, now, now + 0.1, round_=7) is False
    # the last device is heard from: the rebuilt server now decides as Alg. 2 says
    assert s.query_state(0, 2, 0.2, now, now + 0.1, round_=7) is False
    assert s.slowest().rank == 2
    assert s.query_state(2, 2, 0.4, now + 0.1, now + 0.1, round_=7) is True  # the slowest: READY
    assert s.query_state(1, 5, 0.1, now + 0.1, now + 0.15, round_=99) is True  # round kept: 7
    assert s.records[1].round == 7
    s.reset(1, 8, now + 0.2)
    assert s.records[1].round == 8 and s.heard == {0, 1, 2}


async def _mesh5() -> tuple[dict[int, Any], View]:
    """Five started in-memory endpoints of mesh(5), and view 7 of all five (coordinator 0,
    node n in its incarnation n): where a rebuilt service's tests start."""
    from p2psync.topology import mesh
    from p2psync.transport import MemoryHub

    hub = MemoryHub(mesh(5))
    eps = {i: hub.endpoint(i) for i in range(5)}
    for e in eps.values():
        await e.start()
    return eps, View(epoch=7, members=(0, 1, 2, 3, 4), incarnations={n: n for n in range(5)}, coordinator=0)


async def test_rebuilt_service_merges_reported_failures_and_moves_past_a_members_epoch():
    import time

    from p2psync.coordinator import MembershipService, RpcServer

    eps, v = await _mesh5()
    st = rebuild_state(expected=range(5), view=v, failed={0}, me=1, fingerprint="fp",
                       now=time.monotonic(), grace=2.0)
    svc = MembershipService(server=RpcServer(eps[1]), expected=range(5), state=st, rpc_methods=False)
    svc.start()
    try:
        assert 0 in eps[1].dead  # the old coordinator is routed around at once
        first = await eps[2].recv("event.view", timeout=5)  # published at once to every member
        assert View.from_wire(dict(first.meta)) == st.view()
        hb = svc.handlers["membership.heartbeat"]
        term = st.term
        rep = await hb(2, {"epoch": 8, "coord": 1, "term": term}, [])
        assert "view" not in rep and st.epoch == 8  # the caller applied our view: no change, none sent
        # node 3 applied a view the old coordinator published late with the same epoch
        rep = await hb(3, {"epoch": 8, "coord": 0, "term": term}, [])
        assert rep["view"]["epoch"] == 9
        rep = await hb(3, {"epoch": 9, "coord": 1, "term": term}, [])
        assert "view" not in rep and st.epoch == 9
        # failures members learnt from the old coordinator are merged (never the new one)
        rep = await hb(2, {"epoch": 9, "coord": 1, "term": term, "failed": [0, 3, 1]}, [])
        assert rep["view"]["members"] == [1, 2, 4] and st.failed == {0, 3} and 3 in eps[1].dead
        # never below a majority of the agreed five: a report of 4 as well is not taken
        rep = await hb(2, {"epoch": 10, "coord": 1, "term": term, "failed": [4]}, [])
        assert "view" not in rep and st.view().members == (1, 2, 4) and st.failed == {0, 3}
        # a node declared failed learns it in the answer to its next heartbeat (fenced)
        rep = await hb(3, {"epoch": 9, "coord": 1}, [])
        assert rep["fenced"] is True and rep["view"]["members"] == [1, 2, 4]
    finally:
        await svc.close()
        for e in eps.values():
            await e.close()


async def test_state_server_service_started_at_takeover_rebuilds_from_queries():
    """ESync's State Server registered on the node taking over (as ``coordinator_services`` is
    called there) answers over RPC from its first query: NOT-READY until every device has been
    heard from, with the rounds the queries carry, then READY for the slowest device."""
    from p2psync.coordinator import RpcServer
    from p2psync.strategies import get_strategy
    from p2psync.topology import mesh
    from p2psync.transport import MemoryHub

    topo = mesh(3)
    ep = MemoryHub(topo).endpoint(1)
    server = RpcServer(ep)
    get_strategy("esync").coordinator_services(server, topo, {"margin": 0.0})
    ask = {r: {"k": 2, "c": c, "age": 0.0, "rtt": 0.0, "round": 4} for r, c in ((0, 0.1), (1, 0.2), (2, 0.5))}
    assert await server.invoke(1, "esync.query", ask[1]) == {"ready": False, "round": 4}
    assert await server.invoke(0, "esync.query", ask[0]) == {"ready": False, "round": 4}
    assert await server.invoke(2, "esync.query", ask[2]) == {"ready": True, "round": 4}  # slowest
    assert await server.invoke(0, "esync.query", {**ask[0], "k": 3}) == {"ready": True, "round": 4}
    assert await server.invoke(0, "esync.reset", {"round": 5, "rtt": 0.0}) == {}
    with pytest.raises(ProtocolError, match="round"):  # remote input
        await server.invoke(1, "esync.query", {**ask[1], "round": -1})


def test_a_stale_failure_report_does_not_fail_a_joiner_again():
    """Regression: after a takeover the coordinator merges the failures members report; a
    heartbeat sent before its sender saw a node rejoin listed that node as failed, and the
    joiner was declared dead again at once."""
    from p2psync.coordinator import MembershipState

    st = MembershipState(expected=frozenset({0, 1, 2}), failure_timeout=1.0, coordinator=1)
    for n in (0, 1, 2):
        st.register(n, "f", 0.0, incarnation=10 + n)
    for t in (0.5, 1.0, 1.5, 1.9):  # 2 heard throughout: with 1, a majority
        st.heartbeat(1, t)
        st.heartbeat(2, t)
    assert st.check(2.5) == [0]
    before = st.epoch
    assert st.register(0, "f", 3.0, incarnation=99) is True  # node 0 restarted: a join
    assert st.declare_failed([0], seen_epoch=before) == []  # a report from before the join
    assert 0 not in st.failed
    assert st.declare_failed([0], seen_epoch=st.epoch) == [0]  # a report that saw the join


def test_the_line_of_successors_and_the_silent_ones_passed_over():
    v = _view(5, (0, 1, 2, 3, 4, 5, 6), 0)
    s = Succession(me=5, coordinator=0)
    assert s.line(v) == []  # it follows the view's coordinator: its detector watches it
    assert s.suspect(0, v) == 1
    assert s.line(v) == [1, 2, 3, 4]  # ahead of it, lowest first; never itself nor those above
    assert silent_ahead([1, 2, 3, 4], {1: False, 2: False, 3: True, 4: False}) == [1, 2]
    assert silent_ahead([1, 2, 3, 4], {1: False, 3: False}) == [1]  # 2's probe has not ended
    assert silent_ahead([1, 2, 3, 4], {1: True, 2: False}) == []
    assert s.suspect(1, v) == 2 and s.line(v) == [2, 3, 4]
    s.deposed.add(3)
    assert s.line(v) == [2, 4]
    lowest = Succession(me=1, coordinator=0)
    assert lowest.suspect(0, v) == 1 and lowest.line(v) == []  # it follows itself: it runs
    assert Succession(me=5, coordinator=2).line(None) == []


def test_the_next_batch_of_successors_is_probed_once_the_last_one_had_time_to_answer():
    line = list(range(1, 21))
    # the one followed not probed yet: the first batch
    assert probe_next(line, {}, {}, now=0.0, wait=0.1, batch=8) == list(range(1, 9))
    sent = {n: 0.0 for n in range(1, 9)}
    assert probe_next(line, sent, {}, now=0.05, wait=0.1, batch=16) == []  # not had time yet
    # every probe out had its wait and none answered: the next batch, long before the probe
    # time that passes them over
    assert probe_next(line, sent, {1: False}, now=0.1, wait=0.1, batch=16) == list(range(9, 21))
    assert probe_next(line, sent, {5: True}, now=0.5, wait=0.1, batch=16) == []  # the walk ends at 5
    sent |= {n: 0.1 for n in range(9, 21)}
    assert probe_next(line, sent, {}, now=1.0, wait=0.1, batch=32) == []  # all asked
    # following a later one (the line from it) that was not probed: from it at once
    assert probe_next([9, 10], {1: 0.0}, {1: False}, now=0.01, wait=0.1, batch=8) == [9, 10]
    assert probe_next([], {}, {}, now=0.0, wait=0.1, batch=8) == []


def test_a_later_batch_of_probes_ends_with_the_first_while_it_has_time_to_answer():
    assert probe_until(None, now=0.0, wait=0.1, probe_time=0.55) == 0.55  # the first batch
    assert probe_until(0.55, now=0.1, wait=0.1, probe_time=0.55) == 0.55  # judged with it
    assert probe_until(0.55, now=0.45, wait=0.1, probe_time=0.55) == 0.55  # just the wait left
    assert probe_until(0.55, now=0.5, wait=0.1, probe_time=0.55) == 1.05  # too late: its own


async def test_a_rebuilt_service_credits_no_arrival_of_a_newer_process_to_the_registered_one():
    # a successor kept the deposed coordinator 0 (incarnation 0 in its view) as a member; its
    # transport heard a restarted process of node 0 since: those arrivals prove nothing of the
    # registered process, which is declared failed after its silence, not kept alive by them
    import asyncio
    import time

    from p2psync.coordinator import MembershipService, RpcServer

    eps, v = await _mesh5()
    now = time.monotonic()
    st = rebuild_state(expected=range(5), view=v, failed=(), me=1, fingerprint="fp", now=now, grace=0.0,
                       failure_timeout=0.3, heartbeat_interval=0.05)
    svc = MembershipService(server=RpcServer(eps[1]), expected=range(5), state=st, rpc_methods=False,
                            failure_timeout=0.3, heartbeat_interval=0.05, check_interval=0.02)
    svc.start()
    try:
        eps[1]._pipeline.reborn[0] = 1  # a proven message of node 0's incarnation 1 was admitted
        assert eps[1].newer_life(0, 0) == 1 and eps[1].newer_life(0, 1) is None
        hb = svc.handlers["membership.heartbeat"]
        for _ in range(40):  # 0.8 s: the others heartbeat; node 0's new process is heard
            eps[1].last_arrival[0] = time.monotonic()
            for n in (2, 3, 4):
                await hb(n, {"epoch": st.epoch, "coord": 1, "term": st.term}, [])
            await asyncio.sleep(0.02)
        assert st.failed == {0} and st.view().members == (1, 2, 3, 4)
    finally:
        await svc.close()
        for e in eps.values():
            await e.close()

"""Failure detector on synthetic arrival sequences; views and epochs; registration rules."""

from __future__ import annotations

import asyncio
import random

import pytest

from p2psync.coordinator import MembershipState
from p2psync.coordinator.detector import (RTO_GRANULARITY, RTT_WINDOW, DetectorParams, FailureDetector,
                                         PeerDetector, RttEstimator, StallMeter)
from p2psync.coordinator.views import View, ViewTracker
from p2psync.errors import ConfigError, ProtocolError


def _run(det: PeerDetector, arrivals: list[float], step: float = 0.05) -> list[float]:
    """Feed heartbeat arrivals; return the times (sampled every ``step``) the peer was suspected."""
    suspected = []
    t, i = arrivals[0], 0
    while t <= arrivals[-1]:
        while i < len(arrivals) and arrivals[i] <= t:
            det.heartbeat(arrivals[i])
            i += 1
        if det.suspect(t):
            suspected.append(t)
        t += step
    return suspected


def test_steady_link_with_1_2s_rtt_is_never_suspected():
    # pipelined heartbeats every 0.5 s over a 1.2 s-RTT link: arrivals 0.6 s late, +-50 ms jitter
    rng = random.Random(1)
    det = PeerDetector(params=DetectorParams(), now=0.0)
    rtt = RttEstimator()
    for _ in range(50):
        rtt.sample(1.2 + rng.uniform(-0.05, 0.05))
    det.rtt(rtt.srtt or 0.0, rtt.rttvar)
    arrivals = [0.6 + 0.5 * k + rng.uniform(-0.05, 0.05) for k in range(240)]  # 2 minutes
    assert _run(det, sorted(arrivals)) == []
    # the heartbeat RPC's retransmission timeout covers the round trip
    assert rtt.rto() > 1.2
    # RTT-bound: silence needed before suspicion is >= 2 x RTT here, and within 3 s + 2 x RTT
    assert 2.4 <= det.timeout() <= 3.0 + 2 * 1.2


def test_silence_is_suspected_within_the_bound():
    for rtt in (0.0, 0.1, 1.2):
        det = PeerDetector(params=DetectorParams(), now=0.0)
        det.rtt(rtt, 0.01)
        arrivals = [0.5 * k for k in range(1, 41)]
        for a in arrivals:
            det.heartbeat(a)
        last = arrivals[-1]
        assert not det.suspect(last + 1.9)  # never below the 2 s floor
        t = last
        while not det.suspect(t):
            t += 0.01
        assert t - last <= 3.0 + 2 * rtt, (rtt, t - last)
        assert det.phi(t) >= 0


def test_an_outage_longer_than_the_timeout_is_not_learnt_as_an_inter_arrival_time():
    # a peer silent through a split whose declaration was blocked (no majority): the 7 s gap
    # must not stretch the timeout (it made a later pause of that peer declared after 7.3 s)
    det = PeerDetector(params=DetectorParams(), now=0.0)
    for k in range(1, 21):
        det.heartbeat(0.5 * k)
    before = det.timeout()
    for k in range(0, 20):
        det.heartbeat(17.0 + 0.5 * k)  # back after 7 s of silence
    assert det.timeout() == pytest.approx(before) and max(det.intervals) < 1.0
    det.heartbeat(26.5 + 0.9 * before)  # a slow gap under the timeout is learnt
    assert det.intervals[-1] == pytest.approx(0.9 * before)


def test_jitter_widens_the_timeout_and_any_traffic_is_proof_of_life():
    rng = random.Random(2)
    calm, noisy = (PeerDetector(params=DetectorParams(), now=0.0) for _ in range(2))
    t1 = t2 = 0.0
    for _ in range(100):
        t1 += 0.5
        t2 += rng.uniform(0.1, 1.9)
        calm.heartbeat(t1)
        noisy.heartbeat(t2)
    assert noisy.timeout() > calm.timeout() >= 2.0
    det = PeerDetector(params=DetectorParams(floor=1.0), now=0.0)
    det.heartbeat(0.5)
    det.alive(5.0)  # a data message, no heartbeat
    assert not det.suspect(5.5)
    assert det.suspect(6.6)


def test_detector_params_and_failure_detector_bookkeeping():
    with pytest.raises(ValueError):
        DetectorParams(floor=0)
    with pytest.raises(ValueError):
        DetectorParams(threshold=-1)
    fd = FailureDetector(params=DetectorParams(floor=1.0))
    fd.watch(1, 0.0)
    fd.watch(2, 0.0)
    fd.heartbeat(1, 0.9)
    fd.alive(3, 9.0)  # not watched: ignored
    assert fd.suspects(1.5) == [2]
    fd.forget(2)
    assert fd.suspects(1.5) == [] and fd.suspects(5.0) == [1]
    r = RttEstimator(initial_rto=3.0, min_rto=0.25)
    assert r.rto() == 3.0
    r.sample(0.001)
    assert r.rto() == 0.25
    r.sample(float("nan"))
    assert r.samples == 1


def test_views_epochs_and_tracker():
    st = MembershipState(expected=frozenset({0, 1, 2}), failure_timeout=1.0)
    for n in (0, 1, 2):
        st.register(n, "f", 0.0, incarnation=100 + n)
    v = st.view()
    assert v.members == (0, 1, 2) and v.epoch == 3 and v.incarnations == {0: 100, 1: 101, 2: 102}
    st.heartbeat(0, 0.9)
    st.heartbeat(1, 0.9)
    st.alive(2, 0.95)
    st.heartbeat(1, 1.4)  # 1 heard throughout: with 0, a majority
    assert st.check(1.5) == []
    st.heartbeat(0, 2.0)
    st.alive(1, 2.0)
    assert st.check(2.3) == [2]
    v2 = st.view()
    assert v2.epoch == 4 and v2.members == (0, 1)
    assert View.from_wire(v2.to_wire()) == v2
    tr = ViewTracker()
    ch = tr.apply(v)
    assert ch is not None and ch.left == () and tr.view == v
    ch = tr.apply(v2)
    assert ch is not None and ch.left == (2,) and ch.joined == ()
    assert tr.apply(v) is None and tr.apply(v2) is None  # stale and duplicate views are ignored
    for bad in ([], {"epoch": -1, "members": []}, {"epoch": 1, "members": ["a"]},
                {"epoch": 1, "members": [1], "inc": [[1]]}, {"epoch": True, "members": []},
                {"epoch": 1, "members": [1], "inc": [[1, -3]]}):
        with pytest.raises(ProtocolError):
            View.from_wire(bad)


def test_second_registration_of_a_live_node_is_rejected_naming_both():
    st = MembershipState(expected=frozenset({0, 1}))
    st.register(1, "f", 0.0, incarnation=111, address="hostA pid 1")
    st.register(1, "f", 0.1, incarnation=111, address="hostA pid 1")  # a retried request: fine
    with pytest.raises(ConfigError) as ei:
        st.register(1, "f", 0.2, incarnation=222, address="hostB pid 2")
    msg = str(ei.value)
    assert "111" in msg and "222" in msg and "hostA" in msg and "hostB" in msg
    st.register(0, "f", 0.0, incarnation=5)
    # one of two is no majority: the host waits instead of declaring node 1 failed
    assert st.check(10.0) == [] and st.blocked == [1] and not st.has_quorum(10.0)
    closed = MembershipState(expected=frozenset({0, 1, 2}), allow_join=False)
    for n in (0, 1, 2):
        closed.register(n, "f", 0.0, incarnation=111 + n)
    for i in range(1, 20):  # 2 heard throughout: with 0, a majority
        closed.heartbeat(2, 0.5 * i)
    closed.heartbeat(2, 9.9)
    assert closed.check(10.0) == [1]
    with pytest.raises(ConfigError, match="declared failed"):  # --on-failure stop: no joins
        closed.register(1, "f", 10.1, incarnation=333)


def test_failed_node_rejoins_with_a_newer_incarnation():
    """Issue 10 item 5: a failed node's new incarnation is admitted with a new view epoch."""
    st = MembershipState(expected=frozenset({0, 1, 2}), failure_timeout=1.0)
    for n in (0, 1, 2):
        assert st.register(n, "f", 0.0, incarnation=10 + n) is False
    for t in (0.5, 1.0, 1.5, 1.9):  # 1 heard throughout: with 0, a majority
        st.heartbeat(0, t)
        st.heartbeat(1, t)
    assert st.check(2.5) == [2]
    e = st.view().epoch
    with pytest.raises(ConfigError, match="different configuration"):
        st.register(2, "other", 3.0, incarnation=50)
    with pytest.raises(ConfigError, match="older"):
        st.register(2, "f", 3.0, incarnation=1)
    assert st.register(2, "f", 3.0, incarnation=50, address="hostC pid 9") is True
    v = st.view()
    assert v.epoch == e + 1 and v.members == (0, 1, 2) and v.incarnations[2] == 50
    assert st.failed == set() and st.rejoined == {2: 1} and not st.all_finished
    assert st.register(2, "f", 3.1, incarnation=50) is True  # a retried request: same answer
    assert st.view().epoch == e + 1
    st.heartbeat(0, 3.9)
    st.heartbeat(1, 3.9)
    st.heartbeat(2, 3.9)
    assert st.check(4.0) == []  # watched again from its registration


def test_no_failure_is_declared_before_the_rendezvous_completes():
    """Regression: with WAN latency the rendezvous took longer than the 2 s floor, and the
    coordinator declared every early registrant failed (they heartbeat only after it)."""
    st = MembershipState(expected=frozenset({0, 1, 2}), failure_timeout=2.0, heartbeat_interval=0.5)
    st.register(0, "fp", 0.0, incarnation=1)
    st.register(1, "fp", 1.0, incarnation=1)
    assert st.check(4.0) == []  # node 2 still missing: nobody is heartbeating yet
    st.register(2, "fp", 6.0, incarnation=1)
    assert st.check(6.0) == []  # rendezvous complete: every detector starts now
    assert st.check(7.5) == []
    for t in (6.5, 7.0, 7.5, 8.0, 8.5, 9.0, 9.5, 10.0):
        st.heartbeat(0, t)
        st.heartbeat(1, t)
    assert st.check(10.0) == [2]  # only the one that never heartbeat after the start


def test_rto_backoff_persists_until_a_sample():
    """RTT 1.2 s > initial RTO 1 s: the backed-off timer is kept for the next call, so a first
    attempt finally waits long enough to be measured (Karn), instead of never."""
    est = RttEstimator(initial_rto=1.0)
    assert est.rto() == 1.0
    est.backoff()  # the first call's request was resent
    assert est.rto() == 2.0 > 1.2  # the next call's first attempt outlives the RTT
    est.sample(1.2)
    assert 1.2 < est.rto() < 4.0 and est.srtt == 1.2
    for _ in range(20):
        est.backoff()
    assert est.rto() == est.max_rto


def test_rto_stays_above_a_round_trip_that_never_varies():
    """A link whose round trip never varies (a steady path; virtual time) drives ``rttvar``
    towards 0 and ``srtt`` to the round trip, give or take rounding: the timeout keeps a margin
    of the granularity over it, else it expires as the reply arrives and every other request
    is resent."""
    est = RttEstimator()
    for _ in range(400):
        est.sample(0.64)
    assert est.rttvar < 1e-12
    assert est.rto() >= 0.64 + RTO_GRANULARITY - 1e-9
    assert est.rto() < 0.64 + 2 * RTO_GRANULARITY


def test_the_rtt_estimate_keeps_within_its_latest_samples_once_a_long_round_trip_is_over():
    """A link back from a 3.1 s round trip to 24 ms: RFC 6298's averages alone still held a
    0.4 s round trip and 0.6 s of variation 16 samples later (the heartbeats' detector waited
    4.1 s for a silence, twice its floor); within the window of samples they are the short
    round trip's."""
    rfc, est = RttEstimator(window=10**6), RttEstimator()
    for e in (rfc, est):
        for k in range(40):
            e.sample(3.0 if k % 2 else 3.2)
    # a round trip that varies less than the window shows: RFC 6298's averages (once the
    # first sample's variation, half of it, has worn off)
    assert est.srtt == pytest.approx(rfc.srtt) and est.rttvar == pytest.approx(rfc.rttvar, rel=1e-3)
    assert rfc.rttvar < 0.2
    for k in range(RTT_WINDOW):
        for e in (rfc, est):
            e.sample(0.024)
        if k < RTT_WINDOW - 1:  # a long round trip still in the window: the average stands
            assert est.srtt == pytest.approx(rfc.srtt)
    assert est.srtt == 0.024 and est.rttvar == 0.0 and est.rto() == est.min_rto
    assert rfc.srtt is not None and rfc.srtt > 1.0 and rfc.rttvar > 1.0
    det, stale = (PeerDetector(params=DetectorParams(), now=0.0) for _ in range(2))
    det.rtt(est.srtt, est.rttvar)
    stale.rtt(rfc.srtt, rfc.rttvar)
    assert det.timeout() == DetectorParams().floor < 2 * stale.timeout()
    # a longer round trip is in the window at once: the averages grow as RFC 6298's
    for e in (rfc, est):
        e.sample(3.1)
    assert est.srtt == pytest.approx(0.875 * 0.024 + 0.125 * 3.1) and est.rttvar == pytest.approx(0.25 * 3.076)
    assert est.rto() > 3.1
    with pytest.raises(ValueError):
        RttEstimator(window=1)


async def test_a_newer_life_is_no_proof_of_life_for_the_registered_one():
    """Regression (review): a restarted node's probes and registration retries kept its old,
    registered incarnation 'alive', so it was never declared failed and the new one could never
    join. Arrivals count for the registered incarnation only; a newer life of a node already
    declared dead, or heard before it was, is reachable again."""
    from p2psync.errors import DuplicateNode
    from p2psync.topology import mesh
    from p2psync.transport.memory import MemoryHub

    hub = MemoryHub(mesh(2))
    a, b = hub.endpoint(0), hub.endpoint(1)
    await a.start()
    await b.start()
    try:
        a.peer_incarnations[1] = b.incarnation
        b.incarnation += 1  # node 1 restarted: same id, newer incarnation
        await b.send(0, "hello", kind="event")
        await a.recv("hello", timeout=5)
        assert 1 not in a.last_arrival
        a.mark_dead(1)  # the registered process failed: the newer life heard is registered at once
        assert 1 not in a.dead and a.peer_incarnations[1] == b.incarnation
        a.mark_dead(1)  # that life failed too
        assert 1 in a.dead
        b.incarnation += 1
        await b.send(0, "again", kind="event")
        await a.recv("again", timeout=5)
        assert 1 not in a.dead and a.peer_incarnations[1] == b.incarnation
    finally:
        await a.close()
        await b.close()
    st = MembershipState(expected=frozenset({0, 1}))
    st.register(1, "f", 0.0, incarnation=1)
    with pytest.raises(DuplicateNode):  # retried by the registering node until its start timeout
        st.register(1, "f", 0.1, incarnation=2)


async def test_a_view_naming_an_older_process_does_not_lower_the_incarnation_heard():
    """Regression (review): node 1 registered node 2's new process when it heard it (node 2 was
    marked dead here: routed around on this node's own judgement), then applied a newer view of
    a coordinator that still named node 2's previous process, and wrote that older incarnation
    back over the newer one: the gone process's late messages were admitted again, each a proof
    of life of node 2. A view only raises what the transport knows."""
    from p2psync.coordinator import MembershipClient, RpcClient
    from p2psync.topology import mesh
    from p2psync.transport.memory import MemoryHub

    hub = MemoryHub(mesh(3))
    eps = {i: hub.endpoint(i) for i in range(3)}
    for e in eps.values():
        await e.start()
    try:
        a, b = eps[1], eps[2]
        client = MembershipClient(transport=a, rpc=RpcClient(a), coordinator=0)
        old = b.incarnation
        incs = {0: eps[0].incarnation, 1: a.incarnation, 2: old}
        client._apply_view(View(epoch=1, members=(0, 1, 2), incarnations=incs).to_wire(), src=0)
        assert a.peer_incarnations[2] == old
        a.mark_dead(2)  # (its own judgement, e.g. a successor passed over)
        b.incarnation = old + 1  # node 2 restarted; its new process is heard here
        await b.send(1, "hello", kind="event")
        await a.recv("hello", timeout=5)
        assert a.peer_incarnations[2] == old + 1 and 2 not in a.dead
        client._apply_view(View(epoch=2, members=(0, 1, 2), incarnations=incs).to_wire(), src=0)
        assert a.peer_incarnations[2] == old + 1
        b.incarnation = old  # a late message of the previous process: still rejected
        await b.send(1, "late", kind="event")
        await asyncio.sleep(0.05)
        assert a.recv_nowait("late") is None and a.rejected.get("stale_incarnation") == 1
        newer = {**incs, 2: old + 2}  # a view naming a newer process still raises it
        client._apply_view(View(epoch=3, members=(0, 1, 2), incarnations=newer).to_wire(), src=0)
        assert a.peer_incarnations[2] == old + 2
    finally:
        for e in eps.values():
            await e.close()


async def test_a_registered_process_whose_first_view_does_not_name_it_is_fenced_not_failed():
    """A process that registered (a joiner) and whose first view does not name it (the run
    moved on without the coordinator that admitted it) is fenced, with a rejoin: the view is
    not applied, so its strategy never runs over a view without it (where it would fail with a
    PeerFailure, exit 1, and not be started again), and :meth:`first_view` raises the
    :class:`Fenced` error."""
    from p2psync.coordinator import MembershipClient, RpcClient
    from p2psync.errors import Fenced
    from p2psync.topology import mesh
    from p2psync.transport.memory import MemoryHub

    hub = MemoryHub(mesh(3))
    ep = hub.endpoint(2)
    await ep.start()
    try:
        client = MembershipClient(transport=ep, rpc=RpcClient(ep), coordinator=0)
        client.info = {"joined": True, "view": {}}  # registered; its registration's view not applied
        client._apply_view(View(epoch=9, members=(0, 1), coordinator=1, term=2).to_wire(), src=None)
        assert client.view is None and client.removed_by is not None and client.removed_by.epoch == 9
        assert isinstance(client.fenced, Fenced) and client.fenced.rejoin
        with pytest.raises(Fenced):
            await client.first_view(timeout=1.0)
    finally:
        await ep.close()


def test_the_coordinator_never_declares_its_own_host_failed():
    """CI regression: a stalled coordinator process declared its own host (node 0) failed."""
    st = MembershipState(expected=frozenset({0, 1, 2}), failure_timeout=2.0, heartbeat_interval=0.5)
    for n in (0, 1, 2):
        st.register(n, "fp", 0.0, incarnation=1)
    for i in range(1, 20):  # 2 heard throughout: with 0 (this coordinator), a majority
        st.heartbeat(2, 0.5 * i)
    st.heartbeat(2, 9.9)
    assert st.check(10.0) == [1]  # 0 and 1 silent for 10 s: only the other node is declared


def test_a_local_stall_is_credited_not_blamed_on_peers():
    det = FailureDetector(params=DetectorParams(interval=0.5, floor=2.0))
    meter = StallMeter(0.5, 0.0)
    det.watch(1, 0.0)
    for t in (0.5, 1.0, 1.5):
        det.heartbeat(1, t)
        assert meter.tick(t) == 0.0
    # this process stalls from 1.5 to 5.0: its next tick comes 3.0 s late
    stall = meter.tick(5.0)
    assert stall == pytest.approx(3.0)
    assert det.suspects(5.0) == [1]  # without the credit: a false failure
    det.pause(stall)
    assert det.suspects(5.0) == [] and det.silence(1, 5.0) == pytest.approx(0.5)
    det.heartbeat(1, 5.01)  # the heartbeats queued in the socket are read after the stall
    assert max(det.peers[1].intervals) < 1.0  # the stall is not an inter-arrival sample
    assert det.suspects(5.0 + 2.1) == [1]  # a peer silent after the stall is still detected

"""ESync's State Server (Alg. 2) on hand-made records, a simulation of the blocking-time bound,
slowdown profiles, and ESync itself over the in-memory transport."""

from __future__ import annotations

import asyncio
import heapq

import numpy as np
import pytest

from p2psync.coordinator.state_server import StateServer
from p2psync.errors import ConfigError, ProtocolError
from p2psync.strategies import get_strategy
from p2psync.topology import mesh
from p2psync.training.hetero import Slowdown, default_profile, parse_profiles
from p2psync.transport import MemoryHub
from tests.helpers import close_replica, gate_replicas, make_context, make_trainer


def _server(caps, now=0.0, eps=0.0):
    s = StateServer(list(range(len(caps))), epsilon=eps)
    for r, c in enumerate(caps):
        s.query_state(r, 0, c, now, now)  # k = 0: records capability, never ready
    return s


def test_k_zero_is_never_ready():
    s = StateServer([0, 1], epsilon=0.0)
    assert s.query_state(0, 0, 0.1, 0.0, 0.0) is False
    assert s.query_state(1, 0, 1.0, 0.0, 0.0) is False


def test_slowest_device_is_ready_after_its_first_iteration():
    s = _server([0.1, 1.0])
    assert s.slowest().rank == 1
    assert s.query_state(1, 1, 1.0, 1.0, 1.0) is True  # current == slowest
    assert s.query_state(0, 5, 0.1, 0.5, 0.5) is True  # slowest is ready


def test_rest_time_boundary_with_epsilon():
    # slowest (c=1.0) finished its last iteration at t=0: it is ready again at t=1.0
    s = _server([0.2, 1.0], eps=0.0)
    s.query_state(1, 1, 1.0, 0.0, 0.0)  # slowest reports (and becomes ready: it is the slowest)
    s.records[1].ready = False  # look at the rest-time rule alone
    # fast device at t=0.7: rest = 1.0 - 0.7 + 0 = 0.3 > 0.2 -> one more iteration fits
    assert s.query_state(0, 3, 0.2, 0.7, 0.7) is False
    # at t=0.85: rest = 0.15 < 0.2 -> cannot finish another iteration in time: READY
    assert s.query_state(0, 4, 0.2, 0.85, 0.85) is True
    # the epsilon margin turns the boundary case (c == rest) into READY
    s2 = _server([0.25, 1.0], eps=0.01)
    s2.query_state(1, 1, 1.0, 0.0, 0.0)
    s2.records[1].ready = False
    assert s2.query_state(0, 3, 0.25, 0.75, 0.75) is True  # 0.25 + 0.01 > rest 0.25
    s3 = _server([0.25, 1.0], eps=0.0)
    s3.query_state(1, 1, 1.0, 0.0, 0.0)
    s3.records[1].ready = False
    assert s3.query_state(0, 3, 0.25, 0.75, 0.75) is False  # c == rest exactly: not without eps


def test_slowest_not_yet_pulled():
    s = _server([0.1, 1.0])
    s.reset(0, 1, 2.0)  # device 0 already in round 1
    # device 1 (slowest) still in round 0: device 0 must keep training
    assert s.query_state(0, 2, 0.1, 2.2, 2.2) is False
    s.reset(1, 1, 2.5)
    s.query_state(1, 1, 1.0, 3.5, 3.5)
    assert s.query_state(0, 9, 0.1, 3.5, 3.5) is True


def test_a_device_never_heard_from_blocks_only_during_the_grace_period():
    """A rebuilt server (coordinator takeover) knows nobody; a member that does not query (a
    joiner fetching its state from the others) must not keep the others NOT-READY forever."""
    s = StateServer([0, 1, 2], epsilon=0.0, unheard_grace=5.0)
    s.query_state(0, 0, 0.1, 100.0, 100.0, round_=7)  # device 0 is in round 7
    s.query_state(1, 0, 0.2, 100.0, 100.0, round_=7)
    # device 2 unheard: the slowest, in round 0 -> NOT-READY while it may still call in
    assert s.query_state(0, 3, 0.1, 104.0, 104.0, round_=7) is False
    assert s.slowest(104.0).rank == 2
    # after the grace period it is left out until it queries: device 1 is the slowest
    assert s.slowest(106.0).rank == 1
    assert s.query_state(1, 5, 0.2, 106.0, 106.0) is True
    s.query_state(2, 0, 0.5, 107.0, 107.0, round_=7)  # it calls in: it counts again
    assert s.slowest(107.0).rank == 2


def test_bad_queries_rejected():
    s = StateServer([0])
    with pytest.raises(ProtocolError):  # remote input
        s.query_state(0, -1, 0.1, 0, 0)
    with pytest.raises(ProtocolError):  # remote input
        s.query_state(3, 1, 0.1, 0, 0)
    with pytest.raises(ConfigError):
        StateServer([])


def simulate_round(caps, eps=0.0):
    """Blocking-mode devices with fixed capabilities (zero network delay). Returns each device's
    number of local iterations and its idle wait at the barrier (aggregation = last ready)."""
    s = StateServer(list(range(len(caps))), epsilon=eps)
    events = [(0.0, r) for r in range(len(caps))]  # (time of next query, device)
    k = [0] * len(caps)
    ready_at = {}
    for r, c in enumerate(caps):
        s.query_state(r, 0, c, 0.0, 0.0)
    heapq.heapify(events)
    while events:
        t, r = heapq.heappop(events)
        if s.query_state(r, k[r], caps[r], t, t):
            ready_at[r] = t
            continue
        k[r] += 1
        heapq.heappush(events, (t + caps[r], r))
    start = max(ready_at.values())
    return k, {r: start - t for r, t in ready_at.items()}


@pytest.mark.parametrize("caps", [[1.0, 1.0, 2.0, 8.0], [0.3, 0.7, 1.1, 5.0], [0.05, 3.3],
                                  list(np.random.default_rng(4).uniform(0.1, 3.0, 7))])
def test_blocking_time_is_below_a_step_time(caps):
    k, wait = simulate_round(caps, eps=0.0)
    slowest = int(np.argmax(caps))
    assert wait[slowest] == 0  # the aggregation never waits beyond the slowest device
    for r, c in enumerate(caps):
        assert wait[r] < c + 1e-9  # nobody idles a whole iteration: it would have run one more
    fastest = int(np.argmin(caps))
    assert wait[fastest] < caps[fastest]  # the paper's bound: below c_p
    assert k[fastest] >= k[slowest]
    assert k[fastest] == int(np.floor(caps[slowest] / caps[fastest] + 1e-9)) or k[fastest] == int(caps[slowest] / caps[fastest])


def test_slowdown_profiles():
    p = parse_profiles("0:1,3:8", "2:30:4", "1:0.05")
    assert p[3].pad(0.01, 0) == pytest.approx(0.07)
    assert p[2].factor_at(29.9) == 1 and p[2].factor_at(30.0) == 4
    assert p[2].pad(0.01, 31) == pytest.approx(0.03)
    assert p[1].pad(0.01, 0) == pytest.approx(0.04) and p[1].pad(0.2, 0) == 0
    assert Slowdown().trivial
    for bad in (("0:0.5", "", ""), ("x", "", ""), ("", "1:2", ""), ("", "", "0:-1")):
        with pytest.raises(ConfigError):
            parse_profiles(*bad)


def test_step_jitter():
    j = parse_profiles(step_time="1:0.1", jitter=0.2)[1]
    assert j.pad(0.01, 0, u=1.0) == pytest.approx(0.11) and j.pad(0.01, 0, u=-1.0) == pytest.approx(0.07)
    assert j.pad(0.01, 0) == pytest.approx(0.09) and not j.trivial
    own = default_profile(jitter=0.5)  # a node of its own speed: never faster than its real compute
    assert own.pad(0.1, 0, u=1.0) == pytest.approx(0.05) and own.pad(0.1, 0, u=-1.0) == 0.0
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="step-jitter"):
            parse_profiles(jitter=bad)


async def test_factor_four_node_takes_four_times_longer():
    import time

    from p2psync.topology import mesh as _mesh
    slow = make_trainer(_mesh(1), 0, model="cnn", batch_size=512)  # ~10+ ms: overheads negligible
    slow.slowdown = Slowdown(factor=4)
    slow.forward_backward()  # warm-up
    ratios = []
    for _ in range(5):
        pad_before = slow.padded_s
        t0 = time.perf_counter()
        slow.forward_backward()
        wall = time.perf_counter() - t0
        real = wall - (slow.padded_s - pad_before)
        ratios.append(wall / real)
    # each step takes ~4x its own unpadded compute time (sleep can only overshoot a little)
    assert 3.6 < float(np.median(ratios)) < 4.8, ratios


async def run_esync_rounds(transports, topo, rounds=4, mode="blocking"):
    """ESync on the given started transports with step times 1:1:2:8; checks identical w_t
    after every round; returns the local iterations per node per round."""
    profiles = parse_profiles(step_time="0:0.01,1:0.01,2:0.02,3:0.08")
    strats = []
    trainers = {i: make_trainer(topo, i) for i in topo.ids}
    for i, tr in trainers.items():
        tr.slowdown = profiles[i]
    replicas = gate_replicas(trainers)
    for i in topo.ids:
        ctx = make_context(topo, transports[i], replicas[i], options={"mode": mode})
        if i == topo.coordinator:
            get_strategy("esync").coordinator_services(ctx.rpc_server, topo, {})
        ctx.rpc_server.start()
        strats.append(get_strategy("esync")(ctx))
    await asyncio.gather(*(s.start() for s in strats))
    n_local = {i: [] for i in topo.ids}
    for rnd in range(rounds):
        reps = await asyncio.gather(*(s.run_step(rnd, rnd == rounds - 1) for s in strats))
        params = [await s.ctx.replica.get_params() for s in strats]
        assert all(p.tobytes() == params[0].tobytes() for p in params)  # identical w_t
        for i, r in zip(topo.ids, reps):
            n_local[i].append(r.extra["n_local"])
        assert all(r.stop == (rnd == rounds - 1) for r in reps)
    for s in strats:
        await s.close()
        await s.ctx.rpc_server.close()
        await close_replica(s.ctx.replica)
    return n_local


@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
async def test_esync_rounds_over_memory_transport(mode):
    topo = mesh(4)
    hub = MemoryHub(topo)
    eps = {i: hub.endpoint(i, default_timeout=10) for i in topo.ids}
    for e in eps.values():
        await e.start()
    n_local = await run_esync_rounds(eps, topo, mode=mode)
    assert np.mean(n_local[0]) > np.mean(n_local[3]) and np.mean(n_local[2]) >= np.mean(n_local[3])
    for e in eps.values():
        await e.close()


async def test_the_state_server_answers_fenced_to_a_device_its_newest_view_removed():
    """Regression (bench/faults.py, esync pause-member-15): node 2, stopped for 15 s, was
    removed; its next query, when it woke, got BadRequest 'not registered' and the node failed
    with exit 1, so the launcher did not start it again. The State Server now answers 'Fenced'
    (the node then stops as fenced and rejoins)."""
    from p2psync.coordinator.rpc import RpcServer
    from p2psync.coordinator.state_server import StateServerService
    from p2psync.errors import RemoteError

    hub = MemoryHub(mesh(4))
    ep = hub.endpoint(0, default_timeout=5)
    await ep.start()
    try:
        svc = StateServerService(RpcServer(ep), [0, 1, 2, 3])
        view = {"epoch": 7, "members": [0, 1, 3]}  # a member's query carries the view without 2
        assert (await svc._query(1, {"k": 0, "c": 0.1, **view}, []))["ready"] is False
        for call, args in ((svc._query, {"k": 1, "c": 0.1}), (svc._reset, {"round": 3})):
            with pytest.raises(RemoteError) as exc:
                await call(2, {**args, "epoch": 5, "members": [0, 1, 2, 3]}, [])  # its older view
            assert exc.value.kind == "Fenced" and "removed from the run" in exc.value.message
        # its new process, admitted in a newer view, is a device again
        assert (await svc._query(2, {"k": 0, "c": 0.1, "epoch": 8, "members": [0, 1, 2, 3]}, []))["ready"] is False
    finally:
        await ep.close()

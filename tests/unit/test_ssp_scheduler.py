"""The SSP / DSSP / ElasticBSP schedulers against the thesis and the reading notes
(../shared/specs/ssp-dssp-elasticbsp.md §7 worked examples S1, S2, D1-D6, §10 invariants),
driven by scripted pushes and event simulations with a fake clock."""

from __future__ import annotations

import heapq
import random
from typing import Any, Callable

import numpy as np
import pytest

from p2psync.coordinator.ssp import ElasticScheduler, StalenessScheduler
from p2psync.coordinator.zipline import dssp_controller, naive_search, predict, zipline_opt_bs
from p2psync.errors import ConfigError, ProtocolError


def test_fig_3_3_worker1_waits_at_iteration_8_until_worker2_reaches_5():
    """S1: s = 3; worker 1 completed 7 pushes, worker 2 three: worker 1 is held; worker 2's
    4th push releases it (gap 7 - 4 = 3), in the same handler."""
    s = StalenessScheduler(workers=[1, 2], s_lower=3)
    for _ in range(3):
        assert [g.worker for g in s.push(2, 0.0)] == [2]
    for i in range(6):
        (g,) = s.push(1, 1.0 + i)
        assert g.worker == 1 and g.gap <= 3
    assert s.push(1, 8.0) == [] and s.waiting == [1]
    got = s.push(2, 9.0)
    assert [(g.worker, g.gap) for g in got] == [(1, 3), (2, 0)] and s.waiting == []


def simulate(sched: Any, intervals: Callable[[int, int], float], workers: list[int], until: float,
             on_grant: Callable[[Any, Any], None] | None = None) -> list[Any]:
    """Workers compute for ``intervals(worker, iteration)`` then push; held ones wait for an OK.
    Returns every grant; ``on_grant(grant, sched)`` runs as each is issued."""
    events = [(intervals(w, 0), w) for w in workers]
    heapq.heapify(events)
    it = dict.fromkeys(workers, 0)
    grants = []
    while events and events[0][0] < until:
        now, w = heapq.heappop(events)
        for g in sched.push(w, now):
            grants.append((now, g))
            if on_grant:
                on_grant(g, sched)
            it[g.worker] += 1
            heapq.heappush(events, (now + intervals(g.worker, it[g.worker]), g.worker))
    return grants


def _random_intervals(seed: int, n: int) -> Callable[[int, int], float]:
    rng = random.Random(seed)
    base = {w: rng.uniform(1.0, 6.0) for w in range(n)}
    return lambda w, i: base[w] * rng.uniform(0.7, 1.3)


@pytest.mark.parametrize("s", [0, 1, 3])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ssp_bounds_the_gap_and_never_holds_the_slowest(s, seed):
    sched = StalenessScheduler(workers=list(range(5)), s_lower=s)
    spread = []

    def check(g, sc):
        spread.append(max(sc.counts.values()) - min(sc.counts.values()))
        assert g.gap <= s

    grants = simulate(sched, _random_intervals(seed, 5), list(range(5)), 400.0, check)
    assert len(grants) > 100 and max(spread) <= s + 1
    if s == 0:  # BSP: an OK only when every count is equal, a barrier (its number: the count)
        assert all(g.gap == 0 and g.barrier == g.count for _, g in grants)
    else:
        assert not any(g.barrier for _, g in grants)


def test_asp_never_holds():
    sched = StalenessScheduler(workers=[0, 1, 2], s_lower=None)
    grants = simulate(sched, lambda w, i: 1.0 + 4 * w, [0, 1, 2], 200.0)
    assert sched.waiting == [] and max(g.gap for _, g in grants) > 50


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("s", [0, 2])
def test_dssp_with_equal_bounds_is_ssp_trace_for_trace(seed, s):
    traces = []
    for sched in (StalenessScheduler(workers=list(range(4)), s_lower=s),
                  StalenessScheduler(workers=list(range(4)), s_lower=s, s_upper=s)):
        traces.append([(t, g) for t, g in simulate(sched, _random_intervals(seed, 4), list(range(4)), 300.0)])
    assert traces[0] == traces[1]


@pytest.mark.parametrize("intervals", [[1.0, 10.0], [1.0, 3.3], [2.0, 2.5, 7.0]])
def test_fixed_dssp_never_grants_beyond_s_upper(intervals):
    """D6: s_L = 1, s_U = 3: the printed Alg. 1 reaches gaps 19 / 3 / 51; the fixed one <= 3."""
    n = len(intervals)
    sched = StalenessScheduler(workers=list(range(n)), s_lower=1, s_upper=3)
    spread = []

    def check(g, sc):
        spread.append(max(sc.counts.values()) - min(sc.counts.values()))

    grants = simulate(sched, lambda w, i: intervals[w], list(range(n)), 2000.0, check)
    assert max(g.gap for _, g in grants) <= 3 and max(spread) <= 4
    assert sched.controller_calls > 0
    assert max(g.gap for _, g in grants) > 1  # the controller let the fast worker run beyond s_L


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_dssp_random_schedules_stay_within_s_upper(seed):
    sched = StalenessScheduler(workers=list(range(6)), s_lower=2, s_upper=8)
    spread = []
    grants = simulate(sched, _random_intervals(seed, 6), list(range(6)), 500.0,
                      lambda g, sc: spread.append(max(sc.counts.values()) - min(sc.counts.values())))
    assert max(g.gap for _, g in grants) <= 8 and max(spread) <= 9


def test_controller_examples_and_the_slowest_worker_definition():
    """D1-D4 and D5: the slowest is the worker with the fewest pushes (the one a held worker
    waits for), not the longest interval."""
    assert dssp_controller([100, 90], [64, 31], 4) == 3  # D1
    assert dssp_controller([100, 90], [64, 31], 0) == 0  # D2
    assert dssp_controller([100, 90], [95, 85], 4) == 0  # D3: ties -> smallest r
    assert dssp_controller([100, 90], [99.5, 40], 4) == 4  # D4
    sched = StalenessScheduler(workers=["p", "q", "u"], s_lower=0, s_upper=4)  # type: ignore[list-item]
    sched.c.t.update(p=5, q=1, u=3)
    sched.c.a.update(p=(100.0, 90.0), q=(98.0, 88.0), u=(95.0, 45.0))
    assert sched.c.slowest() == "q"
    assert dssp_controller([100, 90], [98, 88], 4) == 1 and dssp_controller([100, 90], [95, 45], 4) == 4


def test_views_release_workers_held_by_a_departed_one_and_admit_joiners():
    sched = StalenessScheduler(workers=[0, 1, 2], s_lower=1)
    for t in range(2):
        sched.push(0, float(t))
    assert sched.waiting == [0]  # gap 2: held by 1 and 2 (count 0)
    sched.push(1, 3.0)
    assert sched.waiting == [0]  # still held by 2
    got = sched.set_workers([0, 1], 4.0)  # 2 died: 0 is no longer held by it
    assert [(g.worker, g.gap) for g in got] == [(0, 1)]
    sched.set_workers([0, 1, 3], 4.0)
    assert sched.counts[3] == 1  # a joiner starts at the slowest count
    with pytest.raises(ProtocolError, match="not a current worker"):
        sched.push(2, 5.0)
    with pytest.raises(ConfigError):
        StalenessScheduler(workers=[0], s_lower=2, s_upper=1)


# -- ElasticBSP (§4.7) ---------------------------------------------------------------------

def test_elastic_barrier_is_zipline_choice_and_everyone_is_released_together():
    """Constant intervals: after two monitoring pushes each worker runs exactly j_q more
    iterations (ZipLine's choice), the first arrival waits exactly d*, and all are released
    by the same push."""
    intervals = {0: 1.0, 1: 1.7, 2: 2.9, 3: 4.1}
    R = 6
    sched = ElasticScheduler(workers=list(intervals), R=R, searcher="zipline_opt_bs")
    released: list[list[tuple[float, int]]] = []
    arrivals: dict[int, float] = {}
    decisions = []
    pushes_in_superstep = dict.fromkeys(intervals, 0)
    per_superstep = []

    events = [(intervals[w], w) for w in intervals]
    heapq.heapify(events)
    while events and len(released) < 5:
        now, w = heapq.heappop(events)
        pushes_in_superstep[w] += 1
        before = sched.target
        grants = sched.push(w, now)
        if before is None and sched.target is not None:
            decisions.append((dict(sched.last_j), sched.last_d, sched.last_t_sync, dict(sched.c.a)))
        if not grants:
            arrivals[w] = now
        if any(g.barrier for g in grants):
            released.append([(now, g.worker) for g in grants])
            first = min(arrivals.values(), default=now)
            assert now - first == pytest.approx(decisions[-1][1])  # the measured wait is d*
            assert now == pytest.approx(decisions[-1][2])  # at t_sync
            per_superstep.append(dict(pushes_in_superstep))
            pushes_in_superstep = dict.fromkeys(intervals, 0)
            arrivals = {}
        for g in grants:
            heapq.heappush(events, (now + intervals[g.worker], g.worker))
    assert len(released) == 5 and all(len(r) == 4 for r in released)
    for (j, _, _, _), counts in zip(decisions, per_superstep):
        # k_q >= 2 monitoring pushes, then exactly j_q in [1, R]
        assert all(1 <= j[w] <= R and counts[w] >= 2 + j[w] for w in intervals), (j, counts)
    # the choice is ZipLine's on the predicted matrix of the monitoring pushes
    j, d, t_sync, a = decisions[0]
    M = predict([[a[w][1], a[w][0]] for w in sorted(intervals)], R)
    choice = zipline_opt_bs(M)
    assert [z + 1 for z in choice.z] == [j[w] for w in sorted(intervals)] and choice.d == pytest.approx(d)


def test_elastic_identical_workers_barrier_at_the_first_prediction_and_views():
    sched = ElasticScheduler(workers=[0, 1], R=5)
    for t in (1.0, 2.0):
        sched.push(0, t)
        sched.push(1, t)
    assert sched.last_j == {0: 1, 1: 1} and sched.last_d == 0.0 and sched.last_t_sync == 3.0
    assert sched.push(0, 3.0) == [] and sched.held == (0,)
    got = sched.set_workers([0], 3.5)  # 1 left: the barrier is recomputed without it
    assert [(g.worker, g.barrier) for g in got] == [(0, 1)]
    with pytest.raises(ConfigError):
        ElasticScheduler(workers=[0], R=0)


def test_dssp_reports_the_r_granted_and_grants_exactly_r_oks_beyond_s_lower():
    """The spec's DSSP example (D1: A[p] = (100, 90), A[slowest] = (64, 31): r* = 3) on the
    scheduler: the deciding OK reports r = r* = 3 (not the r_p left after it), and the decision
    yields exactly r* OKs beyond s_L (gaps 2, 3, 4); the next push asks the controller again."""
    sched = StalenessScheduler(workers=[0, 1], s_lower=1, s_upper=5)
    for t, w in [(31.0, 1), (40.0, 0), (64.0, 1), (70.0, 0), (90.0, 0)]:
        assert [g.r for g in sched.push(w, t)] == [0]
    got = [sched.push(0, t) for t in (100.0, 110.0, 120.0)]
    assert [(g.gap, g.r) for (g,) in got] == [(2, 3), (3, 0), (4, 0)]
    assert sched.push(0, 130.0) == [] and sched.controller_calls == 2  # r* = 0 at gap 5: held


# -- ElasticBSP: a worker leaves while the barrier is pending (§4.7 failure) -----------------

def _replan_matrix(sched: ElasticScheduler, ws: list[int], now: float) -> tuple[np.ndarray, dict[int, int]]:
    """The survivors' (``ws``) timelines from ``now`` as the test reads §4.7: a held worker
    stays (now) or goes on; a running one pushes next an interval after its last push, not
    before now."""
    rows, base = [], {}
    for w in ws:
        last, prev = sched.c.a[w]
        gamma = last - prev
        if w in sched.held:
            rows.append([now + i * gamma for i in range(sched.R)])
            base[w] = sched.counts[w]
        else:
            rows.append([max(last + gamma, now) + i * gamma for i in range(sched.R)])
            base[w] = sched.counts[w] + 1
    return np.array(rows), base


def test_elastic_leave_mid_barrier_is_zipline_over_the_survivors_from_now():
    """Constant intervals; the slowest worker (3) leaves once the first worker (2) is held at
    the barrier: the new targets are ZipLine's choice (checked against naive search) over the
    survivors' timelines from that moment, not the old ones; the held worker goes on at once
    (an OK that is no barrier), and the survivors meet exactly at the new t_sync, released
    together."""
    intervals = {0: 1.0, 1: 1.3, 2: 2.9, 3: 5.3}
    sched = ElasticScheduler(workers=list(intervals), R=6)
    events = [(intervals[w], w) for w in intervals]
    heapq.heapify(events)
    replanned, released = None, []
    while events and not released:
        now, w = heapq.heappop(events)
        if w not in sched.counts:
            continue
        grants = sched.push(w, now)
        if not grants and replanned is None:  # the first arrival at the barrier: 3 leaves now
            assert sched.held == (2,) and sched.target is not None
            old = {q: sched.target[q] for q in (0, 1, 2)}
            now += 0.25
            ws = [0, 1, 2]
            M, base = _replan_matrix(sched, ws, now)
            grants = sched.set_workers(ws, now)
            assert [(g.worker, g.barrier) for g in grants] == [(2, 0)] and sched.held == ()
            replanned = (old, naive_search(M), {q: base[q] + z for q, z in zip(ws, zipline_opt_bs(M).z)})
        for g in grants:
            if g.barrier:
                released.append((now, g.worker))
            else:
                heapq.heappush(events, (now + intervals[g.worker], g.worker))
    assert replanned is not None
    old, oracle, targets = replanned
    assert targets != old and all(targets[q] > old[q] for q in old)  # later: 2 runs one more
    assert sched.last_d == pytest.approx(oracle.d) and sched.last_t_sync == pytest.approx(oracle.t_sync)
    assert {q: sched.counts[q] for q in targets} == targets  # every survivor stopped at its new target
    assert sorted(q for _, q in released) == [0, 1, 2] and len({t for t, _ in released}) == 1
    assert released[0][0] == pytest.approx(oracle.t_sync)  # the barrier came where ZipLine put it
    assert sched.held == () and sched.barrier == 1


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_elastic_leaves_at_random_moments_never_hold_anyone_forever(seed):
    """Jittered intervals, three of six workers leave at random moments (some mid-barrier,
    some while held): every barrier releases exactly the current workers, no OK is ever lost
    (every survivor always has a push in flight or is held at a pending barrier), and the
    survivors go on reaching barriers after the last leave."""
    rng = random.Random(seed)
    base = {w: rng.uniform(1.0, 6.0) for w in range(6)}
    sched = ElasticScheduler(workers=list(base), R=8)
    events: list[tuple[float, int]] = [(base[w], w) for w in base]
    leaves = sorted(rng.uniform(5.0, 150.0) for _ in range(3))
    gone = rng.sample(sorted(base), 3)
    barriers_after: list[int] = []
    heapq.heapify(events)
    while events and events[0][0] < 250.0:
        now, w = heapq.heappop(events)
        grants = []
        if leaves and now > leaves[0]:
            heapq.heappush(events, (now, w))
            now = leaves.pop(0)
            grants = sched.set_workers([q for q in sched.counts if q != gone[len(barriers_after)]], now)
            barriers_after.append(0)
        elif w in sched.counts:
            grants = sched.push(w, now)
        released = [g.worker for g in grants if g.barrier]
        if released:
            assert sorted(released) == sorted(sched.counts)
            if barriers_after:
                barriers_after[-1] += 1
        for g in grants:
            heapq.heappush(events, (now + base[g.worker] * rng.uniform(0.7, 1.3), g.worker))
        running = {q for _, q in events if q in sched.counts}
        assert running | set(sched.held) == set(sched.counts), (now, running, sched.held)
    assert len(barriers_after) == 3 and barriers_after[-1] >= 3, barriers_after


def test_elastic_joiner_runs_one_iteration_to_the_pending_barrier_then_monitors_with_everyone():
    """A joiner (module docstring, "Joiners"): admitted at the slowest count while a barrier is
    pending, it runs one iteration and waits there; the barrier releases everyone, it included;
    the next decision waits for its two monitoring pushes too."""
    sched = ElasticScheduler(workers=[0, 1], R=5)
    for t in (1.0, 2.0):
        sched.push(0, t)
        sched.push(1, t + 0.5)
    assert sched.target == {0: 3, 1: 3}
    assert sched.set_workers([0, 1, 2], 2.6) == []
    assert sched.counts[2] == 2 and sched.target == {0: 3, 1: 3, 2: 3}
    assert sched.push(2, 3.2) == [] and sched.push(0, 3.0) == [] and sched.held == (2, 0)
    got = sched.push(1, 3.5)
    assert sorted((g.worker, g.barrier) for g in got) == [(0, 1), (1, 1), (2, 1)]
    for t in (4.0, 5.0):  # monitoring again: no decision until the joiner pushed twice as well
        sched.push(0, t)
        sched.push(1, t)
    assert sched.target is None
    sched.push(2, 4.5)
    assert sched.target is None
    sched.push(2, 5.5)
    assert sched.target is not None and set(sched.target) == {0, 1, 2}


@pytest.mark.parametrize("seed", range(4))
def test_elastic_leaves_and_rejoins_never_hold_anyone_forever(seed):
    """Workers leave and come back (a new process joins at the slowest count, its first
    iteration starting at once): every barrier releases exactly the current workers, every
    worker is always running or held at a pending barrier, and barriers go on after the last
    rejoin."""
    rng = random.Random(100 + seed)
    base = {w: rng.uniform(1.0, 4.0) for w in range(4)}
    sched = ElasticScheduler(workers=list(base), R=6)
    events: list[tuple[float, int]] = [(base[w], w) for w in base]
    heapq.heapify(events)
    changes = sorted((rng.uniform(5.0, 120.0), rng.randrange(4)) for _ in range(6))
    out: set[int] = set()
    gen = {w: 0 for w in base}  # each process's incarnation: events of a departed one are dropped
    barriers_after_last = rejoins = 0
    while events and events[0][0] < 200.0:
        now, w = heapq.heappop(events)
        grants = []
        if changes and now > changes[0][0]:
            heapq.heappush(events, (now, w))
            now, who = changes.pop(0)
            if who in out:  # it comes back: a new process, its first iteration under way
                out.discard(who)
                gen[who] += 1
                rejoins += 1
                heapq.heappush(events, (now + base[who], who + 10 * gen[who]))
            elif len(out) < 2:
                out.add(who)
            grants = sched.set_workers([q for q in base if q not in out], now)
            barriers_after_last = 0
        else:
            q, g = w % 10, w // 10
            if q in out or g != gen[q]:
                continue  # a push of a process that left
            grants = sched.push(q, now)
        released = [g.worker for g in grants if g.barrier]
        if released:
            assert sorted(released) == sorted(sched.counts)
            barriers_after_last += 1
        for g in grants:
            heapq.heappush(events, (now + base[g.worker] * rng.uniform(0.7, 1.3), g.worker + 10 * gen[g.worker]))
        running = {e % 10 for _, e in events if e % 10 in sched.counts and e // 10 == gen[e % 10]}
        assert running | set(sched.held) == set(sched.counts), (now, running, sched.held)
    assert rejoins >= 1 and barriers_after_last >= 3, (rejoins, barriers_after_last)

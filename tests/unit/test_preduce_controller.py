"""The P-Reduce controller's decision logic against the paper and the reading notes
(../shared/specs/preduce.md §2.2-2.4 worked examples, §5 items 1-6)."""

from __future__ import annotations

import heapq
import random
from fractions import Fraction as F

import numpy as np
import pytest

from p2psync.coordinator.preduce import Controller, constant_weights, dynamic_weights, t_min
from p2psync.errors import ConfigError, ProtocolError

HALF = F(1, 2)


# -- weights (Sec. 3.3, spec §1.4, §2.3) ---------------------------------------------------

@pytest.mark.parametrize("ks,want", [
    ([10, 10, 10], [F(1, 3)] * 3),
    ([12, 10], [F(4, 7), F(3, 7)]),
    ([5, 3], [F(4, 7), F(3, 7)]),  # only differences matter
    ([10, 9, 8], [F(4, 7), F(2, 7), F(1, 7)]),
    ([10, 10, 8], [F(2, 7), F(2, 7), F(3, 7)]),  # the stale worker outweighs each fresh one (B7)
    ([7, 7, 6], [F(1, 3)] * 3),
    ([20, 19, 19, 15], [F(32, 63), F(8, 63), F(8, 63), F(15, 63)]),
])
def test_dynamic_weights_exact_vectors(ks, want):
    assert dynamic_weights(ks, HALF) == want


@pytest.mark.parametrize("ks,want", [
    ([12, 10], [0.369, 0.631]),
    ([10, 9, 8], [0.369, 0.332, 0.299]),
    ([20, 19, 19, 15], [0.213, 0.096, 0.096, 0.595]),
])
def test_dynamic_weights_alpha_09(ks, want):
    assert dynamic_weights(ks, 0.9) == pytest.approx(want, abs=1e-3)


def test_fig5_example_conservative_and_nearest():
    """§2.2: k_i = 4, k_j = 1, alpha 1/2: beta = 8/15, 4/15, 2/15, 1/15."""
    assert dynamic_weights([4, 1], HALF) == [F(8, 15), F(7, 15)]
    assert dynamic_weights([4, 1], HALF, "nearest") == [F(12, 15), F(3, 15)]


@pytest.mark.parametrize("alpha,row", [(0.5, [0.667, 0.571, 0.533, 0.516, 0.508]),
                                       (0.9, [0.526, 0.369, 0.291, 0.244, 0.213]),
                                       (0.2, [0.833, 0.806, 0.801, 0.800, 0.800])])
def test_p2_freshest_weight_by_gap(alpha, row):
    """§2.3's table: (1 - alpha) / (1 - alpha^(g+1)) for gaps g = 1..5."""
    got = [dynamic_weights([10 + g, 10], alpha)[0] for g in range(1, 6)]
    assert got == pytest.approx(row, abs=1e-3)
    assert dynamic_weights([10, 10], alpha) == [0.5, 0.5]


def test_dynamic_weights_are_a_distribution_and_per_version_decreasing():
    rng = random.Random(7)
    for _ in range(300):
        ks = [rng.randrange(0, 12) for _ in range(rng.randrange(2, 7))]
        alpha = F(rng.randrange(0, 99), 100)
        for approx in ("conservative", "nearest"):
            w = dynamic_weights(ks, alpha, approx)
            assert all(x >= 0 for x in w) and sum(w) == 1, (ks, alpha, approx, w)
        if len(set(ks)) == 1:
            assert dynamic_weights(ks, alpha) == [F(1, len(ks))] * len(ks)
    # nearest is monotone for P = 2 (B7): the fresher member always weighs more
    assert [float(dynamic_weights([10 + g, 10], HALF, "nearest")[0]) for g in (1, 2, 3)] == \
        pytest.approx([0.667, 0.714, 0.8], abs=1e-3)


def test_constant_weights_and_bad_inputs():
    assert constant_weights(3) == [F(1, 3)] * 3 and sum(constant_weights(5)) == 1
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match="alpha"):
            dynamic_weights([1, 2], bad)
    with pytest.raises(ConfigError):
        dynamic_weights([1, 2.5], HALF)  # type: ignore[list-item]
    with pytest.raises(ConfigError):
        dynamic_weights([1, 2], HALF, "closest")


# -- queue and validation (Alg. 2 controller, spec §2.4, §5 items 1, 6) ----------------------

def test_t_min_table():
    assert [t_min(n, p) for n, p in [(4, 2), (3, 2), (8, 3), (8, 5), (16, 4), (32, 4)]] == [3, 2, 4, 2, 5, 11]


def test_fifo_groups_example():
    """Arrivals 3, 1, 4, 2, 5 with N = 5, P = 2, filter off: (3,1), then (4,2); 5 waits."""
    c = Controller(members=[1, 2, 3, 4, 5], p=2, avoid_frozen=False)
    groups = []
    for t, w in enumerate([3, 1, 4, 2, 5]):
        groups += c.ready(w, 1, float(t))
    assert [g.members for g in groups] == [(3, 1), (4, 2)]
    assert [g.op for g in groups] == [1, 2] and c.queue == (5,)
    assert all(g.weights == (0.5, 0.5) for g in groups)


def test_validation_errors_leave_the_state_unchanged():
    for kw, msg in (({"p": 1}, "P=1"), ({"p": 5}, "P=5"), ({"p": 2, "alpha": 1.0}, "alpha"),
                    ({"p": 2, "window": 2}, "window T=2"), ({"p": 2, "weights": "x"}, "weights"),
                    ({"p": 2, "tail": "x"}, "tail"), ({"p": 2, "max_defer": -1.0}, "max_defer")):
        with pytest.raises(ConfigError, match=msg):
            Controller(members=[0, 1, 2, 3], **kw)
    c = Controller(members=[0, 1, 2, 3], p=3)
    c.ready(0, 1, 0.0)
    for w, k, msg in ((9, 1, "not a member"), (0, 2, "already queued"), (1, -1, "iteration number"),
                      (1, True, "iteration number")):
        with pytest.raises(ProtocolError, match=msg):  # remote input
            c.ready(w, k, 0.0)
    assert c.queue == (0,)


def test_dynamic_groups_carry_weights_and_the_new_version():
    c = Controller(members=[0, 1, 2], p=3, weights="dynamic", alpha=0.5)
    c.ready(0, 10, 0.0)
    c.ready(1, 10, 0.0)
    (g,) = c.ready(2, 8, 0.0)
    assert g.members == (0, 1, 2) and g.k_new == 10
    assert g.weights == pytest.approx([2 / 7, 2 / 7, 3 / 7])


# -- topology: groups connected over direct links ----------------------------------------

def ring_adj(n: int) -> dict[int, list[int]]:
    return {i: [(i - 1) % n, (i + 1) % n] for i in range(n)}


def test_groups_are_connected_over_direct_links():
    c = Controller(members=range(6), p=3, adjacency=ring_adj(6), avoid_frozen=False)  # type: ignore[arg-type]
    assert c.ready(0, 1, 0.0) == [] and c.ready(2, 1, 0.0) == [] and c.ready(4, 1, 0.0) == []
    (g,) = c.ready(1, 1, 1.0)
    assert sorted(g.members) == [0, 1, 2] and c.queue == (4,)
    assert c.ready(5, 1, 2.0) == []  # 4-5 alone is only two
    (g,) = c.ready(3, 1, 3.0)
    assert sorted(g.members) == [3, 4, 5]


# -- group frozen (Sec. 4, spec §1.5-1.6, §2.4, §5 item 4) ---------------------------------

def _rho(groups: list[tuple[int, ...]], n: int) -> float:
    """The spectral bound of E[W] (Eq. 4, 6) for a group sequence."""
    mats = []
    for g in groups:
        w = np.eye(n)
        for i in g:
            w[i, i] = 0.0
            for j in g:
                w[i, j] = 1.0 / len(g)
        mats.append(w)
    ev = sorted(np.abs(np.linalg.eigvalsh(np.mean(mats, axis=0))), reverse=True)
    return float(ev[1])


def test_fig4_spectral_bounds():
    assert _rho([(0, 1), (1, 2), (0, 2)], 3) == pytest.approx(0.5)
    assert _rho([(0, 1), (0, 1), (0, 2), (1, 2)], 3) == pytest.approx(0.625)
    assert _rho([(0, 1, 2)], 3) == pytest.approx(0.0, abs=1e-12)


def _pairs(c: Controller, rounds: int) -> list[tuple[int, ...]]:
    """Workers 0, 1 then 2, 3 ready in turn, every worker again as soon as its group formed."""
    out: list[tuple[int, ...]] = []
    t = 0.0
    for _ in range(rounds):
        for w in (0, 1, 2, 3):
            t += 1.0
            if w not in c.queue:
                out += [g.members for g in c.ready(w, 1, t)]
    return out


def test_frozen_pattern_without_the_filter_never_reaches_consensus():
    c = Controller(members=[0, 1, 2, 3], p=2, avoid_frozen=False)
    groups = _pairs(c, 20)
    assert set(groups) == {(0, 1), (2, 3)}
    assert _rho(groups, 4) == pytest.approx(1.0)  # Assumption 2(3) violated
    assert not c.sync_graph_connected()


def test_the_filter_bridges_the_halves_within_the_first_window():
    c = Controller(members=[0, 1, 2, 3], p=2)  # max_defer: automatic (one READY interval)
    groups = _pairs(c, 1)
    t = 10.0
    connected_after = []
    for _ in range(40):  # ready again in the order of the frozen pattern
        for w in (0, 1, 2, 3):
            t += 1.0
            if w not in c.queue:
                for g in c.ready(w, 1, t):
                    groups.append(g.members)
                    connected_after.append(c.sync_graph_connected())
    first_cross = next(i for i, g in enumerate(groups) if set(g) not in ({0, 1}, {2, 3}))
    assert first_cross < c.window, groups[:c.window]
    assert c.swaps >= 1 and c.frozen_detected >= 1
    assert all(connected_after[c.window:])
    assert _rho(groups, 4) < 0.99  # < 1: consensus between the halves (a few cross groups per window suffice)


def test_deferral_waits_for_the_other_component_then_gives_up():
    c = Controller(members=[0, 1, 2, 3], p=2, window=3, max_defer=5.0)
    for g in ((0, 1), (0, 1)):
        for w in g:
            c.ready(w, 1, 0.0)
    assert c.history == [(0, 1), (0, 1)]
    assert c.ready(0, 1, 1.0) == [] and c.ready(1, 1, 1.0) == []  # {0,1} again: frozen, 2/3 not queued
    assert c.deferrals == 1 and c.wake_at() == 6.0
    assert c.tick(5.9) == []
    (g,) = c.tick(6.0)  # accepted as is: never deadlock
    assert set(g.members) == {0, 1} and c.unresolved == 1
    # a READY from the other component before the deadline is swapped in
    c.ready(0, 1, 7.0)
    assert c.ready(1, 1, 7.0) == [] and c.wake_at() == 12.0
    (g,) = c.ready(3, 1, 8.0)
    assert set(g.members) == {0, 3} and g.swapped and c.queue == (1,)


def test_automatic_max_defer_is_the_slowest_ready_interval():
    """Default max_defer: one READY interval of the slowest known worker (spec §1.6)."""
    c = Controller(members=[0, 1, 2, 3], p=2, window=3)
    for t in (0.0, 1.0):
        c.ready(0, 1, t)
        c.ready(1, 1, t)
    c.ready(0, 1, 4.0)
    assert c.ready(1, 1, 4.5) == []  # frozen again: deferred by worker 1's 3.5 s interval
    assert c.wake_at() == 8.0


# -- simulated schedule (issue 13's invariant) --------------------------------------------

def _simulate(n: int, p: int, seed: int, avoid: bool, groups_wanted: int = 3000,
              halves: bool = False) -> tuple[Controller, list, dict]:
    """Workers with random speeds (step time uniform in [1, 3], jitter +-20 %), reduce time 0.1.
    ``halves``: equal speeds (jitter +-1 %) and the second half of the workers half a step
    out of phase, so READYs come in bursts of one half: FIFO alone freezes the halves."""
    rng = random.Random(seed)
    jitter = 0.01 if halves else 0.2
    speed = {w: 1.0 if halves else rng.uniform(1.0, 3.0) for w in range(n)}
    c = Controller(members=range(n), p=p, avoid_frozen=avoid)  # type: ignore[arg-type]
    phase = {w: 0.5 if halves and w >= n // 2 else 0.0 for w in range(n)}
    events = [(phase[w] + speed[w] * rng.uniform(1 - jitter, 1 + jitter), w) for w in range(n)]
    heapq.heapify(events)
    k = dict.fromkeys(range(n), 0)
    groups: list = []
    last_grouped = dict.fromkeys(range(n), 0)
    longest_gap = dict.fromkeys(range(n), 0)
    connected: list[bool] = []

    def accept(gs, now):
        for g in gs:
            assert len(g.members) == p and len(set(g.members)) == p
            groups.append(g.members)
            connected.append(c.sync_graph_connected())
            for m in g.members:
                longest_gap[m] = max(longest_gap[m], len(groups) - last_grouped[m])
                last_grouped[m] = len(groups)
                k[m] = g.k_new
                heapq.heappush(events, (now + 0.1 + speed[m] * rng.uniform(1 - jitter, 1 + jitter), m))

    while len(groups) < groups_wanted:
        wake = c.wake_at()
        if wake is not None and wake <= events[0][0]:
            accept(c.tick(wake), wake)
            continue
        now, w = heapq.heappop(events)
        k[w] += 1
        accept(c.ready(w, k[w], now), now)
    return c, groups, {"gap": longest_gap, "connected": connected}


@pytest.mark.parametrize("n,p", [(6, 3), (8, 3), (8, 5)])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_schedule_everyone_grouped_and_no_frozen_state_beyond_the_window(n, p, seed):
    c, groups, st = _simulate(n, p, seed, avoid=True)
    # grouped again and again: every worker's longest gap is a few windows at most
    assert max(st["gap"].values()) <= 4 * c.window, st["gap"]
    counts = {w: sum(w in g for g in groups) for w in range(n)}
    assert min(counts.values()) > len(groups) * p / n / 4, counts
    # no frozen state lasts beyond the window
    run = longest = 0
    for ok in st["connected"]:
        run = 0 if ok else run + 1
        longest = max(longest, run)
    assert longest <= c.window, (longest, c.window)


def _frozen_after_warmup(st: dict, window: int) -> tuple[int, int]:
    """(windows disconnected after the first ``window`` groups, longest run of them)."""
    flags = [not x for x in st["connected"][window:]]
    run = longest = 0
    for f in flags:
        run = run + 1 if f else 0
        longest = max(longest, run)
    return sum(flags), longest


def test_out_of_phase_halves_freeze_without_the_filter_and_not_with_it():
    """READYs in bursts of one half (N = 6, P = 3): without the filter every group is one half,
    forever (group frozen, Sec. 4); with it cross groups keep the sync-graph connected."""
    c_off, g_off, st_off = _simulate(6, 3, 1, avoid=False, groups_wanted=600, halves=True)
    assert {tuple(sorted(g)) for g in g_off[c_off.window:]} == {(0, 1, 2), (3, 4, 5)}
    off, _ = _frozen_after_warmup(st_off, c_off.window)
    assert off == len(g_off) - c_off.window  # frozen all along
    c_on, g_on, st_on = _simulate(6, 3, 1, avoid=True, groups_wanted=600, halves=True)
    on, longest = _frozen_after_warmup(st_on, c_on.window)
    print(f"out-of-phase halves: frozen windows {on} with the filter (swaps {c_on.swaps}, deferrals "
          f"{c_on.deferrals}, unresolved {c_on.unresolved}), {off} without, of {len(g_on) - c_on.window}")
    assert on == 0 and c_on.swaps > 0, (on, longest)


# -- tail and views (spec B10) --------------------------------------------------------------

def test_fewer_than_p_remaining_stops_the_run():
    c = Controller(members=[0, 1, 2, 3], p=3, avoid_frozen=False)
    c.ready(0, 1, 0.0, last=True)
    c.ready(1, 1, 0.0)
    (g,) = c.ready(2, 1, 0.0)
    assert g.members == (0, 1, 2) and c.finished == {0}
    assert not c.stopped  # 1, 2, 3 remain: still P
    c.ready(3, 1, 1.0, last=True)
    c.ready(1, 1, 1.0)
    (g,) = c.ready(2, 1, 1.0)
    assert c.stopped and c.ready(1, 2, 2.0) == []  # 1 and 2 left: fewer than P


def test_shrink_forms_smaller_groups_then_solos():
    c = Controller(members=[0, 1, 2], p=3, tail="shrink", avoid_frozen=False)
    c.ready(0, 1, 0.0, last=True)
    c.ready(1, 1, 0.0)
    (g,) = c.ready(2, 1, 0.0)
    c.ready(1, 2, 1.0)
    (g,) = c.ready(2, 2, 1.0, last=True)
    assert g.members == (1, 2) and g.weights == (0.5, 0.5)
    (g,) = c.ready(1, 3, 2.0)
    assert g.members == (1,) and g.weights == (1.0,) and not c.stopped


def test_views_drop_departed_workers_and_admit_joiners():
    c = Controller(members=[0, 1, 2, 3], p=3, avoid_frozen=False)
    c.ready(0, 1, 0.0)
    c.ready(3, 1, 0.0)
    assert c.set_members([0, 1, 2], 1.0) == [] and c.queue == (0,)
    with pytest.raises(ProtocolError, match="not a member"):
        c.ready(3, 1, 1.0)
    c.set_members([0, 1, 2, 3], 2.0)
    c.ready(3, 1, 2.0)
    (g,) = c.ready(1, 1, 2.0)
    assert g.members == (0, 3, 1)
    assert c.set_members([0, 1], 3.0) == [] and c.stopped  # fewer than P members


def test_a_restarted_worker_is_forgotten_and_can_queue_again():
    c = Controller(members=[0, 1, 2], p=2, avoid_frozen=False)
    c.ready(0, 1, 0.0, last=True)
    c.forget(0, 1.0)
    assert c.queue == () and 0 not in c.finished
    c.ready(0, 1, 1.0)
    (g,) = c.ready(2, 1, 1.0)
    assert g.members == (0, 2)


def test_automatic_max_defer_excludes_time_spent_queued_and_deferred():
    """The automatic bound is one compute interval (group formed -> next READY), not the READY
    to READY gap: time a worker spent in the queue or in a deferral does not lengthen the next
    deferral (with the READY-to-READY gap, each deferral that ran out made the next one longer)."""
    c = Controller(members=[0, 1, 2, 3], p=2, window=3)
    for w in (0, 1):
        c.ready(w, 1, 0.0)  # group (0, 1) formed at 0
    for w in (0, 1):
        c.ready(w, 1, 1.0)  # compute interval 1.0; group (0, 1) again at 1
    c.ready(0, 1, 2.0)
    assert c.ready(1, 1, 2.0) == [] and c.wake_at() == 3.0  # frozen: deferred one interval
    (g,) = c.tick(3.0)  # ran out: accepted as is at 3 after both waited 1 s in the queue
    assert set(g.members) == {0, 1} and c.unresolved == 1
    c.ready(0, 1, 4.0)
    assert c.ready(1, 1, 4.0) == []
    assert c.wake_at() == 5.0  # still one compute interval (1 s), not the 2 s READY-to-READY gap

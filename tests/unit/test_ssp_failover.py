"""The parameter-server schedulers rebuilt after a coordinator failover (issue 14): the node
that takes over starts a fresh scheduler, and every worker's first report to it carries its own
push count (> 1 mid-run) and barrier generation. The scheduler adopts them (it used to refuse
any first count but 1, so the run could not go on), keeps SSP / DSSP within their bounds
(counted on the workers' true counts), and ElasticBSP abandons the dead coordinator's barrier,
owes a lost release, and reaches its next barrier with everyone."""

from __future__ import annotations

import heapq
import random
from typing import Any, Callable

import pytest

from p2psync.coordinator.ssp import ElasticScheduler, Grant, StalenessScheduler
from p2psync.errors import ProtocolError

pytestmark = pytest.mark.timeout(30)


class Run:
    """Workers that compute for ``interval(w)``, push, report to the scheduler of the moment
    and wait for its OK; a barrier OK moves a worker to the next generation. ``crash(...)``:
    the coordinator (and ``dead``, its own worker) dies; grants of the handler it died in
    reach only the workers not in ``lost``; a new scheduler adopts every survivor at its next
    report (held ones report again at once). Counts and generations are the workers' own."""

    def __init__(self, sched: Any, interval: Callable[[int], float], on_grant: Callable[[Grant], None]) -> None:
        self.sched, self.interval, self.on_grant = sched, interval, on_grant
        self.count = dict.fromkeys(sched.counts, 0)
        self.gen = dict.fromkeys(sched.counts, 0)
        self.events = [(interval(w), w) for w in self.count]
        heapq.heapify(self.events)
        self.grants: list[tuple[float, Grant]] = []
        self.spread: list[int] = []  # max - min of the true counts after every push
        self.now = 0.0

    def deliver(self, now: float, grants: list[Grant], lost: frozenset[int] = frozenset()) -> None:
        for g in grants:
            if g.worker in lost:
                continue
            self.grants.append((now, g))
            self.on_grant(g)
            self.gen[g.worker] += bool(g.barrier)
            heapq.heappush(self.events, (now + self.interval(g.worker), g.worker))

    def report(self, w: int, now: float) -> list[Grant]:
        if w in self.sched.unheard:
            return list(self.sched.adopt(w, self.count[w], now, gen=self.gen[w]))
        return list(self.sched.push(w, now))

    def step(self) -> tuple[float, list[Grant]]:
        now, w = heapq.heappop(self.events)
        self.count[w] += 1
        self.spread.append(max(self.count.values()) - min(self.count.values()))
        return now, self.report(w, now)

    def run(self, until: float, stop: Callable[[list[Grant]], bool] = lambda g: False) -> list[Grant] | None:
        """Until ``until``; or until ``stop(grants)`` holds after a handler (those grants are
        returned, not delivered)."""
        while self.events and self.events[0][0] < until:
            self.now, grants = self.step()
            if stop(grants):
                return grants
            self.deliver(self.now, grants)
        self.now = until
        return None

    def crash(self, new: Any, now: float, *, dead: int, grants: list[Grant] | None = None,
              lost: frozenset[int] = frozenset()) -> None:
        self.deliver(now, grants or [], lost)
        self.count.pop(dead)
        self.gen.pop(dead)
        self.events = [(t, w) for t, w in self.events if w != dead]
        heapq.heapify(self.events)
        running = {w for _, w in self.events}
        self.sched = new
        self.deliver(now, new.set_workers(sorted(self.count), now))  # the first report's view
        for w in sorted(set(self.count) - running):  # held (or their OK lost): they ask again
            self.deliver(now, self.report(w, now))


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["ssp", "dssp", "bsp"])
@pytest.mark.parametrize("lose", [False, True])
def test_staleness_scheduler_rebuilt_mid_run_adopts_counts_and_keeps_the_bound(kind, seed, lose):
    """Random step times; the coordinator (worker 0) dies mid-run (``lose``: in a handler that
    released held workers, before their OKs went out: they report the same count again); a
    new scheduler adopts the survivors' counts (all well above 1). Every OK before and after is
    within s (s_U) of the slowest true count, the true spread stays <= s + 1, and the survivors
    go on."""
    s_lower, s_upper = {"ssp": (3, None), "dssp": (1, 4), "bsp": (0, None)}[kind]
    s = s_upper if s_upper is not None else s_lower
    make = lambda: StalenessScheduler(workers=list(range(5)), s_lower=s_lower, s_upper=s_upper)  # noqa: E731
    rng = random.Random(seed)
    base = {w: rng.uniform(1.0, 6.0) for w in range(5)}

    def true_gap(g: Grant) -> None:
        assert run.count[g.worker] - min(run.count.values()) <= s, (g, run.count)

    run = Run(make(), lambda w: base[w] * rng.uniform(0.7, 1.3), true_gap)
    grants = run.run(400.0, lambda gs: len(gs) >= 2 and run.now > 100.0) if lose else run.run(100.0)
    assert (grants is not None) == lose
    lost = frozenset(g.worker for g in (grants or [])[:-1])  # the pusher's own OK (last) arrives
    before = dict(run.count)
    assert min(before.values()) > 5
    run.crash(make(), run.now, dead=0, grants=grants, lost=lost)
    after = len(run.grants)
    run.run(run.now + 200.0)
    assert len(run.grants) - after > 60 and max(run.spread) <= s + 1
    assert all(run.count[w] > before[w] + 10 for w in run.count), (before, run.count)
    assert run.sched.unheard == frozenset() and 0 not in run.sched.counts
    assert run.sched.counts == run.count  # the new scheduler counts in the workers' own terms
    if kind == "bsp":  # every OK a barrier numbered by the count, on both schedulers
        assert all(g.gap == 0 and g.barrier == g.count for _, g in run.grants)


def test_a_worker_already_ahead_is_held_until_the_slowest_catches_up():
    sched = StalenessScheduler(workers=[0, 1, 2], s_lower=2)
    assert sched.adopt(0, 10, 1.0) == [] and sched.waiting == [0]  # 1 and 2 unheard: count 0
    assert sched.adopt(1, 7, 1.1) == [] and sched.waiting == [0, 1]  # 2 still unheard
    got = sched.adopt(2, 7, 1.2)  # everyone heard: 1 and 2 at gap 0, 0 three ahead: held
    assert [(g.worker, g.gap) for g in got] == [(1, 0), (2, 0)] and sched.waiting == [0]
    assert [(g.worker, g.gap) for g in sched.push(1, 2.0)] == [(1, 1)] and sched.waiting == [0]
    got = sched.push(2, 2.1)  # the slowest reaches 8: 0 (10) is within s again
    assert [(g.worker, g.gap, g.count) for g in got] == [(0, 2, 10), (2, 0, 8)]
    assert sched.counts == {0: 10, 1: 8, 2: 8}
    with pytest.raises(ProtocolError, match="already heard"):
        sched.adopt(1, 9, 3.0)  # a second adoption
    with pytest.raises(ProtocolError, match="not a current worker"):
        sched.adopt(5, 3, 3.0)
    fresh = StalenessScheduler(workers=[0, 1], s_lower=1)
    with pytest.raises(ProtocolError, match="integer >= 1"):
        fresh.adopt(0, 0, 1.0)
    assert fresh.unheard == {0, 1} and fresh.counts == {0: 0, 1: 0}  # refused: nothing changed


@pytest.mark.parametrize("lost", [frozenset(), frozenset({1, 3}), frozenset({1, 2, 3})])
def test_elastic_rebuilt_mid_barrier_recovers_and_reaches_the_next_barrier_together(lost):
    """The coordinator (worker 0) dies while releasing barrier 2, before its OKs to ``lost``
    went out: those survivors are still in generation 1, the others went on in generation 2.
    The new scheduler abandons the old targets, holds every adopted worker until all three are
    heard from, then releases them together: a barrier OK to those behind when another survivor
    passed the barrier (their release was lost), a plain OK otherwise. Every survivor is then
    in the same generation, monitoring starts again, and the next barrier releases all three
    at once, at targets ZipLine chose from fresh monitoring pushes."""
    intervals = {0: 1.0, 1: 1.4, 2: 2.3, 3: 3.1}
    make = lambda: ElasticScheduler(workers=list(intervals), R=4)  # noqa: E731
    run = Run(make(), lambda w: intervals[w], lambda g: None)
    grants = run.run(500.0, lambda gs: any(g.barrier == 2 for g in gs))
    assert grants is not None and run.sched.barrier == 2 and set(run.gen.values()) == {1}
    n0 = len(run.grants) + len(grants) - len(lost)  # the old release's OKs that went out
    run.crash(make(), run.now, dead=0, grants=grants, lost=lost)
    new: ElasticScheduler = run.sched
    assert run.gen == {w: 1 if w in lost else 2 for w in (1, 2, 3)}
    # held until the running ones report (none is held when none was lost; all heard when all were)
    assert new.recovering == (0 < len(lost) < 3) and set(new.held) == (lost if new.recovering else set())
    nxt = run.run(500.0, lambda gs: len(gs) == 3 and all(g.barrier for g in gs))
    assert nxt is not None
    recovery = [g for _, g in run.grants[n0:n0 + 3]]
    assert sorted(g.worker for g in recovery) == [1, 2, 3]  # released together, once all were heard
    owed = lost if len(lost) < 3 else frozenset()  # nobody alive passed barrier 2 when all were lost
    assert {g.worker for g in recovery if g.barrier} == owed and all(g.barrier in (0, 2) for g in recovery)
    assert not new.recovering and new.adopted == [] and new.unheard == frozenset()
    passed = 2 if owed or not lost else 1
    assert set(run.gen.values()) == {passed}  # everyone passed the same barriers
    run.deliver(run.now, nxt)
    assert sorted(g.worker for g in nxt) == [1, 2, 3] and run.gen == dict.fromkeys((1, 2, 3), passed + 1)
    assert all(1 <= j <= 4 for j in new.last_j.values()) and new.last_j.keys() == {1, 2, 3}


def test_elastic_first_reports_count_one_are_the_runs_first_pushes():
    """At the run's start every first report is count 1, generation 0: ordinary monitoring
    pushes (OK at once, no recovery); a generation below 0 or a push while held is refused."""
    sched = ElasticScheduler(workers=[0, 1], R=3)
    assert [g.worker for g in sched.adopt(0, 1, 1.0)] == [0] and not sched.recovering
    with pytest.raises(ProtocolError, match="generation"):
        sched.adopt(1, 1, 1.0, gen=-1)
    assert [g.worker for g in sched.adopt(1, 1, 1.0)] == [1] and sched.counts == {0: 1, 1: 1}
    rebuilt = ElasticScheduler(workers=[0, 1], R=3)
    assert rebuilt.adopt(0, 9, 5.0, gen=2) == [] and rebuilt.recovering and rebuilt.held == (0,)
    with pytest.raises(ProtocolError, match="held"):
        rebuilt.push(0, 6.0)
    got = rebuilt.set_workers([0], 6.0)  # the unheard one died: the recovery ends without it
    assert [(g.worker, g.barrier) for g in got] == [(0, 0)] and not rebuilt.recovering

"""The parameter-server schedulers of the thesis: BSP, ASP, SSP, Dynamic SSP and ElasticBSP.
Pure: no I/O, times are arguments (the coordinator's own clock at a push report's arrival).

Paper: the thesis *Elastic Synchronization for Efficient and Effective Distributed Deep Learning*, §3.1.1-3.1.3 (BSP, ASP, SSP,
Fig. 3.3), ch. 5 (DSSP: Alg. 1 server part, Alg. 2 synchronization_controller), ch. 6
(ElasticBSP: prediction §6.3-6.4, ZipLine §6.5). Read with these errata resolved: SSP in its
push-count form (checked against Fig. 3.3); DSSP's Alg. 1-2 as printed do not enforce s_U, so
the fixed pseudocode is implemented here; ElasticBSP as an online protocol.

A worker's loop (spec §5): wait for OK, pull the weights, compute a gradient, push it, report
the push to the scheduler (:meth:`StalenessScheduler.push`), which answers with the OKs it grants
now — the pusher's own and those of held workers the push released.

* :class:`StalenessScheduler`: SSP with threshold ``s`` (``s_lower``; BSP is s = 0, ASP is
  ``s_lower=None``: never held) and DSSP with ``s_upper > s_lower`` (spec §3.4 fixed: every grant
  beyond s_L consumes one unit of r_p, and the controller's range is capped at
  ``s_U - gap + 1``, so no OK is ever granted at a gap above s_U; the printed algorithm reaches
  gaps of 19 and 51 at s_U = 3).
* :class:`ElasticScheduler`: ElasticBSP online (§4.7): a monitoring phase (every worker pushes at
  least twice, ASP-like), then the barrier is chosen by ZipLine over the predicted next R push
  times and fixed as a per-worker push count; a worker that reaches its count is held until
  everyone has, then all are released together (they pull identical weights: their pulls
  are tagged as a barrier's, :mod:`p2psync.params.barriers`). A worker that leaves
  while a barrier is pending makes ZipLine run again over the survivors' timelines predicted
  from that moment (:meth:`ElasticScheduler._replan`).

Rebuilt after a coordinator failover (the coordinator role moves to the lowest live id;
the node taking over starts a fresh scheduler, as ESync's State Server rebuilds from the members'
next calls). A scheduler starts with every worker *unheard*, at count 0; a worker's first report
to it is an **adoption** (:meth:`StalenessScheduler.adopt`, :meth:`ElasticScheduler.adopt`): it
carries the worker's own push count (1 at the run's start, any count after a failover) and, for
ElasticBSP, its barrier generation (the barriers it was released from), and the scheduler takes
them as that worker's state instead of requiring counts to start at 1. Afterwards the counts
must go on one push at a time (the RPC shell refuses a count that goes backwards or skips, a
second adoption, a push from a held worker: ProtocolError).

* SSP / DSSP / BSP / ASP: an unheard worker keeps count 0, so it is the slowest: until every
  worker has been heard from, no OK is granted beyond s (s_U) of 0. Counts the scheduler knows
  are exact and the others are lower bounds, so every gap it computes is at least the true gap:
  the bound ``max - min <= s + 1`` survives the failover, and a worker that is already ahead
  is simply held until the slowest catches up. DSSP grants in flight (``r_p`` left on the dead
  coordinator) are lost: an adopted worker starts with r_p = 0 and the controller decides again
  once it has two timestamps here (never beyond s_U). BSP needs no generation: its barriers are
  its counts, so a worker the dead coordinator released (count c + 1) is held until those it
  did not reach (count c, asking again) get their barrier-c OK.
* ElasticBSP: the barrier in progress on the dead coordinator is abandoned (its targets are
  gone) and monitoring starts again. Adopted workers are held until every worker has been
  heard from (:attr:`ElasticScheduler.recovering`); then all are released at once, and a
  worker whose generation is below the highest one gets a barrier OK: the dead coordinator had
  released that barrier to the others, so it was held there and its release was lost. So every
  worker ends up in the same generation and pulls the same barrier (the store's identical
  pulls, :mod:`p2psync.params.barriers`). A first report with count 1 and generation 0 is the
  run's first push (no barrier can have passed), taken as an ordinary push.

Joiners (a new view admits a worker: a node joining late, or the new process of a node the
members declared failed; :meth:`StalenessScheduler.set_workers`, :meth:`ElasticScheduler.set_workers`).
The thesis has no joins; what its rules imply:

* SSP / DSSP / BSP: a joiner's clock is **the slowest member's push count** (the fewest among
  the workers heard from). SSP bounds every worker's gap to the slowest (spec §2.2: ``t_p - min
  t <= s`` at each OK, ``max t - min t <= s + 1``), and the joiner starts from the current
  weights (it takes them from the store), so any clock in ``[min t, max t]`` keeps both
  invariants; the slowest's is the one that holds nobody back who was not already held (min t
  does not drop) and makes the joiner the slowest, which never blocks (§2.1). A clock of 0
  would hold every other worker until the joiner had replayed their pushes; BSP (s = 0) joins
  the round the slowest is in. A DSSP joiner starts with r_p = 0.
* ElasticBSP: a joiner joins the superstep in progress: with a barrier pending it runs one
  iteration and waits there (its target is its count plus one); while monitoring, the decision
  waits for its two monitoring pushes like everyone's (§4.7 "all k[q] >= 2"). Its barrier
  generation is the members' (the strategy takes it from the store's re-shard), so its pulls
  after the next release are that barrier's, as everyone's.

The worker keeps the same clock (:mod:`p2psync.strategies.ps`: the slowest member's count at
the store's re-shard), so its reports go on from there, and a scheduler rebuilt after a failover
adopts a count in line with the others'.

"The slowest worker" (spec §9 item 4; the thesis defines it two ways): the worker with the
fewest pushes — the one a held worker actually waits for — ties broken by the longest latest
interval. :func:`p2psync.coordinator.zipline.slowest_worker` (longest interval overall) is the
other reading; test D5 shows they differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import AbstractSet, Sequence

import numpy as np

from p2psync.coordinator.zipline import SEARCHERS, dssp_controller, predict
from p2psync.errors import ConfigError, ProtocolError


@dataclass(frozen=True)
class Grant:
    """OK for ``worker`` to pull and start its next iteration."""

    worker: int
    #: the worker's push count when the OK was granted
    count: int
    #: t_p - min t at the grant (the staleness the OK allows)
    gap: int
    #: r*: the extra iterations (beyond s_L) a DSSP controller decision granted at this OK, this
    #: one included (0: no decision at this OK; the r* - 1 OKs it allows later report 0)
    r: int = 0
    #: the barrier this OK releases (0: not a barrier): ElasticBSP's barrier number; BSP
    #: (s_U = 0, every OK a barrier): the push count, so the pulls it releases can be tagged
    barrier: int = 0


class _Counts:
    """Push counts and the last two push times of the current workers."""

    def __init__(self, workers: Sequence[int]) -> None:
        if not workers or len(set(workers)) != len(workers):
            raise ConfigError(f"bad worker list {list(workers)}")
        self.t = {w: 0 for w in workers}
        self.a: dict[int, tuple[float | None, float | None]] = {w: (None, None) for w in workers}
        #: workers not heard from since this scheduler was built (count 0: the slowest)
        self.unheard = set(workers)

    def _check(self, p: int, now: float) -> None:
        if p not in self.t:
            raise ProtocolError("scheduler", f"push from node {p}, not a current worker")
        if not math.isfinite(now):
            raise ProtocolError("scheduler", f"push at a non-finite time {now!r}")

    def record(self, p: int, now: float) -> None:
        self._check(p, now)
        self.t[p] += 1
        self.a[p] = (now, self.a[p][0])
        self.unheard.discard(p)

    def adopt(self, p: int, count: int, now: float) -> None:
        """``p``'s first report to this scheduler: it made ``count`` pushes, the last one now."""
        self._check(p, now)
        if p not in self.unheard:
            raise ProtocolError("scheduler", f"node {p} reported its count {count!r} again (already heard from)")
        if type(count) is not int or count < 1:
            raise ProtocolError("scheduler", f"node {p} reported count {count!r}, not an integer >= 1")
        self.t[p] = count
        self.a[p] = (now, None)
        self.unheard.discard(p)

    def interval(self, w: int) -> float:
        last, prev = self.a[w]
        return last - prev if last is not None and prev is not None else -1.0

    def slowest(self) -> int:
        """Fewest pushes; ties: the longest latest interval, then the lowest id."""
        return min(self.t, key=lambda w: (self.t[w], -self.interval(w), w))

    def gap(self, p: int) -> int:
        return self.t[p] - min(self.t.values())

    def add(self, w: int) -> None:
        """A joiner starts at the slowest count heard (it is not ahead of anyone; module
        docstring, "Joiners")."""
        if w not in self.t:
            heard = [c for q, c in self.t.items() if q not in self.unheard]
            self.t[w] = min(heard or self.t.values(), default=0)
            self.a[w] = (None, None)

    def remove(self, w: int) -> None:
        self.t.pop(w, None)
        self.a.pop(w, None)
        self.unheard.discard(w)


class _Scheduler:
    """What both schedulers read the same way from their push counts (``c``)."""

    c: _Counts

    @property
    def counts(self) -> dict[int, int]:
        return dict(self.c.t)

    @property
    def unheard(self) -> AbstractSet[int]:
        """Workers whose first report (:meth:`adopt`) has not come yet (read only, not a copy)."""
        return self.c.unheard


class StalenessScheduler(_Scheduler):
    """SSP / DSSP (and BSP = SSP(0), ASP = no bound) on push counts (spec §2.2, §3.4)."""

    def __init__(self, *, workers: Sequence[int], s_lower: int | None, s_upper: int | None = None) -> None:
        if s_lower is not None and (type(s_lower) is not int or s_lower < 0):
            raise ConfigError(f"staleness s={s_lower!r} must be an integer >= 0")
        if s_upper is not None and (s_lower is None or type(s_upper) is not int or s_upper < s_lower):
            raise ConfigError(f"s_upper={s_upper!r} must be an integer >= s_lower={s_lower!r}")
        self.s_lower = s_lower
        self.s_upper = s_lower if s_upper is None else s_upper
        self.c = _Counts(workers)
        self.r = {w: 0 for w in workers}
        self.waiting: list[int] = []  # held workers, in order of arrival
        self.controller_calls = 0

    @property
    def lockstep(self) -> bool:
        """BSP (s_U = 0): every OK is granted when all counts are equal, a barrier."""
        return self.s_upper == 0

    def _ok(self, p: int, r: int = 0) -> Grant:
        return Grant(worker=p, count=self.c.t[p], gap=self.c.gap(p), r=r,
                     barrier=self.c.t[p] if self.lockstep else 0)

    def push(self, p: int, now: float) -> list[Grant]:
        """Worker ``p`` pushed (its gradient is applied): the OKs granted now (p's own first
        only if it is not held; released workers in order of arrival)."""
        if p in self.waiting:
            raise ProtocolError("scheduler", f"push from node {p}, which is held (it has no OK)")
        self.c.record(p, now)
        return self._pushed(p)

    def adopt(self, p: int, count: int, now: float, gen: int = 0) -> list[Grant]:
        """Worker ``p``'s first report to this scheduler (module docstring: rebuilt after a
        failover): its own ``count`` becomes its state, the report is its latest push; then as
        :meth:`push` (held if it is ahead). ``gen`` is not used (BSP numbers its barriers by
        counts); r_p starts at 0."""
        self.c.adopt(p, count, now)
        self.r[p] = 0
        return self._pushed(p)

    def _pushed(self, p: int) -> list[Grant]:
        out = self._release()
        own = self._decide(p)
        if own is None:
            self.waiting.append(p)
        else:
            out.append(own)
        return out

    def _release(self) -> list[Grant]:
        """Spec §3.4 line 15: held workers whose gap closed to s_L get their OK."""
        out = []
        for q in list(self.waiting):
            g = self.c.gap(q)
            if self.s_lower is None or g <= self.s_lower:
                self.waiting.remove(q)
                out.append(self._ok(q))
        return out

    def _decide(self, p: int) -> Grant | None:
        g = self.c.gap(p)
        if self.s_lower is None or self.s_upper is None:  # ASP
            return self._ok(p)
        if self.r[p] > 0:  # Alg. 1 lines 3-5: an extra iteration left from an earlier decision
            self.r[p] -= 1
            return self._ok(p)
        if g <= self.s_lower:  # lines 7-9
            return self._ok(p)
        p_last, p_prev = self.c.a[p]
        if self.s_upper > self.s_lower and self.c.t[p] == max(self.c.t.values()) \
                and p_last is not None and p_prev is not None:
            s_last, s_prev = self.c.a[self.c.slowest()]  # line 11: the fastest asks the controller
            if s_last is not None and s_prev is not None:
                self.controller_calls += 1
                rs = dssp_controller([p_last, p_prev], [s_last, s_prev], max(0, self.s_upper - g + 1))
                if rs > 0:  # this grant consumes one unit (fix 1)
                    self.r[p] = rs - 1
                    return self._ok(p, r=rs)
        return None

    def set_workers(self, workers: Sequence[int], now: float) -> list[Grant]:
        """A new view: departed workers no longer bound anyone; joiners are admitted (``now``
        is not used: the signature is :class:`ElasticScheduler`'s)."""
        keep = set(workers)
        for w in [w for w in self.c.t if w not in keep]:
            self.c.remove(w)
            self.r.pop(w, None)
            if w in self.waiting:
                self.waiting.remove(w)
        for w in workers:
            if w not in self.c.t:
                self.c.add(w)
                self.r[w] = 0
        if not self.c.t:
            raise ConfigError("the scheduler needs at least one worker")
        return self._release()


class ElasticScheduler(_Scheduler):
    """ElasticBSP online (spec §4.7): monitor, predict, ZipLine, barrier by push counts."""

    def __init__(self, *, workers: Sequence[int], R: int, searcher: str = "zipline_opt_bs") -> None:
        if type(R) is not int or R < 1:
            raise ConfigError(f"R={R!r} must be an integer >= 1")
        if searcher not in SEARCHERS:
            raise ConfigError(f"unknown barrier search {searcher!r} (choose from {', '.join(SEARCHERS)})")
        self.R = R
        self.search = SEARCHERS[searcher]
        self.c = _Counts(workers)
        self.k = {w: 0 for w in workers}  # pushes since the last barrier
        self.target: dict[int, int] | None = None  # None: monitoring
        self.arrived: list[int] = []
        self.barrier = 0  # barriers released so far
        #: the last decision: predicted spread d* and barrier time t_sync (coordinator clock)
        self.last_d: float | None = None
        self.last_t_sync: float | None = None
        self.last_j: dict[int, int] = {}
        #: rebuilt after a failover: adopted workers are held until every worker was heard from
        self.recovering = False
        self.gens: dict[int, int] = {}  # while recovering: every heard worker's generation
        self.adopted: list[int] = []  # while recovering: held adopted workers, in order of arrival

    @property
    def held(self) -> tuple[int, ...]:
        return (*self.arrived, *self.adopted)

    #: pushes between barriers are applied ASP-like (not BSP's rounds)
    lockstep = False

    def _ok(self, w: int, barrier: int = 0) -> Grant:
        """Worker ``w``'s OK at its current count (``barrier``: the barrier it is released from)."""
        return Grant(worker=w, count=self.c.t[w], gap=self.c.gap(w), barrier=barrier)

    def _monitor_again(self) -> None:
        """Forget the intervals and monitoring pushes: monitoring starts from scratch."""
        for w in self.c.t:
            self.k[w] = 0
            self.c.a[w] = (None, None)

    def push(self, p: int, now: float) -> list[Grant]:
        if p in self.arrived or p in self.adopted:
            raise ProtocolError("scheduler", f"push from node {p}, which is held at the barrier")
        self.c.record(p, now)
        return self._pushed(p)

    def adopt(self, p: int, count: int, now: float, gen: int = 0) -> list[Grant]:
        """Worker ``p``'s first report to this scheduler, with its own push ``count`` and barrier
        generation ``gen`` (module docstring). Count 1 in generation 0 is the run's first push;
        any other starts (or goes on) recovering: monitoring starts again, ``p`` is held until
        every worker has been heard from, then all are released (:meth:`_recovered`)."""
        if type(gen) is not int or gen < 0:
            raise ProtocolError("scheduler", f"node {p} reported generation {gen!r}, not an integer >= 0")
        first = count == 1 and gen == 0 and not self.recovering
        self.c.adopt(p, count, now)
        if first:
            return self._pushed(p)
        if not self.recovering:  # the dead coordinator's barrier is gone: monitor again
            self.recovering, self.target, self.arrived = True, None, []
            self.gens = {w: 0 for w in self.c.t if w not in self.c.unheard and w != p}
        self.gens[p] = gen
        self.adopted.append(p)
        return self._recovered()

    def _recovered(self) -> list[Grant]:
        """Every worker heard from while recovering: release the adopted ones together (a
        barrier OK for a worker behind the highest generation: that barrier was released to
        the others, it waited there), and monitor from scratch, as after a barrier."""
        if not self.recovering or self.c.unheard:
            return []
        top = max(self.gens.values(), default=0)
        out = [self._ok(w, top if self.gens[w] < top else 0) for w in self.adopted]
        self.recovering, self.adopted, self.gens = False, [], {}
        self.barrier = max(self.barrier, top)
        self._monitor_again()
        return out

    def _pushed(self, p: int) -> list[Grant]:
        self.k[p] += 1
        if self.target is None:
            out = [self._ok(p)]  # ASP-like
            if all(v >= 2 for v in self.k.values()):
                self._decide()
            return out
        if self.c.t[p] < self.target[p]:
            return [self._ok(p)]
        self.arrived.append(p)
        return self._maybe_release()

    def _decide(self) -> None:
        """The last monitoring push: predict R pushes per worker, pick the barrier (§6.4-6.5)."""
        ws = sorted(self.c.t)
        table = [[self.c.a[w][1], self.c.a[w][0]] for w in ws]
        choice = self.search(predict(table, self.R))  # type: ignore[arg-type]
        self.last_j = {w: int(z) + 1 for w, z in zip(ws, choice.z)}
        self.target = {w: self.c.t[w] + self.last_j[w] for w in ws}
        self.last_d, self.last_t_sync = float(choice.d), float(choice.t_sync)

    def _maybe_release(self) -> list[Grant]:
        if self.target is None or set(self.arrived) != set(self.c.t):
            return []
        self.barrier += 1
        out = [self._ok(w, self.barrier) for w in self.arrived]
        self.arrived = []
        self.target = None
        self._monitor_again()
        return out

    def _replan(self, target: dict[int, int], now: float) -> list[Grant]:
        """A worker left while the barrier was pending (§4.7 failure: "recompute with the
        survivors"): ZipLine again over the survivors' timelines predicted from ``now``. A
        survivor held at its barrier count may stay there (its point: ``now``, j = 0) or go on,
        released now (``now + i*gamma``: target = count + i, an OK now); a running survivor's
        next push is expected an interval after its last one but not before ``now``
        (target = count + 1 + i). So no target is below the count a survivor reached, and a held
        survivor is released only by a barrier or by a target moved past it; one without an
        interval (a joiner) keeps its target. ``last_j``: the new targets minus the counts."""
        ws = [w for w in sorted(self.c.t) if self.c.interval(w) >= 0]  # each has a last push
        if not ws:
            return []
        rows, base = [], {}
        for w in ws:
            gamma, last = self.c.interval(w), self.c.a[w][0] or 0.0  # not None: interval >= 0
            held = w in self.arrived
            base[w] = self.c.t[w] + (0 if held else 1)
            start = now if held else max(last + gamma, now)
            rows.append(start + gamma * np.arange(self.R))
        choice = self.search(np.array(rows))
        out = []
        for w, z in zip(ws, choice.z):
            target[w] = base[w] + int(z)
            if w in self.arrived and target[w] > self.c.t[w]:
                self.arrived.remove(w)
                out.append(self._ok(w))
        self.last_j = {w: target[w] - self.c.t[w] for w in ws}
        self.last_d, self.last_t_sync = float(choice.d), float(choice.t_sync)
        return out

    def set_workers(self, workers: Sequence[int], now: float) -> list[Grant]:
        """A new view at ``now``: a pending barrier is recomputed without a worker that left
        (§6.4 "taken out of the computation"; :meth:`_replan`), a monitoring phase that only
        waited for it ends; a joiner runs one iteration and waits at the barrier in progress,
        then monitors with everyone."""
        keep = set(workers)
        left = [w for w in self.c.t if w not in keep]
        for w in left:
            self.c.remove(w)
            self.k.pop(w, None)
            self.gens.pop(w, None)
            for held in (self.arrived, self.adopted):
                if w in held:
                    held.remove(w)
            if self.target is not None:
                self.target.pop(w, None)
        joined = [w for w in workers if w not in self.c.t]
        for w in joined:
            self.c.add(w)
            self.k[w] = 0
            if self.target is not None:  # one iteration (its implicit first OK), then the barrier
                self.target[w] = self.c.t[w] + 1
        if not self.c.t:
            raise ConfigError("the scheduler needs at least one worker")
        out = self._recovered()  # the last unheard worker left
        if self.recovering or out:
            pass
        elif self.target is None and all(v >= 2 for v in self.k.values()):
            self._decide()
        elif self.target is not None and left:
            out = self._replan(self.target, now)
        return out + self._maybe_release()

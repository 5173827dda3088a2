"""The P-Reduce controller's decision logic. Pure: no I/O, times are arguments.

Paper: Miao et al., *Heterogeneity-Aware Distributed Machine Learning Training via Partial
Reduce*, Sec. 3.1.1 Algorithm 2 ("Controller": a FIFO of ready
signals; as soon as P are queued, pop P and tell them their group), Sec. 3.3 (dynamic partial
reduce: staleness-aware weights from the members' iteration numbers, Eq. 9), Sec. 4 / Fig. 6
(signal queue -> group filter with the group history -> weight generator -> broadcaster; group
frozen and the sync-graph over the last T groups). Read with these errata resolved: the
precise reading of the dynamic weights (B5, B7), the controller and the concrete group-frozen
rule (B8), the end-of-training deadlock (B10).

p2psync decisions beyond the spec (why):

* **Groups are connected over direct links** (``adjacency``): collectives only move tensors
  between adjacent nodes, so on a ring a group must be a run of neighbours. The candidate is
  the first P queued when they are connected; otherwise the earliest queued worker grown
  greedily by the earliest queued adjacent ones (then the next start). On a mesh every set is
  connected and this is exactly Alg. 2's FIFO.
* **The frozen filter swaps one member** (spec §1.6): when the sync-graph of the last T-1
  groups plus the candidate is disconnected and the candidate lies inside one component, the
  earliest queued worker of another component replaces the latest-arrived member that keeps the
  group connected; with none queued the group is deferred for at most ``max_defer`` seconds
  (default: one compute interval of the slowest known worker: the largest, over the current
  members, of the latest time from a worker's group being formed to its next READY; that is
  its local step plus its reduce, not the time it spent queued or deferred, so the bound does
  not grow with the deferrals themselves), then accepted as is. It never deadlocks.
* **The tail** (B10: a controller-driven stop when fewer than P workers remain):
  *remaining* workers are current members that may still send READY (not finished) plus those
  queued. Fewer than P remaining (or every remaining worker queued and no connected group of P
  possible): ``tail="stop"`` stops the run; ``tail="shrink"`` forms smaller groups (a single
  worker gets a solo group of one: no reduce).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Collection, Literal, Mapping, Sequence, get_args

from p2psync.errors import ConfigError, ProtocolError

Weights = Literal["constant", "dynamic"]
Approx = Literal["conservative", "nearest"]
Tail = Literal["stop", "shrink"]
WEIGHTS: tuple[str, ...] = get_args(Weights)
APPROX: tuple[str, ...] = get_args(Approx)
TAILS: tuple[str, ...] = get_args(Tail)

Weight = Fraction | float


def t_min(n: int, p: int) -> int:
    """The smallest sync-graph window that can be connected: ceil((N-1)/(P-1)) (Sec. 4)."""
    if not 2 <= p <= n:
        raise ConfigError(f"P={p} must be between 2 and N={n}")
    return -(-(n - 1) // (p - 1))


def constant_weights(p: int) -> list[Fraction]:
    """Alg. 2 line 7: 1/P each."""
    if p < 1:
        raise ConfigError(f"a group needs at least one member, not {p}")
    return [Fraction(1, p)] * p


def _check_alpha(alpha: Fraction | float) -> None:
    if isinstance(alpha, bool) or not 0 <= alpha < 1:
        raise ConfigError(f"alpha={alpha} must be in [0, 1)")


def dynamic_weights(ks: Sequence[int], alpha: Fraction | float, approx: str = "conservative") -> list[Weight]:
    """Sec. 3.3.3 with the spec's precise reading (§1.4): relative numbers k^_i = max k - k_i + 1,
    K = max k^; version a in 1..K weighs beta(a) = (1-alpha) alpha^(a-1) / (1-alpha^K) (a = 1
    freshest); members sharing a version split it; versions nobody holds go to the stalest
    members (``conservative``, the paper's "initial model") or to the members whose k^ is
    closest (``nearest``, ties split). Exact Fractions when ``alpha`` is a Fraction or int."""
    if not ks:
        raise ConfigError("dynamic weights need at least one member")
    if any(type(k) is not int for k in ks):
        raise ConfigError(f"iteration numbers must be integers: {list(ks)}")
    _check_alpha(alpha)
    if approx not in APPROX:
        raise ConfigError(f"approx={approx!r}: choose conservative or nearest")
    a: Fraction | float = alpha if isinstance(alpha, (Fraction, int)) else float(alpha)
    if isinstance(a, int):
        a = Fraction(a)
    top = max(ks)
    rel = [top - k + 1 for k in ks]
    big_k = max(rel)
    norm = 1 - a ** big_k
    beta = {v: (1 - a) * a ** (v - 1) / norm for v in range(1, big_k + 1)}
    holders: dict[int, list[int]] = {}
    for i, v in enumerate(rel):
        holders.setdefault(v, []).append(i)
    zero: Weight = Fraction(0) if isinstance(a, Fraction) else 0.0
    w: list[Weight] = [zero] * len(ks)
    for v, b in beta.items():
        if v in holders:
            to = holders[v]
        elif approx == "conservative":
            to = holders[big_k]
        else:
            d = min(abs(u - v) for u in holders)
            to = [i for u in holders if abs(u - v) == d for i in holders[u]]
        for i in to:
            w[i] += b / len(to)
    return w


@dataclass(frozen=True)
class Group:
    """One partial reduce the controller decided on."""

    op: int
    members: tuple[int, ...]
    weights: tuple[float, ...]
    k_new: int
    swapped: bool = False


class _Components:
    """Connected components of a graph given by cliques (union-find)."""

    def __init__(self, vertices: Collection[int], cliques: Sequence[Sequence[int]]) -> None:
        self.parent = {v: v for v in vertices}
        for c in cliques:
            inside = [v for v in c if v in self.parent]
            for v in inside[1:]:
                self._union(inside[0], v)

    def find(self, v: int) -> int:
        while self.parent[v] != v:
            self.parent[v] = self.parent[self.parent[v]]
            v = self.parent[v]
        return v

    def _union(self, a: int, b: int) -> None:
        self.parent[self.find(a)] = self.find(b)

    def count(self) -> int:
        return len({self.find(v) for v in self.parent})


class Controller:
    """Signal queue, group filter (topology + group frozen), weight generator (Fig. 6)."""

    def __init__(self, *, members: Sequence[int], p: int, weights: str = "constant", alpha: float = 0.5,
                 approx: str = "conservative", avoid_frozen: bool = True, window: int | None = None,
                 max_defer: float | None = None, tail: str = "stop",
                 adjacency: Mapping[int, Collection[int]] | None = None) -> None:
        if len(set(members)) != len(members) or not members:
            raise ConfigError(f"bad member list {list(members)}")
        if type(p) is not int or p < 2 or p > len(members):
            raise ConfigError(f"P={p} must be between 2 and the number of workers ({len(members)})")
        if weights not in WEIGHTS:
            raise ConfigError(f"weights={weights!r}: choose constant or dynamic")
        if approx not in APPROX:
            raise ConfigError(f"approx={approx!r}: choose conservative or nearest")
        if tail not in TAILS:
            raise ConfigError(f"tail={tail!r}: choose stop or shrink")
        _check_alpha(alpha)
        tm = t_min(len(members), p)
        if window is not None and window < tm:
            raise ConfigError(f"window T={window} is below ceil((N-1)/(P-1)) = {tm}: the sync-graph could "
                              "never be connected")
        if max_defer is not None and not (max_defer >= 0 and math.isfinite(max_defer)):
            raise ConfigError(f"max_defer={max_defer} must be a finite number >= 0")
        self.p, self.mode, self.alpha, self.approx = p, weights, alpha, approx
        self.avoid_frozen, self.tail = avoid_frozen, tail
        self.window = window if window is not None else 4 * tm
        self.max_defer = max_defer
        self.adjacency = {n: frozenset(v) for n, v in adjacency.items()} if adjacency is not None else None
        self.members: frozenset[int] = frozenset(members)
        self._queue: list[tuple[int, int]] = []  # (worker, k) in arrival order
        self.finished: set[int] = set()  # sent their last READY and were grouped (or stopped)
        self._last: set[int] = set()  # queued with last=True
        self.history: list[tuple[int, ...]] = []  # the last T accepted groups
        self._grouped_at: dict[int, float] = {}  # when each worker's latest group was formed
        self._interval: dict[int, float] = {}  # latest group-to-READY interval per worker
        self._defer_until: float | None = None
        self.stopped = False
        self.ops = self.frozen_detected = self.swaps = self.deferrals = self.unresolved = 0

    # -- inputs --------------------------------------------------------------------------

    @property
    def queue(self) -> tuple[int, ...]:
        return tuple(w for w, _ in self._queue)

    def ready(self, worker: int, k: int, now: float, *, last: bool = False) -> list[Group]:
        """READY(worker, k) after a local step (Alg. 2 worker line 5); the groups formed now.
        Remote bad input (not a member, already queued, bad k) is a ProtocolError; the state is
        unchanged."""
        if self.stopped:
            return []
        if type(worker) is not int or worker not in self.members:
            raise ProtocolError("preduce", f"READY from node {worker!r}, not a member of the current view")
        if type(k) is not int or k < 0:
            raise ProtocolError("preduce", f"READY from node {worker}: bad iteration number {k!r}")
        if worker in self.queue:
            raise ProtocolError("preduce", f"READY from node {worker}, which is already queued")
        if worker in self.finished:
            raise ProtocolError("preduce", f"READY from node {worker} after its last one")
        if worker in self._grouped_at:  # one compute interval (step + reduce), queueing excluded
            self._interval[worker] = now - self._grouped_at.pop(worker)
        self._queue.append((worker, k))
        if last:
            self._last.add(worker)
        return self._form(now)

    def tick(self, now: float) -> list[Group]:
        """A deferral deadline passed (or any time): form what can be formed."""
        return [] if self.stopped else self._form(now)

    def wake_at(self) -> float | None:
        return None if self.stopped else self._defer_until

    def set_members(self, members: Sequence[int], now: float) -> list[Group]:
        """The newest membership view: departed workers leave the queue; joiners are admitted."""
        self.members = frozenset(members)
        self._queue = [(w, k) for w, k in self._queue if w in self.members]
        self._last &= self.members
        return [] if self.stopped else self._form(now)

    def forget(self, worker: int, now: float) -> list[Group]:
        """A new life of ``worker`` (it restarted): whatever its previous one had queued or
        finished is dropped."""
        self._queue = [(w, k) for w, k in self._queue if w != worker]
        self._last.discard(worker)
        self.finished.discard(worker)
        self._grouped_at.pop(worker, None)
        self._interval.pop(worker, None)
        return [] if self.stopped else self._form(now)

    def request_stop(self) -> None:
        self.stopped = True
        self._defer_until = None

    # -- state ---------------------------------------------------------------------------

    def remaining(self) -> frozenset[int]:
        """Workers that can still be grouped: members not finished (queued ones included)."""
        return frozenset(self.members - self.finished)

    def _window_graph(self, extra: Sequence[int] = ()) -> _Components:
        recent = self.history[-(self.window - 1):] if self.window > 1 else []
        cliques: list[Sequence[int]] = list(recent)
        if extra:
            cliques.append(extra)
        return _Components(self.remaining(), cliques)

    def sync_graph_connected(self) -> bool:
        """Whether the sync-graph of the last T groups (over the remaining workers) is connected."""
        return _Components(self.remaining(), self.history[-self.window:]).count() <= 1

    def _connected(self, group: Sequence[int]) -> bool:
        if self.adjacency is None or len(group) <= 1:
            return True
        inside, seen, todo = set(group), {group[0]}, [group[0]]
        while todo:
            v = todo.pop()
            for u in self.adjacency.get(v, ()):
                if u in inside and u not in seen:
                    seen.add(u)
                    todo.append(u)
        return len(seen) == len(inside)

    def _candidate(self, size: int) -> list[int] | None:
        """The FIFO group of ``size`` queued workers connected over direct links, or None."""
        q = self.queue
        if len(q) < size:
            return None
        first = list(q[:size])
        if self._connected(first):
            return first
        adj = self.adjacency or {}
        for s in range(len(q)):
            cand = [q[s]]
            while len(cand) < size:
                nxt = next((w for w in q if w not in cand and any(w in adj.get(c, ()) for c in cand)), None)
                if nxt is None:
                    break
                cand.append(nxt)
            if len(cand) == size:
                return sorted(cand, key=q.index)
        return None

    # -- formation -----------------------------------------------------------------------

    def _max_defer(self) -> float:
        if self.max_defer is not None:
            return self.max_defer
        return max((v for w, v in self._interval.items() if w in self.members), default=0.0)

    def _form(self, now: float) -> list[Group]:
        out: list[Group] = []
        while not self.stopped:
            rem = self.remaining()
            size = self.p
            if len(rem) < self.p or len(self.members) < 2:
                if self.tail == "stop" or not rem:
                    self._stop()
                    break
                size = len(rem)
            cand = self._candidate(size)
            if cand is None:
                if set(rem) <= set(self.queue):  # every remaining worker waits: a stall
                    if self.tail == "stop":
                        self._stop()
                        break
                    cand = self._largest_connected(size)
                if cand is None:
                    break
            swapped = False
            if self.avoid_frozen and len(cand) > 1 and len(self.history) >= self.window - 1:
                cand2 = self._unfreeze(cand)
                if cand2 is None:  # frozen, nobody from another component queued
                    if self._defer_until is None:
                        self._defer_until = now + self._max_defer()
                        self.deferrals += 1
                    if now < self._defer_until:
                        break
                    self.unresolved += 1
                else:
                    swapped = cand2 != cand
                    cand = cand2
            self._defer_until = None
            out.append(self._accept(cand, swapped, now))
        return out

    def _unfreeze(self, cand: list[int]) -> list[int] | None:
        """The candidate, or one with a member swapped for a queued worker of another component;
        None when the sync-graph stays disconnected and no such worker is queued."""
        if self._window_graph(cand).count() <= 1:
            return cand
        comps = self._window_graph()
        roots = {comps.find(w) for w in cand if w in comps.parent}
        if len(roots) > 1:  # the candidate already bridges components: it helps
            return cand
        self.frozen_detected += 1
        root = next(iter(roots), None)
        for x in self.queue:
            if x in cand or x not in comps.parent or comps.find(x) == root:
                continue
            for i in range(len(cand) - 1, -1, -1):
                trial = cand[:i] + cand[i + 1:] + [x]
                if self._connected(trial):
                    self.swaps += 1
                    return trial
        return None

    def _largest_connected(self, size: int) -> list[int] | None:
        for s in range(min(size, len(self.queue)), 0, -1):
            cand = self._candidate(s)
            if cand is not None:
                return cand
        return None

    def _accept(self, cand: list[int], swapped: bool, now: float) -> Group:
        ks = dict(self._queue)
        self._queue = [(w, k) for w, k in self._queue if w not in cand]
        self.ops += 1
        self.history.append(tuple(cand))
        del self.history[:-self.window]
        group_ks = [ks[w] for w in cand]
        for w in cand:
            self._grouped_at[w] = now
        if self.mode == "dynamic" and len(cand) > 1:
            raw = dynamic_weights(group_ks, float(self.alpha), self.approx)
        else:
            raw = list(constant_weights(len(cand)))
        for w in cand:
            if w in self._last:
                self._last.discard(w)
                self.finished.add(w)
        return Group(op=self.ops, members=tuple(cand), weights=tuple(float(x) for x in raw),
                     k_new=max(group_ks), swapped=swapped)

    def _stop(self) -> None:
        self.stopped = True
        self._defer_until = None
        self.finished |= self._last
        self._last.clear()

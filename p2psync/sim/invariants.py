"""The invariants a simulated run is checked against, over what its nodes saw. Pure.

Input: every view a node applied (:class:`ViewSeen`, in virtual time), the faults injected
and the detection bound. Each check answers ``"held"`` or a description of the violation (a
check that does not apply, such as the training's ``same_model_at_end`` for a strategy that
promises no single model, answers ``"not promised: ..."``: :func:`violated` tells them apart):

* ``one_coordinator_per_term``: no two views of one term name different coordinators.
* ``faults_detected_in_bound``: the members a fault cuts off from the group of nodes holding
  a majority (:func:`cut_by`: a killed node, a paused one, the side of a partition without
  the majority, and the nodes that reach the majority only through such nodes, such as the
  shorter arc of a ring with two nodes killed) are declared failed (left out of a view)
  within the bound of the fault's start when the fault is a kill or lasts at least the bound
  (within two bounds for the members cut off together with the coordinator, when the fault
  lasts that long: its successor is elected first, and only then watches them; and the
  coordinator itself within the bound plus one probe of its line of successors when
  successors ahead of the first one on the majority's side are cut off with it: they are
  passed over after one unanswered probe, ``line_s``); a node
  paused for less than the failure timeout less a heartbeat interval is not declared failed
  at all; no node is removed by a fault after which no group holds a majority (an even
  split; a declaration in its window that another fault accounts for, as
  ``no_false_failure`` counts it, is that fault's). A restart of a running node kills it
  first: that process is declared failed within the bound like a killed one (the
  coordinator admits the new process only then); so is the process of a node killed before
  that a view still names (a kill after which no group held a majority got nobody
  declared), that declaration being the restart's; the nodes behind it are not cut off (the
  new process relays at once). When no group held a majority right before the restart (the
  kill split a ring into two even arcs: :func:`leaderless_before`), the old process is
  declared within two bounds: the nodes cut off from the coordinator may have deposed it
  meanwhile, and a coordinator is elected first. A kill's declaration counts until its node is restarted (plus the bound); a later
  removal of the new process is another matter. A killed node is declared failed however
  soon it is restarted (its process is gone), but the nodes behind it are cut off only until
  the restart that joins them to the majority again (:func:`reconnected`): like the nodes of
  a pause, they must be declared only when that lasts at least their bound. A slowdown (:func:`slow_risk`) must get a
  member declared failed only when every way from it to the coordinator gets at least the
  bound longer one way while the slowdown lasts at least the bound, and the members not at
  risk (below) hold a majority. While slowdowns are in force, and until the members have
  measured the round trip again after their end (:func:`remeasured`), the bound of the other
  faults grows by four times the longest round trip they add. A declaration due after the run
  ended (its processes ended after the finish barrier) is not required.
* ``no_false_failure``: every node declared failed was cut off by a fault (as above) between
  the fault's start and its end (a kill's: its node's restart) plus the bound, or was at risk
  from a slowdown (:func:`slow_risk`: a shortest way to the coordinator got at least the
  failure timeout less a heartbeat interval longer there and back, the silence a detector
  may take for a failure; when half the members are, the coordinator too and the members
  slowed so on the way to any member, their next coordinator) between its start
  and its end plus the bound and the delay it adds. A node whose round trip a slowdown
  lengthens by less is not declared failed: its detector's bound fits the link.
* ``one_view_at_end``: every node that is neither killed, nor fenced, nor cut off for good
  from the group of nodes holding a majority of the newest view (a fenced process is gone:
  nobody relays through it; with a strategy a new process of it starts and joins) holds the
  same view at the end, and its members are exactly those nodes, restarted nodes included (a new process must have rejoined); only
  a node restarted too late to rejoin before the end (:func:`rejoin_bound`) and not rejoined
  yet may be in it or not. When no group holds such a majority (nothing can change), each
  connected group holds one view (:func:`one_view_per_group`).

* ``quiet_end`` (a run whose processes end after the finish barrier: :func:`quiet_end`): once
  the first of them ended, nobody is declared failed any more; the others end too, each once
  it has the barrier's reply. The checks above judge the declarations until then; at the end
  (``one_view_at_end``) the nodes that the last view does not name were declared failed and
  nobody is left to tell them (``left_behind``: not held to that view), and a node killed less
  than a bound before the end, or after its loop had finished (the coordinator declares no
  node that finished), may be named or not.

* ``bounded_queues``: no node's memory for messages overflowed: no message was dropped, or
  refused, because a queue was full (the mailbox's byte budget per sender, its caps on queued
  data and control messages, the bytes held for relaying: reasons :data:`OVERFLOWS`), and the
  most bytes queued at once stayed within the mailbox's budget per sender times the senders
  and the relay budget (:func:`bounded_queues`; the summary gives each node's peaks).

:func:`declarations` derives who was declared failed, when and by which coordinator, from
the views (a node left out of a node's next view, not as departed).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Mapping, Sequence

from p2psync.coordinator.detector import RTT_WINDOW
from p2psync.sim.faults import Fault

HELD = "held"
#: how a check that does not apply begins (a strategy that promises no single model): no
#: violation, and no proof either
NOT_PROMISED = "not promised"


def violated(result: str) -> bool:
    """Whether a check's ``result`` is a violation: neither :data:`HELD` nor
    :data:`NOT_PROMISED`."""
    return result != HELD and not result.startswith(NOT_PROMISED)


@dataclass(frozen=True)
class ViewSeen:
    """Node ``node``'s process ``incarnation`` applied the view (``term``, ``epoch``) of
    ``coordinator`` at virtual time ``t``."""

    t: float
    node: int
    term: int
    epoch: int
    coordinator: int
    members: tuple[int, ...]
    departed: tuple[int, ...] = ()
    incarnation: int = 1


@dataclass(frozen=True)
class Declaration:
    """``node`` was first seen declared failed at ``t`` in a view of ``coordinator`` (``term``)."""

    t: float
    coordinator: int
    term: int
    node: int


def declarations(views: Iterable[ViewSeen]) -> list[Declaration]:
    """Removals from the views: a node left out of a process's next view (not as departed; a
    new process's first view follows nothing: what its node's previous process saw last is
    no view it replaced). Each removal counts once, at its earliest sighting: a node is
    declared failed again only after a view newer than the one that removed it listed it as
    a member again (a rejoin)."""
    prev: dict[tuple[int, int], ViewSeen] = {}
    removed: dict[int, tuple[int, int]] = {}  # node -> (term, epoch) of the view that removed it
    out: list[Declaration] = []
    for v in sorted(views, key=lambda v: v.t):
        for n in v.members:
            if n in removed and (v.term, v.epoch) > removed[n]:
                del removed[n]
        before = prev.get((v.node, v.incarnation))
        prev[v.node, v.incarnation] = v
        if before is None:
            continue
        for n in sorted(set(before.members) - set(v.members) - set(v.departed)):
            if n not in removed:
                removed[n] = (v.term, v.epoch)
                out.append(Declaration(t=v.t, coordinator=v.coordinator, term=v.term, node=n))
    return sorted(out, key=lambda d: (d.t, d.node))


def one_coordinator_per_term(views: Iterable[ViewSeen]) -> str:
    by_term: dict[int, set[int]] = {}
    for v in views:
        by_term.setdefault(v.term, set()).add(v.coordinator)
    bad = {t: sorted(c) for t, c in sorted(by_term.items()) if len(c) > 1}
    return HELD if not bad else f"terms with more than one coordinator: {bad}"


def _newest_before(views: Sequence[ViewSeen], t: float) -> ViewSeen | None:
    """The newest view (by term, epoch) applied before ``t``."""
    seen = [v for v in views if v.t <= t]
    return max(seen, key=lambda v: (v.term, v.epoch)) if seen else None


def _members_before(views: Sequence[ViewSeen], t: float) -> tuple[int, ...]:
    """The members of the newest view (by term, epoch) applied before ``t``."""
    v = _newest_before(views, t)
    return () if v is None else v.members


#: node -> its neighbours (the topology's links); None: every node reaches every other
Links = Mapping[int, Sequence[int]]


def components(links: Links, removed: Iterable[int],
               split: tuple[Collection[int], Collection[int]] | None = None) -> list[set[int]]:
    """The connected groups of the nodes of ``links`` that are not ``removed``, over the links
    that do not join the two sides of ``split`` (a partition)."""
    gone = set(removed)
    a, b = (set(split[0]), set(split[1])) if split is not None else (set(), set())
    seen: set[int] = set()
    out: list[set[int]] = []
    for start in sorted(links):
        if start in gone or start in seen:
            continue
        group, todo = {start}, [start]
        while todo:
            n = todo.pop()
            for nb in links[n]:
                if nb not in gone and nb not in group and not ((n in a and nb in b) or (n in b and nb in a)):
                    group.add(nb)
                    todo.append(nb)
        seen |= group
        out.append(group)
    return out


def _down(faults: Sequence[Fault], past: Callable[[Fault], bool]) -> set[int]:
    """The nodes whose process is down once the faults in time order are applied up to the
    first that is ``past`` the moment asked about: killed and not restarted since."""
    down: set[int] = set()
    for f in sorted(faults, key=lambda f: f.at):
        if past(f):
            break
        if f.kind == "kill":
            down |= set(f.nodes)
        elif f.kind == "restart":
            down -= set(f.nodes)
    return down


def killed_by(faults: Sequence[Fault], t: float) -> set[int]:
    """The nodes whose process is down at ``t``: killed at or before ``t`` and not restarted
    since (a restart at ``t`` runs a new process from ``t``)."""
    return _down(faults, lambda f: f.at > t)


def _down_before(f: Fault, faults: Sequence[Fault]) -> set[int]:
    """The nodes whose process is down right before fault ``f``: killed before it (or at its
    time by a fault listed before it) and not restarted since."""
    return _down(faults, lambda g: g is f)


def _running_before(f: Fault, faults: Sequence[Fault]) -> set[int]:
    """The nodes of restart ``f`` whose process was running right before it (neither killed
    before, nor killed at its time by a fault listed before it): it kills them first."""
    return set(f.nodes) - _down_before(f, faults)


def leaderless_before(f: Fault, faults: Sequence[Fault], members: Sequence[int], links: Links | None) -> bool:
    """Whether, right before restart ``f``, no group of live nodes held a majority of
    ``members`` (a kill split a ring into two even arcs, and the restart joins them again):
    the nodes cut off from the coordinator since may have deposed it by then, so the old
    process is declared failed only once a coordinator is elected again (two bounds)."""
    if f.kind != "restart":
        return False
    return _major_without(_down_before(f, faults) | (set(links or ()) - set(members)), members, links) is None


def until(f: Fault, faults: Sequence[Fault]) -> float:
    """When fault ``f`` stops cutting its nodes off: a lasting fault's end; a kill's, the
    restart of the last of its nodes restarted (inf when one never is); a restart's, its time."""
    if f.kind == "restart":
        return f.at
    if f.kind != "kill":
        return f.end if f.end is not None else math.inf
    ends = []
    for n in f.nodes:
        ends.append(min((g.at for g in faults if g.kind == "restart" and n in g.nodes and g.at >= f.at),
                        default=math.inf))
    return max(ends, default=math.inf)


def rejoin_bound(bound: float, discover_s: float) -> float:
    """How long a restarted node may take to be a member again: its previous process declared
    failed (one bound: the coordinator admits the new one only then), its probe for a run going
    (``discover_s``), and its registration and the view that admits it reaching every node
    (another bound)."""
    return 2 * bound + discover_s


def _gone(faults: Sequence[Fault], t: float, members: Sequence[int], links: Links | None) -> set[int]:
    """The nodes that relay nothing at ``t``: those killed, and those the view ``members``
    left out (every node routes around the nodes declared failed; a fenced node stays out
    until restarted)."""
    return killed_by(faults, t) | (set(links or ()) - set(members))


def _major(groups: Iterable[set[int]], members: Sequence[int]) -> set[int] | None:
    return next((g for g in groups if 2 * len(g & set(members)) > len(members)), None)


def _major_without(gone: set[int], members: Sequence[int], links: Links | None) -> set[int] | None:
    """The group of nodes, ``gone`` left out, that holds a majority of ``members`` (over the
    topology's ``links``; without them, every member left is one group); None when none does."""
    return _major(components(links, gone) if links is not None else [set(members) - gone], members)


def stranded(links: Links | None, killed: Iterable[int], members: Sequence[int]) -> list[int] | None:
    """The live ``members`` that the loss of the nodes ``killed`` (killed, or removed from the
    view: nobody relays through them) cuts off from the group of live nodes holding a majority
    of ``members`` (a ring with two nodes killed is two arcs: the shorter one is cut off for
    good, as by a partition that never heals); None when no group holds such a majority."""
    dead = set(killed)
    major = _major_without(dead, members, links)
    if major is None:
        return None
    return sorted(n for n in members if n not in dead and n not in major)


def cut_by(f: Fault, faults: Sequence[Fault], members: Sequence[int], links: Links | None) -> list[int] | None:
    """The ``members`` that fault ``f`` cuts off from the group of nodes holding a majority of
    ``members``: the nodes it kills or stops, the side of a partition without the majority,
    and the nodes behind them (that reach the majority only through them; the nodes killed or
    removed from the view before relay nothing either; a kill cuts off only the members that
    were in the majority without it: those that earlier faults cut off are theirs, as when a
    process exits on its own while others are cut off). None when no group holds a majority."""
    if f.kind == "slow":
        return []  # (a slowdown cuts nobody off: slow_risk)
    gone = _gone(faults, f.at, members, links)
    stopped = _running_before(f, faults) if f.kind == "restart" else set(f.nodes)
    if f.kind not in ("partition", "restart"):  # (a new process relays at once)
        gone |= stopped
    split = (f.nodes, f.other) if f.kind == "partition" else None
    if links is not None:
        groups = components(links, gone, split)
    elif split is not None:
        groups = [set(split[0]) - gone, set(split[1]) - gone]
    else:
        groups = [set(members) - gone]
    major = _major([g - stopped for g in groups] if f.kind == "restart" else groups, members)
    if major is None:
        return None
    if f.kind == "restart":  # the new processes relay at once: nobody behind them is cut off
        # (a node killed before and still a member: its process is gone, and the coordinator
        # admits the new one only once it is declared, as the restart of a running node)
        return sorted(n for n in members if n in f.nodes)
    if f.kind == "kill":
        prior = _gone([g for g in faults if g is not f], f.at, members, links)  # (gone without this kill)
        before = _major_without(prior, members, links)
        return sorted(n for n in members if n not in major and (n in f.nodes or before is None or n in before))
    return sorted(n for n in members if n not in major)


def reconnected(f: Fault, faults: Sequence[Fault], members: Sequence[int], links: Links | None,
                cut: Iterable[int]) -> dict[int, float]:
    """When each node of ``cut`` behind the nodes of kill ``f`` (not one of them) reaches the
    group holding a majority of ``members`` again: the first restart of the kill's nodes
    after which it does (their new processes relay at once; inf: none does). The kill's own
    nodes are not in it: their processes are gone, and each is declared failed whenever it
    is restarted (the coordinator admits the new process only then)."""
    out = {n: math.inf for n in cut if n not in f.nodes}
    if not out:
        return out
    gone = _gone(faults, f.at, members, links) | set(f.nodes)
    restarts = sorted((g.at, m) for g in faults if g.kind == "restart" and g.at >= f.at
                      for m in g.nodes if m in f.nodes)
    for at, m in restarts:
        if m not in gone:
            continue  # (restarted again: its first restart counts)
        gone.discard(m)
        major = _major_without(gone, members, links)
        for n in out:
            if out[n] == math.inf and major is not None and n in major:
                out[n] = at
    return out


#: the one-way latency of the link between two neighbours (seconds)
Latency = Callable[[int, int], float]


def _slow_delays(f: Fault, coordinator: int, nodes: Collection[int], links: Links | None,
                 latency: Latency | None) -> tuple[dict[int, float], dict[int, float]]:
    """Per node of ``nodes`` (the live ones) that reaches ``coordinator`` through them: the
    extra one-way delay that slowdown ``f`` adds on its way to the coordinator, the most over
    its shortest ways (in hops: the router's), and the least over every way (a resend may take
    another)."""
    live = set(nodes)
    if coordinator not in live:
        return {}, {}
    adj = {n: [m for m in (links[n] if links is not None else live) if m in live and m != n] for n in live}
    factor = f.factor or 1.0

    def extra(a: int, b: int) -> float:
        return (factor - 1.0) * (latency(a, b) if latency is not None else 0.0) if f.slows(a, b) else 0.0

    dist = {coordinator: 0}
    most = {coordinator: 0.0}
    order = [coordinator]
    for n in order:  # breadth first: every node after the nodes one hop closer
        for m in adj[n]:
            if m not in dist:
                dist[m] = dist[n] + 1
                order.append(m)
    for n in order[1:]:
        most[n] = max(most[p] + extra(p, n) for p in adj[n] if dist.get(p) == dist[n] - 1)
    least = {coordinator: 0.0}
    heap = [(0.0, coordinator)]
    while heap:
        d, n = heapq.heappop(heap)
        if d > least.get(n, math.inf):
            continue
        for m in adj[n]:
            dm = d + extra(n, m)
            if dm < least.get(m, math.inf):
                least[m] = dm
                heapq.heappush(heap, (dm, m))
    return most, least


@dataclass(frozen=True)
class SlowRisk:
    """What a slowdown may do (:func:`slow_risk`): the members it may get declared failed
    (``risk``), those it must (``must``), and the most extra round trip it adds to a member's
    way to the coordinator (``rtt``)."""

    risk: tuple[int, ...]
    must: tuple[int, ...]
    rtt: float


def slow_risk(f: Fault, faults: Sequence[Fault], views: Sequence[ViewSeen], *, bound: float,
              failure_timeout: float, interval: float, links: Links | None = None,
              latency: Latency | None = None) -> SlowRisk:
    """The members that slowdown ``f`` may and must get declared failed (see the module
    docstring), from the view in force at its start: at risk, a member whose round trip to
    the coordinator, over a shortest way, gets at least ``failure_timeout - interval`` longer
    (the coordinator hears it that much later, and it hears the coordinator's replies that much
    later: a silence the detector may take for a failure, before it measured the new round
    trip), and when at least half the members are (they may depose the coordinator and elect
    another) the coordinator too and every member at risk so on the way to any other member
    (the coordinator it may follow then); declared for sure, a
    member whose every way to the coordinator gets at least ``bound`` longer one way while the
    slowdown lasts ``bound`` at least, when the coordinator is not at risk and the members not
    at risk hold a majority. ``latency``: the links' one-way latency (None: none, nothing
    gets slower)."""
    before = _newest_before(views, f.at)
    if before is None:
        return SlowRisk((), (), 0.0)
    members, c = before.members, before.coordinator
    gone = _gone(faults, f.at, members, links)
    live = [n for n in (links if links is not None else members) if n not in gone]
    most, least = _slow_delays(f, c, live, links, latency)
    rtt = 2 * max(most.values(), default=0.0)
    risk = {n for n in members if n in most and 2 * most[n] >= failure_timeout - interval}
    if risk and 2 * len(risk) >= len(members):  # enough of them may depose it and elect another
        risk.add(c)
        for m in members:  # whoever coordinates then: at risk, who is slowed on the way to it
            if m != c and m in most:
                theirs, _ = _slow_delays(f, m, live, links, latency)
                risk |= {n for n in members if 2 * theirs.get(n, 0.0) >= failure_timeout - interval}
    must: set[int] = set()
    if (c in most and c not in risk and f.duration is not None and f.duration >= bound
            and 2 * len([n for n in members if n not in risk and n not in gone]) > len(members)):
        must = {n for n in risk if least.get(n, 0.0) >= bound}
    return SlowRisk(tuple(sorted(risk)), tuple(sorted(must)), rtt)


def remeasured(f: Fault, rtt: float, interval: float) -> float:
    """When the members' round-trip estimates no longer hold slowdown ``f``, which adds at most
    ``rtt`` to a round trip: a request sent before its end is answered by its end plus that
    round trip and the links' own (a heartbeat interval covers theirs); then every member
    measures :data:`~p2psync.coordinator.detector.RTT_WINDOW` round trips, one a heartbeat
    (its estimate keeps within as many latest samples), and its next heartbeat carries the
    estimate to the coordinator, whose detector waits for silence by it."""
    end = f.end if f.end is not None else math.inf
    return end + rtt + (RTT_WINDOW + 2) * interval


def _bound_at(f: Fault, faults: Sequence[Fault], views: Sequence[ViewSeen], *, bound: float,
              failure_timeout: float, interval: float, links: Links | None, latency: Latency | None) -> float:
    """The detection bound of fault ``f``: ``bound``, plus four times the longest round trip
    the slowdowns add that are in force during it or not yet remeasured at its start
    (:func:`remeasured`; see the module docstring); twice that for a restart that joins a
    cluster left without a majority (:func:`leaderless_before`)."""
    extra = 0.0
    for g in faults:
        if g.kind != "slow" or g is f or g.at > f.at + bound:
            continue
        rtt = slow_risk(g, faults, views, bound=bound, failure_timeout=failure_timeout, interval=interval,
                        links=links, latency=latency).rtt
        if remeasured(g, rtt, interval) >= f.at:
            extra = max(extra, rtt)
    twice = leaderless_before(f, faults, _members_before(views, f.at), links)
    return (bound + 4 * extra) * (2 if twice else 1)


def _reaches(faults: Sequence[Fault], views: Sequence[ViewSeen], *, bound: float, failure_timeout: float,
             interval: float, links: Links | None,
             latency: Latency | None) -> list[tuple[Fault, float, frozenset[int]]]:
    """Per fault, until when a declaration may be its own (from its start; see
    ``no_false_failure`` in the module docstring: its end plus its bound, a slowdown's plus the
    round trip it adds too) and the nodes it may get declared (those it cuts off, or a
    slowdown's at risk)."""
    out: list[tuple[Fault, float, frozenset[int]]] = []
    for f in faults:
        fbound = _bound_at(f, faults, views, bound=bound, failure_timeout=failure_timeout, interval=interval,
                           links=links, latency=latency)
        if f.kind == "slow":
            risk = slow_risk(f, faults, views, bound=bound, failure_timeout=failure_timeout, interval=interval,
                             links=links, latency=latency)
            out.append((f, until(f, faults) + fbound + risk.rtt, frozenset(risk.risk)))
        else:
            out.append((f, until(f, faults) + fbound,
                        frozenset(cut_by(f, faults, _members_before(views, f.at), links) or ())))
    return out


def _first_declared(decls: Sequence[Declaration], f: Fault, last: float,
                    counts: Callable[[Declaration], bool]) -> dict[int, float]:
    """How long after ``f`` started each node was first declared failed, among the
    declarations from its start to ``last`` that ``counts``."""
    seen: dict[int, float] = {}
    for d in decls:
        if counts(d) and f.at <= d.t <= last and d.node not in seen:
            seen[d.node] = round(d.t - f.at, 6)
    return seen


def _declared(seen: Mapping[int, float]) -> dict[str, float]:
    return {str(n): s for n, s in sorted(seen.items())}


def _slow_detection(f: Fault, faults: Sequence[Fault], views: Sequence[ViewSeen], decls: Sequence[Declaration], *,
                    fbound: float, bound: float, failure_timeout: float, interval: float, links: Links | None,
                    latency: Latency | None, horizon: float = math.inf) -> tuple[dict[str, object], str | None]:
    """A slowdown's record and problem (None: none) for :func:`detections`: the members it put
    at risk may be declared failed; those it slowed beyond the bound on every way to the
    coordinator must be, within ``fbound``."""
    risk = slow_risk(f, faults, views, bound=bound, failure_timeout=failure_timeout, interval=interval,
                     links=links, latency=latency)
    seen = _first_declared(decls, f, until(f, faults) + fbound + risk.rtt, lambda d: d.node in risk.risk)
    rec: dict[str, object] = {"fault": f.spec(), "declared_after_s": _declared(seen), "at_risk": list(risk.risk)}
    due = risk.must if f.at + fbound <= horizon else ()  # (the run ended before its bound)
    missed = [n for n in due if n not in seen]
    late = {n: seen[n] for n in due if n in seen and seen[n] > fbound}
    if not (missed or late):
        return rec, None
    return rec, (f"{f.spec()}: slowed beyond the bound on every way to the coordinator, " + "; ".join(
        ([f"never declared failed: {missed}"] if missed else [])
        + ([f"declared after more than {fbound:.3f}s: {late}"] if late else [])))


def _cut_limits(f: Fault, views: Sequence[ViewSeen], members: Sequence[int], cut: Sequence[int], *,
                fbound: float, line_s: float) -> tuple[dict[int, float], bool]:
    """How soon each node ``f`` cut off must be declared failed, and whether the coordinator
    is among them: then its successor is elected before it watches the others, who are
    declared within two bounds (one for the coordinator, one for them), and the coordinator
    itself within the bound plus one probe of the line of successors (``line_s``) when
    successors ahead of the majority's first one are cut off with it."""
    before = _newest_before(views, f.at)
    lead_by = before.coordinator if before is not None and before.coordinator in cut else None
    limit = {n: fbound if lead_by is None or n == lead_by else 2 * fbound for n in cut}
    if lead_by is not None:
        first = min((n for n in members if n not in cut), default=None)
        if first is not None and any(n in cut and n != lead_by for n in members if n < first):
            limit[lead_by] = fbound + line_s
    return limit, lead_by is not None


def _cut_detection(f: Fault, faults: Sequence[Fault], views: Sequence[ViewSeen], decls: Sequence[Declaration], *,
                   fbound: float, failure_timeout: float, interval: float, links: Links | None, line_s: float,
                   elsewhere: Callable[[Fault, Declaration], bool],
                   horizon: float = math.inf) -> tuple[dict[str, object], str | None]:
    """A kill's, restart's, pause's or partition's record and problem (None: none) for
    :func:`detections` (the rules are the module docstring's ``faults_detected_in_bound``)."""
    members = _members_before(views, f.at)
    found = cut_by(f, faults, members, links)
    cut = found if found is not None else []
    limit, lead = _cut_limits(f, views, members, cut, fbound=fbound, line_s=line_s)
    seen = _first_declared(decls, f, until(f, faults) + fbound, lambda d: d.node in cut or (
        found is None and d.node in members and not elsewhere(f, d)))
    rec: dict[str, object] = {"fault": f.spec(), "declared_after_s": _declared(seen)}
    back = reconnected(f, faults, members, links, cut) if f.kind == "kill" else {}

    def must(n: int) -> bool:  # cut off long enough to be declared in its limit, before the run ended
        if f.at + limit.get(n, fbound) > horizon:
            return False
        if f.kind == "kill":
            return n in f.nodes or back.get(n, math.inf) - f.at >= limit.get(n, fbound)
        return f.kind == "restart" or (f.duration is not None and f.duration >= limit.get(n, fbound))

    problems: list[str] = []
    if f.kind == "pause" and f.duration is not None and f.duration < failure_timeout - interval and seen:
        problems.append(f"{f.spec()}: paused {f.duration:g}s, under the failure timeout "
                        f"{failure_timeout:g}s less a heartbeat interval, yet declared failed "
                        f"({rec['declared_after_s']})")
    if found is None:
        rec["majority"] = None
        if seen:
            problems.append(f"{f.spec()}: no group of nodes holds a majority of {len(members)} members, yet "
                            f"{sorted(seen)} were declared failed")
        return rec, " | ".join(problems) or None
    late = {n: s for n, s in seen.items() if must(n) and s > limit.get(n, fbound)}
    missed = [n for n in cut if n not in seen and must(n)]
    if missed or late:
        problems.append(f"{f.spec()}: " + "; ".join(
            ([f"never declared failed: {missed}"] if missed else [])
            + ([f"declared after more than {fbound:.3f}s"
                + (" (twice that for those cut off with the coordinator)" if lead else "")
                + f": {late}"] if late else [])))
    return rec, " | ".join(problems) or None


def detections(faults: Sequence[Fault], views: Sequence[ViewSeen], *, bound: float,
               failure_timeout: float, links: Links | None = None,
               interval: float = 0.0, latency: Latency | None = None,
               line_s: float = 0.0, horizon: float = math.inf) -> tuple[list[dict[str, object]], str]:
    """Per fault, who was declared failed how long after it started; and the verdict of
    ``faults_detected_in_bound`` (see the module docstring). ``links``: the topology's links
    (a fault also cuts off the nodes behind the ones it stops, :func:`cut_by`); ``interval``:
    the heartbeat interval (a node's silence starts at its last heartbeat, up to an interval
    before the fault: a pause under the failure timeout less an interval is never declared);
    ``latency``: the links' one-way latency (what a slowdown multiplies, :func:`slow_risk`);
    ``line_s``: how long a probe of the line of successors waits for an answer before passing
    a silent one over (the coordinator's extra time when successors are cut off with it);
    ``horizon``: when the run ended (its processes ended after the finish barrier): a
    declaration due later is not required."""
    decls = declarations(views)
    reach = _reaches(faults, views, bound=bound, failure_timeout=failure_timeout, interval=interval, links=links,
                     latency=latency)

    def elsewhere(f: Fault, d: Declaration) -> bool:  # another fault's own declaration
        return any(g is not f and g.at <= d.t <= last and d.node in nodes for g, last, nodes in reach)

    out: list[dict[str, object]] = []
    problems: list[str] = []
    for f in faults:
        fbound = _bound_at(f, faults, views, bound=bound, failure_timeout=failure_timeout, interval=interval,
                           links=links, latency=latency)
        if f.kind == "slow":
            rec, problem = _slow_detection(f, faults, views, decls, fbound=fbound, bound=bound,
                                           failure_timeout=failure_timeout, interval=interval, links=links,
                                           latency=latency, horizon=horizon)
        else:
            rec, problem = _cut_detection(f, faults, views, decls, fbound=fbound, failure_timeout=failure_timeout,
                                          interval=interval, links=links, line_s=line_s, elsewhere=elsewhere,
                                          horizon=horizon)
        out.append(rec)
        if problem is not None:
            problems.append(problem)
    return out, (HELD if not problems else " | ".join(problems))


def no_false_failure(faults: Sequence[Fault], views: Sequence[ViewSeen], *, bound: float,
                     links: Links | None = None, failure_timeout: float = math.inf, interval: float = 0.0,
                     latency: Latency | None = None) -> str:
    """See the module docstring: a declaration is covered by a fault that cut the node off
    from the majority (:func:`cut_by`: it was killed or paused, on the side of a partition
    without the majority, or behind such nodes; ``links``: the topology's links), from the
    fault's start to its end (:func:`until`) plus ``bound``, or by a slowdown that put it at
    risk (:func:`slow_risk`, with ``failure_timeout``, ``interval`` and ``latency``; the
    default timeout puts nobody at risk) from its start to its end plus the bound and the
    round trip it adds."""
    bad: list[str] = []
    reach = _reaches(faults, views, bound=bound, failure_timeout=failure_timeout, interval=interval, links=links,
                     latency=latency)
    risks = any(f.kind == "slow" for f in faults)
    for d in declarations(views):
        if not any(f.at <= d.t <= last and d.node in nodes for f, last, nodes in reach):
            bad.append(f"node {d.node} declared failed by coordinator {d.coordinator} (term {d.term}) at "
                       f"{d.t:.3f}s with no fault on it, nor a partition leaving it without a majority"
                       + (", nor a slowdown putting it at risk" if risks else ""))
    return HELD if not bad else "; ".join(bad)


def quiet_end(views: Sequence[ViewSeen], faults: Sequence[Fault], end: float, *, bound: float) -> str:
    """Once the first process ended after the finish barrier (at ``end``), the others end too,
    each once it has the barrier's reply (and the nodes behind it theirs): nobody stays long
    enough to declare anyone failed. A declaration after ``end`` is a violation (a reply lost,
    a node left waiting), unless a fault that began after ``end`` less ``bound`` touched the
    node (killed, paused or slowed it, or cut it off: a partition's either side)."""
    late = [f for f in faults if f.at > end - bound]
    touched = {n for f in late for n in (*f.nodes, *f.other)}
    everyone = any(f.kind == "partition" and not f.other for f in late)  # (one side and every other node)
    after = [d for d in declarations(views) if d.t > end and d.node not in touched and not everyone]
    if not after:
        return HELD
    return (f"after the first process ended behind the finish barrier at {end:.3f}s, nodes were declared failed: "
            + "; ".join(f"node {d.node} by {d.coordinator} (term {d.term}) at {d.t:.3f}s" for d in after[:10]))


#: the reasons a transport counts a message dropped or refused because a queue was full
OVERFLOWS: tuple[str, ...] = ("mailbox_budget", "mailbox_full", "mailbox_control_full", "relay_budget")


@dataclass(frozen=True)
class Queues:
    """What one node's queues held: the most messages and payload bytes queued unclaimed in
    its mailbox at once, the most bytes it held for relaying at once, and the messages it
    dropped or refused per reason of :data:`OVERFLOWS` (only those counted)."""

    peak_pending: int
    peak_bytes: int
    peak_relay_bytes: int
    overflows: Mapping[str, int]

    def __or__(self, other: Queues) -> Queues:
        """Both processes' queues of one node: the larger peaks, the overflows added."""
        return Queues(peak_pending=max(self.peak_pending, other.peak_pending),
                      peak_bytes=max(self.peak_bytes, other.peak_bytes),
                      peak_relay_bytes=max(self.peak_relay_bytes, other.peak_relay_bytes),
                      overflows={k: self.overflows.get(k, 0) + other.overflows.get(k, 0)
                                 for k in {*self.overflows, *other.overflows}})


def bounded_queues(queues: Mapping[int, Queues], *, mailbox_budget: int, relay_budget: int, senders: int) -> str:
    """``held`` when no node overflowed a queue (see the module docstring), else which ones
    and how; ``senders``: the most nodes a mailbox takes messages from (its byte budget is
    per sender). Pure."""
    bad: list[str] = []
    for n, q in sorted(queues.items()):
        why = [f"{k} x{v}" for k, v in sorted(q.overflows.items()) if v]
        if q.peak_bytes > mailbox_budget * senders:
            why.append(f"{q.peak_bytes} bytes queued > {mailbox_budget} x {senders} senders")
        if q.peak_relay_bytes > relay_budget:
            why.append(f"{q.peak_relay_bytes} bytes held for relaying > {relay_budget}")
        if why:
            bad.append(f"node {n}: {', '.join(why)}")
    if not bad:
        return HELD
    return f"{len(bad)} node(s) overflowed a queue: " + "; ".join(bad[:10]) + ("; ..." if len(bad) > 10 else "")


def _departed_since(v: ViewSeen, newest: ViewSeen) -> bool:
    """Whether ``v`` is an earlier view of ``newest``'s coordinator and term whose members
    are ``newest``'s and some of the nodes ``newest`` names departed."""
    extra = set(v.members) - set(newest.members)
    return (v.term == newest.term and v.coordinator == newest.coordinator and v.epoch <= newest.epoch
            and set(newest.members) <= set(v.members) and extra <= set(newest.departed))


def one_view_per_group(final: Mapping[int, ViewSeen | None], groups: Iterable[Sequence[int]]) -> str:
    """With no group of nodes holding a majority at the end (nothing can change): the live
    nodes of each connected group (``groups``) hold one view."""
    split = []
    for g in groups:
        keys = {(v.term, v.epoch, v.coordinator) for n in g if (v := final.get(n)) is not None}
        if len(keys) > 1:
            split.append(f"nodes {list(g)} hold {len(keys)} views: {sorted(keys)}")
    return HELD if not split else "no group holds a majority at the end, and " + "; ".join(split)


def one_view_at_end(final: Mapping[int, ViewSeen | None], live: Iterable[int], pending: Collection[int] = (),
                    *, ended: bool = False) -> str:
    """``final``: each node's last view (None: none); ``live``: the nodes neither killed nor
    fenced; ``pending``: nodes restarted too late to have rejoined (not among ``live``): the
    view may list them or not; ``ended``: the processes ended after the finish barrier, so a
    node may have ended before the view that departed the last joiners (published with the
    barrier's replies) reached it: a view that differs from the newest only by such
    departures counts as the newest. See the module docstring."""
    live = sorted(live)
    views = {n: final.get(n) for n in live}
    missing = [n for n, v in views.items() if v is None]
    if missing:
        return f"nodes {missing} hold no view"
    if ended:
        newest = max((v for v in views.values() if v is not None), key=lambda v: (v.term, v.epoch), default=None)
        if newest is not None:
            views = {n: newest if v is not None and _departed_since(v, newest) else v for n, v in views.items()}
    keys = {(v.term, v.epoch, v.coordinator, v.members) for v in views.values() if v is not None}
    if len(keys) > 1:
        groups: dict[tuple[int, int, int], list[int]] = {}
        for n, v in views.items():
            if v is not None:
                groups.setdefault((v.term, v.epoch, v.coordinator), []).append(n)
        return f"{len(keys)} views at the end: " + "; ".join(
            f"(term {t}, epoch {e}, coordinator {c}): nodes {ns}" for (t, e, c), ns in sorted(groups.items()))
    (term, epoch, coord, members), = keys
    if sorted(set(members) - set(pending)) != live:
        return (f"the view (term {term}, epoch {epoch}) lists members {list(members)}, but the live, unfenced "
                f"nodes are {live}")
    return HELD


__all__ = ["Declaration", "HELD", "Latency", "Links", "NOT_PROMISED", "OVERFLOWS", "Queues", "SlowRisk", "ViewSeen",
           "bounded_queues", "components", "cut_by", "declarations", "detections", "killed_by", "no_false_failure",
           "one_coordinator_per_term", "one_view_at_end", "one_view_per_group", "quiet_end", "reconnected", "rejoin_bound",
           "remeasured", "slow_risk", "stranded", "until", "violated"]

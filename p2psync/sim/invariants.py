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
  lasts that long: its successor is elected first, and only then watches them); a node
  paused for less than the failure timeout less a heartbeat interval is not declared failed
  at all; no node is removed by a fault after which no group
  holds a majority (an even split).
* ``no_false_failure``: every node declared failed was cut off by a fault (as above) between
  the fault's start and its end plus the bound.
* ``one_view_at_end``: every node that is neither killed, nor fenced, nor cut off for good
  from the group of nodes holding a majority of the newest view (the simulation restarts no
  fenced node, and nobody relays through it) holds the same view at the end, and its members
  are exactly those nodes; when no group holds such a majority (nothing can change), each
  connected group holds one view (:func:`one_view_per_group`).

:func:`declarations` derives who was declared failed, when and by which coordinator, from
the views (a node left out of a node's next view, not as departed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Sequence

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
    """Node ``node`` applied the view (``term``, ``epoch``) of ``coordinator`` at virtual time ``t``."""

    t: float
    node: int
    term: int
    epoch: int
    coordinator: int
    members: tuple[int, ...]
    departed: tuple[int, ...] = ()


@dataclass(frozen=True)
class Declaration:
    """``node`` was first seen declared failed at ``t`` in a view of ``coordinator`` (``term``)."""

    t: float
    coordinator: int
    term: int
    node: int


def declarations(views: Iterable[ViewSeen]) -> list[Declaration]:
    """Removals from the views: a node left out of a node's next view (not as departed). Each
    removal counts once, at its earliest sighting: a node is declared failed again only after
    a view newer than the one that removed it listed it as a member again (a rejoin)."""
    prev: dict[int, ViewSeen] = {}
    removed: dict[int, tuple[int, int]] = {}  # node -> (term, epoch) of the view that removed it
    out: list[Declaration] = []
    for v in sorted(views, key=lambda v: v.t):
        for n in v.members:
            if n in removed and (v.term, v.epoch) > removed[n]:
                del removed[n]
        before = prev.get(v.node)
        prev[v.node] = v
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


def killed_by(faults: Sequence[Fault], t: float) -> set[int]:
    """The nodes killed at or before ``t``."""
    return {n for f in faults if f.kind == "kill" and f.at <= t for n in f.nodes}


def _gone(faults: Sequence[Fault], t: float, members: Sequence[int], links: Links | None) -> set[int]:
    """The nodes that relay nothing at ``t``: those killed, and those the view ``members``
    left out (every node routes around the nodes declared failed; a fenced node stays out
    until restarted)."""
    return killed_by(faults, t) | (set(links or ()) - set(members))


def _major(groups: Iterable[set[int]], members: Sequence[int]) -> set[int] | None:
    return next((g for g in groups if 2 * len(g & set(members)) > len(members)), None)


def stranded(links: Links | None, killed: Iterable[int], members: Sequence[int]) -> list[int] | None:
    """The live ``members`` that the loss of the nodes ``killed`` (killed, or removed from the
    view: nobody relays through them) cuts off from the group of live nodes holding a majority
    of ``members`` (a ring with two nodes killed is two arcs: the shorter one is cut off for
    good, as by a partition that never heals); None when no group holds such a majority."""
    dead = set(killed)
    major = _major([set(members) - dead] if links is None else components(links, dead), members)
    if major is None:
        return None
    return sorted(n for n in members if n not in dead and n not in major)


def cut_by(f: Fault, faults: Sequence[Fault], members: Sequence[int], links: Links | None) -> list[int] | None:
    """The ``members`` that fault ``f`` cuts off from the group of nodes holding a majority of
    ``members``: the nodes it kills or stops, the side of a partition without the majority,
    and the nodes behind them (that reach the majority only through them; the nodes killed or
    removed from the view before relay nothing either). None when no group holds a majority."""
    gone = _gone(faults, f.at, members, links)
    if f.kind != "partition":
        gone |= set(f.nodes)
    split = (f.nodes, f.other) if f.kind == "partition" else None
    if links is not None:
        groups = components(links, gone, split)
    elif split is not None:
        groups = [set(split[0]) - gone, set(split[1]) - gone]
    else:
        groups = [set(members) - gone]
    major = _major(groups, members)
    return None if major is None else sorted(n for n in members if n not in major)


def detections(faults: Sequence[Fault], views: Sequence[ViewSeen], *, bound: float,
               failure_timeout: float, links: Links | None = None,
               interval: float = 0.0) -> tuple[list[dict[str, object]], str]:
    """Per fault, who was declared failed how long after it started; and the verdict of
    ``faults_detected_in_bound`` (see the module docstring). ``links``: the topology's links
    (a fault also cuts off the nodes behind the ones it stops, :func:`cut_by`); ``interval``:
    the heartbeat interval (a node's silence starts at its last heartbeat, up to an interval
    before the fault: a pause under the failure timeout less an interval is never declared)."""
    decls = declarations(views)
    out: list[dict[str, object]] = []
    problems: list[str] = []
    for f in faults:
        members = _members_before(views, f.at)
        end = f.end if f.end is not None else float("inf")
        found = cut_by(f, faults, members, links)
        cut = found if found is not None else []
        before = _newest_before(views, f.at)
        # with the coordinator among them, its successor must be elected before it watches the
        # others: they are declared within two bounds (one for the coordinator, one for them)
        lead_by = before.coordinator if before is not None and before.coordinator in cut else None
        lead = lead_by is not None
        limit = {n: bound if lead_by is None or n == lead_by else 2 * bound for n in cut}
        seen: dict[int, float] = {}
        for d in decls:
            if d.node in cut or (found is None and d.node in members):
                if f.at <= d.t <= end + bound and d.node not in seen:
                    seen[d.node] = round(d.t - f.at, 6)
        rec: dict[str, object] = {"fault": f.spec(), "declared_after_s": {str(n): s for n, s in sorted(seen.items())}}
        out.append(rec)
        def must(n: int) -> bool:  # cut off long enough to be declared in its limit
            return f.kind == "kill" or (f.duration is not None and f.duration >= limit.get(n, bound))

        if f.kind == "pause" and f.duration is not None and f.duration < failure_timeout - interval and seen:
            problems.append(f"{f.spec()}: paused {f.duration:g}s, under the failure timeout "
                            f"{failure_timeout:g}s less a heartbeat interval, yet declared failed "
                            f"({rec['declared_after_s']})")
        if found is None:
            rec["majority"] = None
            if seen:
                problems.append(f"{f.spec()}: no group of nodes holds a majority of {len(members)} members, yet "
                                f"{sorted(seen)} were declared failed")
            continue
        late = {n: s for n, s in seen.items() if must(n) and s > limit.get(n, bound)}
        missed = [n for n in cut if n not in seen and must(n)]
        if missed or late:
            problems.append(f"{f.spec()}: " + "; ".join(
                ([f"never declared failed: {missed}"] if missed else [])
                + ([f"declared after more than {bound:.3f}s"
                    + (" (twice that for those cut off with the coordinator)" if lead else "")
                    + f": {late}"] if late else [])))
    return out, (HELD if not problems else " | ".join(problems))


def no_false_failure(faults: Sequence[Fault], views: Sequence[ViewSeen], *, bound: float,
                     links: Links | None = None) -> str:
    """See the module docstring: a declaration is covered by a fault that cut the node off
    from the majority (:func:`cut_by`: it was killed or paused, on the side of a partition
    without the majority, or behind such nodes; ``links``: the topology's links), from the
    fault's start to its end plus ``bound``."""
    bad: list[str] = []
    for d in declarations(views):
        ok = False
        for f in faults:
            end = (f.end if f.end is not None else float("inf")) + bound
            if f.at <= d.t <= end and d.node in (cut_by(f, faults, _members_before(views, f.at), links) or []):
                ok = True
                break
        if not ok:
            bad.append(f"node {d.node} declared failed by coordinator {d.coordinator} (term {d.term}) at "
                       f"{d.t:.3f}s with no fault on it, nor a partition leaving it without a majority")
    return HELD if not bad else "; ".join(bad)


def one_view_per_group(final: Mapping[int, ViewSeen | None], groups: Iterable[Sequence[int]]) -> str:
    """With no group of nodes holding a majority at the end (nothing can change): the live
    nodes of each connected group (``groups``) hold one view."""
    split = []
    for g in groups:
        keys = {(v.term, v.epoch, v.coordinator) for n in g if (v := final.get(n)) is not None}
        if len(keys) > 1:
            split.append(f"nodes {list(g)} hold {len(keys)} views: {sorted(keys)}")
    return HELD if not split else "no group holds a majority at the end, and " + "; ".join(split)


def one_view_at_end(final: Mapping[int, ViewSeen | None], live: Iterable[int]) -> str:
    """``final``: each node's last view (None: none); ``live``: the nodes neither killed nor
    fenced. See the module docstring."""
    live = sorted(live)
    views = {n: final.get(n) for n in live}
    missing = [n for n, v in views.items() if v is None]
    if missing:
        return f"nodes {missing} hold no view"
    keys = {(v.term, v.epoch, v.coordinator, v.members) for v in views.values() if v is not None}
    if len(keys) > 1:
        groups: dict[tuple[int, int, int], list[int]] = {}
        for n, v in views.items():
            if v is not None:
                groups.setdefault((v.term, v.epoch, v.coordinator), []).append(n)
        return f"{len(keys)} views at the end: " + "; ".join(
            f"(term {t}, epoch {e}, coordinator {c}): nodes {ns}" for (t, e, c), ns in sorted(groups.items()))
    (term, epoch, coord, members), = keys
    if sorted(members) != live:
        return (f"the view (term {term}, epoch {epoch}) lists members {list(members)}, but the live, unfenced "
                f"nodes are {live}")
    return HELD


__all__ = ["Declaration", "HELD", "Links", "NOT_PROMISED", "ViewSeen", "components", "declarations", "detections",
           "killed_by", "cut_by", "no_false_failure", "one_coordinator_per_term", "one_view_at_end",
           "one_view_per_group", "stranded", "violated"]

"""Coordinator failover decisions: who is the coordinator now. Pure.

Why: the coordinator hosts membership and every coordinator service; without failover its death
leaves the run with no failure detection at all. The rule is deterministic so that nodes agree
without an extra round of messages: **the lowest live id of the last view takes over**.

Every node keeps a :class:`Succession`: the coordinator it follows, the coordinators it has
*deposed* (suspected dead, or superseded by a newer view naming another coordinator) and the
highest view epoch it applied.

* A node whose detector suspects its coordinator deposes it and follows the successor:
  :func:`successor` of its current view's members, minus every deposed node
  (:meth:`Succession.suspect`). If the successor is dead or cut off too, the same detector
  would suspect it only one detection time later, and the next one a detection time after
  that; so at the deposition the node also asks the successors it would try in turn
  (:meth:`Succession.line`) whether they live, all at once: one that does not answer within a
  short probe time is deposed at once (:func:`silent_ahead`), and the node follows the lowest
  that answers (the probes run in :class:`~p2psync.coordinator.failover.CoordinatorHost`).
  The successors are probed in batches, each twice as large as the one before, so that a
  failover whose first successor lives costs few messages; the next batch goes out as soon as
  the ones out have had time to answer but none did (about two round trips, :func:`probe_next`),
  and it ends with the batches before it, at the end of the first one's probe time, while that
  leaves it the time to answer (:func:`probe_until`); so every successor cut off is passed over
  one probe time after the deposition (up to the successors that the batches within one probe
  time reach: hundreds). The failover then takes about one detection time plus one probe
  time, whatever the number of successors cut off; deposing a live but slow successor costs no safety (the election
  still needs a majority), only a vote that may go to the next one.
* A node contacted by a member that deposed the coordinator it follows takes over at once when
  it is itself the successor of its own view minus both deposed sets
  (:meth:`Succession.contacted`): detectors suspect at slightly different times, and the first
  member to suspect brings the successor in. Not when the member's view is of a lower term
  than the view whose coordinator this node follows: that coordinator was elected after the
  member deposed it (e.g. while the member was cut off it passed over the successors it could
  not reach), and the member follows it once it applies this node's view.
* The successor becomes the coordinator only once a majority of its view's members voted for
  it in a new term (:mod:`p2psync.coordinator.quorum`; the election runs in
  :class:`~p2psync.coordinator.failover.CoordinatorHost`). Until then it coordinates nothing.
* Views name their coordinator and their term. A view is applied only if it is newer in the
  order ``(term, epoch)`` than any applied, of no lower term than one this node voted in, and,
  within the same term, not published by a coordinator deposed here
  (:meth:`Succession.accepts`), so late views of a dead coordinator are ignored; applying a
  view naming another coordinator deposes the previous one (:meth:`Succession.adopt`): nodes
  follow the coordinator of the newest view.

The new coordinator publishes a view with a higher term and epoch than its last one, without
the old coordinator; members report their epoch in heartbeats, so a member that saw a later
view of the old coordinator pushes the new one's epoch above it (see ``MembershipService``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Iterable, Mapping, Sequence

from p2psync.coordinator.views import View


def successor(members: Iterable[int], deposed: Collection[int]) -> int | None:
    """The lowest member that is not deposed, or None when none is left."""
    live = [m for m in members if m not in deposed]
    return min(live) if live else None


@dataclass
class Succession:
    """One node's choice of coordinator (see the module docstring). Every method is pure."""

    me: int
    coordinator: int
    deposed: set[int] = field(default_factory=set)
    #: the (term, epoch) of the newest view applied ((-1, -1): none yet)
    key: tuple[int, int] = (-1, -1)

    @property
    def epoch(self) -> int:
        """The highest view epoch applied (-1: none yet)."""
        return self.key[1]

    def _members(self, view: View | None, fallback: Iterable[int]) -> list[int]:
        members = list(view.members) if view is not None else list(fallback)
        if view is not None and self.me in view.departed:  # it finished: never coordinates
            return members
        return members if self.me in members else [*members, self.me]

    def suspect(self, node: int, view: View | None, fallback: Iterable[int] = ()) -> int | None:
        """``node`` is suspected dead: depose it. Returns the coordinator to follow now when that
        changed (the successor in ``view``, or ``fallback`` members without a view), else None."""
        if node == self.me or node in self.deposed:
            return None
        self.deposed.add(node)
        if node != self.coordinator:
            return None
        nxt = successor(self._members(view, fallback), self.deposed)
        self.coordinator = self.me if nxt is None else nxt
        return self.coordinator

    def line(self, view: View | None) -> list[int]:
        """The successors this node would follow in turn, each falling silent after the one
        before, starting with the one it follows now: the members of ``view`` below this node
        that are not deposed, lowest first. Empty when it follows itself, or a coordinator
        that published ``view`` (elected: the detector watches it), or has no view."""
        c = self.coordinator
        if view is None or c == self.me or c == view.coordinator or self.me in view.departed:
            return []
        ahead = sorted(m for m in view.members if m < self.me and m not in self.deposed)
        return ahead if c in ahead and ahead[0] == c else []

    def contacted(self, theirs: Collection[int], view: View | None, their_term: int | None = None) -> bool:
        """A member that deposed ``theirs`` asks this node to coordinate: True when this node
        should take over (it follows one of ``theirs`` and is the successor of its own view
        minus every deposed node). ``their_term``: the term of the member's view (None: not
        told). A deposition made in a term below that of this node's view does not count
        against the coordinator that published this view: it was elected after that member
        last learnt of it (as :meth:`adopt` forgets the deposition of a node elected in a
        newer term); the member learns of the election from this node's redirect instead."""
        if self.coordinator == self.me or self.coordinator not in theirs or self.me in theirs:
            return False
        if their_term is not None and view is not None and view.coordinator == self.coordinator \
                and their_term < view.term:
            return False
        return successor(self._members(view, ()), self.deposed | set(theirs)) == self.me

    def take_over(self, theirs: Collection[int]) -> list[int]:
        """Become the coordinator after :meth:`contacted`; returns the newly deposed nodes."""
        new = sorted((set(theirs) | {self.coordinator}) - self.deposed - {self.me})
        self.deposed.update(new)
        self.coordinator = self.me
        return new

    def accepts(self, view: View, promised: int = -1) -> bool:
        """Whether ``view`` may be applied: newer than every applied view, of no term below
        ``promised`` (the highest term this node voted in), and not published by a
        coordinator deposed here in the same term (a late view of a dead coordinator is
        ignored; a deposed node elected in a newer term is followed)."""
        if view.key <= self.key or view.term < promised:
            return False
        return view.term > self.key[0] or view.coordinator not in self.deposed

    def adopt(self, view: View) -> int | None:
        """Record an accepted view; returns the previous coordinator when the view names another
        one (the previous one is deposed), else None."""
        if view.term > self.key[0]:
            self.deposed.discard(view.coordinator)  # elected in a newer term
        self.key = max(self.key, view.key)
        if view.coordinator == self.coordinator:
            return None
        old = self.coordinator
        if old != self.me:
            self.deposed.add(old)
        self.coordinator = view.coordinator
        return old


def silent_ahead(line: Sequence[int], answered: Mapping[int, bool]) -> list[int]:
    """The successors of ``line`` (:meth:`Succession.line`) to depose now, given the probes
    that ended (``answered``: node -> whether it answered): the leading run of those that did
    not answer. It stops at the first that answered or whose probe has not ended."""
    out: list[int] = []
    for n in line:
        if answered.get(n, True):
            break
        out.append(n)
    return out


def probe_next(line: Sequence[int], sent: Mapping[int, float], answered: Mapping[int, bool], *, now: float,
               wait: float, batch: int) -> list[int]:
    """The successors of ``line`` (:meth:`Succession.line`, from the one followed now) to
    probe now. Pure.

    ``sent``: node -> when its probe went out; ``answered``: the probes that ended (node ->
    whether it answered); ``wait``: how long a probe gets before its silence makes the next
    batch go out (about two round trips, far less than the probe time that passes it over);
    ``batch``: the size of the next batch. The first ``batch`` successors when the one
    followed was not probed yet; else the next ``batch`` unprobed successors once every probe
    out has been out ``wait`` and none answered (an answer ends the walk at that successor or
    before, so nobody after it need be asked); else none."""
    if not line:
        return []
    if line[0] not in sent:
        return [n for n in line[:batch] if n not in sent]
    if any(answered.get(n, False) for n in sent):
        return []
    if any(now < t + wait for t in sent.values()):
        return []
    return [n for n in line if n not in sent][:batch]


def probe_until(deadline: float | None, *, now: float, wait: float, probe_time: float) -> float:
    """When the probes of a batch sent at ``now`` end. Pure.

    With the batches before it (``deadline``: when theirs end; None: none out), so that the
    successors of every batch are passed over together one probe time after the first went
    out, while that leaves them ``wait`` to answer (:func:`probe_next`); else ``probe_time``
    from ``now`` (a batch too late for the first one's probe time, or the first)."""
    if deadline is not None and deadline - now >= wait:
        return deadline
    return now + probe_time


__all__ = ["Succession", "probe_next", "probe_until", "silent_ahead", "successor"]

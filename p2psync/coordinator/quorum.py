"""Majority quorum, terms and votes: the rules that keep one coordinator per run. Pure.

Why: a coordinator that decides alone who failed splits the cluster as soon as a node pauses
(a GC pause, swap, SIGSTOP) or a link partitions: the side that cannot hear the other declares
it failed and trains on, and the run ends with two models. These rules are Raft's, applied to
membership views instead of a log; every function takes its inputs explicitly (no IO, no clock).

**Views are ordered by (term, epoch)** (:func:`view_key`). A term has at most one coordinator:
a node becomes coordinator of term ``t`` only with the votes of a majority of the members of
its last view, and a node grants one vote per term (:class:`Ballot`). A node never applies a
view of a term lower than one it voted in.

**The agreed view** (:class:`Agreement`) is the last view a majority of the previous agreed
view's members acknowledged (heartbeats carry the epoch a member applied). The coordinator
holds its role only while a majority of the agreed view's members is alive to it
(:meth:`Agreement.quorum`), and it may publish a view that removes nodes only when the view
keeps such a majority (:meth:`Agreement.may_remove`). So two disjoint groups can never both
hold a majority of the same agreed view, and a group that lost its majority stops: it neither
coordinates, nor declares failures, nor trains, until it hears the majority again.

Departures are not failures: a node that finished leaves the agreed view at once
(:meth:`Agreement.depart`); it never votes or coordinates again, so the majority shrinks with it.

**Votes** (:meth:`Ballot.decide`): a node grants its vote for term ``t`` to a candidate when

* ``t`` is above every term it voted in, or it voted for that candidate in ``t`` already;
* the candidate's last view is at least as new as its own (a candidate that missed a view
  cannot win: the view's majority holds it);
* it does not coordinate with a quorum itself, and it does not follow another coordinator it
  still hears holding a majority (so a node that wakes from a pause cannot depose a healthy
  coordinator). A node that follows a candidate whose election is not won, or a coordinator
  cut off from the majority, hears no such coordinator: after a partition heals its vote can
  end a deadlock of two candidates that each hold half of the votes.

A vote is kept before it is granted (``Ballot.keep``: the node's folder of the run,
:mod:`p2psync.coordinator.votes`), and a restarted process starts from the votes kept, so it
never grants a second vote in a term its earlier process voted in. So is the key of the newest
view the node applied (``Ballot.saw``): a restarted process that has not applied a view yet
compares a candidate's view with the one its earlier process applied, so that a candidate
that missed a view agreed by a majority still cannot win.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Mapping

log = logging.getLogger("p2psync.membership")

#: a view's place in the order of views: (term, epoch)
ViewKey = tuple[int, int]


def majority(n: int) -> int:
    """The smallest majority of ``n`` voters (``n // 2 + 1``; 1 for an empty set)."""
    return n // 2 + 1


def holds_majority(alive: Collection[int], base: Collection[int]) -> bool:
    """Whether the nodes ``alive`` include a majority of ``base`` (trivially, when every voter
    of ``base`` has left the run: nobody is left to disagree)."""
    base_set = set(base)
    return not base_set or len(base_set & set(alive)) >= majority(len(base_set))


def view_key(term: int, epoch: int) -> ViewKey:
    """The order of views: a higher term wins, then a higher epoch."""
    return (term, epoch)


@dataclass
class Agreement:
    """The coordinator's record of which view its members agreed on (see the module docstring).

    ``members``: the agreed view's members; ``epoch``: its epoch; ``me``: the coordinator
    (it acknowledges every view it publishes). :meth:`acknowledge` records a member's applied
    epoch and advances the agreed view to the newest published one once a majority of the
    agreed members applied it."""

    me: int
    members: frozenset[int]
    epoch: int
    #: node -> the highest view epoch it reported having applied
    acked: dict[int, int] = field(default_factory=dict)
    #: the newest view published: (epoch, members); equal to the agreed one when none is pending
    latest: tuple[int, frozenset[int]] | None = None

    def publish(self, epoch: int, members: Iterable[int]) -> None:
        """A view was published; it is agreed once a majority of the agreed members applied it."""
        self.latest = (epoch, frozenset(members))
        self.acked[self.me] = epoch
        self._advance()

    def acknowledge(self, node: int, epoch: int) -> bool:
        """``node`` reported that it applied view ``epoch``. Returns True when the agreed view
        moved (to the newest published one)."""
        if epoch > self.acked.get(node, -1):
            self.acked[node] = epoch
        return self._advance()

    def depart(self, node: int) -> None:
        """``node`` finished and left the run: it is no voter any more (nor of a view pending)."""
        self.members = self.members - {node}
        if self.latest is not None:
            self.latest = (self.latest[0], self.latest[1] - {node})
        self._advance()

    def _advance(self) -> bool:
        if self.latest is None or self.latest[0] <= self.epoch:
            return False
        epoch, members = self.latest
        have = {n for n in self.members if self.acked.get(n, -1) >= epoch}
        if len(have) >= majority(len(self.members)):
            self.members, self.epoch = members, epoch
            return True
        return False

    @property
    def pending(self) -> bool:
        """A published view is not agreed yet."""
        return self.latest is not None and self.latest[0] > self.epoch

    def quorum(self, alive: Collection[int]) -> bool:
        """Whether the coordinator (always alive to itself) hears a majority of the agreed view."""
        return holds_majority(set(alive) | {self.me}, self.members)

    def may_remove(self, members_after: Collection[int]) -> bool:
        """Whether a view with ``members_after`` keeps a majority of the agreed view (removing
        nodes from it is then safe: the removed ones cannot form a majority of their own)."""
        return holds_majority(members_after, self.members)


@dataclass(frozen=True)
class VoteRequest:
    """A candidate asks for votes: its id, the term it wants, and its last view's key."""

    candidate: int
    term: int
    view: ViewKey


@dataclass(frozen=True)
class VoteAnswer:
    """A voter's answer: granted or not, why (for the log), and the voter's own view key and
    highest term voted (a refused candidate learns what is newer)."""

    granted: bool
    reason: str
    view: ViewKey
    voted_term: int


@dataclass
class Ballot:
    """One node's votes (see the module docstring). ``keep``: called with the votes, the new
    one included, before a vote is granted (a durable copy, so that a restarted process of
    this node never grants a second vote in a term its earlier process voted in: seed the new
    ballot's ``voted`` with it); when it raises OSError the vote is not granted. ``keep_view``:
    called with the key of each newer view the node applied (:meth:`saw`; seed ``seen`` with
    what it kept), so that a restarted process never votes as if it had missed a view its
    earlier process applied."""

    me: int
    #: term -> the candidate this node voted for in it
    voted: dict[int, int] = field(default_factory=dict)
    keep: Callable[[Mapping[int, int]], None] | None = field(default=None, compare=False, repr=False)
    #: the key of the newest view this node applied, in this process or an earlier one
    seen: ViewKey = (0, -1)
    #: keeps :attr:`seen` durably (OSError when it cannot: said, and the view counts all the same)
    keep_view: Callable[[ViewKey], None] | None = field(default=None, compare=False, repr=False)

    #: a view key could not be kept (said once)
    unkept: bool = field(default=False, compare=False, repr=False)

    def saw(self, key: ViewKey) -> None:
        """This node applied the view of ``key``: kept when newer than :attr:`seen`."""
        if key <= self.seen:
            return
        self.seen = key
        if self.keep_view is None:
            return
        try:
            self.keep_view(key)
        except OSError as exc:
            if not self.unkept:
                self.unkept = True
                log.warning("node %d: the key %s of the newest view applied could not be kept (%s): a restarted "
                            "process may grant a vote as if it had missed that view", self.me, key, exc)

    def forget(self) -> None:
        """Drop every vote and view key (a new launch of the run: see
        :mod:`p2psync.coordinator.votes`); the store forgets them too (the caller's)."""
        self.voted.clear()
        self.seen = (0, -1)

    def _grant(self, term: int, candidate: int) -> bool:
        """Record a vote for ``candidate`` in ``term`` (kept first, see the class docstring);
        whether it was recorded."""
        if self.keep is not None:
            try:
                self.keep({**self.voted, term: candidate})
            except OSError:
                return False
        self.voted[term] = candidate
        return True

    @property
    def promised(self) -> int:
        """The highest term this node voted in (-1: none): it never applies a view of a lower term."""
        return max(self.voted, default=-1)

    def decide(self, req: VoteRequest, *, mine: ViewKey, coordinating_with_quorum: bool,
               hears_coordinator: int | None) -> VoteAnswer:
        """Answer ``req`` (and record a granted vote). ``mine``: this node's last view key (raised
        to :attr:`seen`: a restarted process compares with its earlier one's newest view);
        ``hears_coordinator``: the coordinator this node follows and still hears holding a
        majority (its heartbeat replies say so), or None."""
        mine = max(mine, self.seen)  # (a restarted process that has applied no view yet: its earlier one's)

        def answer(granted: bool, reason: str) -> VoteAnswer:
            return VoteAnswer(granted=granted, reason=reason, view=mine, voted_term=self.promised)

        if req.candidate == self.me:
            if req.term not in self.voted and not self._grant(req.term, self.me):
                return answer(False, "its own vote could not be kept on disk")
            return answer(self.voted[req.term] == self.me, "own vote")
        if req.term <= mine[0]:
            return answer(False, f"term {req.term} is not above this node's view term {mine[0]}")
        if self.voted.get(req.term, req.candidate) != req.candidate:
            return answer(False, f"voted for node {self.voted[req.term]} in term {req.term}")
        if req.term < self.promised:
            return answer(False, f"voted in a later term {self.promised}")
        if req.view < mine:
            return answer(False, f"the candidate's view {req.view} is older than this node's {mine}")
        if coordinating_with_quorum:
            return answer(False, "this node coordinates with a majority")
        if hears_coordinator is not None and hears_coordinator != req.candidate:
            return answer(False, f"this node still hears its coordinator {hears_coordinator}")
        if req.term not in self.voted and not self._grant(req.term, req.candidate):
            return answer(False, "the vote could not be kept on disk")
        return answer(True, "granted")


@dataclass
class Candidacy:
    """A candidate's count of votes for one term over ``voters`` (its last view's members)."""

    me: int
    term: int
    voters: frozenset[int]
    granted: set[int] = field(default_factory=set)
    #: voters that answered at all (granted or not): they are alive
    answered: set[int] = field(default_factory=set)

    def record(self, voter: int, answer: VoteAnswer | None) -> None:
        """One voter's answer (None: no answer in time)."""
        if answer is None or voter not in self.voters:
            return
        self.answered.add(voter)
        if answer.granted:
            self.granted.add(voter)

    @property
    def won(self) -> bool:
        """A majority of the voters granted this term; the candidate's own vote counts only when
        recorded like any other (its ballot may have gone to another candidate of the term)."""
        return holds_majority(self.granted, self.voters)


__all__ = ["Agreement", "Ballot", "Candidacy", "ViewKey", "VoteAnswer", "VoteRequest", "holds_majority",
           "majority", "view_key"]

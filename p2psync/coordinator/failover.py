"""Hosting the coordinator services on whichever node coordinates.

Why: the coordinator role moves to the lowest live id when the coordinator dies
(:mod:`p2psync.coordinator.takeover`), so every node must be able to host membership and every
strategy's coordinator services at any time, with their state rebuilt from the members (it is
small by design: coordinator services hold no model tensors).

:class:`CoordinatorHost` runs on every node. It owns the ``membership.*`` RPC methods of the
node's server: while the node does not coordinate, a heartbeat or finish from a member that
deposed the coordinator this node follows makes it take over if it is the successor
(:meth:`MembershipClient.take_over`; not when the member's view, whose term its heartbeat
carries, is of a term below the one that coordinator was elected in); otherwise heartbeats get
a *redirect* reply carrying the view this node follows, and other calls a ``NotCoordinator`` error (callers retry). When this
node becomes the coordinator (its client's ``on_takeover``), the host builds a
:class:`MembershipService` on a state rebuilt from what the node knows
(:func:`rebuild_state`: the last view with its incarnations, the failed and deposed nodes, an
epoch above the last one) and registers the strategy's coordinator services (``services``,
e.g. ESync's State Server, which rebuilds its records from the members' next queries). Members
then heartbeat and re-send their finish stats to it. The host owns the service it started and
closes it in :meth:`CoordinatorHost.close` (and when a newer view deposes this node, or the node
is fenced).

Proof of life before a takeover's first view. A candidate judges the nodes it deposes or
counts failed before its election, and it may have judged them on a side of a split that held
no majority: it wins only once the split heals, and its vote answers alone cannot show whether
the heal came before or after its judgment. So the nodes its first view would remove get one
probe once it has won (marked dead or not), answered within
:meth:`CoordinatorHost.probe_wait`; those that answer, or were heard since its vote answers
made a majority, stay members (:func:`silent_since`), for its detector to judge. A new process
of a restarted node answering for a judged one does not count: the process judged is gone; a
judged node whose new process was heard leaves in the first view unprobed, even one that the
rules above would keep (:func:`gone_judged`).
The probe costs a takeover that removes nodes :meth:`CoordinatorHost.probe_wait` (a quarter
of a heartbeat interval at least), within the detection bound.

Re-election above a higher term. A node cut off from the majority (a partition's minority side)
deposes the coordinator it cannot hear and votes, or runs, in a new term; having voted there, it
applies no view of a lower term (:meth:`Succession.accepts`), so after the heal it could never
follow the majority's coordinator again, nor learn from its views that it was removed. So a
coordinator holding a majority that hears of a term above its own (a vote request, or a probe
carrying the prober's highest voted term, or a member's heartbeat passing on such a term that
it heard of: a cut-off node may reach only nodes that do not coordinate) runs an election above
that term among the members of its agreed view (:meth:`CoordinatorHost.outrank`): they follow it
and grant their votes, and its next view, of the new term, is applied by every node: the
minority's nodes rejoin its view, or find that it no longer names them (fenced). It coordinates
throughout; the election only renumbers its term, and it does not declare the members that did
not vote for it failed before a full detection window (they follow it only once they apply the
new term's view). A coordinator that hears of a higher term while it holds no majority keeps it
and runs that election as soon as it holds one again. Losing it (a member voted for another node in
that term) changes nothing: a later vote request, probe or heartbeat tries a higher term. A
candidate raises its own term only over voters whose view is not newer than its own (a voter
with a newer view follows a coordinator that won; outbidding it would only start the race
again), and only while those voters and itself could make a majority (:func:`may_win`): rival
candidates cut off from the majority would otherwise outbid each other every round, faster
than the majority's coordinator goes above the terms it hears of, and never apply its views.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np

from p2psync import clock
from p2psync.coordinator.membership import MembershipService
from p2psync.coordinator.quorum import Agreement, Candidacy, VoteAnswer, VoteRequest, holds_majority
from p2psync.coordinator.takeover import probe_next, probe_until, silent_ahead
from p2psync.coordinator.membership_client import MembershipClient
from p2psync.coordinator.membership_state import MembershipState
from p2psync.coordinator.rpc import Handler, RpcServer
from p2psync.coordinator.views import View, news_for
from p2psync.errors import Fenced, P2PSyncError, ProtocolError, RemoteError
from p2psync.tasks import TaskSet

log = logging.getLogger("p2psync.failover")

METHODS = ("membership.register", "membership.heartbeat", "membership.finish", "membership.diverged")
VOTE = "membership.vote"
#: seconds a coordinator waits after losing a re-election before it runs another
REELECT_RETRY_S = 2.0
#: successors probed at once at first when a node deposes its coordinator (then twice as many)
PROBE_BATCH = 8


def rebuild_state(*, expected: Collection[int], view: View | None, failed: Collection[int], me: int,
                  fingerprint: str, now: float, grace: float, failure_timeout: float = 2.0,
                  heartbeat_interval: float = 0.5, phi_threshold: float = 8.0, term: int = 0,
                  epoch_floor: int = 0, quiet: Collection[int] = (), asked: float | None = None,
                  kept: Collection[int] = ()) -> MembershipState:
    """The membership state of a node taking over as coordinator of ``term``. Pure.

    Members are the last view's members minus ``failed`` (the deposed coordinators that did
    not answer the election, and the peers this node saw fail); they keep their incarnations.
    Nodes the view lists as departed (finished) stay departed. Every other node that was
    registered counts as registered and failed, so the finish barrier does not wait for it.
    The epoch is one above the view's and above ``epoch_floor`` (the newest epoch a voter
    had applied). The agreed view is the last view's members (the majority that elected this
    node was counted over them). Members are watched from ``now + grace``: they detect the old
    coordinator's death up to about one detection time after this node, and need that long
    to reach it; but the ``quiet`` ones, which did not answer this node's vote request sent
    at ``asked`` (cut off with the old coordinator, most likely), are watched from ``asked``:
    a live one gets the first view at once and heartbeats within an interval. The ``kept``
    members, deposed by the voters long before (through a split that healed since), are not
    declared failed on the reports of members that have not applied this node's first view
    yet (those reports concern that deposition): its own detector judges them."""
    members = set(view.members) if view is not None else set(expected)
    members = (members | {me}) - set(failed)
    departed = (set(view.departed) if view is not None else set()) - members
    dead = ((set(expected) - members) | (set(failed) & set(expected))) - departed
    dead.discard(me)
    st = MembershipState(expected=frozenset(expected), failure_timeout=failure_timeout,
                         heartbeat_interval=heartbeat_interval, phi_threshold=phi_threshold,
                         coordinator=me)
    incs = dict(view.incarnations) if view is not None else {}
    st.departed = departed  # finished: their finish stats are re-sent to this node
    for n in sorted(members | dead | departed):
        st.registered[n] = fingerprint
        st.incarnations[n] = incs.get(n, 0)
        st.addresses[n] = "?"
    st.failed = dead
    st.started = True  # the run is going: no rendezvous to wait for
    for n in members:
        st.detector.watch(n, asked if asked is not None and n in quiet else now + grace)
    st.epoch = max(view.epoch if view is not None else 0, epoch_floor) + 1
    for n in set(kept) & members:
        st.joined_epoch[n] = st.epoch
    st.term = term
    base = (set(view.members) if view is not None else set(expected)) - departed
    st.agreement = Agreement(me=me, members=frozenset(base | ({me} if view is None else set())),
                             epoch=view.epoch if view is not None else 0)
    return st


def cut_off_when_judged(voters: Collection[int], judged: Collection[int]) -> bool:
    """Whether a candidate whose election has ``voters`` (its view's members and itself)
    judged the nodes ``judged`` failed or deposed while cut off from the majority. Pure.

    True when the voters it did not judge are no majority: a node that counts a majority of
    its view failed cannot tell a split from failures (the run declares nobody failed while no
    side of a split holds a majority); if it wins all the same, some of them answered, and
    what it judged was a split that healed since. Its first view then removes none of those
    that did not answer unheard: they get a detection window from the new coordinator."""
    return not holds_majority(set(voters) - set(judged), voters)


def silent_since(suspects: Collection[int], answered: Mapping[int, bool], heard: Mapping[int, float],
                 since: float, *, judged: Mapping[int, int], known: Mapping[int, int]) -> list[int]:
    """The ``suspects`` that a winner of an election may remove in its first view: those that
    neither answered its proof-of-life probe (``answered``: node -> whether it answered; a
    node missing did not) nor were heard (``heard``: node -> latest arrival from it) at or
    after ``since``, the time its vote answers first made a majority; and those whose
    incarnation known now (``known``: node -> the incarnation its latest admitted message
    carried) is not the one its view names (``judged``): what answered is a new process of a
    restarted node, and the process judged is gone (the new one joins once it is removed).
    Pure.

    The winner judged them silent before it reached a majority: when that was only once a
    split healed (an even split, whose side held no majority), they are as reachable as the
    voters now, and removing them would fence live nodes that no fault cut off from the
    majority. A node silent to a winner that holds a majority is cut off, or dead."""
    def same_life(n: int) -> bool:
        return n not in judged or known.get(n, judged[n]) == judged[n]

    return sorted(n for n in suspects if not same_life(n) or (
        not answered.get(n, False) and heard.get(n, -math.inf) < since))


def gone_judged(judged: Collection[int], named: Mapping[int, int], newest: Mapping[int, int]) -> list[int]:
    """The nodes of ``judged`` (those a winner of an election judged failed or deposed and
    that did not answer it) whose process its view names (``named``: node -> incarnation) is
    gone: a newer process of the node was heard (``newest``: node -> the newest incarnation a
    proven message of it carried, ``Transport.newer_life``). Pure.

    The winner removes them in its first view whatever else would keep a judged node (judged
    while cut off from the majority, deposed long ago, heard lately): a restarted node's
    previous process never answers again (the transport rejects its messages once it knows a
    newer incarnation), so keeping it only delays its declaration by a detection window, and
    the new process is admitted only once it is declared. No probe either: what would answer
    is the new process, which proves nothing of the one judged."""
    return sorted(n for n in judged if n in named and n in newest and newest[n] > named[n])


def may_win(me: int, voters: Collection[int], mine: tuple[int, int],
            answers: Mapping[int, VoteAnswer | None]) -> bool:
    """Whether a candidate with view key ``mine`` may win an election over ``voters``, given
    one round's ``answers`` (voter -> answer, None: none in time). Pure.

    Only the voters that answered with a view not newer than the candidate's may grant it a
    vote in some term (a voter with a newer view follows a coordinator that won); when they
    and the candidate are no majority, no term wins it the election. Such a candidate (cut
    off, or on the side of a healed split that the majority removed) keeps its term instead
    of going above a rival's: rivals that outbid each other every round, each cut off from the
    majority, drive the terms up faster than the majority's coordinator, re-elected above the
    term it hears of (:meth:`CoordinatorHost.outrank`), can bring its view to them, and they
    apply no view of a term below one they voted in, so they never learn that they were
    removed."""
    may = {me} | {v for v, ans in answers.items() if ans is not None and ans.view <= mine}
    return holds_majority(may, voters)


def _ids(raw: Any) -> list[int]:
    """A list of node ids from an untrusted field (anything else: empty)."""
    if isinstance(raw, list) and all(type(n) is int and n >= 0 for n in raw):
        return list(raw)
    return []


def _answer(rep: Any) -> VoteAnswer:
    """A vote answer from an untrusted reply; raises :class:`ProtocolError` (reason ``vote``)."""
    if not isinstance(rep, dict):
        raise ProtocolError("vote", "a vote answer must be a map")
    granted, reason, view, voted = rep.get("granted"), rep.get("reason", ""), rep.get("view"), rep.get("voted")
    if type(granted) is not bool or not isinstance(reason, str) or type(voted) is not int \
            or not isinstance(view, list) or len(view) != 2 or not all(type(x) is int for x in view):
        raise ProtocolError("vote", "a vote answer needs granted, reason, view [term, epoch] and voted")
    return VoteAnswer(granted=granted, reason=reason[:200], view=(view[0], view[1]), voted_term=voted)


def ask_again(answer: VoteAnswer | None, req: VoteRequest, *, waiting: bool) -> bool:
    """Whether a candidate asks a voter that gave ``answer`` to ``req`` again within the same
    round (:meth:`CoordinatorHost._votes`): it refused, its view is not newer than the
    candidate's (a voter with a newer view follows a coordinator that won), and it has not
    voted in the request's term or above (it never grants this one); only while first requests
    of the round are still out (``waiting``): the round ends when they do, and the next one
    asks every voter again."""
    return waiting and answer is not None and not answer.granted and answer.view <= req.view \
        and answer.voted_term < req.term


class CoordinatorHost:
    """Every node: hosts membership and the strategy's coordinator services while it coordinates."""

    def __init__(self, *, server: RpcServer, membership: MembershipClient, expected: Sequence[int],
                 services: Callable[[RpcServer], None] | None = None, start_timeout: float = 60.0,
                 failure_timeout: float = 2.0, heartbeat_interval: float = 0.5,
                 phi_threshold: float = 8.0, check_interval: float = 0.1,
                 run_info: Mapping[str, Any] | None = None, allow_join: bool = True) -> None:
        self.server = server
        self.membership = membership
        self.allow_join = allow_join
        self.me = server.transport.node_id
        self.expected = list(expected)
        self.services = services
        self.start_timeout = start_timeout
        self.failure_timeout = failure_timeout
        self.heartbeat_interval = heartbeat_interval
        self.phi_threshold = phi_threshold
        self.check_interval = check_interval
        #: returned by registrations (run id); set after rendezvous on nodes that may take over
        self.run_info = dict(run_info or {})
        self.service: MembershipService | None = None
        #: services started here and closed since (a newer view deposed this node)
        self._retired: list[MembershipService] = []
        #: deposed services still closing (each on its own: one that fails to close is logged)
        self._closing = TaskSet("close-deposed-service", isolated=True)
        self._services_registered = False
        self.took_over_at: float | None = None
        #: the election this node runs as the successor (at most one at a time)
        self._election = TaskSet("election")
        #: set when a voter that refused its vote in the campaign's last round contacts this
        #: node as one that deposed the coordinator (it follows this node now): the next round
        #: need not wait (once per such voter and round: no storm of rounds)
        self._rallied = asyncio.Event()
        self._refused: set[int] = set()
        #: the highest term a voter reported having voted in (the next candidacy goes above it)
        self._seen_term = -1
        #: elections this node won (its terms)
        self.terms: list[int] = []
        #: the re-election of this coordinator above a term it heard of (at most one at a time)
        self._reelection = TaskSet("re-election")
        #: no re-election before this time (monotonic; a lost one waits REELECT_RETRY_S)
        self._reelect_after = 0.0
        #: the probes of the successors ahead of the one this node follows (at most one walk)
        self._walk = TaskSet("succession-probe")
        #: node -> when this node first counted it deposed (while it stays deposed)
        self._deposed_at: dict[int, float] = {}
        for method in METHODS:
            server.register(method, self._dispatcher(method))
        server.register(VOTE, self._vote)
        membership.on_takeover = self._take_over
        membership.coordinator_listeners.append(self._followed)
        membership.fence_listeners.append(self._fenced)

    @property
    def coordinating(self) -> bool:
        """True while this node hosts the live coordinator services."""
        return self.service is not None and self.membership.coordinator == self.me

    def host(self) -> MembershipService:
        """Start as the run's first coordinator (before rendezvous)."""
        return self._start(None)

    def _start(self, state: MembershipState | None) -> MembershipService:
        svc = MembershipService(server=self.server, expected=self.expected, start_timeout=self.start_timeout,
                                failure_timeout=self.failure_timeout, heartbeat_interval=self.heartbeat_interval,
                                phi_threshold=self.phi_threshold, check_interval=self.check_interval,
                                run_info=self.run_info, state=state, rpc_methods=False,
                                allow_join=self.allow_join)
        if state is not None:  # a takeover: the run started when this node's rendezvous ended
            svc.run_started = self.membership.run_started
        svc.state.on_publish = self.membership.ballot.saw  # (kept before this node counts as having applied it)
        self.service = svc
        svc.start()
        if self.services is not None and not self._services_registered:
            self._services_registered = True
            self.services(self.server)
        return svc

    def _take_over(self, deposed: list[int]) -> None:
        """This node is the successor: run for coordinator (:meth:`_campaign`)."""
        if self.service is not None or len(self._election):
            return
        self._election.spawn(self._campaign(deposed), name="election")

    async def _campaign(self, deposed: list[int]) -> None:
        """Ask the members of this node's view for their votes in a new term until a majority
        grants it (then take over), another coordinator's view is followed, or this node is
        fenced. Each round is bounded; rounds repeat every heartbeat interval. A win keeps
        the nodes this node judged failed or deposed unheard while it was cut off from the
        majority (see the comments at the win, and :func:`cut_off_when_judged`), and before its
        first view it probes the nodes it would still remove, once it reaches a majority: those
        that answer, or are heard, stay members (:func:`silent_since`). After a round
        that shows it cannot win (:func:`may_win`) the next one keeps the term: it goes above
        neither a rival's term nor one this node voted in for another candidate."""
        m = self.membership
        rounds = 0
        # when the first vote request went out, and when the voters that answered it (any
        # answer: they are alive and reachable) first made a majority with this node
        first: float | None = None
        majority_at: float | None = None

        def count() -> None:
            nonlocal majority_at
            if majority_at is None and holds_majority(cand.answered | {self.me}, voters):
                majority_at = clock.now()
        hopeless = False  # the last round showed that this node cannot win (:func:`may_win`)
        while m.coordinator == self.me and self.service is None and m.fenced is None:
            view = m.view
            voters = frozenset(view.members if view is not None else self.expected) | {self.me}
            # (its own applied view, not the key an earlier process kept, Ballot.seen: a process
            # that has applied no view cannot rebuild the membership, so it must not win)
            mine = view.key if view is not None else (0, -1)
            term = max(mine[0], self._seen_term) + 1
            if m.ballot.voted.get(term, self.me) != self.me and not hopeless:
                term = max(m.ballot.promised, term) + 1  # this node voted for another in it
            cand = Candidacy(me=self.me, term=term, voters=voters)
            req = VoteRequest(candidate=self.me, term=term, view=mine)
            cand.record(self.me, m.ballot.decide(req, mine=mine, coordinating_with_quorum=False,
                                                 hears_coordinator=None))
            others = sorted(voters - {self.me})
            asked = clock.now()
            first = asked if first is None else first
            count()
            answers = await self._votes(others, req, cand, again=self.heartbeat_interval, answered=count)
            floor = mine[1]
            hopeless = not may_win(self.me, voters, mine, answers)
            for v, ans in answers.items():
                if ans is not None:
                    # it voted for another in a term this one must pass; not when its view is
                    # newer: another coordinator won, and a higher term would only disrupt it;
                    # nor while this node cannot win: it would only outbid a rival as cut off
                    if not ans.granted and ans.view <= mine and not hopeless:
                        self._seen_term = max(self._seen_term, ans.voted_term if ans.voted_term >= term else -1)
                    floor = max(floor, ans.view[1])
            if m.coordinator != self.me or self.service is not None or m.fenced is not None:
                return
            if cand.won:
                # the deposed and failed nodes that did not answer leave, unless deposed long
                # ago (stale: the election waited for a majority, e.g. through an even split
                # that healed since; kept: watched like any member, not removed unheard); those that
                # answered live; the other members that did not answer (yet) are watched from
                # the vote request on
                # also kept: those this node itself heard within the failure timeout (deposed
                # on another member's word, e.g. one that was cut off from them); and all of
                # them when this node judged them while cut off from the majority, by a split
                # that healed since, as its win shows (cut_off): the voters that answered at
                # all made a majority only more than a probe time after its first request, or
                # the nodes it counts failed or deposed leave no majority of its view
                # none of this holds for a node whose new process this node heard (restarted:
                # the process judged is gone, and the transport drops its messages now): it
                # leaves in the first view, without a probe (:func:`gone_judged`)
                now = clock.now()
                stale = now - self.failure_timeout - 2 * self.heartbeat_interval
                judged = m.failed | set(deposed)
                incs = m.view.incarnations if m.view is not None else {}
                newest = {n: inc for n in judged - cand.answered
                          if (inc := m.transport.newer_life(n, incs.get(n, 0))) is not None}
                gone = gone_judged(judged - cand.answered, incs, newest)
                unheard = judged - cand.answered - set(gone)
                heard = m.transport.last_arrival
                late = majority_at is None or first is None or majority_at - first > self.probe_time()
                cut_off = late or cut_off_when_judged(voters, judged)
                kept = sorted(n for n in unheard if cut_off or self._deposed_at.get(n, stale + 1) <= stale
                              or now - heard.get(n, -math.inf) < self.failure_timeout)
                failed = sorted(unheard - set(kept))
                if failed and majority_at is not None:
                    # proof of life: the nodes it would remove get one probe from a node that
                    # reaches a majority; those heard are kept (:func:`silent_since`)
                    answered = await self._alive_all(failed, self.probe_wait())
                    if m.coordinator != self.me or self.service is not None or m.fenced is not None:
                        return
                    silent = silent_since(failed, answered, m.transport.last_arrival, majority_at,
                                          judged=incs, known=m.transport.peer_incarnations)
                    if silent != failed:
                        log.warning("node %d: nodes %s, judged failed or deposed before this node reached a "
                                    "majority, answered after it won: kept", self.me,
                                    sorted(set(failed) - set(silent)))
                    kept, failed = sorted({*kept, *failed} - set(silent)), silent
                failed = sorted({*failed, *gone})
                quiet = sorted(voters - cand.answered - set(failed) - {self.me})
                self._become(term, failed, floor, sorted(cand.granted), quiet=quiet, asked=asked, kept=kept)
                return
            if rounds % 10 == 0:
                log.warning("node %d: election for term %d: votes of %s out of %s (answers from %s): no "
                            "majority yet", self.me, term, sorted(cand.granted | {self.me}), sorted(voters),
                            sorted(cand.answered))
            rounds += 1
            self._refused = set(cand.answered) - set(cand.granted) - {self.me}
            self._rallied.clear()
            try:  # (the next round at once when a member that deposed the coordinator rallies)
                await asyncio.wait_for(self._rallied.wait(), self.heartbeat_interval)
            except asyncio.TimeoutError:
                pass

    async def _votes(self, others: Sequence[int], req: VoteRequest, cand: Candidacy, *,
                     enough: Callable[[], bool] | None = None, again: float | None = None,
                     answered: Callable[[], None] | None = None) -> dict[int, VoteAnswer | None]:
        """Ask ``others`` for their votes at once and record each answer in ``cand`` as it
        comes; returns the answers in (voter -> answer, None: no answer in time) once ``cand``
        is won (or ``enough()`` holds, when given) or every voter answered or timed out. The
        requests still out are then given up: a voter cut off with the old coordinator must
        not hold the election up for the whole vote timeout. ``again``: a voter that refused
        (with a view not newer than the candidate's) is asked again that many seconds later,
        while the first requests of the round are still out (:func:`ask_again`; those asked
        again are given up with them): its detector may suspect the old coordinator a moment
        after the candidate's did (silence counts from each node's own last heartbeat), and
        the voters that cannot answer must not make it wait for the next round. ``answered``:
        called after each answer is recorded (the candidate notes when its answers made a
        majority)."""
        won = enough if enough is not None else (lambda: cand.won)
        asks = TaskSet("vote-requests", isolated=True)
        voter_of = {asks.spawn(self._ask(v, req), name=f"vote-{v}"): v for v in others}
        first = set(voter_of)
        out: dict[int, VoteAnswer | None] = {}
        try:
            pending = set(voter_of)
            while pending & first and not won():  # asked again: only while the round lasts
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in sorted(done, key=voter_of.__getitem__):  # in voter order: deterministic
                    v = voter_of[t]
                    ans = None if t.cancelled() else t.result()
                    if ans is None and v in out:
                        continue  # a request asked again went unanswered: keep the refusal
                    out[v] = ans
                    cand.record(v, ans)
                    if answered is not None:
                        answered()
                    if again is not None and ask_again(ans, req, waiting=bool(pending & first)):
                        t2 = asks.spawn(self._ask(v, req, delay=again), name=f"vote-{v}-again")
                        voter_of[t2] = v
                        pending.add(t2)
        finally:
            await asks.close()
        return out

    def outrank(self, seen: int) -> None:
        """A node voted or ran in term ``seen``: if this node coordinates with a majority in a
        lower term, it is re-elected above ``seen`` (see the module docstring; in an owned task,
        one at a time, and after a lost one not before :data:`REELECT_RETRY_S`). A node that
        does not coordinate passes ``seen`` on to its coordinator in its heartbeats. A
        coordinator that hears no majority now keeps ``seen`` the same way (its own client's
        heartbeats carry it to its service): once it hears the majority again it is re-elected
        above ``seen`` within a heartbeat interval, inside the detection window that spares the
        members that follow a candidate of that term (:meth:`MembershipState.check`)."""
        svc = self.service
        if svc is None or not self.coordinating:
            self.membership.hear_term(seen)
            return
        now = clock.now()
        if seen <= svc.state.term:
            return
        if not svc.state.has_quorum(now):
            self.membership.hear_term(seen)
            return
        if len(self._reelection) or now < self._reelect_after:
            return
        self._reelection.spawn(self._reelect(svc, seen), name="re-election")

    async def _reelect(self, svc: MembershipService, seen: int) -> None:
        """One election of this coordinator in a term above ``seen`` and every term it knows,
        over the members of its agreed view, over once a majority granted; won: its state moves
        to that term (:meth:`MembershipState.reelected`: the members that did not vote for it
        are not declared failed before a full detection window) and its view is published at
        once."""
        m, st = self.membership, svc.state
        term = max(seen, st.term, m.ballot.promised, self._seen_term) + 1
        key = (st.term, st.epoch)
        voters = frozenset(st.agreement.members if st.agreement is not None else st.alive_nodes) | {self.me}
        cand = Candidacy(me=self.me, term=term, voters=voters)
        req = VoteRequest(candidate=self.me, term=term, view=key)
        others = sorted(voters - {self.me})
        # over once the others' votes and its own make a majority: members cut off, or that
        # cannot route their answers back yet, must not hold up the view that reaches them
        answers = await self._votes(others, req, cand,
                                    enough=lambda: holds_majority(cand.granted | {self.me}, voters))
        floor = st.epoch
        newer = False
        for ans in answers.values():
            if ans is not None:
                self._seen_term = max(self._seen_term, ans.voted_term)
                floor = max(floor, ans.view[1])
                newer = newer or ans.view > key
        if self.service is not svc or not self.coordinating:
            return
        # its own vote last, and only when it completes a majority: a lost re-election leaves
        # no vote of this node in ``term``, so it can still apply the views of a coordinator
        # elected meanwhile in a lower term (below: when voters follow one)
        if holds_majority(cand.granted | {self.me}, voters):
            cand.record(self.me, m.ballot.decide(req, mine=key, coordinating_with_quorum=False,
                                                 hears_coordinator=None))
        if not cand.won:
            self._reelect_after = clock.now() + REELECT_RETRY_S
            log.warning("node %d: re-election above term %d (for term %d): votes of %s out of %s: not re-elected; "
                        "it coordinates on in term %d", self.me, seen, term, sorted(cand.granted), sorted(voters),
                        st.term)
            if newer:
                # voters applied a view newer than this coordinator's: another coordinator was
                # elected while this one could not run (paused, cut off); its view says whether
                # this node is still a member (then it follows it) or was removed (fenced)
                m.probe_now()
            return
        old = st.term
        st.reelected(term, max(st.epoch, floor) + 1, cand.granted, clock.now())
        self.terms.append(term)
        view = st.view()
        log.warning("node %d: re-elected coordinator in term %d above term %d that node(s) voted in (votes of %s; "
                    "was term %d); view epoch %d members %s", self.me, term, seen, sorted(cand.granted), old,
                    view.epoch, list(view.members))
        svc.publish_now(view)

    async def _ask(self, voter: int, req: VoteRequest, delay: float = 0.0) -> VoteAnswer | None:
        """One vote request (bounded), after ``delay`` seconds; None when the voter does not
        answer in time or answers nonsense."""
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            rep = await self.membership.rpc.call(voter, VOTE, {"term": req.term, "view": list(req.view)},
                                                 timeout=max(1.0, 4 * self.heartbeat_interval))
        except P2PSyncError:
            return None
        try:
            return _answer(rep)
        except ProtocolError as exc:
            log.warning("node %d: malformed vote from node %d ignored: %s", self.me, voter, exc)
            return None

    async def _vote(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        """A candidate asks for this node's vote (:meth:`Ballot.decide`)."""
        term, view = args.get("term"), args.get("view")
        if type(term) is not int or not 0 <= term < 1 << 62 or not isinstance(view, list) or len(view) != 2 \
                or not all(type(x) is int and -1 <= x < 1 << 62 for x in view):
            raise ProtocolError("vote", "a vote request needs a term and the candidate's view [term, epoch]")
        m = self.membership
        svc = self.service
        now = clock.now()
        follows = m.coordinator
        # a coordinator counts as heard only while it says it holds a majority: a node that follows
        # a candidate (its election not won) or a coordinator cut off from the majority may vote
        hears = follows if follows != self.me and not m.coordinator_suspected and m.has_quorum else None
        ans = m.ballot.decide(VoteRequest(candidate=caller, term=term, view=(view[0], view[1])),
                              mine=m.view.key if m.view is not None else (0, -1),
                              coordinating_with_quorum=svc is not None and self.coordinating
                              and svc.state.has_quorum(now),
                              hears_coordinator=hears)
        log.info("node %d: vote for node %d in term %d: %s", self.me, caller, term, ans.reason)
        self.outrank(term)  # a coordinator with a majority goes above it; a member tells its coordinator
        return {"granted": ans.granted, "reason": ans.reason, "view": list(ans.view), "voted": ans.voted_term}

    def _become(self, term: int, failed: list[int], floor: int, voters: list[int], *,
                quiet: Sequence[int] = (), asked: float | None = None, kept: Sequence[int] = ()) -> None:
        """This node won the election of ``term``: host membership and the services, with
        ``failed`` left out of its first view; ``quiet`` members did not answer the vote
        request sent at ``asked``; ``kept``: members deposed long ago (:func:`rebuild_state`)."""
        m = self.membership
        now = clock.now()  # the clock of MembershipService
        state = rebuild_state(expected=self.expected, view=m.view, failed=failed,
                              me=self.me, fingerprint=m.fingerprint, now=now,
                              grace=self.failure_timeout, failure_timeout=self.failure_timeout,
                              heartbeat_interval=self.heartbeat_interval, phi_threshold=self.phi_threshold,
                              term=term, epoch_floor=floor, quiet=quiet, asked=asked, kept=kept)
        state.allow_join = self.allow_join
        self.took_over_at = now
        self.terms.append(term)
        log.warning("node %d: taking over as coordinator of term %d (votes of %s; deposed %s); view epoch %d "
                    "members %s", self.me, term, voters, failed, state.epoch, state.alive_nodes)
        self._start(state)

    def _followed(self, coordinator: int) -> None:
        """The node follows another coordinator: a service of its own is deposed, close it;
        when that one is a successor not elected yet, probe the successors ahead
        (:meth:`_probe_line`)."""
        m = self.membership
        now, deposed = clock.now(), m.succession.deposed
        for n in deposed:
            self._deposed_at.setdefault(n, now)
        for n in [n for n in self._deposed_at if n not in deposed]:
            del self._deposed_at[n]
        if coordinator != self.me and not len(self._walk) and m.succession.line(m.view):
            self._walk.spawn(self._probe_line(), name="succession-probe")
        svc = self.service
        if coordinator == self.me or svc is None:
            return
        log.warning("node %d: deposed as coordinator by a newer view naming node %d", self.me, coordinator)
        self.service = None
        self._retired.append(svc)
        self._closing.spawn(svc.close())

    def probe_time(self) -> float:
        """How long a successor has to answer a probe before it is passed over: a heartbeat
        interval plus two of the longest round trips this node measured (the failure
        detection bound leaves that much after the coordinator's own detection)."""
        rtts = [e.srtt for e in self.membership.rpc.rtt.values() if e.srtt is not None]
        return self.heartbeat_interval + 2 * max(rtts, default=0.0)

    async def _alive(self, node: int, timeout: float, *, any_path: bool = False) -> bool:
        """Whether ``node`` answers a view probe within ``timeout`` (an error reply is an answer);
        ``any_path``: ask it even when it and the nodes between are marked dead here, by any way
        (:meth:`RpcClient.call`)."""
        try:
            await self.membership.rpc.call(node, "membership.heartbeat", {"probe": True}, timeout=timeout,
                                           any_path=any_path)
        except RemoteError:
            return True
        except P2PSyncError:
            return False
        return True

    async def _alive_all(self, nodes: Sequence[int], timeout: float) -> dict[int, bool]:
        """Whether each of ``nodes`` answers a view probe within ``timeout``, asked at once;
        nodes marked dead here are asked too, by any way (``any_path``)."""
        asks = TaskSet("proof-of-life", isolated=True)
        tasks = {n: asks.spawn(self._alive(n, timeout, any_path=True), name=f"alive-{n}") for n in nodes}
        try:
            await asyncio.wait(tasks.values())
        finally:
            await asks.close()
        return {n: t.done() and not t.cancelled() and t.result() for n, t in tasks.items()}

    def probe_wait(self) -> float:
        """How long the probes of a batch of successors go unanswered before the next batch
        goes out (:func:`probe_next`): twice the longest round trip this node measured, and at
        least a quarter of a heartbeat interval (a round trip it did not measure, such as one
        the long way round a ring missing a node, must not make it ask every successor at
        once: the batches within one probe time reach about a hundred)."""
        rtts = [e.srtt for e in self.membership.rpc.rtt.values() if e.srtt is not None]
        return max(2 * max(rtts, default=0.0), self.heartbeat_interval / 4)

    async def _probe_line(self) -> None:
        """This node follows a successor that is not elected yet: ask it and the successors
        after it (:meth:`Succession.line`) whether they live, in batches (:data:`PROBE_BATCH`
        first, then twice as many each time), the next batch as soon as the ones out have had
        :meth:`probe_wait` and none answered (:func:`probe_next`), each ending with the batches
        before it when that leaves it :meth:`probe_wait` (:func:`probe_until`), and depose each
        that does not answer within its probe (:meth:`probe_time` from the first batch) while it
        is the one followed (:func:`silent_ahead`), so that the node reaches the lowest live one in about one
        probe time, not one detection time per successor nor one probe time per batch (see
        :mod:`p2psync.coordinator.takeover`). Ends once the successor followed answered, or
        the node follows itself, an elected coordinator or nobody of the line."""
        m = self.membership
        line = m.succession.line(m.view)
        timeout, wait = self.probe_time(), self.probe_wait()
        probes: dict[int, asyncio.Task[bool]] = {}
        sent: dict[int, float] = {}
        until: float | None = None  # when the probes of the latest batch end
        ends: dict[int, float] = {}  # node -> when its probe ends
        asked = TaskSet("succession-probes", isolated=True)
        batch = PROBE_BATCH
        try:
            while m.fenced is None and m.coordinator in line and m.coordinator != self.me \
                    and (m.view is None or m.view.coordinator != m.coordinator):
                c = m.coordinator
                ahead = line[line.index(c):]
                answered = {n: t.result() for n, t in probes.items() if t.done() and not t.cancelled()}
                now = clock.now()
                more = probe_next(ahead, sent, answered, now=now, wait=wait, batch=batch)
                if more:
                    until = probe_until(until, now=now, wait=wait, probe_time=timeout)
                    batch *= 2
                    for n in more:
                        sent[n], ends[n] = now, until
                        probes[n] = asked.spawn(self._alive(n, until - now), name=f"probe-{n}")
                # wake when the one followed is judged, or when the next batch may be due
                due = None if all(n in sent for n in ahead) or any(answered.values()) \
                    else max(0.0, max(sent.values()) + wait - now)
                await asyncio.wait([probes[c]], timeout=due)
                if m.coordinator != c or not probes[c].done():
                    continue  # moved on meanwhile (a view, the detector), or a batch is due
                # the probes that end with this one (later batches): judged together with it
                together = [t for n, t in probes.items() if ends[n] <= ends[c] and not t.done()]
                if together:
                    await asyncio.wait(together)
                if m.coordinator != c:
                    continue
                answered = {n: t.result() for n, t in probes.items() if t.done() and not t.cancelled()}
                silent = silent_ahead(line[line.index(c):], answered)
                if not silent:
                    return
                for n in silent:
                    if m.coordinator != n or m.fenced is not None:
                        break
                    m.pass_over(n, f"no answer to a probe within {timeout:.2f}s")
                if m.coordinator == c:
                    return
        finally:
            await asked.close()

    def _fenced(self, why: Fenced) -> None:
        """The node was removed from the run: it coordinates nothing from now on (a service
        of its own would declare the members it no longer hears failed, in a term the run
        has left); close it."""
        svc = self.service
        if svc is None:
            return
        log.warning("node %d: fenced while coordinating: its membership service closes", self.me)
        self.service = None
        self._retired.append(svc)
        self._closing.spawn(svc.close())

    def _dispatcher(self, method: str) -> Handler:
        async def dispatch(caller: int, args: Mapping[str, Any], arrays: Sequence[np.ndarray]) -> Any:
            view = self.membership.view
            # only a member of this node's view may bring it in (not a node excluded or failed)
            if self.service is None and method != "membership.register" and view is not None \
                    and caller in view.members:
                theirs = _ids(args.get("deposed"))
                term = args.get("term")
                their_term = term if type(term) is int and 0 <= term < 1 << 62 else None
                if theirs and self.membership.take_over(theirs, their_term):
                    log.warning("node %d: node %d deposed %s and contacted this node: took over",
                                self.me, caller, theirs)
                elif theirs and caller in self._refused and self.membership.coordinator == self.me:
                    self._refused.discard(caller)
                    self._rallied.set()  # (its campaign asks again: this one may vote for it now)
            seen = args.get("seen_term") if method == "membership.heartbeat" else None
            if type(seen) is int and 0 <= seen < 1 << 62:
                self.outrank(seen)  # a node voted in, or heard of, a term above its view's
            svc = self.service
            if svc is not None:
                return await svc.handlers[method](caller, args, arrays)
            view = self.membership.newest_view
            if method == "membership.heartbeat" and view is not None:
                if args.get("probe") is True and not news_for(view, args):
                    return {"redirect": True}  # a probe from a node that has this view or a newer one
                return {"view": view.to_wire(), "redirect": True}
            raise RemoteError("NotCoordinator", f"node {self.me} does not coordinate (it follows node "
                                                f"{self.membership.coordinator})")
        return dispatch

    async def close(self) -> None:
        await self._walk.close()
        await self._election.close()
        await self._reelection.close()
        svcs = [s for s in (self.service, *self._retired) if s is not None]
        self.service = None
        self._retired = []
        for s in svcs:
            await s.close()
        await self._closing.wait()  # their own close is bounded
        await self._closing.close()


__all__ = ["CoordinatorHost", "ask_again", "cut_off_when_judged", "may_win", "rebuild_state", "silent_since"]

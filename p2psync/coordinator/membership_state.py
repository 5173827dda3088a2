"""Membership bookkeeping, pure: the coordinator's decisions on registrations, failures,
joins, offences and views.

Contract: nothing here does IO or reads a clock. Every :class:`MembershipState` method whose
answer depends on time takes ``now`` (tests and the simulator control time), and the functions
(:func:`walled_in`, :func:`reachable`, :func:`majority_regained`, :func:`reborn`) depend on their
arguments only. :class:`~p2psync.coordinator.membership.MembershipService` (RPC on the
coordinator node) feeds it and publishes what it decides; the client every node runs is
:mod:`p2psync.coordinator.membership_client`. This module imports neither.

What it decides:

* **the view** (:meth:`MembershipState.view`, a :class:`~p2psync.coordinator.views.View`): who
  registered under which incarnation (and address), who failed, was excluded or departed, the
  coordinator it names, and whether the run ended as diverged;
* **the epoch**: every change of the members bumps it (a registration, a join, a failure, an
  exclusion, a departure, a redo of a failed operation, the end of the run);
* **the term**: the coordinator's election (0 for the run's first coordinator; set by
  :meth:`MembershipState.reelected`);
* **the quorum**: whether this coordinator hears a majority of the agreed view
  (:meth:`MembershipState.has_quorum`, over a :class:`~p2psync.coordinator.quorum.Agreement`); a
  failure whose declaration would leave less than that majority is not declared
  (:attr:`MembershipState.blocked`).

Failures are decided by a phi-accrual :class:`~p2psync.coordinator.detector.FailureDetector` fed
with heartbeat arrivals, any other traffic (``Transport.last_arrival``) and the RTT each client
measures. A second registration under a node id whose registered process is alive is rejected
with an error naming both incarnations and addresses.

Joins: a node of the topology that was declared failed may register again
with a newer incarnation (the same ``--node`` restarted, same ``--run-id``) while the run is
going; it is admitted (same configuration fingerprint required) and the epoch bumped. A run
still starts only once every node has registered (``--start-timeout``); joins come after that.
``allow_join=False`` (``--on-failure stop``) keeps rejecting them. A joiner that the coordinator
reaches only through nodes removed from the run (:func:`walled_in`: a restarted node of a ring
whose two neighbours were removed, its request relayed by one still running) is not to be
admitted: no answer, view or heartbeat reply could reach it, and a view naming it would hold a
member that every operation waits for until it is declared failed. The service refuses it as
:data:`UNREACHABLE`.

Non-finite tensor values. A node whose own gradient, or any tensor it
is about to send, holds NaN or infinity stops with :class:`~p2psync.errors.Diverged` ("training
diverged at step k on node i") before sending it, blaming nobody; its departure is a failure
for the others, which go on without it. A sum of finite values that overflowed in a collective
(:class:`~p2psync.errors.SumDiverged`) is the group's divergence, not one node's: the node that
computed it reports it to the coordinator (``membership.diverged``,
:meth:`MembershipState.report_diverged`), which ends the run as diverged: the view then carries
``end`` and every member stops with Diverged too, also those that saw no such value (a sum that
overflowed in one piece only is seen by that piece's owner alone; the others would wait for
the piece it never sends). A receiver rejects a piece holding such values and reports the
neighbour that delivered it (tensors only cross direct links) in its heartbeats. The
coordinator (:meth:`MembershipState.report_offences`) counts reports only from members about
their own neighbours, and

* excludes a node once **two distinct members** reported it, or all of its live neighbours when
  it has fewer than two: one key holder reporting all its neighbours excludes nobody (on a ring
  path only one neighbour ever receives from an offender, so such an offender is not excluded:
  that neighbour's step fails after the regroup bound with the offence named);
* ends the run as **diverged** when most members are reported (the view then carries ``end``
  and every node stops with :class:`~p2psync.errors.Diverged`): that is not one bad node;
* never excludes or deposes the coordinator for an offence alone (a coordinator is deposed only
  when it falls silent).

The wire constants of the membership protocol that the service and the client share are here
too: :data:`EVENT_VIEW` (the event that pushes a view) and :data:`UNREACHABLE` (the kind of the
refusal of a walled-in joiner).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Sequence

from p2psync.coordinator.detector import DetectorParams, FailureDetector
from p2psync.coordinator.quorum import Agreement
from p2psync.coordinator.views import View
from p2psync.errors import ConfigError, DuplicateNode, RunEnded
from p2psync.topology import Topology
from p2psync.topology.paths import hop_distances

#: the event by which the coordinator pushes a view to a member
EVENT_VIEW = "event.view"
#: the kind of the refusal of a joiner that no live path reaches (:func:`walled_in`)
UNREACHABLE = "Unreachable"


def walled_in(topology: Topology, coordinator: int, joiner: int, dead: Collection[int]) -> list[int] | None:
    """Whether ``coordinator`` can reach ``joiner`` over nodes not in ``dead`` (the nodes it
    routes around: those its views removed, which every member routes around too). Pure.

    None when it can: ``joiner`` is its neighbour, or a path leads to it whose relays are all
    outside ``dead`` (``joiner`` itself may be in it: its previous life was declared). Else the
    neighbours of ``joiner`` (each in ``dead``, or walled in behind such nodes), sorted: every
    way to it crosses a node nobody relays through, so no answer, view or heartbeat reply can
    reach it while they stay out, and a view naming it would hold a member that nobody can
    reach. Its request came through such a node (one removed but still running, such as a
    fenced process before it ends), or through a node that no longer relays for it."""
    if reachable(topology, coordinator, set(dead) - {joiner})(joiner):
        return None
    return sorted(topology.neighbors(joiner))


def reachable(topology: Topology, coordinator: int, dead: Collection[int]) -> Callable[[int], bool]:
    """Whose arrivals are proof of life at ``coordinator``: a node it reaches over nodes not in
    ``dead`` (the nodes it routes around), or one in ``dead`` itself (heard again). Pure. A
    member walled in behind removed nodes may still be heard through them (a removed process
    that has not ended relays on), but the coordinator can answer nothing it sends: its
    silence counts as if nothing arrived, and it is declared in the usual time."""
    if not dead:
        return lambda n: True
    gone = set(dead)
    reach = hop_distances(topology, coordinator, avoid=gone)
    return lambda n: n in reach or n in gone


def majority_regained(since: float, outages: Mapping[int, tuple[float, float] | None],
                      quorum: Callable[[Collection[int]], bool]) -> float | None:
    """When the coordinator heard a majority again, if it lost it after ``since`` (a suspect's
    last proof of life): ``outages`` maps the members heard lately to their latest outage
    (start, end: when it was heard again; None: none), ``quorum`` says whether a set of members
    is a majority. Those with no outage ending after ``since`` were heard throughout; when they
    are no majority, the majority came back when enough of the others were heard again (the
    outages are taken to overlap: a split silences its far side at once). None: a majority was
    heard throughout (or is not heard even now: :meth:`MembershipState.check` blocks then)."""
    throughout = {m for m, o in outages.items() if o is None or o[1] <= since}
    if quorum(throughout):
        return None
    got = set(throughout)
    for end, m in sorted((o[1], m) for m, o in outages.items() if o is not None and o[1] > since):
        got.add(m)
        if quorum(got):
            return end
    return None


def reborn(left: Collection[int], named: Mapping[int, int], known: Mapping[int, int]) -> list[int]:
    """The nodes of ``left`` (removed by a view) whose process removed (``named``: node ->
    the incarnation the previous view named) is not the one heard now (``known``: node -> the
    incarnation its latest admitted message carried): restarted, their new process runs. Pure.

    The view declares the old process failed; the node is not routed around for it: its new
    process relays at once (the transport routes through it again as soon as it is heard),
    and it may be the only way to the nodes behind it, such as an arc of a ring it joins
    again, through which the new process itself joins."""
    return sorted(n for n in left if n in named and n in known and known[n] != named[n])

@dataclass
class MembershipState:
    """Pure bookkeeping; every method takes ``now`` so tests control time.

    ``failure_timeout`` is the detector's floor (minimum silence before a node is declared
    failed); ``heartbeat_interval`` and ``phi_threshold`` parametrise the phi-accrual detector."""

    expected: frozenset[int]
    failure_timeout: float = 2.0
    heartbeat_interval: float = 0.5
    phi_threshold: float = 8.0
    registered: dict[int, str] = field(default_factory=dict)  # node -> config fingerprint
    incarnations: dict[int, int] = field(default_factory=dict)
    addresses: dict[int, str] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)
    finished: dict[int, Any] = field(default_factory=dict)
    epoch: int = 0
    started: bool = False
    #: the node hosting this state (named in every view); -1: the lowest expected id
    coordinator: int = -1
    #: admit a failed node that registers again with a newer incarnation (a join)
    allow_join: bool = True
    #: node -> how many times it rejoined
    rejoined: dict[int, int] = field(default_factory=dict)
    #: joiner -> time until which it is not suspected before its first heartbeat (its
    #: registration reply may need a retry while relays still route around its old life)
    join_grace: dict[int, float] = field(default_factory=dict)
    #: joiner -> the epoch of the view that admitted its current incarnation
    joined_epoch: dict[int, int] = field(default_factory=dict)
    #: joiners whose strategy has not joined the training yet (registered as a join; cleared
    #: for good, per incarnation, by a heartbeat that does not say ``joining``) -> when they
    #: last said so (:attr:`joining`)
    joining_heard: dict[int, float] = field(default_factory=dict)
    #: nodes whose current incarnation said it joined the training (a late copy of an older
    #: heartbeat does not make them joiners again)
    trained: set[int] = field(default_factory=set)
    #: when the latest node finished (None: none yet)
    finished_at: float | None = None
    #: joiners the run's end left out (:meth:`end_joiners`)
    ended: set[int] = field(default_factory=set)
    #: nodes that finished and left the view gracefully
    departed: set[int] = field(default_factory=set)
    #: nodes excluded for what they sent (node -> why), also in ``failed``
    excluded: dict[int, str] = field(default_factory=dict)
    #: node -> the members that reported it for sending non-finite tensor values
    reports: dict[int, set[int]] = field(default_factory=dict)
    #: why the run ended as diverged (most members reported), or ""
    diverged: str = ""
    #: the coordinator's term (its election; 0 for the run's first coordinator)
    term: int = 0
    #: the agreed view and the members' acknowledgements (from the end of the rendezvous on)
    agreement: Agreement | None = None
    #: suspected nodes this coordinator may not declare failed: that would leave less than a
    #: majority of the agreed view (it has lost its quorum until they are heard again)
    blocked: list[int] = field(default_factory=list)
    #: member -> time before which it is not declared failed unless heard meanwhile: its
    #: silence counts only from when it could know to heartbeat this coordinator (:meth:`check`,
    #: :meth:`reelected`)
    spared: dict[int, float] = field(default_factory=dict)
    #: called with the key of each view this coordinator publishes, before it counts itself as
    #: having applied it: its node keeps the key with its votes first (``Ballot.saw``), or a
    #: restarted process of it could grant its vote to a candidate that missed that view
    on_publish: Callable[[tuple[int, int]], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._view_cache: tuple[tuple[Any, ...], View] | None = None
        self._wire_cache: tuple[View, dict[str, Any]] | None = None
        if self.coordinator < 0:
            self.coordinator = min(self.expected)
        self.detector = FailureDetector(params=DetectorParams(
            interval=self.heartbeat_interval, floor=self.failure_timeout, threshold=self.phi_threshold))

    def register(self, node: int, fingerprint: str, now: float, *, incarnation: int = 0,
                 address: str = "?") -> bool:
        """Admit ``node``; returns True when this is a join (a failed node's new incarnation)."""
        if node not in self.expected:
            raise ConfigError(f"node {node} is not in the topology")
        if node in self.registered:
            old, addr = self.incarnations.get(node, 0), self.addresses.get(node, "?")
            if old == incarnation:
                return self.rejoined.get(node, 0) > 0  # the same process again (a retried request)
            self.refuse_at_end(node, incarnation, address)
            if node in self.failed:
                if not self.allow_join:
                    raise ConfigError(f"node {node} (incarnation {incarnation} at {address}) was declared "
                                      f"failed in incarnation {old} at {addr}; this run does not admit "
                                      f"joins (--on-failure stop)")
                if incarnation < old:
                    raise ConfigError(f"node {node}: incarnation {incarnation} at {address} is older than "
                                      f"the failed incarnation {old} at {addr}")
                self._check_fingerprint(node, fingerprint)
                self.failed.discard(node)
                self.departed.discard(node)
                self.finished.pop(node, None)
                self.registered[node] = fingerprint
                self.incarnations[node] = incarnation
                self.addresses[node] = address
                self.detector.watch(node, now)
                self.join_grace[node] = now + 3 * self.failure_timeout + 10 * self.heartbeat_interval
                self.rejoined[node] = self.rejoined.get(node, 0) + 1
                self.reports.pop(node, None)  # reports concerned its previous life
                self.epoch += 1
                self.joined_epoch[node] = self.epoch
                self.joining_heard[node] = now
                self.trained.discard(node)
                self.ended.discard(node)
                return True
            raise DuplicateNode(f"node {node} is already registered and alive (incarnation {old} at "
                                f"{addr}); second registration (incarnation {incarnation} at {address}) "
                                f"rejected")
        self._check_fingerprint(node, fingerprint)
        self.registered[node] = fingerprint
        self.incarnations[node] = incarnation
        self.addresses[node] = address
        self.detector.watch(node, now)
        self.epoch += 1
        if self.complete and not self.started:  # rendezvous done: heartbeats start now
            self.started = True
            for n in self.registered:
                self.detector.forget(n)
                self.detector.watch(n, now)
            self.agreement = Agreement(me=self.coordinator, members=frozenset(self.alive_nodes), epoch=self.epoch)
        return False

    def _check_fingerprint(self, node: int, fingerprint: str) -> None:
        others = [(n, fp) for n, fp in self.registered.items() if n != node]
        if others:
            ref_node, ref = others[0]
            if fingerprint != ref:
                raise ConfigError(f"node {node} runs a different configuration than node {ref_node} "
                                  f"({fingerprint} != {ref}); start every node with the same options")

    @property
    def missing(self) -> list[int]:
        """The expected nodes that have not registered yet, sorted."""
        return sorted(self.expected - set(self.registered))

    @property
    def complete(self) -> bool:
        """Every expected node has registered: the rendezvous is done (O(1) until as many
        nodes registered as are expected: every waiter of the rendezvous asks it on every
        registration)."""
        return len(self.registered) >= len(self.expected) and not self.missing

    def heartbeat(self, node: int, now: float, *, srtt: float | None = None, rttvar: float = 0.0,
                  applied: tuple[int, int] | None = None, joining: bool = False) -> None:
        """A heartbeat from a live registered ``node`` at ``now``, with the RTT it measured to
        the coordinator (``srtt``, ``rttvar``) when it has one; ends a joiner's grace period.
        ``applied``: the (term, epoch) of the newest view of this coordinator it applied (its
        acknowledgement, :class:`~p2psync.coordinator.quorum.Agreement`); ``joining``: it
        joined a run going and its strategy has not joined the training yet. Called from the
        service's ``membership.heartbeat`` handler."""
        if node in self.registered and node not in self.failed:
            if not joining:
                self.joining_heard.pop(node, None)
                self.trained.add(node)
            elif node not in self.trained and node not in self.finished:
                self.joining_heard[node] = now  # (a coordinator that took over learns it so)
            self.join_grace.pop(node, None)
            self.spared.pop(node, None)
            self.detector.heartbeat(node, now)
            if srtt is not None:
                self.detector.rtt(node, srtt, rttvar)
            if applied is not None and applied[0] == self.term and self.agreement is not None:
                self.agreement.acknowledge(node, applied[1])

    def is_member(self, node: int) -> bool:
        """Whether ``node`` is a member of the current view (not failed, excluded or departed)."""
        return node in self.registered and node not in self.failed and node not in self.departed

    def has_quorum(self, now: float) -> bool:
        """Whether this coordinator hears a majority of the agreed view now (always True before
        the rendezvous ends: there is nothing to agree on yet)."""
        if self.agreement is None:
            return True
        suspects = set(self.detector.suspects(now))
        # a member that finished (it is in this coordinator's finish barrier, or left it)
        # counts as heard: it agreed to the end, and it may have exited since
        heard = [n for n in self.alive_nodes if n not in suspects or n in self.finished]
        return not self.blocked and self.agreement.quorum(heard)

    def _may_remove(self, nodes: Sequence[int], now: float | None = None) -> bool:
        """Whether declaring ``nodes`` failed keeps a majority of the agreed view. With ``now``,
        only the members heard lately (:meth:`_fresh`) count for that majority: members
        silent for almost as long as ``nodes``, cut off by the same split but heard a moment
        later, are not a majority's support (an even split would otherwise remove the half
        that falls silent first)."""
        if self.agreement is None:
            return True
        alive = set(self.alive_nodes) - set(nodes)
        if now is not None:
            alive = {n for n in alive if n == self.coordinator or n in self.finished or self._fresh(n, now)}
        return self.agreement.may_remove(alive)

    def _outages(self, now: float) -> dict[int, tuple[float, float] | None]:
        """The members heard lately (:meth:`_fresh`), each with its latest outage
        (:attr:`PeerDetector.outage`; None: none, as for this coordinator and the members that
        finished, which count as heard)."""
        peers = self.detector.peers
        return {n: (peers[n].outage if n in peers and n != self.coordinator and n not in self.finished else None)
                for n in self.alive_nodes
                if n == self.coordinator or n in self.finished or self._fresh(n, now)}

    def _fresh(self, node: int, now: float) -> bool:
        """Whether ``node`` was heard within two heartbeat intervals, or half the failure
        timeout if that is longer, before ``now``."""
        return self.detector.silence(node, now) <= max(2 * self.heartbeat_interval, self.failure_timeout / 2)

    def alive(self, node: int, at: float) -> None:
        """Any message from ``node`` arrived at ``at`` (proof of life)."""
        if node in self.registered and node not in self.failed:
            self.detector.alive(node, at)

    def check(self, now: float) -> list[int]:
        """Nodes newly declared failed: registered, not finished, suspected by the detector.

        The node hosting this state is never declared failed (this code runs on it).
        Nothing is declared before the rendezvous completes: a registered node only starts
        heartbeating once every node has registered (its register call is the server's own
        long poll until then), and missing nodes are the start timeout's business. The
        registration that completes the rendezvous starts every member's detector afresh.

        A member's silence counts against it only while this coordinator holds a majority
        of the agreed view and the member can know that it is to heartbeat it:

        * when the suspects cannot be removed without losing that majority, nobody is
          declared (:attr:`blocked`: the quorum is lost);
        * once a majority is heard again, every member is spared (:attr:`spared`) a full
          detection window (its detector's timeout) from then, unless heard meanwhile: while
          no majority was heard, members deposed this coordinator and followed a candidate, as
          they must, and they heartbeat it again only once it is re-elected above that
          candidate's term, which it may do only now that it holds the majority again (and the
          far side of a healed split is heard a moment later, over longer paths);
        * a majority lost without anyone suspected (a split shorter than the failure
          timeout: the far side heard again before its silence was long enough) counts the
          same way: a suspect's silence counts only from when a majority was heard again
          (:func:`majority_regained`, over the members' latest outages);
        * when it is re-elected in a new term, every member that did not vote for it is
          spared the same way (:meth:`reelected`): it followed another candidate, or could not
          answer, and heartbeats this coordinator only once it applies the new term's view.

        A member silent through such a window is failed: the coordinator of a majority reaches
        every live member within it."""
        if not self.complete:
            return []
        new = [n for n in self.detector.suspects(now) if n not in self.failed and n not in self.finished
               and n not in self.departed and n != self.coordinator and self.join_grace.get(n, now) <= now]
        if new and not self._may_remove(new, now):
            self.blocked = sorted(new)  # no majority without them: declare nothing, wait
            return []
        if self.blocked:  # a majority is heard again: the silence counts from now on
            self.blocked = []
            self._spare(self.alive_nodes, now)
        for n in new:
            # its silence counts only from when a majority was heard again, if that was lost
            # meanwhile without this coordinator suspecting anyone (a split shorter than the
            # failure timeout, healed before the members on the far side were suspected)
            d = self.detector.peers[n]
            back = majority_regained(d.last, self._outages(now), self.agreement.quorum) \
                if self.agreement is not None else None
            if back is not None:
                self.spared[n] = max(self.spared.get(n, now), back + d.timeout())
        new = [n for n in new if self.spared.get(n, now) <= now]
        if new:
            self.failed.update(new)
            for n in new:
                self.detector.forget(n)
                self.spared.pop(n, None)
            self.epoch += 1
        return sorted(new)

    def reelected(self, term: int, epoch: int, voters: Collection[int], now: float) -> None:
        """This coordinator won the election of ``term`` (above its own) with the votes of
        ``voters``; its next view has ``epoch``. Every other member is spared a full detection
        window from ``now`` (unless heard meanwhile): it followed another candidate, or could
        not answer, and heartbeats this coordinator only once it applies that view."""
        self.term, self.epoch = term, epoch
        self._spare([n for n in self.alive_nodes if n not in voters], now)

    def _spare(self, nodes: Collection[int], now: float) -> None:
        """Declare none of ``nodes`` failed before a full detection window from ``now``."""
        peers = self.detector.peers
        for n in nodes:
            if n != self.coordinator and n in peers:
                self.spared[n] = max(self.spared.get(n, now), now + peers[n].timeout())

    def declare_failed(self, nodes: Sequence[int], *, seen_epoch: int | None = None) -> list[int]:
        """Nodes reported failed by someone else (a member after a coordinator takeover):
        registered, not failed yet and not the coordinator. Returns those newly failed.

        ``seen_epoch``: the view epoch the reporter had applied; a node that (re)joined in a
        later epoch is not declared failed on such a report (the report concerns its previous
        life: heartbeats are pipelined, so one sent before the reporter saw the join arrives
        after it)."""
        new = sorted({n for n in nodes if n in self.registered and n != self.coordinator
                      and (seen_epoch is None or self.joined_epoch.get(n, -1) <= seen_epoch)}
                     - self.failed)
        if new and not self._may_remove(new):
            return []  # a minority's word: the detector of a coordinator with a quorum decides
        if new:
            self.failed.update(new)
            for n in new:
                self.detector.forget(n)
            self.epoch += 1
        return new

    def redo(self, node: int, epoch: int, peers: Sequence[int], now: float) -> bool:
        """Member ``node`` reports that an operation of view ``epoch`` failed on a wait for
        ``peers`` that nobody declared failed (a slow piece, a lost message): when ``epoch`` is
        the current one, this coordinator holds a majority and every one of ``peers`` is a
        member and none is suspected (then the detector decides), the epoch moves on so every
        member redoes the operation over the same members. Returns True when it did. One bump
        per epoch: the members of that operation report the same epoch, and the first report
        moves past it. A peer that is no member (a removed relay whose death cut the group
        apart) is refused: the same members would fail the same way at once, view after view,
        until the membership itself changes."""
        if not self.complete or epoch != self.epoch or not self.is_member(node) or not self.has_quorum(now):
            return False
        suspects = set(self.detector.suspects(now))
        if any(p in suspects or not self.is_member(p) for p in peers):
            return False
        self.epoch += 1
        return True

    def report_offences(self, reporter: int, offenders: Sequence[int], neighbors: Callable[[int], Sequence[int]],
                        *, seen_epoch: int | None = None) -> list[int]:
        """Member ``reporter`` received non-finite tensor values from ``offenders`` (the policy
        is in the module docstring). Returns the nodes newly excluded; sets :attr:`diverged`
        (and bumps the epoch) when most members are reported."""
        members = set(self.alive_nodes)
        if reporter not in members or self.diverged:
            return []
        for n in offenders:
            if n != reporter and n in members and reporter in neighbors(n):
                self.reports.setdefault(n, set()).add(reporter)
        reported = sorted(n for n, who in self.reports.items() if n in members and who & members)
        if 2 * len(reported) > len(members) > 1:
            who = sorted(set().union(*(self.reports[n] for n in reported)) & members)
            self.diverged = (f"{len(reported)} of {len(members)} members {reported} were reported for sending "
                             f"non-finite tensor values (reported by nodes {who})")
            self.epoch += 1
            return []
        due = [n for n in reported if n != self.coordinator
               and len(self.reports[n] & members) >= min(2, len((set(neighbors(n)) & members) - {n}))]
        new = self.declare_failed(due, seen_epoch=seen_epoch)
        for n in new:
            self.excluded[n] = f"sent non-finite tensor values (reported by nodes {sorted(self.reports[n])})"
        return new

    def report_diverged(self, reporter: int, why: str) -> bool:
        """A sum of finite values that member ``reporter`` computed in a collective overflowed
        (:class:`~p2psync.errors.SumDiverged`): the run ends as diverged, since the other
        members would wait for what it will never send. Whether this ended it (False: the
        reporter is no member, or the run had ended already)."""
        if reporter not in set(self.alive_nodes) or self.diverged:
            return False
        self.diverged = f"a sum that node {reporter} computed diverged: {why}"
        self.epoch += 1
        return True

    def finish(self, node: int, stats: Any, *, depart: bool = True, now: float | None = None) -> bool:
        """``node`` finished: record its stats; with ``depart`` it leaves the view (not a
        failure: its loop ended while the others go on). Returns True when the view changed."""
        self.finished[node] = stats
        self.joining_heard.pop(node, None)
        if now is not None:
            self.finished_at = now
        if depart and node in self.registered and node not in self.failed and node not in self.departed:
            self.departed.add(node)
            if self.agreement is not None:
                self.agreement.depart(node)
            self.epoch += 1
            return True
        return False

    @property
    def joining(self) -> set[int]:
        """The joiners whose strategy has not joined the training yet."""
        return set(self.joining_heard)

    @property
    def stopping(self) -> bool:
        """The run is ending: some node finished at a stop (it did not depart), and so did
        every member but the joiners still joining (a strategy whose nodes stop one by one,
        such as ASGD's, is not ending while a member trains on). A failed or departed node
        may not rejoin it (:meth:`refuse_at_end`)."""
        stopped = {n for n in self.finished if n not in self.departed}
        members = set(self.registered) - self.failed - self.departed
        return bool(stopped) and members - self.joining <= set(self.finished)

    def refuse_at_end(self, node: int, incarnation: int, address: str) -> None:
        """:class:`RunEnded` when a new process of failed or departed ``node`` asks to rejoin a
        run that is :attr:`stopping` (nothing is left to join)."""
        if self.stopping and (node in self.failed or node in self.departed):
            raise RunEnded(f"node {node} (incarnation {incarnation} at {address}) asks to rejoin, but the run is "
                           f"ending: its members stopped (nodes {sorted(self.finished)} finished)")

    def end_joiners(self, now: float, grace: float) -> list[int]:
        """The joiners still joining that the run ends without: once it is :attr:`stopping`,
        ``grace`` after the last node finished (the heartbeat of a joiner that joined the
        training in time says so first), those that said ``joining`` again since that finish
        (never the coordinator itself) depart: the view names them departed, and each ends as
        :class:`RunEnded`. Returns them; the view changed when it is not empty."""
        # (the cheap tests first: the barrier asks at every change, and rarely with a joiner)
        if not self.joining_heard or self.finished_at is None or now - self.finished_at < grace or not self.stopping:
            return []
        at = self.finished_at
        waiting = {n for n, heard in self.joining_heard.items() if heard >= at and n != self.coordinator
                   and n not in self.finished and n not in self.failed and n not in self.departed}
        if not waiting:
            return []
        for n in sorted(waiting):
            self.departed.add(n)
            self.detector.forget(n)
            if self.agreement is not None:
                self.agreement.depart(n)
        for n in waiting:
            del self.joining_heard[n]
        self.ended |= waiting
        self.epoch += 1
        return sorted(waiting)

    @property
    def all_finished(self) -> bool:
        """Every expected node finished, failed or departed: the finish barrier may end."""
        return set(self.finished) | self.failed | self.departed >= self.expected

    @property
    def alive_nodes(self) -> list[int]:
        """The members: registered, neither failed nor departed (finished)."""
        return sorted(set(self.registered) - self.failed - self.departed)

    def view(self) -> View:
        """The current view: the epoch, the live members with their incarnations, the
        coordinator, the departed nodes and why the run ended (``ended``, or "").

        Built once per change (memoized on the epoch, term, coordinator, ``ended`` and the
        sizes of the registered, failed and departed sets: every change of the members bumps
        the epoch), so a heartbeat costs no O(N) rebuild."""
        key = (self.epoch, self.term, self.coordinator, self.diverged, len(self.registered), len(self.failed),
               len(self.departed))
        cached = self._view_cache
        if cached is not None and cached[0] == key:
            view = cached[1]
        else:
            members = self.alive_nodes
            view = View(epoch=self.epoch, members=tuple(members),
                        incarnations={n: self.incarnations.get(n, 0) for n in members},
                        coordinator=self.coordinator, departed=tuple(sorted(self.departed)), ended=self.diverged,
                        term=self.term)
            self._view_cache = (key, view)
        agreement = self.agreement
        if agreement is not None and (agreement.latest is None or agreement.latest[0] != self.epoch) \
                and self.epoch > agreement.epoch:
            if self.on_publish is not None:
                self.on_publish(view.key)
            agreement.publish(self.epoch, view.members)
        return view

    def wire_view(self) -> dict[str, Any]:
        """:meth:`view` in wire form (:meth:`View.to_wire`), also built once per change."""
        view = self.view()
        cached = self._wire_cache
        if cached is None or cached[0] is not view:
            cached = self._wire_cache = (view, view.to_wire())
        return cached[1]


__all__ = ["EVENT_VIEW", "UNREACHABLE", "MembershipState", "majority_regained", "reachable", "reborn",
           "walled_in"]

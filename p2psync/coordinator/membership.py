"""Membership: rendezvous, heartbeats, failure detection, views and the finish barrier.

:class:`MembershipState` is the pure decision logic (who registered under which incarnation,
who failed, the current :class:`~p2psync.coordinator.views.View`); failures are decided by a
phi-accrual :class:`~p2psync.coordinator.detector.FailureDetector` fed with heartbeat arrivals,
any other traffic (``Transport.last_arrival``) and the RTT each client measures.

:class:`MembershipService` exposes it over RPC on the coordinator node; on every change it bumps
the view's epoch and publishes the view to every live node as an ``event.view`` event (owned
tasks) and in the reply to every heartbeat whose sender has not applied it yet (a heartbeat
names the sender's view: epoch, coordinator and term), so a lost event is repaired by the next
reply while a heartbeat of an up-to-date member costs O(1) bytes whatever the size of the run.
A second
registration under a node id whose registered process is alive is rejected with an error naming
both incarnations and addresses.

:class:`MembershipClient` (:mod:`p2psync.coordinator.membership_client`, re-exported here)
runs on every node: rendezvous, pipelined heartbeats, views in epoch order, failure listeners,
coordinator failover and the finish barrier.

Coordinator failover: a service built with a ``state`` rebuilt after a
takeover (:mod:`p2psync.coordinator.failover`) publishes its view at once, names itself as the
coordinator in every view, merges the failures members report and moves its epoch past any
epoch a member reports (so a view the old coordinator published late cannot outrank it).

Joins: a node of the topology that was declared failed may register again
with a newer incarnation (the same ``--node`` restarted, same ``--run-id``) while the run is
going; the coordinator admits it (same configuration fingerprint required), bumps the epoch,
publishes the new view to every member at once and answers ``joined: true`` so the joiner
fetches its state from live peers before training. A run still starts only once every node
has registered (``--start-timeout``); joins come after that. ``allow_join=False``
(``--on-failure stop``) keeps rejecting them. A joiner that the coordinator reaches only
through nodes removed from the run (:func:`walled_in`: a restarted node of a ring whose two
neighbours were removed, its request relayed by one still running) is not admitted: no
answer, view or heartbeat reply could reach it, and a view naming it would hold a member that
every operation waits for until it is declared failed. It is refused as ``Unreachable``
(logged once per incarnation) and admitted once one of its neighbours is back; the joiner asks
again until its start timeout, whether the refusal reached it or its attempt timed out (the
refusal takes the same ways back as an admission would).

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

The excluded node is told (the view without it) before it is cut off, so it stops instead of
waiting for peers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np

from p2psync import clock
from p2psync.coordinator.detector import DetectorParams, FailureDetector, StallMeter
from p2psync.coordinator.quorum import Agreement
from p2psync.coordinator.rpc import Handler, RpcServer
from p2psync.coordinator.views import MAX_END_CHARS, View, news_for
from p2psync.errors import ConfigError, DuplicateNode, P2PSyncError, PeerTimeout, ProtocolError, RemoteError
from p2psync.tasks import TaskSet
from p2psync.topology import Topology
from p2psync.topology.paths import hop_distances

log = logging.getLogger("p2psync.membership")

EVENT_VIEW = "event.view"
#: heartbeats in flight at once (pipelined); more are skipped until one finishes
MAX_HEARTBEATS_IN_FLIGHT = 8
#: remote error kinds after which a call to the coordinator is retried (it is moving)
RETRY_KINDS = frozenset({"UnknownMethod", "NotCoordinator"})
#: the kind of the refusal of a joiner that no live path reaches (:func:`walled_in`)
UNREACHABLE = "Unreachable"
#: characters of a member's reason for its divergence that the coordinator keeps
MAX_WHY = 300


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
                  applied: tuple[int, int] | None = None) -> None:
        """A heartbeat from a live registered ``node`` at ``now``, with the RTT it measured to
        the coordinator (``srtt``, ``rttvar``) when it has one; ends a joiner's grace period.
        ``applied``: the (term, epoch) of the newest view of this coordinator it applied (its
        acknowledgement, :class:`~p2psync.coordinator.quorum.Agreement`). Called from the
        service's ``membership.heartbeat`` handler."""
        if node in self.registered and node not in self.failed:
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
               and n != self.coordinator and self.join_grace.get(n, now) <= now]
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

    def finish(self, node: int, stats: Any, *, depart: bool = True) -> bool:
        """``node`` finished: record its stats; with ``depart`` it leaves the view (not a
        failure: its loop ended while the others go on). Returns True when the view changed."""
        self.finished[node] = stats
        if depart and node in self.registered and node not in self.failed and node not in self.departed:
            self.departed.add(node)
            if self.agreement is not None:
                self.agreement.depart(node)
            self.epoch += 1
            return True
        return False

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
            agreement.publish(self.epoch, view.members)
        return view

    def wire_view(self) -> dict[str, Any]:
        """:meth:`view` in wire form (:meth:`View.to_wire`), also built once per change."""
        view = self.view()
        cached = self._wire_cache
        if cached is None or cached[0] is not view:
            cached = self._wire_cache = (view, view.to_wire())
        return cached[1]


class MembershipService:
    """Coordinator side. Methods: membership.register / heartbeat / finish.

    ``state``: a state rebuilt after a takeover (:func:`p2psync.coordinator.failover.rebuild_state`);
    such a service publishes its view at once and merges the failures members report.
    ``rpc_methods=False``: do not register the handlers (a :class:`CoordinatorHost` dispatches
    to :attr:`handlers`)."""

    def __init__(self, *, server: RpcServer, expected: Sequence[int], start_timeout: float = 60.0,
                 failure_timeout: float = 2.0, heartbeat_interval: float = 0.5,
                 phi_threshold: float = 8.0, check_interval: float = 0.1,
                 run_info: Mapping[str, Any] | None = None, state: MembershipState | None = None,
                 rpc_methods: bool = True, allow_join: bool = True) -> None:
        self.server = server
        self.transport = server.transport
        self.rebuilt = state is not None
        self.state = state if state is not None else MembershipState(
            expected=frozenset(expected), failure_timeout=failure_timeout,
            heartbeat_interval=heartbeat_interval, phi_threshold=phi_threshold,
            coordinator=server.transport.node_id, allow_join=allow_join)
        self.start_timeout = start_timeout
        self.check_interval = check_interval
        self.run_info = dict(run_info or {})
        self._changed = asyncio.Event()
        #: the failure monitor
        self._tasks = TaskSet("membership-service")
        #: the view pushes (``event.view``) in flight: one per peer, each on its own (the next
        #: heartbeat reply carries the view anyway), so they fail alone, logged
        self._tells = TaskSet("view-push", isolated=True)
        self._t0 = clock.now()
        #: (when, whether) the majority was last found heard (:meth:`_quorum`)
        self._quorum_seen: tuple[float, bool] | None = None
        #: when the rendezvous completed (this node's clock); a rebuilt service is given it
        self.run_started: float | None = None
        #: joiner -> the incarnation whose registration was refused as unreachable (logged once)
        self._walled: dict[int, int] = {}
        self.handlers: dict[str, Handler] = {"membership.register": self._register, "membership.heartbeat": self._heartbeat,
                         "membership.finish": self._finish, "membership.diverged": self._diverged}
        if rpc_methods:
            for method, handler in self.handlers.items():
                server.register(method, handler)

    def start(self) -> None:
        """Start the failure monitor (an owned task); a rebuilt service also marks the failed
        nodes dead and publishes its view at once. Called from failover.py: ``svc.start()``."""
        self._t0 = clock.now()
        self._tasks.spawn(self._monitor(), name="membership-monitor")
        if self.rebuilt:
            for n in self.state.failed:
                self.transport.mark_dead(n)
            self._publish(self.state.view())

    async def close(self) -> None:
        """Cancel the view pushes in flight and the failure monitor (``CoordinatorHost.close``);
        raises the monitor's failure, if it failed."""
        await self._tells.close()
        await self._tasks.close()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_until(self, pred: Callable[[], bool], deadline: float) -> bool:
        while not pred():
            remaining = deadline - clock.now()
            if remaining <= 0:
                return False
            ev = self._changed
            try:
                await asyncio.wait_for(ev.wait(), min(remaining, 0.5))
            except asyncio.TimeoutError:
                pass
        return True

    async def _register(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        inc = args.get("incarnation", 0)
        if type(inc) is not int or inc < 0:
            raise ProtocolError("register", f"bad incarnation {inc!r}"[:100])
        addr = str(args.get("address", "?"))[:200]
        before = self.state.epoch
        if self.state.started and not self.state.has_quorum(clock.now()):
            # a coordinator cut off from the majority admits nobody: the joiner asks elsewhere
            raise RemoteError("NotCoordinator", f"node {self.transport.node_id} coordinates no majority of "
                                                "the run now")
        if self.state.started and caller in self.state.failed and self.state.allow_join:
            around = walled_in(self.transport.topology, self.transport.node_id, caller, self.transport.dead)
            if around is not None:
                # admitted, it would be a member that no answer reaches: declared failed once
                # its grace ran out, a false failure, while every view until then names it
                if self._walled.get(caller) != inc:
                    self._walled[caller] = inc
                    log.warning("coordinator %d: node %d (incarnation %d at %s) asks to rejoin, but every "
                                "way to it crosses nodes removed from the run (its neighbours %s): not "
                                "admitted while none of them is back", self.transport.node_id, caller, inc,
                                addr, around)
                raise RemoteError(UNREACHABLE, f"node {self.transport.node_id} coordinates the run but no live "
                                               f"path leads from it to node {caller}: its neighbours {around} "
                                               "are removed from the run (or reach it only through removed "
                                               "nodes); it is admitted once one of them rejoins")
        self._walled.pop(caller, None)
        joined = self.state.register(caller, str(args.get("fingerprint", "")), clock.now(),
                                     incarnation=inc, address=addr)
        self.transport.peer_incarnations[caller] = inc
        self._notify()
        if joined and self.state.epoch != before:
            self.transport.revive(caller)
            view = self.state.view()
            log.warning("coordinator: node %d rejoined (incarnation %d at %s); view epoch %d members %s",
                        caller, inc, addr, view.epoch, list(view.members))
            self._publish(view, skip=caller)
        ok = await self._wait_until(lambda: self.state.complete, self._t0 + self.start_timeout)
        if not ok:
            raise PeerTimeout(f"nodes {self.state.missing} never registered with the coordinator "
                              f"(node {self.transport.node_id}) within {self.start_timeout:g}s")
        now = clock.now()
        if self.run_started is None:
            self.run_started = now
        # ``elapsed``: how long the run has been going, so a joiner's time budget (--time) ends
        # with the run's, not a full budget after its own start
        return {"members": sorted(self.state.registered), "view": self.state.wire_view(),
                "joined": joined, "elapsed": now - self.run_started, **self.run_info}

    async def _heartbeat(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        if args.get("probe") is True:  # a starting process asks for the view: no proof of life
            # (a probe naming the prober's view gets this one only when it is newer)
            return {"view": self.state.wire_view()} if news_for(self.state.view(), args) else {}
        if self.state.started and caller in self.state.failed:
            # fenced: a node declared failed (it paused, or was cut off) learns that it is no
            # member; its progress since is void, it rejoins as a new process
            why = self.state.excluded.get(caller, "declared failed")
            return {"fenced": True, "why": why, "view": self.state.wire_view()}
        epoch, coord = args.get("epoch"), args.get("coord")
        if type(epoch) is int and epoch < 1 << 62 and (epoch > self.state.epoch or (
                epoch == self.state.epoch and coord != self.state.coordinator)):
            # the caller applied a view at least as new as ours from another coordinator (a
            # takeover's first view may reuse an epoch the old coordinator published late):
            # move past it so every member takes ours
            self.state.epoch = epoch + 1
        failed = args.get("failed")
        seen = epoch if type(epoch) is int else -1  # a report without an epoch: oldest
        if self.rebuilt and isinstance(failed, list) and all(type(n) is int for n in failed):
            self._failed(self.state.declare_failed(failed, seen_epoch=seen), f"reported failed by node {caller}")
        await self._offenders(caller, args.get("offenders"), seen)
        self._redo(caller, args.get("redo"))
        srtt, rttvar = args.get("srtt"), args.get("rttvar", 0.0)
        term = args.get("term", 0)
        applied = (term, epoch) if type(term) is int and type(epoch) is int \
            and coord == self.state.coordinator else None
        now = clock.now()
        if isinstance(srtt, float) and isinstance(rttvar, float):
            self.state.heartbeat(caller, now, srtt=srtt, rttvar=rttvar, applied=applied)
        else:
            self.state.heartbeat(caller, now, applied=applied)
        reply: dict[str, Any] = {"quorum": self._quorum(now)}
        view = self.state.view()
        if (epoch, coord, term) != (view.epoch, view.coordinator, view.term):
            reply["view"] = self.state.wire_view()  # the caller has not applied it yet
        return reply

    def _quorum(self, now: float) -> bool:
        """Whether this coordinator hears a majority (:meth:`MembershipState.has_quorum`), as
        the failure monitor found it at most ``check_interval`` ago: the answer of every
        heartbeat reply, at O(N) once per check instead of once per heartbeat."""
        last = self._quorum_seen
        if last is None or not 0 <= now - last[0] <= self.check_interval:
            last = self._quorum_seen = (now, self.state.has_quorum(now))
        return last[1]

    def _redo(self, caller: int, redo: Any) -> None:
        """A member's report ``{"epoch": e, "peers": [...]}`` that an operation of view ``e``
        failed while its peers live: a new epoch over the same members (:meth:`MembershipState.redo`)."""
        if not isinstance(redo, dict):
            return
        epoch, peers = redo.get("epoch"), redo.get("peers", [])
        if type(epoch) is not int or not isinstance(peers, list) or not all(type(n) is int for n in peers):
            return
        if self.state.redo(caller, epoch, peers, clock.now()):
            view = self.state.view()
            log.warning("coordinator %d: node %d's operation of view %d failed waiting for live nodes %s: "
                        "view epoch %d members %s, so it is redone", self.transport.node_id, caller, epoch,
                        peers, view.epoch, list(view.members))
            self._notify()
            self._publish(view)

    async def _offenders(self, caller: int, offenders: Any, seen: int) -> None:
        """A member's report of the nodes that sent it non-finite tensor values: exclude them
        or end the run as diverged (:meth:`MembershipState.report_offences`)."""
        if not isinstance(offenders, list) or not all(type(n) is int for n in offenders):
            return
        topo = self.transport.topology
        ended = self.state.diverged
        new = self.state.report_offences(caller, offenders, lambda n: topo.neighbors(n) if n in topo.ids else [],
                                         seen_epoch=seen)
        for n in new:  # told first (and why), so it stops instead of waiting for peers
            await self._tell(n, self.state.view(), excluded=self.state.excluded.get(n))
        self._failed(new, "excluded: sent non-finite tensor values")
        if self.state.diverged and not ended:
            self._ended()

    async def _diverged(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        """A member's report that a sum it computed overflowed: the run ends as diverged
        (:meth:`MembershipState.report_diverged`)."""
        why = args.get("why")
        if self.state.report_diverged(caller, why[:MAX_WHY] if isinstance(why, str) else "no reason given"):
            self._ended()
        return {}

    def _ended(self) -> None:
        """Tell every member the view that ends the run as diverged."""
        view = self.state.view()
        log.error("coordinator %d: the run ends: training diverged (%s); view epoch %d",
                  self.transport.node_id, self.state.diverged, view.epoch)
        self._notify()
        self._publish(view)

    async def _finish(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        if self.state.started and caller in self.state.failed:  # fenced: its records are void
            raise RemoteError("Fenced", f"node {caller} was removed from the run; its finish is not recorded")
        if self.state.finish(caller, args.get("stats"), depart=args.get("depart") is True):
            view = self.state.view()
            log.info("coordinator: node %d finished and left the run; view epoch %d members %s",
                     caller, view.epoch, list(view.members))
            self._publish(view, skip=caller)
        self._notify()
        timeout = float(args.get("timeout", 30.0))
        await self._wait_until(lambda: self.state.all_finished, clock.now() + timeout)
        return {"finished": sorted(self.state.finished), "failed": sorted(self.state.failed)}

    async def _monitor(self) -> None:
        me = self.transport.node_id
        stalls = StallMeter(self.check_interval, clock.now())
        quorum = True
        while True:
            await asyncio.sleep(self.check_interval)
            self.state.detector.pause(stalls.tick(clock.now()))
            heard = reachable(self.transport.topology, me, self.transport.dead)
            for n, at in list(self.transport.last_arrival.items()):
                if n != me and heard(n):
                    self.state.alive(n, at)
            now = clock.now()
            silences = {n: self.state.detector.silence(n, now) for n in self.state.detector.peers}
            new = self.state.check(now)
            self._failed(new, f"silent for {[round(silences.get(n, 0.0), 2) for n in new]} s")
            held = self.state.has_quorum(now)
            self._quorum_seen = (now, held)
            if held != quorum:
                quorum = held
                agreed = sorted(self.state.agreement.members) if self.state.agreement is not None else []
                if not held:
                    log.error("coordinator %d: lost the majority of the agreed view %s (silent: %s); "
                              "no failure is declared and no node steps until it is heard again",
                              me, agreed, self.state.blocked or self.state.detector.suspects(now))
                else:  # a new epoch: operations that failed meanwhile are redone over it
                    self.state.epoch += 1
                    view = self.state.view()
                    log.warning("coordinator %d: the majority of %s is heard again; view epoch %d members %s",
                                me, agreed, view.epoch, list(view.members))
                    self._notify()
                    self._publish(view)

    def publish_now(self, view: View) -> None:
        """A view changed outside the service's own handlers (its coordinator was re-elected in
        a new term): wake the waiters and push it to every member."""
        self._notify()
        self._publish(view)

    def _failed(self, new: Sequence[int], why: str) -> None:
        if not new:
            return
        view = self.state.view()
        log.warning("coordinator %d: nodes %s %s: declared failed; view epoch %d members %s",
                    self.transport.node_id, list(new), why, view.epoch, list(view.members))
        heard = set(reborn(new, self.state.incarnations, self.transport.peer_incarnations))
        for n in new:  # the declared process; a newer one already heard relays on
            if n not in heard:
                self.transport.mark_dead(n, self.state.incarnations.get(n))
        self._notify()
        self._publish(view)

    def _publish(self, view: View, skip: int | None = None) -> None:
        """Push ``view`` to every member but this node (and ``skip``), in owned tasks; the
        coordinator's own client learns it from its (local) heartbeat reply."""
        for peer in view.members:
            if peer not in (self.transport.node_id, skip):
                self._tells.spawn(self._tell(peer, view), name=f"view-to-{peer}")

    async def _tell(self, peer: int, view: View, *, excluded: str | None = None) -> None:
        meta = view.to_wire()
        if excluded is not None:  # the view fences this node for good
            meta["excluded"] = excluded[:MAX_END_CHARS]
        try:
            await self.transport.send(peer, EVENT_VIEW, kind="event", meta=meta, timeout=2.0)
        except P2PSyncError as exc:  # the next heartbeat reply carries the view anyway
            log.info("could not send view %d to node %d: %s", view.epoch, peer, exc)


# the client lives in its own module (it imports the names above)
from p2psync.coordinator.membership_client import MembershipClient  # noqa: E402

__all__ = ["EVENT_VIEW", "UNREACHABLE", "MembershipClient", "MembershipService", "MembershipState", "majority_regained",
           "walled_in"]

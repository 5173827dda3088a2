"""The membership client every node runs: rendezvous, heartbeats, views, failover, finish.

:class:`MembershipClient` registers with the coordinator, sends heartbeats every interval
without waiting for the previous reply (pipelined, so inter-arrival times do not grow with the
RTT; each heartbeat RPC is retried over other paths within its RTT-derived timeout), applies
views in epoch order (``view``, ``view_listeners``), records registered incarnations in the
transport, marks removed members dead and calls ``listeners`` once per failed peer.

Which peers this node counts failed or departed, and how it routes around the ones it
suspects and through them again once heard: :mod:`p2psync.coordinator.peer_status`
(:attr:`MembershipClient.peers`).

Coordinator failover (decisions in :mod:`p2psync.coordinator.takeover`,
hosting in :mod:`p2psync.coordinator.failover`): when the client's phi-accrual detector suspects
the coordinator, the client deposes it, reports it failed to its listeners, fails its RPCs in
flight to it (:meth:`RpcClient.abort_calls`) and follows the lowest live member of its view
(``coordinator``, ``coordinator_listeners``). Heartbeats carry the view epoch, the deposed
coordinators and the failed peers, so the successor takes over when the first member contacts
it (or when it suspects the old coordinator itself; ``on_takeover``) and rebuilds membership
from them. Views name their coordinator and are accepted only from the node they name and
never from a deposed one. :meth:`MembershipClient.call_coordinator` retries a call at the new
coordinator when the old one died under it (finish barrier, strategy services such as ESync's
State Server).

Quorum and fencing: :mod:`p2psync.coordinator.quorum_gate` (:attr:`MembershipClient.quorum`).
:meth:`MembershipClient.wait_quorum` is what the step loop awaits before every step: a node cut
off from the majority stops stepping. Meanwhile it asks every node for its view once a second
(``probe``); a newer view that names it is applied, one that does not fences it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any, Callable, Collection, Mapping, Sequence

from p2psync import clock
from p2psync.coordinator.detector import DetectorParams, FailureDetector, StallMeter
from p2psync.coordinator.membership_state import EVENT_VIEW, UNREACHABLE, reborn
from p2psync.coordinator.peer_status import PeerStatus, left_out
from p2psync.coordinator.quorum import Ballot
from p2psync.coordinator.quorum_gate import QuorumGate
from p2psync.coordinator.rpc import RpcClient
from p2psync.coordinator.takeover import Succession
from p2psync.coordinator.views import View, ViewTracker
from p2psync.coordinator.votes import VoteStore
from p2psync.errors import (ConfigError, Fenced, P2PSyncError, PeerFailure, PeerTimeout, ProtocolError, RemoteError,
                            RunEnded, TransportError)
from p2psync.tasks import TaskSet
from p2psync.transport import Transport

log = logging.getLogger("p2psync.membership")

#: heartbeats in flight at once (pipelined); more are skipped until one finishes
MAX_HEARTBEATS_IN_FLIGHT = 8
#: remote error kinds after which a call to the coordinator is retried (it is moving)
RETRY_KINDS = frozenset({"UnknownMethod", "NotCoordinator"})
#: seconds a joiner waits for one coordinator's answer before asking where the run is now
JOIN_ATTEMPT_S = 8.0
#: how long such a joiner asks the others
DISCOVER_RETRY_S = 1.5
#: seconds between two probes of every node while this node hears no majority
PROBE_EVERY_S = 1.0


class MembershipClient:
    """Every node: register, heartbeat, follow views and the coordinator they name, learn of
    failures, finish barrier."""

    def __init__(self, *, transport: Transport, rpc: RpcClient, coordinator: int,
                 heartbeat_interval: float = 0.5, failure_timeout: float = 2.0,
                 phi_threshold: float = 8.0, quorum_timeout: float = 300.0,
                 votes: VoteStore | None = None) -> None:
        """``votes``: where this node's votes and the key of the newest view it applied outlive
        its process (:mod:`p2psync.coordinator.votes`; None: they do not, e.g. a run without a
        run folder)."""
        self.transport = transport
        #: how long :meth:`call_coordinator` waits for a majority (``--quorum-timeout``)
        self.quorum_timeout = quorum_timeout
        self.rpc = rpc
        self.succession = Succession(me=transport.node_id, coordinator=coordinator)
        self.interval = heartbeat_interval
        self.failure_timeout = failure_timeout
        #: the peers counted failed or departed here, and the routing around them
        self.peers = PeerStatus(transport)
        #: whether this node may step: a fresh majority through its coordinator; fencing
        self.quorum = QuorumGate(me=transport.node_id, window=self._quorum_window, recheck=heartbeat_interval,
                                 failure_timeout=failure_timeout)
        #: called with every newer view
        self.view_listeners: list[Callable[[View], None]] = []
        #: called with the new coordinator whenever this node follows another one
        self.coordinator_listeners: list[Callable[[int], None]] = []
        #: called (before the listeners) with the deposed coordinators when this node becomes
        #: the coordinator; the node's CoordinatorHost starts the services there
        self.on_takeover: Callable[[list[int]], None] | None = None
        self.views = ViewTracker()
        self.detector = FailureDetector(params=DetectorParams(
            interval=heartbeat_interval, floor=failure_timeout, threshold=phi_threshold))
        self.coordinator_suspected = False
        self.run_started: float | None = None
        self.fingerprint = ""
        #: the heartbeat loop and the view listener (started by :meth:`start`)
        self._tasks = TaskSet("membership-client")
        #: heartbeats and probes in flight (pipelined, at most MAX_HEARTBEATS_IN_FLIGHT): each
        #: is on its own (the next one replaces a failed one), so they fail alone, logged
        self._beats = TaskSet("heartbeat", isolated=True)
        self._started = False
        self._moved = asyncio.Event()  # replaced (after being set) on every coordinator change
        #: set once a view is applied, or once this node is fenced (:meth:`first_view`)
        self._viewed = asyncio.Event()
        self.quorum.listeners.append(lambda _: self._viewed.set())
        self.info: dict[str, Any] = {}
        #: the view of a running run that :meth:`discover` found (this node joins it), or None
        self.discovered: View | None = None
        #: members this node reports for exclusion (they sent it non-finite tensor values)
        self.offenders: set[int] = set()
        transport.offence_listeners.append(self._offence)
        #: this node's loop ended first and it asked to leave the run (finish with ``depart``)
        self.departing = False
        #: this process joined a run going and its strategy has not joined the training yet
        #: (:meth:`joined_training`); said in every heartbeat: the coordinator does not hold
        #: the finish barrier for it once every member finished
        self.joining = False
        #: (epoch, peers): an operation of that view failed waiting for live peers; reported in
        #: every heartbeat until a newer view arrives (:meth:`request_redo`)
        self.redo: tuple[int, tuple[int, ...]] | None = None
        #: this node's votes in coordinator elections (the host answers vote requests with it)
        self._votes = votes
        self.ballot = Ballot(me=transport.node_id) if votes is None else \
            Ballot(me=transport.node_id, voted=votes.load(), keep=votes.keep, seen=votes.load_view() or (0, -1),
                   keep_view=votes.keep_view)
        #: the view that fenced this node (it does not name it; never applied here), or None;
        #: this node answers probes with it (:attr:`newest_view`)
        self.removed_by: View | None = None
        self._probed_at = 0.0
        #: the highest term another node ran or voted in that this node heard of (its vote
        #: requests, its probes); see :attr:`seen_term`
        self.heard_term = -1

    @property
    def failed(self) -> set[int]:
        """The peers counted failed here (:attr:`peers`)."""
        return self.peers.failed

    @property
    def departed(self) -> set[int]:
        """The peers that finished and left the run gracefully (:attr:`peers`)."""
        return self.peers.departed

    @property
    def listeners(self) -> list[Callable[[int], None]]:
        """Called once per failed or departed peer (strategies' ``on_peer_failure``)."""
        return self.peers.listeners

    @property
    def fenced(self) -> Fenced | None:
        """Why this node is no member of the run any more, or None (:attr:`quorum`)."""
        return self.quorum.fenced

    @property
    def fence_listeners(self) -> list[Callable[[Fenced], None]]:
        """Called once with the :class:`Fenced` error when this node learns it was removed."""
        return self.quorum.listeners

    @property
    def left(self) -> bool:
        """Whether this node is leaving or left the run (its loop ended first: it called
        :meth:`finish` with ``depart``, or a view names it departed). It is no member: it never
        runs for coordinator and never waits for a majority, so its bounded finish barrier
        ends even when it hears nobody (it stays only as a relay)."""
        view = self.view
        return self.departing or (view is not None and self.transport.node_id in view.departed)

    def joined_training(self) -> None:
        """This process's strategy joined the training (its ``start()`` returned): it takes
        part in the agreed stop from now on."""
        self.joining = False

    def hear_term(self, term: int) -> None:
        """Another node ran, or voted, in ``term`` (a vote request, a probe)."""
        self.heard_term = max(self.heard_term, term)

    @property
    def seen_term(self) -> int:
        """The highest term this node voted in or heard of, and at least one above its view's
        term once it deposed that view's coordinator (it applies no more views of that
        coordinator in that term). Its probes, and its heartbeats while it is above its view's
        term, carry it (``seen_term``): a coordinator with a majority in a lower term is then
        re-elected above it (:meth:`CoordinatorHost.outrank`), since a node that voted in a
        term applies no view of a lower one, and its new view, of a newer term, reaches a node
        that deposed it without ever voting (cut off from every candidate): the node follows it
        again, or learns that it was removed."""
        view = self.view
        left = view.term + 1 if view is not None and view.coordinator in self.succession.deposed else -1
        return max(self.ballot.promised, self.heard_term, left)

    @property
    def coordinator(self) -> int:
        """The coordinator this node follows now."""
        return self.succession.coordinator

    @property
    def newest_view(self) -> View | None:
        """The newest view this node knows of: the one that fenced it (:attr:`removed_by`), else
        :attr:`view`. A node that does not coordinate answers probes with it, so that a node
        cut off behind a fenced one (its only path to the run) learns that it was removed too."""
        removed, view = self.removed_by, self.view
        return removed if removed is not None and (view is None or removed.key > view.key) else view

    @property
    def view(self) -> View | None:
        """The newest view applied (None before the rendezvous); strategies read it through
        ``StrategyContext.view``."""
        return self.views.view

    async def register(self, fingerprint: str, timeout: float) -> dict[str, Any]:
        """Register with the coordinator (the rendezvous: it answers once every node has, or at
        once for a joiner) and apply the first view; returns its reply (``joined``, the view,
        the run's info). ConfigError when the coordinator refuses the configuration,
        RunEnded when the run this process would rejoin is ending (its members agreed to
        stop), PeerTimeout after ``timeout``. Called from ``NodeRuntime.rendezvous``:
        ``self.info = await self.membership.register(self.cfg.fingerprint(), timeout=...)``."""
        self.fingerprint = fingerprint
        args = {"fingerprint": fingerprint, "incarnation": self.transport.incarnation,
                "address": f"{socket.gethostname()} pid {os.getpid()}"}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        walled = False  # the coordinator said that no live path leads to this node (logged once)
        try:
            while True:
                remaining = max(0.1, deadline - loop.time())
                try:
                    # a joiner (it discovered a running run) asks one coordinator for a bounded
                    # time: if that one died meanwhile, it asks the others where the run is now
                    info = await self.rpc.call(self.coordinator, "membership.register", args, timeout=(
                        min(remaining, max(JOIN_ATTEMPT_S, 4 * self.failure_timeout))
                        if self.discovered is not None else remaining))
                    break
                except (PeerTimeout, PeerFailure):
                    if self.discovered is None or loop.time() >= deadline:
                        raise
                    before = self.coordinator
                    await self.discover(timeout=DISCOVER_RETRY_S)
                    log.warning("node %d: registration with coordinator %d got no answer; asking "
                                "coordinator %d", self.transport.node_id, before, self.coordinator)
                except RemoteError as exc:
                    # NotCoordinator: the coordinator's process is up but not hosting yet (it
                    # is still asking whether a run is already going); DuplicateNode: this
                    # node's previous process (restarted) is not declared failed yet;
                    # Unreachable: no live path leads from the coordinator to this node (its
                    # neighbours are removed from the run) until one of them rejoins. They
                    # pass; try again until the start timeout. A joiner told NotCoordinator
                    # asks again where the run is: the node it asked lost the majority, or is
                    # this node itself (its previous process coordinated, and the run has not
                    # elected the successor yet)
                    if exc.kind not in ("NotCoordinator", "DuplicateNode", UNREACHABLE) or loop.time() >= deadline:
                        raise
                    if exc.kind == UNREACHABLE:
                        if not walled:
                            log.warning("node %d: coordinator %d does not admit it yet: %s",
                                        self.transport.node_id, self.coordinator, exc.message)
                        walled = True
                        await asyncio.sleep(PROBE_EVERY_S)
                    elif exc.kind == "NotCoordinator" and self.discovered is not None:
                        await asyncio.sleep(0.5)
                        await self.discover(timeout=DISCOVER_RETRY_S)
                    else:
                        await asyncio.sleep(0.1 if exc.kind == "NotCoordinator" else 0.5)
        except (PeerTimeout, PeerFailure) as exc:
            raise PeerTimeout(f"node {self.transport.node_id}: rendezvous with coordinator "
                              f"{self.coordinator} failed: {exc} ({self.transport.link_state(self.coordinator)})"
                              ) from None
        except RemoteError as exc:
            who = f"node {self.transport.node_id}: coordinator {self.coordinator}"
            if exc.kind == "NotCoordinator":  # never started hosting within the start timeout
                raise PeerTimeout(f"{who} did not host the run in time: {exc.message}") from None
            if exc.kind == UNREACHABLE:  # its neighbours stayed out of the run until the start timeout
                raise PeerTimeout(f"{who} could not admit it in time: {exc.message}") from None
            if exc.kind == "RunEnded":  # restarted too late: the members agreed to stop
                raise RunEnded(f"{who}: {exc.message}") from None
            if exc.kind in ("ConfigError", "DuplicateNode"):  # e.g. a different configuration
                raise ConfigError(f"{who} refused the registration: {exc.message}") from exc
            raise
        self.info = dict(info)
        self.joining = bool(self.info.get("joined"))
        if not self.joining and (self.ballot.voted or self.ballot.seen != (0, -1)):
            self._forget_launch()
        elapsed = self.info.get("elapsed", 0.0)
        elapsed = float(elapsed) if isinstance(elapsed, (int, float)) and 0 <= elapsed < 1e9 else 0.0
        #: when the run started, on this node's clock (a joiner's run started before it did)
        self.run_started = clock.now() - elapsed
        self._apply_view(self.info.get("view"), src=self.coordinator)
        if self.view is None:
            raw = self.info.get("view")
            log.warning("node %d: coordinator %d registered it, but its view (term %s) is of a term below one "
                        "this node has heard of (%d): it waits for the coordinator's next view",
                        self.transport.node_id, self.coordinator, raw.get("term") if isinstance(raw, dict) else "?",
                        self.seen_term)
        self.quorum.set(True, coordinator=self.coordinator)  # the coordinator answered with every node in
        return self.info

    def _forget_launch(self) -> None:
        """A fresh rendezvous: the votes and view key kept by a process of an earlier launch of
        the run in this folder (the same run id) are not this launch's, and its terms would
        make this node refuse the new views (:mod:`p2psync.coordinator.votes`)."""
        log.warning("node %d: a new launch of the run: the votes and view kept by an earlier launch in its folder "
                    "(terms up to %d, view %s) are forgotten", self.transport.node_id, self.ballot.promised,
                    self.ballot.seen)
        self.ballot.forget()
        if self._votes is not None:
            try:
                self._votes.forget()
            except OSError as exc:
                log.warning("node %d: the earlier launch's votes could not be removed (%s): a process restarted in "
                            "this launch may start from them", self.transport.node_id, exc)

    async def first_view(self, timeout: float) -> View:
        """The view this node applied first, once there is one: at once after a registration
        whose reply's view it applied. A joiner that heard of a newer term than the registered
        coordinator's (while discovering the run, from a node that voted in a takeover) applies
        no view of that coordinator until it is re-elected above that term, which its heartbeats
        (:attr:`seen_term`) bring about; its strategy must not start before (a strategy built
        without a view runs without the run's failure policy). A newer view that does not name
        it (its coordinator was not the run's any more) fences it instead: the :class:`Fenced`
        error is raised, as whenever this node is fenced before or while it waits. Call after
        :meth:`start`; PeerTimeout after ``timeout``."""
        if self.view is None and self.fenced is None:
            try:
                await asyncio.wait_for(self._viewed.wait(), timeout)
            except (asyncio.TimeoutError, TimeoutError):
                raise PeerTimeout(f"node {self.transport.node_id}: registered with coordinator {self.coordinator}, "
                                  f"but applied none of its views within {timeout:g}s (this node heard of term "
                                  f"{self.seen_term})") from None
        if self.fenced is not None:
            raise self.fenced
        view = self.view
        if view is None:  # (set only by applying one)
            raise PeerTimeout(f"node {self.transport.node_id}: no view applied")
        return view

    async def discover(self, *, timeout: float) -> View | None:
        """The newest view of a run that is already going, asked of every other node at once
        (bounded by ``timeout``); None when no node knows of one (a fresh start: nobody has a
        view before the rendezvous). A restarted node must not assume that the topology's
        coordinator still coordinates: after a failover another node does, and the topology's
        coordinator itself, restarted, must join instead of hosting a second run."""
        me = self.transport.node_id
        found = []
        for raw in await self._ask_views({"probe": True}, timeout):
            try:
                found.append(View.from_wire(raw))
            except ProtocolError:
                pass
        if not found:
            return None
        view = max(found, key=lambda v: v.epoch)
        if view.coordinator != me:
            self.succession.coordinator = view.coordinator  # register (join) there
        self.discovered = view
        return view

    def start(self) -> None:
        """Start the heartbeats and the view-event receiver (owned tasks), after
        :meth:`register`; ``NodeRuntime.rendezvous`` calls ``self.membership.start()``."""
        if self.coordinator != self.transport.node_id:
            self.detector.watch(self.coordinator, clock.now())
        self._started = True
        self._tasks.spawn(self._heartbeats(), name="heartbeats")
        self._tasks.spawn(self._events(), name="membership-events")

    async def close(self) -> None:
        """Stop the heartbeats and the event receiver (heartbeats in flight are cancelled)."""
        self._started = False
        await self._tasks.close()
        await self._beats.close()

    def _declare(self, peers: Sequence[int], reborn: Collection[int] = ()) -> None:
        """``peers`` failed (:meth:`PeerStatus.declare`)."""
        self.peers.declare(peers, coordinator=self.coordinator, reborn=reborn)

    def _offence(self, peer: int, reason: str) -> None:
        """A member sent this node a value it rejected (transport): report it to the coordinator
        at once and in every heartbeat until a view drops it (the coordinator decides, see
        :mod:`p2psync.coordinator.membership_state`; an offence never deposes a coordinator)."""
        view = self.view
        if peer == self.transport.node_id or peer in self.offenders or (view is not None and peer not in view.members):
            return
        self.offenders.add(peer)
        log.warning("node %d: node %d sent %s values: reporting it to coordinator %d",
                    self.transport.node_id, peer, reason, self.coordinator)
        if self._started:
            self._send_beat()

    def request_redo(self, epoch: int, peers: Sequence[int]) -> None:
        """An operation of view ``epoch`` failed waiting for ``peers``: ask the coordinator for
        a newer view (a failure it declares, or the same members in a new epoch when they all
        live, see :meth:`MembershipState.redo`), at once and in every heartbeat until a view
        newer than ``epoch`` arrives."""
        if self.view is not None and self.view.epoch > epoch:
            return
        self.redo = (epoch, tuple(sorted(set(peers))))
        if self._started:
            self._send_beat()

    def _apply_view(self, raw: Any, *, src: int | None) -> None:
        """Apply a view from ``src`` (None: relayed by a node that is not the coordinator)."""
        if raw is None:
            return
        try:
            view = View.from_wire(raw)
        except ProtocolError as exc:
            log.warning("node %d: malformed view ignored: %s", self.transport.node_id, exc)
            return
        if src is not None and view.coordinator != src:
            log.info("node %d: view %d naming coordinator %d sent by node %d ignored",
                     self.transport.node_id, view.epoch, view.coordinator, src)
            return
        if not self.succession.accepts(view, self.ballot.promised):
            return
        me = self.transport.node_id
        # a member, or a process a coordinator admitted whose registration's view it did not
        # apply (of a term below one it had heard of): a newer view that does not name it is
        # the run's word that it is out, never a first view to start from
        admitted = self.view is not None or self.registered
        if me in view.departed and not self.departing and admitted:
            # the coordinator ended the run without it: a joiner whose strategy had not joined
            # the training when every member had finished at the agreed stop
            self.quorum.fence(f"coordinator {view.coordinator} ended the run (view {view.epoch}) while it was "
                              "still joining the training", ended=True)
            return
        if me not in view.members and me not in view.departed and admitted:
            if self.removed_by is None or view.key > self.removed_by.key:
                self.removed_by = view
            excluded = raw.get("excluded") if isinstance(raw, dict) else None
            if isinstance(excluded, str):
                self.quorum.fence(f"coordinator {view.coordinator} excluded it: it {excluded[:300]}", rejoin=False)
            else:
                self.quorum.fence(f"view {view.epoch} (term {view.term}) of coordinator {view.coordinator} does not "
                            f"name it (members {list(view.members)})")
            return
        first = self.views.view is None
        before = dict(self.views.view.incarnations) if self.views.view is not None else {}
        change = self.views.apply(view)
        if change is None:
            return
        self.ballot.saw(view.key)
        self._viewed.set()
        if first:
            for n in left_out(view, self.transport.topology.ids, me):
                self.transport.mark_dead(n)
        old = self.succession.adopt(view)
        if old is not None:
            self._moved_to(old, f"view {view.epoch} names it")
        known = self.transport.peer_incarnations
        # a member whose incarnation is newer than the one known here is a new life of that
        # node, even if this node missed the view in which the old one left; a view never
        # lowers what is known (the transport registered a newer process it heard: the one the
        # view names is gone, and its messages stay rejected)
        renewed = {n for n, inc in view.incarnations.items() if n != me and known.get(n, inc) < inc}
        for n, inc in view.incarnations.items():
            if n != me:
                self.transport.register_incarnation(n, inc)
        # every member is alive to the coordinator that names it (a deposed coordinator that
        # voted in its successor's election stays a member), and so is one judged failed here
        # and heard again since: deposed no more, like the others
        for n in sorted(set(change.joined) | renewed | self.peers.suspected_members(view)):
            self.peers.readmit(n)  # a joiner: its next failure is reported again
            # its new life may coordinate again: every node must agree on the successor (a
            # restarted process starts with nobody deposed)
            self.succession.deposed.discard(n)
        self.offenders &= set(view.members)  # reported until excluded
        if view.ended:
            log.error("node %d: coordinator %d ended the run: %s", me, view.coordinator, view.ended)
        departed = set(view.departed)
        self.peers.depart([n for n in change.left if n in departed])
        left = [n for n in change.left if n not in departed]
        self._declare(left, reborn=reborn(left, before, self.transport.peer_incarnations))
        for cb in list(self.view_listeners):
            cb(view)

    def _moved_to(self, old: int, why: str) -> None:
        """This node now follows :attr:`coordinator` instead of ``old`` (deposed)."""
        me, new = self.transport.node_id, self.coordinator
        log.warning("node %d: following coordinator %d, coordinator %d deposed (%s) (at %.3f)",
                    me, new, old, why, clock.wall())
        self.detector.forget(old)
        if new != me:
            self.detector.watch(new, clock.now())
        self.coordinator_suspected = False
        self._declare([old])
        self.rpc.abort_calls(old, PeerFailure(f"node {me}: coordinator {old} was deposed; "
                                              f"node {new} coordinates now", peers=(old,)))
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()
        if new == me and self.on_takeover is not None and not self.left:
            self.on_takeover(sorted(self.succession.deposed))
        for cb in list(self.coordinator_listeners):
            cb(new)
        if self._started:  # tell the new coordinator at once that we follow it
            self._send_beat()

    def _suspect(self, c: int, why: str) -> None:
        view = self.view
        old = self.coordinator
        if self.succession.suspect(c, view, self.transport.topology.ids) is not None:
            self._moved_to(old, why)
        else:
            self._declare([c])

    def pass_over(self, node: int, why: str) -> None:
        """``node``, the successor this node follows (not elected yet), did not answer a probe:
        depose it as its detector would, and follow the next successor (the probes:
        :class:`~p2psync.coordinator.failover.CoordinatorHost`)."""
        if node == self.coordinator and node != self.transport.node_id:
            log.warning("node %d: successor %d passed over: %s", self.transport.node_id, node, why)
            self._suspect(node, why)

    def take_over(self, theirs: Sequence[int], their_term: int | None = None) -> bool:
        """A member that deposed ``theirs`` asks this node to coordinate (``their_term``: the
        term of its view, None: not told); True when it took over (see
        :meth:`Succession.contacted`)."""
        if not self.succession.contacted(theirs, self.view, their_term):
            return False
        old = self.coordinator
        deposed = self.succession.take_over(theirs)
        for n in deposed:
            if n != old:
                self._declare([n])
        self._moved_to(old, f"contacted by a member that deposed {sorted(theirs)}")
        return True

    def _beat_args(self) -> dict[str, Any]:
        c = self.coordinator
        est = self.rpc.estimator(c)
        args: dict[str, Any] = {}
        if est.srtt is not None and c != self.transport.node_id:
            args = {"srtt": float(est.srtt), "rttvar": float(est.rttvar)}
        if self.view is not None:
            args["epoch"], args["coord"], args["term"] = self.view.epoch, self.view.coordinator, self.view.term
        if self.succession.deposed:
            args["deposed"] = sorted(self.succession.deposed)
        if self.failed:
            args["failed"] = sorted(self.failed)
        if self.offenders:
            args["offenders"] = sorted(self.offenders)
        if self.redo is not None and self.view is not None and self.redo[0] >= self.view.epoch:
            args["redo"] = {"epoch": self.redo[0], "peers": list(self.redo[1])}
        if self.seen_term > (self.view.term if self.view is not None else -1):
            args["seen_term"] = self.seen_term
        if self.joining:
            args["joining"] = True
        return args

    async def _beat(self) -> None:
        c, me = self.coordinator, self.transport.node_id
        est = self.rpc.estimator(c)
        det = self.detector.peers.get(c)
        timeout = max(det.timeout() if det is not None else self.failure_timeout, 2 * est.rto())
        try:
            rep = await self.rpc.call(c, "membership.heartbeat", self._beat_args(),
                                      timeout=timeout, measure=True)
        except P2PSyncError as exc:
            log.info("node %d: heartbeat to %d: %s", me, c, exc)
            return
        if not isinstance(rep, dict):
            return
        if rep.get("fenced") is True:
            why = rep.get("why")
            excluded = isinstance(why, str) and why != "declared failed"
            self.quorum.fence(f"coordinator {c} answered that it was {str(why)[:200] if why else 'declared failed'}",
                              rejoin=not excluded)
            return
        if rep.get("redirect"):  # c does not coordinate (yet): it names whom it follows
            self._apply_view(rep.get("view"), src=None)
            return
        if c == self.coordinator:
            self.quorum.set(rep.get("quorum") is not False, coordinator=c)
        if c == self.coordinator and c != me:
            self.detector.heartbeat(c, clock.now())
            if est.srtt is not None:
                self.detector.rtt(c, est.srtt, est.rttvar)
            if self.coordinator_suspected:
                log.warning("node %d: coordinator %d answers again", me, c)
                self.coordinator_suspected = False
        self._apply_view(rep.get("view"), src=c)

    def _send_beat(self) -> None:
        if len(self._beats) < MAX_HEARTBEATS_IN_FLIGHT:
            self._beats.spawn(self._beat())

    # -- quorum and fencing -------------------------------------------------------------

    def _quorum_window(self) -> float:
        """How long a coordinator's "I hold a majority" stays valid: its detection time."""
        det = self.detector.peers.get(self.coordinator)
        return (det.timeout() if det is not None else self.failure_timeout) + self.interval

    @property
    def registered(self) -> bool:
        """Whether this node registered with the run's membership service (False: nothing
        hosts one, e.g. a strategy driven alone in a test; no majority applies then)."""
        return bool(self.info)

    @property
    def has_quorum(self) -> bool:
        """Whether this node follows a coordinator that recently said it hears a majority of
        the run (:attr:`QuorumGate.held`); False once fenced."""
        return self.quorum.held

    async def wait_quorum(self, timeout: float) -> float:
        """Wait until :attr:`has_quorum` (returns at once when it is); returns the seconds
        waited. Raises the :class:`Fenced` error when this node is removed meanwhile, and
        :class:`~p2psync.errors.NoQuorum` after ``timeout``."""
        def describe() -> str:
            view = self.view
            return (f"it follows coordinator {self.coordinator}; view {view.epoch if view else '-'} "
                    f"members {list(view.members) if view else []}")
        return await self.quorum.wait(timeout, describe)

    def probe_now(self) -> None:
        """Ask every node for its view now (:meth:`_probe`, in an owned task), whatever the
        quorum: this node, a coordinator, learnt that a newer coordinator was elected."""
        if self._started and self.fenced is None:
            self._probed_at = clock.now()
            self._beats.spawn(self._probe(), name="probe")

    async def _probe(self) -> None:
        """Ask every other node for its view (no proof of life); apply the newest one that
        names this node, or be fenced by a newer one that does not.

        Neighbours marked dead are asked too (``to_dead``): while cut off this node deposed the
        coordinators it could not hear and marked them dead itself, and a call to a node marked
        dead fails at once, so a node cut off from every other would never hear from the run
        again after the partition healed. The probe carries :attr:`seen_term`: a coordinator with
        a majority whose term is lower is re-elected above it
        (:class:`~p2psync.coordinator.failover.CoordinatorHost`; another node passes it on to its
        coordinator), since this node applies no view of a lower term than one it voted in."""
        args: dict[str, Any] = {"probe": True, "seen_term": self.seen_term}
        if self.view is not None:  # only a newer view comes back (the others would change nothing)
            args["epoch"], args["term"] = self.view.epoch, self.view.term
        await self._ask_views(args, max(0.5, 2 * self.interval), to_dead=True,
                              each=lambda raw: self._apply_view(raw, src=None))

    async def _ask_views(self, args: Mapping[str, Any], timeout: float, *, to_dead: bool = False,
                         each: Callable[[Any], None] | None = None) -> list[Any]:
        """The views (untrusted wire form) every other node answers a probe with, asked at
        once, each bounded by ``timeout``; nodes that do not answer are left out. ``each``: called
        with every view as it comes (a peer that cannot answer, e.g. one marked dead that no
        live path reaches, holds back none of the others' answers)."""
        me = self.transport.node_id

        async def ask(peer: int) -> Any:
            try:
                rep = await self.rpc.call(peer, "membership.heartbeat", args, timeout=timeout, to_dead=to_dead)
            except P2PSyncError:
                return None
            view = rep.get("view") if isinstance(rep, dict) else None
            if view is not None and each is not None:
                each(view)
            return view

        reps = await asyncio.gather(*(ask(p) for p in self.transport.topology.ids if p != me))
        return [r for r in reps if r is not None]

    async def _heartbeats(self) -> None:
        me = self.transport.node_id
        stalls = StallMeter(self.interval, clock.now())
        cpu = clock.cpu()
        while True:
            self._send_beat()
            await asyncio.sleep(self.interval)
            stall = stalls.tick(clock.now())
            self.detector.pause(stall)
            self.peers.reroute(self.view)
            was, cpu = cpu, clock.cpu()
            self.quorum.after_stop(stall, cpu - was, clock.now())
            now = clock.now()
            if not self.has_quorum and self.fenced is None and now - self._probed_at >= PROBE_EVERY_S \
                    and self.view is not None:
                self._probed_at = now
                self._beats.spawn(self._probe(), name="probe")
            c = self.coordinator
            if c == me:
                continue
            at = self.transport.last_arrival.get(c)
            if at is not None:
                self.detector.alive(c, at)
            now = clock.now()
            if not self.coordinator_suspected and c in self.detector.suspects(now):
                self.coordinator_suspected = True
                log.warning("node %d: coordinator %d silent for %.2fs (phi %.1f)", me, c,
                            self.detector.silence(c, now), self.detector.peers[c].phi(now))
                self._suspect(c, "silent")

    async def _events(self) -> None:
        while True:
            try:
                msg = await self.transport.listen(EVENT_VIEW)
            except TransportError:  # closed
                return
            self._apply_view(dict(msg.meta), src=msg.src)

    async def call_coordinator(self, method: str,
                               args: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None, *,
                               timeout: float, measure: bool = False) -> Any:
        """Call ``method`` on the coordinator; when the call fails because the coordinator died
        or moved (PeerFailure, PeerTimeout, or the new one has no such service yet), it is
        retried at the coordinator followed then, until ``timeout``. Other errors propagate.
        ``args`` may be a function, called for every attempt (arguments that name the view or
        the failed peers are then current at the new coordinator).

        While this node hears no coordinator holding a majority (:attr:`has_quorum`; cut off
        by a partition, or during an election) and has not :attr:`left` the run, it calls nobody: it waits for one
        (:meth:`wait_quorum`, up to :attr:`quorum_timeout`: :class:`NoQuorum` after it,
        :class:`Fenced` when this node learns meanwhile that it was removed), and ``timeout``
        counts from then. A call that fails while the majority is lost waits the same way.
        A service that answers ``Fenced`` (it counts this node out of the run: e.g. ESync's
        State Server) fences this node (``fence_listeners``) and :class:`Fenced` is raised."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pause = 0.02
        while True:
            if self._started and not self.left and (not self.has_quorum or self.fenced is not None):
                await self.wait_quorum(self.quorum_timeout)
                deadline = max(deadline, loop.time() + timeout)
            c, moved = self.coordinator, self._moved
            err: P2PSyncError
            try:
                return await self.rpc.call(c, method, args() if callable(args) else args,
                                           timeout=max(0.001, deadline - loop.time()), measure=measure)
            except (PeerFailure, PeerTimeout) as exc:
                err, wait_for_move = exc, True
            except RemoteError as exc:
                if exc.kind == "Fenced":
                    self.quorum.fence(f"coordinator {c} answered {method}: {exc.message[:200]}")
                    if self.fenced is not None:
                        raise self.fenced from None
                if exc.kind not in RETRY_KINDS:
                    raise
                err, wait_for_move = exc, False
            if self._started and not self.left and not self.has_quorum:
                continue  # the majority is lost: wait for it (above), then call again
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise err
            if self.coordinator != c:
                continue
            if wait_for_move:  # the coordinator is dying: wait (bounded) until we follow another
                try:
                    await asyncio.wait_for(moved.wait(), remaining)
                except asyncio.TimeoutError:
                    if self._started and not self.left and not self.has_quorum:
                        continue
                    raise err from None
            else:  # the new coordinator is starting its services
                await asyncio.sleep(min(pause, remaining))
                pause = min(2 * pause, 0.5)

    async def report_diverged(self, why: str, timeout: float) -> None:
        """A sum of finite values this node computed in a collective overflowed
        (:class:`~p2psync.errors.SumDiverged`): ask the coordinator to end the run as
        diverged, so that every member stops with Diverged instead of waiting for what this
        node will never send. Bounded by ``timeout``; a failure is logged, not raised (this
        node stops either way)."""
        try:
            await self.call_coordinator("membership.diverged", {"why": why}, timeout=timeout)
        except P2PSyncError as exc:
            log.warning("node %d: could not report its divergence to the coordinator: %s", self.transport.node_id, exc)

    async def finish(self, stats: Any, timeout: float, *, depart: bool = False) -> dict[str, Any]:
        """Report final stats and wait (bounded) until every live node has finished; when the
        coordinator dies meanwhile, the stats are re-sent to the new one. With ``depart`` this
        node is :attr:`left` from now on."""
        if depart:
            self.departing = True
        try:
            return dict(await self.call_coordinator("membership.finish", {"stats": stats, "timeout": timeout,
                                                                          "depart": depart},
                                                    timeout=timeout + 5))
        except P2PSyncError as exc:
            log.warning("node %d: finish barrier: %s", self.transport.node_id, exc)
            return {}


__all__ = ["MembershipClient"]

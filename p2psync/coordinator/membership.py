"""Membership: rendezvous, heartbeats, failure detection, views and the finish barrier.

:class:`MembershipState` is the pure decision logic (who registered under which incarnation,
who failed, the current :class:`~p2psync.coordinator.views.View`); failures are decided by a
phi-accrual :class:`~p2psync.coordinator.detector.FailureDetector` fed with heartbeat arrivals,
any other traffic (``Transport.last_arrival``) and the RTT each client measures.

:class:`MembershipService` exposes it over RPC on the coordinator node; on every change it bumps
the view's epoch and publishes the view to every live node as an ``event.view`` event (owned
tasks) and in every heartbeat reply (so a lost event is repaired by the next reply). A second
registration under a node id whose registered process is alive is rejected with an error naming
both incarnations and addresses.

Joins (issue 10 item 5): a node of the topology that was declared failed may register again
with a newer incarnation (the same ``--node`` restarted, same ``--run-id``) while the run is
going; the coordinator admits it (same configuration fingerprint required), bumps the epoch,
publishes the new view to every member at once and answers ``joined: true`` so the joiner
fetches its state from live peers before training. A run still starts only once every node
has registered (``--start-timeout``); joins come after that. ``allow_join=False``
(``--on-failure stop``) keeps rejecting them.

:class:`MembershipClient` runs on every node: it registers, sends heartbeats every interval
without waiting for the previous reply (pipelined, so inter-arrival times do not grow with the
RTT; each heartbeat RPC is retried over other paths within its RTT-derived timeout), applies
views in epoch order (``view``, ``view_listeners``), records registered incarnations in the
transport, marks removed members dead and calls ``listeners`` once per failed peer. If the
coordinator itself stays silent past its detector's timeout the client reports it failed to its
listeners, but keeps heartbeating (over any live route): the coordinator's view stays
authoritative, so a node that merely lost its path to the coordinator is never declared dead
for it. (Coordinator failover is not implemented.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from p2psync.coordinator.detector import DetectorParams, FailureDetector
from p2psync.coordinator.rpc import RpcClient, RpcServer
from p2psync.coordinator.views import View, ViewTracker
from p2psync.errors import ConfigError, P2PSyncError, PeerFailure, PeerTimeout, ProtocolError, RemoteError
from p2psync.transport import Transport

log = logging.getLogger("p2psync.membership")

EVENT_VIEW = "event.view"
#: heartbeats in flight at once (pipelined); more are skipped until one finishes
MAX_HEARTBEATS_IN_FLIGHT = 8


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
    #: admit a failed node that registers again with a newer incarnation (a join)
    allow_join: bool = True
    #: node -> how many times it rejoined
    rejoined: dict[int, int] = field(default_factory=dict)
    #: joiner -> time until which it is not suspected before its first heartbeat (its
    #: registration reply may need a retry while relays still route around its old life)
    join_grace: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
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
                self.finished.pop(node, None)
                self.registered[node] = fingerprint
                self.incarnations[node] = incarnation
                self.addresses[node] = address
                self.detector.watch(node, now)
                self.join_grace[node] = now + 3 * self.failure_timeout + 10 * self.heartbeat_interval
                self.rejoined[node] = self.rejoined.get(node, 0) + 1
                self.epoch += 1
                return True
            raise ConfigError(f"node {node} is already registered and alive (incarnation {old} at "
                              f"{addr}); second registration (incarnation {incarnation} at {address}) "
                              f"rejected")
        self._check_fingerprint(node, fingerprint)
        self.registered[node] = fingerprint
        self.incarnations[node] = incarnation
        self.addresses[node] = address
        self.detector.watch(node, now)
        self.epoch += 1
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
        return sorted(self.expected - set(self.registered))

    @property
    def complete(self) -> bool:
        return not self.missing

    def heartbeat(self, node: int, now: float, *, srtt: float | None = None, rttvar: float = 0.0) -> None:
        if node in self.registered and node not in self.failed:
            self.join_grace.pop(node, None)
            self.detector.heartbeat(node, now)
            if srtt is not None:
                self.detector.rtt(node, srtt, rttvar)

    def alive(self, node: int, at: float) -> None:
        """Any message from ``node`` arrived at ``at`` (proof of life)."""
        if node in self.registered and node not in self.failed:
            self.detector.alive(node, at)

    def check(self, now: float) -> list[int]:
        """Nodes newly declared failed: registered, not finished, suspected by the detector."""
        new = [n for n in self.detector.suspects(now) if n not in self.failed and n not in self.finished
               and self.join_grace.get(n, now) <= now]
        if new:
            self.failed.update(new)
            for n in new:
                self.detector.forget(n)
            self.epoch += 1
        return sorted(new)

    def finish(self, node: int, stats: Any) -> None:
        self.finished[node] = stats

    @property
    def all_finished(self) -> bool:
        return set(self.finished) | self.failed >= self.expected

    @property
    def alive_nodes(self) -> list[int]:
        return sorted(set(self.registered) - self.failed)

    def view(self) -> View:
        members = self.alive_nodes
        return View(epoch=self.epoch, members=tuple(members),
                    incarnations={n: self.incarnations[n] for n in members})


class MembershipService:
    """Coordinator side. Methods: membership.register / heartbeat / finish."""

    def __init__(self, *, server: RpcServer, expected: Sequence[int], start_timeout: float = 60.0,
                 failure_timeout: float = 2.0, heartbeat_interval: float = 0.5,
                 phi_threshold: float = 8.0, check_interval: float = 0.1,
                 run_info: Mapping[str, Any] | None = None, allow_join: bool = True) -> None:
        self.server = server
        self.transport = server.transport
        self.state = MembershipState(expected=frozenset(expected), failure_timeout=failure_timeout,
                                     heartbeat_interval=heartbeat_interval, phi_threshold=phi_threshold,
                                     allow_join=allow_join)
        self.start_timeout = start_timeout
        self.check_interval = check_interval
        self.run_info = dict(run_info or {})
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._tells: set[asyncio.Task[None]] = set()
        self._t0 = time.monotonic()
        server.register("membership.register", self._register)
        server.register("membership.heartbeat", self._heartbeat)
        server.register("membership.finish", self._finish)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._task = asyncio.create_task(self._monitor(), name="membership-monitor")

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._tells) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._task = None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_until(self, pred: Callable[[], bool], deadline: float) -> bool:
        while not pred():
            remaining = deadline - time.monotonic()
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
        joined = self.state.register(caller, str(args.get("fingerprint", "")), time.monotonic(),
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
        return {"members": sorted(self.state.registered), "view": self.state.view().to_wire(),
                "joined": joined, **self.run_info}

    async def _heartbeat(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        srtt, rttvar = args.get("srtt"), args.get("rttvar", 0.0)
        if isinstance(srtt, float) and isinstance(rttvar, float):
            self.state.heartbeat(caller, time.monotonic(), srtt=srtt, rttvar=rttvar)
        else:
            self.state.heartbeat(caller, time.monotonic())
        return {"view": self.state.view().to_wire(), "failed": sorted(self.state.failed)}

    async def _finish(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        self.state.finish(caller, args.get("stats"))
        self._notify()
        timeout = float(args.get("timeout", 30.0))
        await self._wait_until(lambda: self.state.all_finished, time.monotonic() + timeout)
        return {"finished": sorted(self.state.finished), "failed": sorted(self.state.failed)}

    async def _monitor(self) -> None:
        me = self.transport.node_id
        while True:
            await asyncio.sleep(self.check_interval)
            for n, at in list(self.transport.last_arrival.items()):
                if n != me:
                    self.state.alive(n, at)
            now = time.monotonic()
            silences = {n: self.state.detector.silence(n, now) for n in self.state.detector.peers}
            new = self.state.check(now)
            if not new:
                continue
            view = self.state.view()
            log.warning("coordinator: nodes %s silent for %s s: declared failed; view epoch %d members %s",
                        new, [round(silences.get(n, 0.0), 2) for n in new], view.epoch, list(view.members))
            for n in new:
                self.transport.mark_dead(n)
            self._notify()
            self._publish(view)

    def _publish(self, view: View, skip: int | None = None) -> None:
        """Push ``view`` to every member but this node (and ``skip``), in owned tasks; the
        coordinator's own client learns it from its (local) heartbeat reply."""
        for peer in view.members:
            if peer not in (self.transport.node_id, skip):
                t = asyncio.create_task(self._tell(peer, view), name=f"view-to-{peer}")
                self._tells.add(t)
                t.add_done_callback(self._tells.discard)

    async def _tell(self, peer: int, view: View) -> None:
        try:
            await self.transport.send(peer, EVENT_VIEW, kind="event", meta=view.to_wire(), timeout=2.0)
        except P2PSyncError as exc:  # the next heartbeat reply carries the view anyway
            log.info("could not send view %d to node %d: %s", view.epoch, peer, exc)


class MembershipClient:
    """Every node: register, heartbeat, follow views, learn of failures, finish barrier."""

    def __init__(self, *, transport: Transport, rpc: RpcClient, coordinator: int,
                 heartbeat_interval: float = 0.5, failure_timeout: float = 2.0,
                 phi_threshold: float = 8.0) -> None:
        self.transport = transport
        self.rpc = rpc
        self.coordinator = coordinator
        self.interval = heartbeat_interval
        self.failure_timeout = failure_timeout
        self.failed: set[int] = set()
        #: called once per failed peer (strategies' on_peer_failure)
        self.listeners: list[Callable[[int], None]] = []
        #: called with every newer view
        self.view_listeners: list[Callable[[View], None]] = []
        self.views = ViewTracker()
        self.detector = FailureDetector(params=DetectorParams(
            interval=heartbeat_interval, floor=failure_timeout, threshold=phi_threshold))
        self.coordinator_suspected = False
        self._tasks: list[asyncio.Task[None]] = []
        self._beats: set[asyncio.Task[None]] = set()
        self.info: dict[str, Any] = {}

    @property
    def view(self) -> View | None:
        return self.views.view

    async def register(self, fingerprint: str, timeout: float) -> dict[str, Any]:
        args = {"fingerprint": fingerprint, "incarnation": self.transport.incarnation,
                "address": f"{socket.gethostname()} pid {os.getpid()}"}
        try:
            info = await self.rpc.call(self.coordinator, "membership.register", args, timeout=timeout)
        except (PeerTimeout, PeerFailure) as exc:
            raise PeerTimeout(f"node {self.transport.node_id}: rendezvous with coordinator "
                              f"{self.coordinator} failed: {exc}") from None
        except RemoteError as exc:
            raise PeerTimeout(f"rendezvous failed: {exc}") from None
        self.info = dict(info)
        self._apply_view(self.info.get("view"))
        return self.info

    def start(self) -> None:
        self.detector.watch(self.coordinator, time.monotonic())
        self._tasks = [asyncio.create_task(self._heartbeats(), name="heartbeats"),
                       asyncio.create_task(self._events(), name="membership-events")]

    async def close(self) -> None:
        tasks = [*self._tasks, *self._beats]
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []

    def _declare(self, peers: Sequence[int]) -> None:
        for p in peers:
            if p in self.failed or p == self.transport.node_id:
                continue
            self.failed.add(p)
            if p != self.coordinator:
                self.transport.mark_dead(p)  # never the coordinator: keep heartbeating to it
            log.warning("node %d: peer %d failed (at %.3f)", self.transport.node_id, p, time.time())
            for cb in list(self.listeners):
                cb(p)

    def _apply_view(self, raw: Any) -> None:
        if raw is None:
            return
        try:
            view = View.from_wire(raw)
        except ProtocolError as exc:
            log.warning("node %d: malformed view ignored: %s", self.transport.node_id, exc)
            return
        change = self.views.apply(view)
        if change is None:
            return
        for n, inc in view.incarnations.items():
            if n != self.transport.node_id:
                self.transport.peer_incarnations[n] = inc
        for n in change.joined:
            self.transport.revive(n)
            self.failed.discard(n)  # a joiner: its next failure is reported again
        self._declare(change.left)
        for cb in list(self.view_listeners):
            cb(view)

    async def _beat(self) -> None:
        est = self.rpc.estimator(self.coordinator)
        args: dict[str, Any] = {}
        if est.srtt is not None:
            args = {"srtt": float(est.srtt), "rttvar": float(est.rttvar)}
        timeout = max(self.detector.peers[self.coordinator].timeout(), 2 * est.rto())
        try:
            rep = await self.rpc.call(self.coordinator, "membership.heartbeat", args,
                                      timeout=timeout, measure=True)
        except P2PSyncError as exc:
            log.info("node %d: heartbeat: %s", self.transport.node_id, exc)
            return
        now = time.monotonic()
        self.detector.heartbeat(self.coordinator, now)
        if est.srtt is not None:
            self.detector.rtt(self.coordinator, est.srtt, est.rttvar)
        if self.coordinator_suspected:
            log.warning("node %d: coordinator %d answers again", self.transport.node_id, self.coordinator)
            self.coordinator_suspected = False
        if isinstance(rep, dict):
            self._apply_view(rep.get("view"))

    async def _heartbeats(self) -> None:
        me, c = self.transport.node_id, self.coordinator
        while True:
            if len(self._beats) < MAX_HEARTBEATS_IN_FLIGHT:
                t = asyncio.create_task(self._beat(), name="heartbeat")
                self._beats.add(t)
                t.add_done_callback(self._beats.discard)
            await asyncio.sleep(self.interval)
            if c == me:
                continue
            at = self.transport.last_arrival.get(c)
            if at is not None:
                self.detector.alive(c, at)
            now = time.monotonic()
            if not self.coordinator_suspected and self.detector.suspects(now):
                self.coordinator_suspected = True
                log.warning("node %d: coordinator %d silent for %.2fs (phi %.1f); still heartbeating",
                            me, c, self.detector.silence(c, now), self.detector.peers[c].phi(now))
                self._declare([c])

    async def _events(self) -> None:
        while True:
            try:
                msg = await self.transport.recv(EVENT_VIEW, timeout=None)
            except P2PSyncError:
                return
            if msg.src == self.coordinator:
                self._apply_view(dict(msg.meta))

    async def finish(self, stats: Any, timeout: float) -> dict[str, Any]:
        """Report final stats and wait (bounded) until every live node has finished."""
        if self.coordinator in self.failed:
            return {}
        try:
            return dict(await self.rpc.call(self.coordinator, "membership.finish",
                                            {"stats": stats, "timeout": timeout}, timeout=timeout + 5))
        except P2PSyncError as exc:
            log.warning("node %d: finish barrier: %s", self.transport.node_id, exc)
            return {}

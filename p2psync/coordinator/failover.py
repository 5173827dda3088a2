"""Hosting the coordinator services on whichever node coordinates.

Why: the coordinator role moves to the lowest live id when the coordinator dies
(:mod:`p2psync.coordinator.takeover`), so every node must be able to host membership and every
strategy's coordinator services at any time, with their state rebuilt from the members (it is
small by design: coordinator services hold no model tensors).

:class:`CoordinatorHost` runs on every node. It owns the ``membership.*`` RPC methods of the
node's server: while the node does not coordinate, a heartbeat or finish from a member that
deposed the coordinator this node follows makes it take over if it is the successor
(:meth:`MembershipClient.take_over`); otherwise heartbeats get a *redirect* reply carrying the
view this node follows, and other calls a ``NotCoordinator`` error (callers retry). When this
node becomes the coordinator (its client's ``on_takeover``), the host builds a
:class:`MembershipService` on a state rebuilt from what the node knows
(:func:`rebuild_state`: the last view with its incarnations, the failed and deposed nodes, an
epoch above the last one) and registers the strategy's coordinator services (``services``,
e.g. ESync's State Server, which rebuilds its records from the members' next queries). Members
then heartbeat and re-send their finish stats to it. The host owns the service it started and
closes it in :meth:`CoordinatorHost.close` (and when a newer view deposes this node).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np

from p2psync.coordinator.membership import MembershipService, MembershipState
from p2psync.coordinator.membership_client import MembershipClient
from p2psync.coordinator.rpc import Handler, RpcServer
from p2psync.coordinator.views import View
from p2psync.errors import RemoteError
from p2psync.tasks import TaskSet

log = logging.getLogger("p2psync.failover")

METHODS = ("membership.register", "membership.heartbeat", "membership.finish")


def rebuild_state(*, expected: Collection[int], view: View | None, failed: Collection[int], me: int,
                  fingerprint: str, now: float, grace: float, failure_timeout: float = 2.0,
                  heartbeat_interval: float = 0.5, phi_threshold: float = 8.0) -> MembershipState:
    """The membership state of a node taking over as coordinator. Pure.

    Members are the last view's members minus ``failed`` (which includes the deposed
    coordinators); they keep their incarnations. Nodes the view lists as departed (finished)
    stay departed. Every other node that was registered counts as
    registered and failed, so the finish barrier does not wait for it. The epoch is one above
    the view's. Members are watched from ``now + grace``: they detect the old coordinator's
    death up to about one detection time after this node, and need that long to reach it."""
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
        st.detector.watch(n, now + grace)
    st.epoch = (view.epoch if view is not None else 0) + 1
    return st


def _ids(raw: Any) -> list[int]:
    """A list of node ids from an untrusted field (anything else: empty)."""
    if isinstance(raw, list) and all(type(n) is int and n >= 0 for n in raw):
        return list(raw)
    return []


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
        #: deposed services still closing
        self._closing = TaskSet("close-deposed-service")
        self._services_registered = False
        self.took_over_at: float | None = None
        for method in METHODS:
            server.register(method, self._dispatcher(method))
        membership.on_takeover = self._take_over
        membership.coordinator_listeners.append(self._followed)

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
        self.service = svc
        svc.start()
        if self.services is not None and not self._services_registered:
            self._services_registered = True
            self.services(self.server)
        return svc

    def _take_over(self, deposed: list[int]) -> None:
        if self.service is not None:
            return
        m = self.membership
        now = time.monotonic()  # the clock of MembershipService
        state = rebuild_state(expected=self.expected, view=m.view, failed=m.failed | set(deposed),
                              me=self.me, fingerprint=m.fingerprint, now=now,
                              grace=self.failure_timeout, failure_timeout=self.failure_timeout,
                              heartbeat_interval=self.heartbeat_interval, phi_threshold=self.phi_threshold)
        state.allow_join = self.allow_join
        self.took_over_at = now
        log.warning("node %d: taking over as coordinator (deposed %s); view epoch %d members %s",
                    self.me, deposed, state.epoch, state.alive_nodes)
        self._start(state)

    def _followed(self, coordinator: int) -> None:
        """The node follows another coordinator: a service of its own is deposed, close it."""
        svc = self.service
        if coordinator == self.me or svc is None:
            return
        log.warning("node %d: deposed as coordinator by a newer view naming node %d", self.me, coordinator)
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
                if theirs and self.membership.take_over(theirs):
                    log.warning("node %d: node %d deposed %s and contacted this node: took over",
                                self.me, caller, theirs)
            svc = self.service
            if svc is not None:
                return await svc.handlers[method](caller, args, arrays)
            view = self.membership.view
            if method == "membership.heartbeat" and view is not None:
                return {"view": view.to_wire(), "redirect": True}
            raise RemoteError("NotCoordinator", f"node {self.me} does not coordinate (it follows node "
                                                f"{self.membership.coordinator})")
        return dispatch

    async def close(self) -> None:
        svcs = [s for s in (self.service, *self._retired) if s is not None]
        self.service = None
        self._retired = []
        for s in svcs:
            await s.close()
        await self._closing.wait()  # their own close is bounded
        await self._closing.close()


__all__ = ["CoordinatorHost", "rebuild_state"]

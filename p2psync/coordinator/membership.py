"""Membership: rendezvous, heartbeats, failure detection and the finish barrier.

:class:`MembershipState` is the pure decision logic (who registered, who is late, who failed);
:class:`MembershipService` exposes it over RPC on the coordinator node and broadcasts
``event.peer_failed`` to every live node; :class:`MembershipClient` runs on every node: it
registers, sends heartbeats, learns of failures (events and heartbeat replies) and calls its
listeners once per failed peer. If the coordinator itself stops answering heartbeats for
``failure_timeout`` seconds, the client reports the coordinator as failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from p2psync.coordinator.rpc import RpcClient, RpcServer
from p2psync.errors import ConfigError, P2PSyncError, PeerFailure, PeerTimeout, RemoteError
from p2psync.transport import Transport

log = logging.getLogger("p2psync.membership")

EVENT_FAILED = "event.peer_failed"


@dataclass
class MembershipState:
    """Pure bookkeeping; every method takes ``now`` so tests control time."""

    expected: frozenset[int]
    failure_timeout: float = 2.0
    registered: dict[int, str] = field(default_factory=dict)  # node -> config fingerprint
    last_seen: dict[int, float] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)
    finished: dict[int, Any] = field(default_factory=dict)

    def register(self, node: int, fingerprint: str, now: float) -> None:
        if node not in self.expected:
            raise ConfigError(f"node {node} is not in the topology")
        if self.registered:
            ref_node, ref = next(iter(self.registered.items()))
            if fingerprint != ref:
                raise ConfigError(f"node {node} runs a different configuration than node {ref_node} "
                                  f"({fingerprint} != {ref}); start every node with the same options")
        self.registered[node] = fingerprint
        self.last_seen[node] = now

    @property
    def missing(self) -> list[int]:
        return sorted(self.expected - set(self.registered))

    @property
    def complete(self) -> bool:
        return not self.missing

    def heartbeat(self, node: int, now: float) -> None:
        if node in self.registered and node not in self.failed:
            self.last_seen[node] = now

    def check(self, now: float) -> list[int]:
        """Nodes newly declared failed: registered, not finished, silent for too long."""
        new = [n for n, t in self.last_seen.items()
               if n not in self.failed and n not in self.finished and now - t > self.failure_timeout]
        self.failed.update(new)
        return sorted(new)

    def finish(self, node: int, stats: Any) -> None:
        self.finished[node] = stats

    @property
    def all_finished(self) -> bool:
        return set(self.finished) | self.failed >= self.expected

    @property
    def alive(self) -> list[int]:
        return sorted(set(self.registered) - self.failed)


class MembershipService:
    """Coordinator side. Methods: membership.register / heartbeat / finish."""

    def __init__(self, *, server: RpcServer, expected: Sequence[int], start_timeout: float = 60.0,
                 failure_timeout: float = 2.0, check_interval: float = 0.2,
                 run_info: Mapping[str, Any] | None = None) -> None:
        self.server = server
        self.transport = server.transport
        self.state = MembershipState(expected=frozenset(expected), failure_timeout=failure_timeout)
        self.start_timeout = start_timeout
        self.check_interval = check_interval
        self.run_info = dict(run_info or {})
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = time.monotonic()
        server.register("membership.register", self._register)
        server.register("membership.heartbeat", self._heartbeat)
        server.register("membership.finish", self._finish)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._task = asyncio.create_task(self._monitor(), name="membership-monitor")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

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
        self.state.register(caller, str(args.get("fingerprint", "")), time.monotonic())
        self._notify()
        ok = await self._wait_until(lambda: self.state.complete, self._t0 + self.start_timeout)
        if not ok:
            raise PeerTimeout(f"nodes {self.state.missing} never registered with the coordinator "
                              f"(node {self.transport.node_id}) within {self.start_timeout:g}s")
        return {"members": sorted(self.state.registered), **self.run_info}

    async def _heartbeat(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        self.state.heartbeat(caller, time.monotonic())
        return {"failed": sorted(self.state.failed)}

    async def _finish(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        self.state.finish(caller, args.get("stats"))
        self._notify()
        timeout = float(args.get("timeout", 30.0))
        await self._wait_until(lambda: self.state.all_finished, time.monotonic() + timeout)
        return {"finished": sorted(self.state.finished), "failed": sorted(self.state.failed)}

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            new = self.state.check(time.monotonic())
            if not new:
                continue
            log.warning("coordinator: nodes %s missed heartbeats for %.1fs: declared failed",
                        new, self.state.failure_timeout)
            for n in new:
                self.transport.mark_dead(n)
            self._notify()
            for peer in self.state.alive:
                if peer == self.transport.node_id:
                    continue
                asyncio.create_task(self._tell(peer, new))
            # the coordinator's own client learns of failures from its heartbeat reply

    async def _tell(self, peer: int, failed: list[int]) -> None:
        try:
            await self.transport.send(peer, EVENT_FAILED, kind="event", meta={"failed": failed}, timeout=2.0)
        except P2PSyncError as exc:
            log.info("could not tell node %d about failures: %s", peer, exc)


class MembershipClient:
    """Every node: register, heartbeat, learn of failures, finish barrier."""

    def __init__(self, *, transport: Transport, rpc: RpcClient, coordinator: int,
                 heartbeat_interval: float = 0.5, failure_timeout: float = 2.0) -> None:
        self.transport = transport
        self.rpc = rpc
        self.coordinator = coordinator
        self.interval = heartbeat_interval
        self.failure_timeout = failure_timeout
        self.failed: set[int] = set()
        self.listeners: list[Callable[[int], None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.info: dict[str, Any] = {}

    async def register(self, fingerprint: str, timeout: float) -> dict[str, Any]:
        try:
            info = await self.rpc.call(self.coordinator, "membership.register",
                                       {"fingerprint": fingerprint}, timeout=timeout)
        except (PeerTimeout, PeerFailure) as exc:
            raise PeerTimeout(f"node {self.transport.node_id}: rendezvous with coordinator "
                              f"{self.coordinator} failed: {exc}") from None
        except RemoteError as exc:
            raise PeerTimeout(f"rendezvous failed: {exc}") from None
        self.info = dict(info)
        return self.info

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._heartbeats(), name="heartbeats"),
                       asyncio.create_task(self._events(), name="membership-events")]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass

    def _declare(self, peers: list[int]) -> None:
        for p in peers:
            if p in self.failed or p == self.transport.node_id:
                continue
            self.failed.add(p)
            self.transport.mark_dead(p)
            log.warning("node %d: peer %d failed", self.transport.node_id, p)
            for cb in list(self.listeners):
                cb(p)

    async def _heartbeats(self) -> None:
        last_ok = time.monotonic()
        while True:
            try:
                rep = await self.rpc.call(self.coordinator, "membership.heartbeat",
                                          timeout=max(self.interval * 2, 0.5))
                last_ok = time.monotonic()
                self._declare([int(p) for p in rep.get("failed", [])])
            except P2PSyncError:
                if time.monotonic() - last_ok > self.failure_timeout:
                    self._declare([self.coordinator])
                    return
            await asyncio.sleep(self.interval)

    async def _events(self) -> None:
        while True:
            try:
                msg = await self.transport.recv(EVENT_FAILED, timeout=None)
            except P2PSyncError:
                return
            failed = msg.meta.get("failed")
            if msg.src == self.coordinator and isinstance(failed, list):
                self._declare([int(p) for p in failed if type(p) is int])

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

"""ZeroMQ endpoint: one ROUTER socket bound per NIC, peers reached over the NIC they share.

Each NIC socket has the routing id ``"<node>/<nic>"``. For every pair of nodes sharing a network,
the lower id's socket connects to the higher id's socket on that network; the single ZMTP
connection then carries traffic both ways (ROUTER-to-ROUTER), and each side addresses the other
by its routing id. ``ROUTER_MANDATORY`` turns a send to a peer that is not connected (not yet,
or no longer) into an error that :class:`~p2psync.transport.base.Transport` retries until the
timeout, so a dead peer surfaces as :class:`~p2psync.errors.PeerUnreachable`, never a hang or
a silent drop. ZMTP heartbeats detect a silent peer; ``MAXMSGSIZE`` caps every frame.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from p2psync.errors import TransportError
from p2psync.topology import Route, Topology
from p2psync.transport.base import NotReady, Transport
from p2psync.wire import DEFAULT_LIMITS, WireLimits

log = logging.getLogger("p2psync.transport")


@dataclass(frozen=True)
class SocketOptions:
    sndhwm: int = 1000
    rcvhwm: int = 1000
    heartbeat_ivl_ms: int = 500
    heartbeat_timeout_ms: int = 2000
    reconnect_ivl_ms: int = 20
    reconnect_ivl_max_ms: int = 500
    io_threads: int = 1


def routing_id(node: int, nic: str) -> bytes:
    return f"{node}/{nic}".encode()


def parse_routing_id(rid: bytes) -> tuple[int, str] | None:
    try:
        node, nic = rid.decode("ascii").split("/", 1)
        if not node.isdigit():
            return None
        return int(node), nic
    except (UnicodeDecodeError, ValueError):
        return None


class ZmqEndpoint(Transport):
    def __init__(self, *, topology: Topology, node_id: int, limits: WireLimits = DEFAULT_LIMITS,
                 default_timeout: float = 30.0, options: SocketOptions = SocketOptions(),
                 context: zmq.asyncio.Context | None = None) -> None:
        super().__init__(topology=topology, node_id=node_id, limits=limits,
                         default_timeout=default_timeout)
        self.options = options
        self._own_ctx = context is None
        self._ctx = context
        self._socks: dict[str, zmq.asyncio.Socket] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._valid_ids = {routing_id(n.id, c.name) for n in topology.nodes for c in n.nics}

    async def start(self) -> None:
        if self._socks:
            return
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context(io_threads=self.options.io_threads)
        o = self.options
        try:
            for nic in self.node.nics:
                s = self._ctx.socket(zmq.ROUTER)
                self._socks[nic.name] = s
                s.setsockopt(zmq.ROUTING_ID, routing_id(self.node_id, nic.name))
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.ROUTER_MANDATORY, 1)
                s.setsockopt(zmq.IMMEDIATE, 1)  # no queueing to peers that are not connected
                s.setsockopt(zmq.SNDHWM, o.sndhwm)
                s.setsockopt(zmq.RCVHWM, o.rcvhwm)
                s.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes + 1024)
                s.setsockopt(zmq.HEARTBEAT_IVL, o.heartbeat_ivl_ms)
                s.setsockopt(zmq.HEARTBEAT_TIMEOUT, o.heartbeat_timeout_ms)
                s.setsockopt(zmq.HEARTBEAT_TTL, o.heartbeat_timeout_ms)
                s.setsockopt(zmq.RECONNECT_IVL, o.reconnect_ivl_ms)
                s.setsockopt(zmq.RECONNECT_IVL_MAX, o.reconnect_ivl_max_ms)
                try:
                    s.bind(nic.endpoint)
                except zmq.ZMQError as exc:
                    raise TransportError(
                        f"node {self.node_id} NIC {nic.name}: cannot bind {nic.endpoint}: {exc.strerror}"
                    ) from None
            for nic in self.node.nics:
                for peer in self.topology.members(nic.network):
                    if peer > self.node_id:
                        remote = next(c for c in self.topology.node(peer).nics if c.network == nic.network)
                        self._socks[nic.name].connect(remote.endpoint)
        except BaseException:
            await self.close()
            raise
        for name, s in self._socks.items():
            self._tasks.append(asyncio.create_task(self._recv_loop(name, s), name=f"recv-{self.node_id}-{name}"))

    async def _recv_loop(self, nic: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.ETERM, zmq.ENOTSOCK) or sock.closed:
                    return
                log.warning("node %d NIC %s: receive error %s", self.node_id, nic, exc)
                continue
            rid = frames[0].bytes
            peer = parse_routing_id(rid) if rid in self._valid_ids else None
            label = f"{peer[0]}/{peer[1]}" if peer else repr(rid[:32])
            self._ingest(nic, peer[0] if peer else None, label, [f.buffer for f in frames[1:]])

    async def _transmit(self, peer: int, route: Route, frames: list[Any]) -> None:
        sock = self._socks.get(route.local_nic)
        if sock is None:
            raise TransportError("endpoint is not started")
        try:
            await sock.send_multipart([routing_id(peer, route.remote_nic), *frames],
                                      flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise NotReady from None
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                raise NotReady from None
            raise TransportError(f"send to node {peer} failed: {exc.strerror}") from None

    async def close(self) -> None:
        self._closing()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks.clear()
        for s in self._socks.values():
            s.close(linger=0)
        self._socks.clear()
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()
            self._ctx = None

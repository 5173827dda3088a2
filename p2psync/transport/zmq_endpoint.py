"""ZeroMQ endpoint: one ROUTER socket bound per NIC, peers reached over the NIC they share.

Each NIC socket has the routing id ``"<node>/<nic>"``. For every pair of nodes sharing a network,
the lower id's socket connects to the higher id's socket on that network; the single ZMTP
connection then carries traffic both ways (ROUTER-to-ROUTER), and each side addresses the other
by its routing id. ``ROUTER_MANDATORY`` turns a send to a peer that is not connected (not yet,
or no longer) into an error that :class:`~p2psync.transport.base.Transport` retries until the
timeout, so a dead peer surfaces as :class:`~p2psync.errors.PeerUnreachable`, never a hang or
a silent drop. ZMTP heartbeats detect a silent peer; ``MAXMSGSIZE`` caps every frame.

On the connecting side ZeroMQ keeps a pipe across a disconnect (to reconnect later), so
``ROUTER_MANDATORY`` alone would let sends to a dead peer queue silently. ``ZMQ_IMMEDIATE``
would prevent that, but it also drops the inbound messages of that pipe that the application
has not read yet when the peer disconnects (a peer that sends its last message and exits
loses it). Instead a socket monitor watches the connecting side: ``DISCONNECTED`` marks the
peer down (sends to it are retried and then fail), a completed handshake marks it up again.

The sockets are plain (synchronous) ZeroMQ sockets driven by the event loop: the loop watches
each socket's file descriptor (``add_reader``) and the callback drains every waiting message with
``NOBLOCK``; sends are ``NOBLOCK`` too. The descriptor is edge-triggered, so after every send the
socket's ``EVENTS`` are checked again and a drain is scheduled when input is waiting. This avoids
``zmq.asyncio``'s per-message futures (about half the per-message cost).
"""

from __future__ import annotations

import asyncio
import errno
import logging
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from p2psync.errors import TransportError
from p2psync.topology import Route, Topology
from p2psync.transport.base import NotReady, Transport
from p2psync.wire import DEFAULT_LIMITS, WireLimits

log = logging.getLogger("p2psync.transport")

_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_get_int = zmq.backend.Socket.get  # the sugar getter wraps EVENTS in an enum on every call
_DRAIN_BATCH = 256  # messages handled per callback before yielding to the loop


@dataclass(frozen=True)
class SocketOptions:
    sndhwm: int = 1000
    rcvhwm: int = 1000
    heartbeat_ivl_ms: int = 500
    heartbeat_timeout_ms: int = 2000
    reconnect_ivl_ms: int = 20
    reconnect_ivl_max_ms: int = 500
    io_threads: int = 1
    #: on close, how long queued outgoing messages may still be flushed (ms); messages to a
    #: peer that is gone are never queued (IMMEDIATE), so this only delays a live send
    close_linger_ms: int = 2000
    #: kernel socket buffer sizes in bytes (0: the OS default)
    sndbuf: int = 0
    rcvbuf: int = 0


def routing_id(node: int, nic: str) -> bytes:
    return f"{node}/{nic}".encode()


class ZmqEndpoint(Transport):
    def __init__(self, *, topology: Topology, node_id: int, limits: WireLimits = DEFAULT_LIMITS,
                 default_timeout: float = 30.0, options: SocketOptions = SocketOptions(),
                 context: zmq.Context | None = None) -> None:
        super().__init__(topology=topology, node_id=node_id, limits=limits,
                         default_timeout=default_timeout)
        self.options = options
        self._own_ctx = context is None
        self._ctx = context
        self._socks: dict[str, zmq.Socket] = {}
        self._fds: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._monitors: dict[str, zmq.Socket] = {}
        self._endpoint_peer: dict[str, int] = {}  # connected endpoint -> peer id
        self.down: set[int] = set()  # peers whose connection (from our side) is down
        # routing ids of every NIC in the topology -> (node, label); anything else is unknown
        self._peers_by_rid = {routing_id(n.id, c.name): (n.id, f"{n.id}/{c.name}")
                              for n in topology.nodes for c in n.nics}
        self._rid_cache: dict[tuple[int, str], bytes] = {}

    async def start(self) -> None:
        if self._socks:
            return
        if self._ctx is None:
            self._ctx = zmq.Context(io_threads=self.options.io_threads)
        self._loop = asyncio.get_running_loop()
        o = self.options
        try:
            for nic in self.node.nics:
                s = self._ctx.socket(zmq.ROUTER)
                self._socks[nic.name] = s
                s.setsockopt(zmq.ROUTING_ID, routing_id(self.node_id, nic.name))
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.ROUTER_MANDATORY, 1)
                s.setsockopt(zmq.SNDHWM, o.sndhwm)
                s.setsockopt(zmq.RCVHWM, o.rcvhwm)
                s.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes + 1024)
                s.setsockopt(zmq.HEARTBEAT_IVL, o.heartbeat_ivl_ms)
                s.setsockopt(zmq.HEARTBEAT_TIMEOUT, o.heartbeat_timeout_ms)
                s.setsockopt(zmq.HEARTBEAT_TTL, o.heartbeat_timeout_ms)
                s.setsockopt(zmq.RECONNECT_IVL, o.reconnect_ivl_ms)
                s.setsockopt(zmq.RECONNECT_IVL_MAX, o.reconnect_ivl_max_ms)
                if o.sndbuf:
                    s.setsockopt(zmq.SNDBUF, o.sndbuf)
                if o.rcvbuf:
                    s.setsockopt(zmq.RCVBUF, o.rcvbuf)
                try:
                    s.bind(nic.endpoint)
                except zmq.ZMQError as exc:
                    raise TransportError(
                        f"node {self.node_id} NIC {nic.name}: cannot bind {nic.endpoint}: {exc.strerror}"
                    ) from None
            for nic in self.node.nics:
                mon = None
                for peer in self.topology.members(nic.network):
                    if peer > self.node_id:
                        if mon is None:
                            mon = self._socks[nic.name].get_monitor_socket(
                                zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
                            self._monitors[nic.name] = mon
                        remote = next(c for c in self.topology.node(peer).nics if c.network == nic.network)
                        self._endpoint_peer[remote.endpoint] = peer
                        self._socks[nic.name].connect(remote.endpoint)
        except BaseException:
            await self.close()
            raise
        for name, s in self._socks.items():
            fd = s.getsockopt(zmq.FD)
            self._fds.append(fd)
            self._loop.add_reader(fd, self._drain, name)
            self._loop.call_soon(self._drain, name)
        for name, mon in self._monitors.items():
            fd = mon.getsockopt(zmq.FD)
            self._fds.append(fd)
            self._loop.add_reader(fd, self._watch, name)
            self._loop.call_soon(self._watch, name)

    def _watch(self, nic: str) -> None:
        """Connection events of our outgoing connections on ``nic`` (loop callback)."""
        mon = self._monitors.get(nic)
        while mon is not None and not mon.closed:
            try:
                if not _get_int(mon, _EVENTS) & _POLLIN:
                    return
                ev = parse_monitor_message(mon.recv_multipart(_NOBLOCK))
            except (zmq.ZMQError, ValueError):
                return
            peer = self._endpoint_peer.get(ev["endpoint"].decode(errors="replace"))
            if peer is None:
                continue
            if ev["event"] == zmq.EVENT_DISCONNECTED:
                self.down.add(peer)
            elif ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.down.discard(peer)

    def _drain(self, nic: str) -> None:
        """Receive every message waiting on ``nic``'s socket (loop callback; never raises)."""
        sock = self._socks.get(nic)
        if sock is None:
            return
        for _ in range(_DRAIN_BATCH):
            try:
                if not _get_int(sock, _EVENTS) & _POLLIN:
                    return
                frames = sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                if not sock.closed:
                    log.warning("node %d NIC %s: receive error %s", self.node_id, nic, exc)
                return
            rid = frames[0].bytes
            known = self._peers_by_rid.get(rid)
            if known is None:
                self._ingest(nic, None, repr(rid[:32]), [f.buffer for f in frames[1:]])
            else:
                self._ingest(nic, known[0], known[1], [f.buffer for f in frames[1:]])
        if self._loop is not None:  # more may be waiting: continue after other callbacks ran
            self._loop.call_soon(self._drain, nic)

    async def _transmit(self, peer: int, route: Route, frames: list[Any]) -> None:
        sock = self._socks.get(route.local_nic)
        if sock is None:
            raise TransportError("endpoint is not started")
        if peer in self.down:
            raise NotReady
        key = (peer, route.remote_nic)
        rid = self._rid_cache.get(key)
        if rid is None:
            rid = self._rid_cache[key] = routing_id(peer, route.remote_nic)
        try:
            sock.send_multipart([rid, *frames], _NOBLOCK, copy=False)
        except zmq.Again:
            raise NotReady from None
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                raise NotReady from None
            raise TransportError(f"send to node {peer} failed: {exc.strerror}") from None
        finally:
            # the FD is edge-triggered: a send may have consumed the readable edge
            if not sock.closed and _get_int(sock, _EVENTS) & _POLLIN and self._loop is not None:
                self._loop.call_soon(self._drain, route.local_nic)

    async def close(self) -> None:
        await self._drain_relays()
        await self._close_shaper()
        self._closing()
        if self._loop is not None:
            for fd in self._fds:
                self._loop.remove_reader(fd)
        self._fds.clear()
        for nic, s in self._socks.items():
            if nic in self._monitors:
                s.disable_monitor()
                self._monitors[nic].close(linger=0)
        self._monitors.clear()
        for s in self._socks.values():
            s.close(linger=self.options.close_linger_ms)
        self._socks.clear()
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()
            self._ctx = None

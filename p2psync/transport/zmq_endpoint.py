"""ZeroMQ endpoint: one ROUTER socket bound per NIC, peers reached over the NIC they share.

**Connections.** Every node connects out to every neighbour, over the NIC they share, and
*sends only on its own outgoing connections*: a message to node ``j`` leaves on the pipe this
node opened to ``j``'s address from the topology, under a routing id this node chose
(``CONNECT_ROUTING_ID``, :func:`routing_id`). Incoming connections (the neighbours' outgoing
ones, accepted by the bound socket) only ever deliver. Nothing a peer claims therefore decides
where this node's messages go (a peer that claims another node's routing id
must not receive that node's traffic). Each direction of a pair has its own TCP connection.

``ROUTER_MANDATORY`` turns a send to a peer whose pipe does not exist into an error that
:class:`~p2psync.transport.base.Transport` retries until the timeout, so a dead peer surfaces
as :class:`~p2psync.errors.PeerUnreachable`, never a hang or a silent drop. ZeroMQ keeps an
outgoing pipe across a disconnect (to reconnect later), so ``ROUTER_MANDATORY`` alone would let
sends to a dead peer queue silently; ``ZMQ_IMMEDIATE`` would prevent that but also drop the
inbound messages of that pipe that the application has not read yet. Instead a socket monitor
watches the outgoing connections: ``DISCONNECTED`` marks the peer down (sends to it are retried
and then fail), a completed handshake marks it up again; a peer is down until its first
handshake completes. ZMTP heartbeats detect a silent peer; ``MAXMSGSIZE`` caps every frame.

The sockets are plain (synchronous) ZeroMQ sockets driven by the event loop: the loop watches
each socket's file descriptor (``add_reader``) and the callback drains every waiting message with
``NOBLOCK``; sends are ``NOBLOCK`` too. The descriptor is edge-triggered, so after every send on
a NIC socket its ``EVENTS`` are checked again and a drain is scheduled when input is waiting (a
control socket receives nothing: see below). This avoids ``zmq.asyncio``'s per-message futures
(about half the per-message cost). A multipart message is read frame by frame through each
frame's ``more`` flag (``getsockopt(RCVMORE)`` in pyzmq builds an option enum per call).

**Control channel**. Control messages (``rpc``, ``reply``, ``event``, ``hb``)
travel on a second TCP connection per peer and NIC, so they never queue behind tensor bytes in a
ZeroMQ pipe or a kernel socket buffer: each node opens a second ROUTER socket per NIC (the
control socket) that connects to the *same* port of every neighbour's NIC socket; no second
port is bound, so the topology format, port plans and firewalls are unchanged. On the
receiving NIC socket a neighbour thus has two incoming pipes, bulk and control; ZeroMQ keeps one
queue (and HWM) per pipe and fair-queues input per pipe, so a control message waits behind at
most one bulk message per pipe on receive.

**Routing ids.** An outgoing pipe is named ``"<peer>/<nic>"`` on the socket that opened it. An
incoming pipe is filed under the id its opener claims: ``"<node>/<nic>/b"`` (bulk) or
``"<node>/<nic>/c"`` (control), which tells the receiver the sender (unkeyed) and never equals
one of the receiver's own names. All connects happen before the NIC sockets bind, so no incoming
connection can take the name of an outgoing pipe first. Each connection appends a random suffix
(``"...#<16 hex>"``, ignored when the sender is named): a restarted node's new process may
connect before the receiver saw its previous process's connection close, and ZeroMQ ignores,
in silence, a connection that claims an id still filed (its messages dropped, its link up on
its side).

**Queues.** ``SocketOptions.sndhwm`` (bulk pipes) defaults to 64 messages (so that no more than
64 pieces sit in one pipe); the transport's per-peer byte window (``window_bytes``, default
8 MiB; :mod:`p2psync.transport.flow`) bounds what waits to enter it. The control socket has its
own ``control_sndhwm`` (1000 messages; control messages are small).

**Keys** (:mod:`p2psync.transport.keys`). With ``keys`` every ROUTER socket runs
CurveZMQ: a socket is a CURVE client on each connect (with the server key of the node it
connects to, from the topology, so an outgoing pipe provably reaches that node) and a CURVE
server on its bind, with the ZAP handler of :mod:`p2psync.transport.zap` (one per endpoint, on
the endpoint's own context) accepting only the topology's keys. The identity check sits in
:meth:`ZmqEndpoint._hand_over`, before a message is decoded: on an incoming connection the
``User-Id`` that ZAP gave its key must be the node of the routing id the peer claims (else
``identity_mismatch``); a message without a ``User-Id`` must come on one of our own outgoing
pipes. Each keyed connection claims its id with a secret random suffix (``"...#<16 hex>"``,
sent only inside the CURVE handshake to the node it connects to), so another key holder cannot
take a node's id at a receiver before that node connects (or while it reconnects) and have the
real connection ignored as a duplicate. A peer with an unknown key never completes a
handshake, so it delivers nothing; each refused attempt is counted (``unknown_key``) and the
first is logged, once per NIC (a sender can make fresh keys without end). Relayed control messages are checked end to end by
:mod:`p2psync.transport.relay_auth`.

**Shared memory** (``SocketOptions.shm``, :mod:`p2psync.transport.shm`). Between loopback NICs
a bulk frame of 64 KiB or more can travel through a ring buffer in ``/dev/shm``: the
:class:`ShmLink` stages it there (a marker frame first, an empty frame in its place) and rolls the ring back
when the send fails; ``_take_in`` takes it as a view of the sender's ring, with a lease that
``_ingest`` lends to a consumer that borrows it or releases after a copy (``Transport.lend``).
An *unordered* bulk message (the collectives' pieces) to such a peer skips ZeroMQ when it can:
marker, header and small frames go as one Unix datagram (:mod:`p2psync.transport.local`; its
big frames in a ring of their own), taken by ``LocalChannel.drain``. Unkeyed endpoints only.

**Data paths.** ``_transmit`` hands a message to one of three :class:`Link` objects: the control
and bulk :class:`ZmqLink` (our outgoing pipes of each channel) and, to a peer on this host when
this endpoint sends through shared memory, the :class:`ShmLink` (ring, datagram, bulk pipe).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import secrets
from typing import Any, Callable, Collection, Mapping, Protocol, cast

import zmq
from zmq.utils.monitor import parse_monitor_message

from p2psync.errors import ConfigError, ProtocolError, TransportError, translate
from p2psync.topology import Nic, Route, Topology
from p2psync.transport.base import NotReady, Transport
from p2psync.transport.keys import NodeKeys
from p2psync.transport.lending import Releasable
from p2psync.transport.local import LocalChannel
from p2psync.transport.shm import Inbound, Outbound, same_host
from p2psync.transport.socket_options import SocketOptions
from p2psync.transport.zap import DOMAIN_PREFIX, ZapHandler
from p2psync.wire import DEFAULT_LIMITS, WireLimits, placed

#: seconds between two checks for input that no edge announced (:meth:`ZmqEndpoint._guard`)
GUARD_S = 0.25
log = logging.getLogger("p2psync.transport")

_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
# the backend getter turns its option into a SocketOption enum on every call; given a member,
# the enum's constructor returns it at once (2.2 against 2.7 µs a call, twice a message or more)
_EVENTS = zmq.SocketOption.EVENTS
#: ``_get_int(sock, option)``: the backend getter (the sugar one wraps EVENTS in an enum on every
#: call), called directly for the int options read here (no wrapper frame per read, several a message)
_get_int = cast("Callable[[zmq.Socket[Any], int], int]", zmq.backend.Socket.get)
# the backend's send / recv with int flags: pyzmq's send_multipart / recv_multipart build a Flag
# enum per frame (SNDMORE | flags) and check every frame's type (~10 µs a small message)
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK_MORE = int(zmq.NOBLOCK) | _SNDMORE

_DRAIN_BATCH = 256  # messages handled per callback before yielding to the loop
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def routing_id(node: int, nic: str) -> bytes:
    """The name of an outgoing pipe to ``node``'s NIC ``nic`` (on the socket that opened it)."""
    return f"{node}/{nic}".encode()


def claimed_id(node: int, nic: str, *, control: bool) -> bytes:
    """The routing id under which ``node``'s connection from its NIC ``nic`` (bulk or control
    socket) is filed by the node it connects to (keyed: plus a random ``#`` suffix)."""
    return f"{node}/{nic}/{'c' if control else 'b'}".encode()


def bind_error(exc: zmq.ZMQError, topology: Topology, node_id: int, nic: Nic) -> TransportError:
    """The error for NIC ``nic`` of node ``node_id`` failing to bind: its endpoint and the
    system's reason; a port in use also names the address and port and how to choose others
    (``--base-port`` of ``p2psync topo`` for a generated topology, or the NIC's ``port`` field
    in the file, by its index as the file's validation names fields)."""
    if exc.errno != errno.EADDRINUSE:
        return TransportError(f"node {node_id} NIC {nic.name}: cannot bind {nic.endpoint}: {exc.strerror}")
    index = next((k for k, n in enumerate(topology.nodes) if n.id == node_id), node_id)
    nic_index = [n.name for n in topology.node(node_id).nics].index(nic.name)
    field = f"nodes[{index}].nics[{nic_index}].port"
    return TransportError(f"node {node_id} NIC {nic.name}: cannot bind {nic.address}:{nic.port}, the port is in use "
                          "(by another run or program): choose other ports with 'p2psync topo ... --base-port "
                          f"PORT', or edit {field} in the topology file")


class Link(Protocol):
    """One data path to adjacent peers."""

    def send(self, peer: int, route: Route, frames: list[Any], unordered: bool = False) -> None:
        """Hand one message's frames to ``peer`` over ``route`` without waiting. ``unordered``:
        the message may overtake, or be overtaken by, others to the same peer. Raises
        :class:`~p2psync.transport.base.NotReady` when nothing of it went (retry later), or
        :class:`~p2psync.errors.TransportError`."""


class ZmqLink:
    """Our own outgoing ZeroMQ pipes of one channel (bulk or control), one socket per NIC: a
    message leaves on the pipe this node opened to the peer's NIC, named by the peer's routing
    id (see the module docstring)."""

    def __init__(self, socks: Mapping[str, "zmq.Socket[Any]"], down: Collection[int], *, bulk: bool,
                 rearm: Callable[[str, "zmq.Socket[Any]"], None] | None = None) -> None:
        """``socks``: NIC name -> socket (filled when the endpoint starts); ``down``: peers whose
        connection on this channel is down (a send to one is NotReady); ``bulk``: Fills are
        computed into arrays of their own before they go; ``rearm``: called after every send
        attempt (a socket that also receives has an edge-triggered descriptor, and a send may
        consume its readable edge)."""
        self.socks = socks
        self.down = down
        self.bulk = bulk
        self._rearm = rearm
        self._rids: dict[tuple[int, str], bytes] = {}

    def ready(self, peer: int, route: Route) -> "zmq.Socket[Any]":
        """The socket a message to ``peer`` over ``route`` leaves on; NotReady while the
        connection is down, TransportError before the endpoint started."""
        sock = self.socks.get(route.local_nic)
        if sock is None:
            raise TransportError("endpoint is not started")
        if peer in self.down:
            raise NotReady
        return sock

    def put(self, sock: "zmq.Socket[Any]", peer: int, route: Route, frames: list[Any]) -> None:
        """Send ``frames`` (buffers as they are) on ``sock``'s pipe to ``peer``: all of them or,
        raising NotReady or TransportError, none."""
        key = (peer, route.remote_nic)
        rid = self._rids.get(key) or self._rids.setdefault(key, routing_id(peer, route.remote_nic))
        try:
            # EAGAIN / EHOSTUNREACH come on the routing id or not at all (nothing queued then);
            # once it is in, the rest of the multipart message always goes
            _send(sock, rid, _NOBLOCK_MORE if frames else _NOBLOCK, copy=False)
            last = len(frames) - 1
            for i, f in enumerate(frames):
                _send(sock, f, _NOBLOCK_MORE if i < last else _NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            if isinstance(exc, zmq.Again) or exc.errno == errno.EHOSTUNREACH:
                raise NotReady from None
            raise TransportError(f"send to node {peer} failed: {exc.strerror}") from None
        finally:
            if self._rearm is not None:
                self._rearm(route.local_nic, sock)

    def send(self, peer: int, route: Route, frames: list[Any], unordered: bool = False) -> None:
        sock = self.socks.get(route.local_nic)  # (what ready() checks, without its call)
        if sock is None:
            raise TransportError("endpoint is not started")
        if peer in self.down:
            raise NotReady
        self.put(sock, peer, route, placed(frames) if self.bulk else frames)


class ShmLink:
    """Bulk messages to a peer on this host: frames of 64 KiB or more through a shared-memory
    ring (:mod:`p2psync.transport.shm`), marker, header and small frames on the ZeroMQ bulk
    pipe; an unordered message as one datagram when the datagram channel takes it
    (:mod:`p2psync.transport.local`)."""

    def __init__(self, pipe: ZmqLink, out: Outbound, datagrams: LocalChannel) -> None:
        self.pipe = pipe
        self.out = out
        self.datagrams = datagrams

    def send(self, peer: int, route: Route, frames: list[Any], unordered: bool = False) -> None:
        sock = self.pipe.ready(peer, route)
        if unordered and self.datagrams.send(self.out, peer, route, frames):
            return
        staged, seg, head, count = self.out.stage(peer, route.local_nic, frames)  # (computes Fills)
        try:
            self.pipe.put(sock, peer, route, staged)
        except (NotReady, TransportError):
            if seg is not None:  # nothing of it went: the retry stages it again
                self.out.rollback(seg, head, count)
            raise


class ZmqEndpoint(Transport):
    def __init__(self, *, topology: Topology, node_id: int, limits: WireLimits = DEFAULT_LIMITS,
                 default_timeout: float = 30.0, options: SocketOptions = SocketOptions(),
                 context: "zmq.Context[Any] | None" = None, keys: NodeKeys | None = None,
                 **transport_options: Any) -> None:
        """``transport_options``: the :class:`Transport` keywords (``window_bytes``,
        ``mailbox_budget_bytes``, ``mailbox_ttl``, ``max_pending``, ``max_control_pending``,
        ``shaper``, ``relay_budget_bytes``).
        ``keys``: this node's keys in a keyed cluster (every socket runs CurveZMQ)."""
        if keys is not None:
            if keys.node != node_id or topology.node(node_id).curve_public != keys.public.decode():
                raise ConfigError(f"node {node_id}: its key pair is not the one the topology lists")
            if context is not None:
                raise ConfigError("a keyed endpoint needs a ZeroMQ context of its own (for its ZAP handler)")
        super().__init__(topology=topology, node_id=node_id, limits=limits,
                         default_timeout=default_timeout,
                         relay_keys=keys.relay if keys is not None else None, **transport_options)
        self.keys = keys
        self._zap: ZapHandler | None = None
        #: per socket (NIC name, control): routing ids of the connections we made
        self._own_rids: dict[tuple[str, bool], set[bytes]] = {}
        self.options = options
        self._own_ctx = context is None
        self._ctx = context
        self._socks: dict[str, "zmq.Socket[Any]"] = {}
        self._fds: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._monitors: dict[str, "zmq.Socket[Any]"] = {}
        self._ctl_socks: dict[str, "zmq.Socket[Any]"] = {}  # NIC -> control socket (to higher ids)
        self._ctl_monitors: dict[str, "zmq.Socket[Any]"] = {}
        self._endpoint_peer: dict[str, int] = {}  # connected endpoint -> peer id
        self._guard_handle: asyncio.TimerHandle | None = None
        self.down: set[int] = set()  # peers whose connection (from our side) is down
        self.control_down: set[int] = set()  # same for our control connections
        # routing ids (without a keyed ``#`` suffix) of every NIC in the topology -> (node,
        # label): our outgoing pipes' names and the ids incoming connections claim
        self._peers_by_rid: dict[bytes, tuple[int, str]] = {}
        for n in topology.nodes:
            for c in n.nics:
                label = f"{n.id}/{c.name}"
                self._peers_by_rid[routing_id(n.id, c.name)] = (n.id, label)
                self._peers_by_rid[claimed_id(n.id, c.name, control=False)] = (n.id, label)
                self._peers_by_rid[claimed_id(n.id, c.name, control=True)] = (n.id, f"{label}/c")
        self._shm_out: Outbound | None = None
        self._shm_in: Inbound | None = None
        #: our NICs with loopback addresses, and the routes (peer, our NIC) whose both ends are
        #: loopback: what shared memory may carry
        self._loopback = frozenset(c.name for c in self.node.nics if same_host(c.address))
        self._on_host = frozenset(
            (peer, r.local_nic) for peer in topology.neighbors(node_id) for r in topology.routes(node_id, peer)
            if r.local_nic in self._loopback
            and same_host(topology.node(peer).nic(r.remote_nic).address))
        if keys is None:  # every endpoint takes marked messages and datagrams; sending them is the option
            self._shm_in = Inbound(node_id, limits.max_frame_bytes)
            self._shm_out = Outbound(node_id) if options.shm else None
        #: unordered bulk messages to and from the peers on this host as datagrams (unkeyed)
        self.datagrams = LocalChannel(node_id=node_id, topology=topology, loopback=self._loopback,
                                      on_host=self._on_host, take_in=self._take_in,
                                      reject=self._reject_datagram)
        #: the data paths: control, bulk, and bulk to a peer on this host (shared memory on)
        self._control_link = ZmqLink(self._ctl_socks, self.control_down, bulk=False)
        self._bulk_link = ZmqLink(self._socks, self.down, bulk=True, rearm=self._rearm)
        self._shm_link = ShmLink(self._bulk_link, self._shm_out, self.datagrams) if self._shm_out is not None else None

    async def start(self) -> None:
        if self._socks:
            return
        if self._ctx is None:
            self._ctx = zmq.Context(io_threads=self.options.io_threads)
        ctx = self._ctx
        self._loop = asyncio.get_running_loop()
        o = self.options
        try:
            if self.keys is not None:  # before any socket can see a handshake
                self._zap = ZapHandler(context=ctx, nodes=self.topology.node_by_key, on_refused=self._refused)
                self._zap.start(self._loop)
            for nic in self.node.nics:
                self._socks[nic.name] = self._socket(ctx, claimed_id(self.node_id, nic.name, control=False), o.sndhwm,
                                                     bulk=True)
            self._connect_all(ctx)
            for nic in self.node.nics:  # bind after every connect: our routing ids are taken
                s = self._socks[nic.name]
                if self.keys is not None:
                    s.setsockopt(zmq.CURVE_SERVER, 1)
                    s.setsockopt(zmq.ZAP_DOMAIN, f"{DOMAIN_PREFIX}{nic.name}".encode())
                    s.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
                with translate({zmq.ZMQError: lambda e: bind_error(e, self.topology, self.node_id, nic)}):
                    s.bind(nic.endpoint)
            if self.keys is None:
                self._fds.extend(self.datagrams.start(self._loop, send=self._shm_out is not None))
        except BaseException:
            await self.close()
            raise
        for control, socks in ((True, self._ctl_socks), (False, self._socks)):
            for name, s in socks.items():
                fd = _get_int(s, zmq.FD)
                self._fds.append(fd)
                self._loop.add_reader(fd, self._drain, name, control)
                self._loop.call_soon(self._drain, name, control)
        for control, mons in ((True, self._ctl_monitors), (False, self._monitors)):
            for name, mon in mons.items():
                fd = _get_int(mon, zmq.FD)
                self._fds.append(fd)
                self._loop.add_reader(fd, self._watch, name, control)
                self._loop.call_soon(self._watch, name, control)
        self._guard_handle = self._loop.call_later(GUARD_S, self._guard)

    def _guard(self) -> None:
        """Every ``GUARD_S``: a socket (or monitor) with input waiting that no edge announced
        is drained. ZeroMQ's descriptor only signals a change, and a NIC socket's edges are
        re-checked after its own sends; a node that only receives (one that waits for a
        majority after the whole process was stopped: SIGSTOP, swap) missed an edge once and
        then never read a message again, replies and fences included (loop callback)."""
        if self._closed or self._loop is None:
            return
        for control, socks, mons in ((True, self._ctl_socks, self._ctl_monitors), (False, self._socks, self._monitors)):
            for name, s in list(socks.items()):
                try:
                    if not s.closed and _get_int(s, _EVENTS) & _POLLIN:
                        self._drain(name, control)
                except zmq.ZMQError:
                    pass
            for name in list(mons):
                self._watch(name, control)
        self._guard_handle = self._loop.call_later(GUARD_S, self._guard)

    def _connect_all(self, ctx: "zmq.Context[Any]") -> None:
        """Connect the NIC sockets (bulk) and control sockets to every neighbour on their
        network, naming each outgoing pipe; the peers count as down until their first
        handshake completes (see the module docstring)."""
        o = self.options
        events = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED
        for nic in self.node.nics:
            for peer in self.topology.members(nic.network):
                if peer == self.node_id:
                    continue
                if nic.name not in self._monitors:
                    self._monitors[nic.name] = self._socks[nic.name].get_monitor_socket(events)
                    c = self._socket(ctx, claimed_id(self.node_id, nic.name, control=True), o.control_sndhwm,
                                     bulk=False)
                    self._ctl_socks[nic.name] = c
                    self._ctl_monitors[nic.name] = c.get_monitor_socket(events)
                remote = next(c for c in self.topology.node(peer).nics if c.network == nic.network)
                self._endpoint_peer[remote.endpoint] = peer
                rid = routing_id(peer, remote.name)
                for control, s in ((False, self._socks[nic.name]), (True, self._ctl_socks[nic.name])):
                    # a suffix of its own per connection: a restarted node's new process never
                    # claims the id its previous process's connection may still hold at the peer
                    # (ZeroMQ ignores a second connection under a filed id, in silence); keyed,
                    # it is secret too: nobody can claim the id first
                    claim = claimed_id(self.node_id, nic.name, control=control) + b"#" + secrets.token_hex(8).encode()
                    if self.keys is not None:
                        s.setsockopt(zmq.CURVE_SERVERKEY, (self.topology.node(peer).curve_public or "").encode())
                    s.setsockopt(zmq.ROUTING_ID, claim)  # read by this connect only
                    s.setsockopt(zmq.CONNECT_ROUTING_ID, rid)
                    s.connect(remote.endpoint)
                    self._own_rids.setdefault((nic.name, control), set()).add(rid)
                self.down.add(peer)
                self.control_down.add(peer)

    def _socket(self, ctx: "zmq.Context[Any]", rid: bytes, sndhwm: int, *, bulk: bool) -> "zmq.Socket[Any]":
        o = self.options
        s: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTING_ID, rid)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.SNDHWM, sndhwm)
        s.setsockopt(zmq.RCVHWM, o.rcvhwm)
        s.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes + 1024)
        s.setsockopt(zmq.HEARTBEAT_IVL, o.heartbeat_ivl_ms)
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, o.heartbeat_timeout_ms)
        s.setsockopt(zmq.HEARTBEAT_TTL, o.heartbeat_timeout_ms)
        s.setsockopt(zmq.RECONNECT_IVL, o.reconnect_ivl_ms)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, o.reconnect_ivl_max_ms)
        if bulk and o.sndbuf:
            s.setsockopt(zmq.SNDBUF, o.sndbuf)
        if bulk and o.rcvbuf:
            s.setsockopt(zmq.RCVBUF, o.rcvbuf)
        if self.keys is not None:
            s.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public)
            s.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)
        return s

    def _refused(self, nic: str, address: str, key: str) -> None:
        """The ZAP handler refused a handshake (a key that is not in the topology)."""
        self._reject(nic, f"key {key[:12]}...", "unknown_key",
                     f"from {address}: its CurveZMQ key is not in the topology; handshake refused",
                     per_peer=False)

    def socket_mechanisms(self) -> dict[str, int]:
        """Security mechanism (``zmq.CURVE``, ``zmq.NULL``) of every network socket, by label."""
        out = {f"{n}": _get_int(s, zmq.MECHANISM) for n, s in self._socks.items()}
        out.update({f"{n}/c": _get_int(s, zmq.MECHANISM) for n, s in self._ctl_socks.items()})
        return out

    def _watch(self, nic: str, control: bool = False) -> None:
        """Connection events of our outgoing connections on ``nic`` (loop callback)."""
        mon = (self._ctl_monitors if control else self._monitors).get(nic)
        down = self.control_down if control else self.down
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
                if peer not in down:
                    log.info("node %d: %s connection to node %d on NIC %s dropped", self.node_id,
                             "control" if control else "bulk", peer, nic)
                down.add(peer)
                if self._shm_out is not None and not control:
                    self._shm_out.forget(peer)
                self._peers_changed()
            elif ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if peer in down:
                    log.info("node %d: %s connection to node %d on NIC %s up", self.node_id,
                             "control" if control else "bulk", peer, nic)
                    down.discard(peer)
                    self._links_changed()
            elif ev["event"] & _HANDSHAKE_FAILED:
                self._reject(nic, str(peer), "handshake_failed",
                             f"handshake with node {peer} failed (event {ev['event']:#x}; with keys: "
                             "its key is not the one the topology lists, or it refused ours)")

    def _connected(self, peer: int, bulk: bool) -> bool:
        """Our connection to ``peer`` on that channel has completed its handshake and not
        dropped since (ZMTP heartbeats drop a silent one)."""
        return peer not in (self.down if bulk else self.control_down)

    def _drain(self, nic: str, control: bool = False, more: bool = False) -> None:
        """Receive every message waiting on ``nic``'s socket (loop callback; never raises).

        The socket's readable edge calls it with ``more`` false: it takes one message, then
        looks for more in a callback of its own (``more``), queued behind what that message
        woke (a waiter's task, an RPC handler), so the look (a ZeroMQ ``EVENTS`` read, 8 µs on
        a cold cache) is off a reply's critical path. libuv runs queued callbacks before it
        polls again, so no edge is missed."""
        sock = (self._ctl_socks if control else self._socks).get(nic)
        if sock is None:
            return
        for i in range(_DRAIN_BATCH):
            try:
                # the first receive needs no check: it raises Again when nothing is waiting
                # (which costs more than the check, but the callback mostly runs for a message)
                if (i or more) and not _get_int(sock, _EVENTS) & _POLLIN:
                    return
                frame = _recv(sock, _NOBLOCK, copy=False)
                frames = [frame]
                while frame.more:  # the rest of a multipart message is already here
                    frame = _recv(sock, 0, copy=False)
                    frames.append(frame)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                if not sock.closed:
                    log.warning("node %d NIC %s: receive error %s", self.node_id, nic, exc)
                return
            self._hand_over(nic, control, frames)
            if not (i or more) and self._loop is not None:
                self._loop.call_soon(self._drain, nic, control, True)
                return
        if self._loop is not None:  # more may be waiting: continue after other callbacks ran
            self._loop.call_soon(self._drain, nic, control, True)

    def _hand_over(self, nic: str, control: bool, frames: list["zmq.Frame"]) -> None:
        """One message received on ``nic``'s socket (``control``: the control socket's), its
        routing id first: name the node it came from, check (keyed) that the connection belongs
        to that node, and hand it to ``_ingest``."""
        rid = frames[0].bytes
        known = self._peers_by_rid.get(rid.partition(b"#")[0])
        if known is None:
            self._ingest(nic, None, repr(rid[:32]), [f.buffer for f in frames[1:]])
            return
        node, label = known
        if self.keys is not None and not self._authentic(frames[0], rid, node, nic, control):
            self._reject(nic, label, "identity_mismatch",
                         f"routing id {rid!r} on a connection authenticated as node {self._user_id(frames[0])}")
            return
        # a marker counts only on a peer's bulk pipe into a loopback NIC (the sender is on this
        # host); anywhere else it is a malformed header
        self._take_in(nic, node, label, [f.buffer for f in frames[1:]],
                      not control and not label.endswith("/c") and nic in self._loopback)

    def _take_in(self, nic: str, src: int, label: str, frames: list[Any], marked: bool = True) -> None:
        """Hand a received message from node ``src`` to ``_ingest``; ``marked``: it may carry a
        shared-memory marker (a bulk message into a loopback NIC, or a datagram), resolved first."""
        lease: Releasable | None = None
        if marked and self._shm_in is not None and Inbound.marked(frames):
            try:
                frames, lease = self._shm_in.take(src, frames)
            except ProtocolError as exc:
                self._reject(nic, label, exc.reason, exc.detail)
                return
        self._ingest(nic, src, label, frames, lease)

    def _reject_datagram(self, nic: str, label: str, reason: str, detail: str) -> None:
        self._reject(nic, label, reason, detail, per_peer=False)

    @property
    def local_sent(self) -> int:
        """Messages this endpoint sent as datagrams (:mod:`p2psync.transport.local`)."""
        return self.datagrams.sent

    @property
    def local_received(self) -> int:
        """Messages it took as datagrams."""
        return self.datagrams.received

    def _authentic(self, frame: "zmq.Frame", rid: bytes, node: int, nic: str, control: bool) -> bool:
        """Does the connection a message came on belong to ``node``, whose routing id it bears?
        Incoming (ZAP gave it a user id): that user id must be ``node``, whatever the routing id.
        Without one it must be one of our own connections: we named it, and CURVE proved the
        server's key."""
        uid = self._user_id(frame)
        if uid is not None:
            return uid == str(node)
        return rid in self._own_rids.get((nic, control), ())

    @staticmethod
    def _user_id(frame: "zmq.Frame") -> str | None:
        try:
            return cast(str, frame.get("User-Id"))
        except zmq.ZMQError:
            return None

    def _transmit(self, peer: int, route: Route, frames: list[Any], *, bulk: bool = False,
                  unordered: bool = False) -> None:
        """Send on our own outgoing pipe to ``peer``: control on the control link; bulk to a peer
        on this host through shared memory when this endpoint sends so, else on the bulk link."""
        if not bulk:
            self._control_link.send(peer, route, frames)
        elif self._shm_link is not None and (peer, route.local_nic) in self._on_host:
            self._shm_link.send(peer, route, frames, unordered)
        else:
            self._bulk_link.send(peer, route, frames, unordered)

    def _rearm(self, nic: str, sock: "zmq.Socket[Any]") -> None:
        """After a send on ``nic``'s socket: the descriptor is edge-triggered and the send may
        have consumed the readable edge, so drain when input is waiting. Only NIC sockets
        receive (a control socket's pipes are all outgoing: nobody sends on them)."""
        if not sock.closed and _get_int(sock, _EVENTS) & _POLLIN and self._loop is not None:
            self._loop.call_soon(self._drain, nic, False)

    @property
    def shm_frames(self) -> int:
        """Frames this endpoint sent through shared memory."""
        return self._shm_out.frames if self._shm_out is not None else 0

    @property
    def shm_filled(self) -> int:
        """Of those, the :class:`~p2psync.wire.fill.Fill` frames computed straight into it."""
        return self._shm_out.filled if self._shm_out is not None else 0

    async def _close_io(self) -> None:
        if self._guard_handle is not None:
            self._guard_handle.cancel()
            self._guard_handle = None
        if self._loop is not None:
            for fd in self._fds:
                self._loop.remove_reader(fd)
        self._fds.clear()
        for socks, mons in ((self._socks, self._monitors), (self._ctl_socks, self._ctl_monitors)):
            for nic, s in socks.items():
                if nic in mons:
                    s.disable_monitor()
                    mons[nic].close(linger=0)
            mons.clear()
        for s in [*self._ctl_socks.values(), *self._socks.values()]:
            s.close(linger=self.options.close_linger_ms)
        self._ctl_socks.clear()
        self._socks.clear()
        if self._zap is not None:
            self._zap.close()
            self._zap = None
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        for shm in (self._shm_out, self._shm_in):
            if shm is not None:
                shm.close()
        self.datagrams.close()

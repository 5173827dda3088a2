"""The transport interface shared by the ZeroMQ endpoint and the in-memory transport.

A :class:`Transport` belongs to one node of a topology. ``send`` encodes a message with the wire
layer and hands it to the subclass, retrying while the peer is not (yet) reachable until the
timeout runs out; ``recv``/``recv_any`` wait on the mailbox.

Control messages (``rpc``, ``reply``, ``event``, ``hb``) to a node that is not adjacent are
relayed hop by hop along shortest paths of the topology **over live nodes only**: the distance
cache is computed on the graph without the nodes marked dead (:meth:`Transport.mark_dead`) and
is dropped whenever that set changes (``mark_dead`` / :meth:`Transport.revive`). A relay first
tries every candidate next hop once without waiting (a neighbour whose connection is gone is
skipped at once), then shares the budget among them. Callers that need end-to-end delivery
(the RPC client) retry over the next candidate path with :meth:`Transport.send_control`
(``attempt`` rotates the first hop). Tensors (``data``) go to adjacent peers, and to others
only when the sender asks (``send(..., relay=True)``: a collective over a group whose members
are not adjacent): then hop by hop on the bulk channel, flow-controlled at every hop, within
a byte budget at every relay (:mod:`p2psync.transport.relay`).

Incoming frames go through the sans-IO ingest pipeline (:mod:`p2psync.transport.ingest`:
decode, authenticate, admit, route), whose decision :meth:`Transport._ingest` acts on: it
delivers, forwards, or rejects and counts bad messages (logged once per peer and reason, in
bounded memory; a sender label the sender chose, such as an unknown routing id, once per NIC
and reason) and never raises. Every header
carries the run id and the sender's incarnation: traffic of another run (``wrong_run``) or of
an older incarnation of a node than the one the membership registered (``stale_incarnation``,
:attr:`Transport.peer_incarnations`) is rejected, counted in :attr:`Transport.rejected` and never
delivered nor relayed. Any accepted message is proof of life of its origin (and of the
neighbour that handed it over, unless that neighbour runs a newer, unregistered incarnation:
:mod:`p2psync.transport.ingest`): :attr:`Transport.last_arrival` keeps the monotonic arrival
time per node, which the failure detectors read (one dict store per message).

Control never waits behind bulk: ``send`` marks ``data`` messages as *bulk*
and everything else as control. Bulk sends take bytes from the peer's flow-control window
(:mod:`p2psync.transport.flow`, ``window_bytes``, default 8 MiB) before they enter the shaper or
the socket; control sends take none, skip the shaper's bulk queue and go out on the endpoint's
control channel (see :mod:`p2psync.transport.zmq_endpoint`). The mailbox has byte budgets per
peer, a control cap, a TTL and retired tags (:mod:`p2psync.transport.mailbox`); what it drops
is counted by reason in :attr:`Transport.rejected` like every other rejected message.

Keyed clusters: with ``relay_keys`` (this node's key shared with each other node,
:mod:`p2psync.transport.keys`) a control message this node relays for itself carries its
digest and counter (:mod:`p2psync.transport.relay_auth`); a relayed message without them is
dropped at the first hop, one whose digest does not verify at its destination
(``relay_auth``), and a replay (``relay_replay``); relayed data likewise. Only a message whose origin is proven
(received from it, or relayed and verified here) is proof of life of its origin or revives a
node declared dead under a newer incarnation: a relay never records what an unverifiable
message claims about its origin. Untrusted values (:mod:`.finite_checks`): :meth:`Transport.check_finite` rejects a
tensor piece holding NaN or infinity, counts it against the node that sent it (the neighbour,
or a relayed piece's origin: its destination checks it, relays pass it on unscanned)
(:attr:`Transport.offences`) and tells :attr:`Transport.offence_listeners` (the membership
client reports it to the coordinator; see :mod:`p2psync.coordinator.membership_state` for when a
node is excluded). A node never sends such a piece itself: :meth:`Transport.send` raises
:class:`~p2psync.errors.Diverged` instead (its training diverged; nobody else is blamed).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable, Collection, Coroutine, Iterable, Mapping, Sequence

import numpy as np

from p2psync import clock
from p2psync.errors import NonFinitePiece, PeerFailure, PeerUnreachable, ProtocolError, TransportError
from p2psync.tasks import resolve
from p2psync.topology import Route, Topology
from p2psync.transport.finite import all_finite, diverged
from p2psync.transport.finite_checks import FiniteChecks
from p2psync.transport.flow import ByteWindow
from p2psync.transport.incarnation import clock_incarnation
from p2psync.transport.ingest import Forward, Ingest, Reject, Revive
from p2psync.transport.lending import Lending, Releasable, own
from p2psync.transport.log_once import LogOnce
from p2psync.transport.mailbox import DEFAULT_BUDGET_BYTES, DEFAULT_TTL, Mailbox, Scope
from p2psync.transport.relay import Relay
from p2psync.transport.relay_auth import OriginAuth
from p2psync.transport.router import Router
from p2psync.transport.shaping import Shaper
from p2psync.wire import (DEFAULT_LIMITS, RELAY_KINDS, Message, MessageKind, WireLimits, encode, frames_len,
                          placed)

log = logging.getLogger("p2psync.transport")

DEFAULT_TIMEOUT = 30.0
DEFAULT_WINDOW_BYTES = 8 << 20
#: relayed data a relay holds at most until next hops take it (all destinations together)
DEFAULT_RELAY_BUDGET_BYTES = DEFAULT_BUDGET_BYTES


@dataclass
class NicStats:
    """Traffic counters of one NIC (``Transport.nic_stats[nic]``); the session logs the bytes
    per step (``NodeRuntime.nic_bytes``)."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    msgs_sent: int = 0
    msgs_recv: int = 0
    rejected: int = 0


async def _woken(waiters: list[asyncio.Future[None]], timeout: float) -> None:
    """Wait until :func:`wake` wakes ``waiters`` (a future joins them, and leaves them after),
    at most ``timeout`` seconds (at least a millisecond: a wait shorter than the clock's
    resolution ends at once)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    waiters.append(fut)
    timer = loop.call_later(max(timeout, 0.001), resolve, fut)
    try:
        await fut
    finally:
        timer.cancel()
        if fut in waiters:
            waiters.remove(fut)


def wake(waiters: Iterable[asyncio.Future[None]]) -> None:
    """Resolve every future of ``waiters`` not done yet (the waits they stand for look again)."""
    for fut in waiters:
        resolve(fut)


class NotReady(Exception):
    """Raised by ``_transmit`` when the peer cannot take the message yet (retry later)."""


class Transport(ABC):
    """One node's messaging endpoint: tagged messages to and from its peers, relaying, flow
    control, strict ingest and the mailbox (see the module docstring).

    Subclasses (:class:`~p2psync.transport.zmq_endpoint.ZmqEndpoint`,
    :class:`~p2psync.transport.memory.MemoryTransport`) implement :meth:`start`,
    ``_transmit`` and ``_close_io``, and feed received frames to ``_ingest``. Every layer above
    uses it, e.g. regroup.py: ``await ctx.transport.send(caller, tag, [vec], kind="data",
    step=max(0, at), timeout=ctx.peer_timeout)`` and ``msg = await ctx.transport.recv(tag,
    timeout=ctx.peer_timeout)``.

    It is composed of parts that each take what they need in their constructor: the ingest
    pipeline (:class:`~p2psync.transport.ingest.Ingest`), the :attr:`router` (live nodes and
    paths), the :attr:`relaying` (:class:`~p2psync.transport.relay.Relay`, which sends through
    this transport's send path), the :attr:`finite_checks`
    (:class:`~p2psync.transport.finite_checks.FiniteChecks`), the :attr:`mailbox`, the flow
    windows and :attr:`lending`.
    """

    def __init__(self, *, topology: Topology, node_id: int, limits: WireLimits = DEFAULT_LIMITS,
                 default_timeout: float = DEFAULT_TIMEOUT, max_pending: int = 65536,
                 mailbox_budget_bytes: int = DEFAULT_BUDGET_BYTES, mailbox_ttl: float | None = DEFAULT_TTL,
                 max_control_pending: int = 4096, window_bytes: int = DEFAULT_WINDOW_BYTES,
                 relay_keys: Mapping[int, bytes] | None = None, shaper: Shaper | None = None,
                 relay_budget_bytes: int = DEFAULT_RELAY_BUDGET_BYTES) -> None:
        """``shaper``: link shaping on the send path (:mod:`p2psync.transport.shaping`); None is
        the real network. The transport owns it and closes it on :meth:`close`.
        ``relay_budget_bytes``: relayed data this node holds for others at most while next hops
        are busy (:mod:`p2psync.transport.relay`)."""
        self.topology = topology
        #: keyed cluster: the key this node shares with each other node (relayed messages)
        self.relay_keys = dict(relay_keys) if relay_keys is not None else None
        self.node_id = node_id
        self.node = topology.node(node_id)
        self.limits = limits
        self.default_timeout = default_timeout
        self.mailbox = Mailbox(max_pending=max_pending, budget_bytes=mailbox_budget_bytes, ttl=mailbox_ttl,
                               max_control_pending=max_control_pending, on_drop=self._mailbox_drop)
        if window_bytes < 1:
            raise ValueError("window_bytes must be >= 1")
        self.window_bytes = window_bytes
        self._windows: dict[int, ByteWindow] = {}
        self.nic_stats: dict[str, NicStats] = {n.name: NicStats() for n in self.node.nics}
        self.rejected: Counter[str] = Counter()
        #: (sender, reason) pairs already logged (bounded; see transport/log_once.py)
        self._log_once = LogOnce()
        self._closed = False
        #: live nodes and the paths between them
        self.router = Router(topology, node_id)
        #: what this node relays for itself and for others
        self.relaying = Relay(node_id=node_id, topology=topology, router=self.router, limits=limits,
                              default_timeout=default_timeout, budget_bytes=relay_budget_bytes,
                              keys=self.relay_keys, route=self.route, send_direct=self._send_direct,
                              send_now=self._send_now, link_up=self._link_up,
                              shaped=lambda: self.shaper is not None)
        #: NaN / infinity checks of received tensor pieces, and offences
        self.finite_checks = FiniteChecks(node_id, mailbox=self.mailbox, count=self._count_offence)
        #: who borrows frames received through shared memory (:meth:`lend`)
        self.lending = Lending()
        #: link shaping on the send path (see transport/shaping.py); None = real network
        self.shaper: Shaper | None = shaper
        #: run id stamped on every header and required on every incoming one (set before start)
        self.run_id = 0
        #: this process's incarnation: its start time in ns; a node runtime with a run folder
        #: replaces it before start with one larger than every earlier process of this node
        #: took there, whatever the wall clock did (transport/incarnation.py)
        self.incarnation = clock_incarnation()
        #: registered incarnation per node (set by the membership); older ones are rejected
        self.peer_incarnations: dict[int, int] = {}
        #: node -> monotonic time its latest accepted message arrived (proof of life)
        self.last_arrival: dict[int, float] = {}
        #: shaped sends waiting for a connection (:meth:`_links_changed` wakes them)
        self._link_waiters: list[asyncio.Future[None]] = []
        #: :meth:`wait_gone` calls waiting for peers to leave (:meth:`_peers_changed` wakes them)
        self._gone_waiters: list[asyncio.Future[None]] = []
        #: peer -> the :meth:`wait_gone` calls waiting for it now
        self._gone_watched: collections.Counter[int] = collections.Counter()
        self._pipeline = Ingest(node_id=node_id, nodes=frozenset(topology.ids), limits=limits,
                                incarnations=self.peer_incarnations, dead=self.router.dead,
                                auth=OriginAuth(node_id, self.relay_keys) if self.relay_keys is not None else None)

    # -- lifecycle -----------------------------------------------------------------------

    @abstractmethod
    async def start(self) -> None:
        """Bind / register this node so peers can reach it (before any send). Called from
        ``NodeRuntime.rendezvous``: ``await self.transport.start()``."""

    async def close(self) -> None:
        """Close in the one safe order: let relayed control messages go out, flush and close the
        shaper, fail every waiter (the transport is closed from here on), then release the
        subclass's IO (:meth:`_close_io`). Idempotent."""
        if not self._closed:
            await self.relaying.drain()
            await self._close_shaper()
            self._closing()
        await self._close_io()

    @abstractmethod
    async def _close_io(self) -> None:
        """Release sockets / registrations (after :meth:`close` failed every waiter); must be
        idempotent and must not raise for a transport that never started."""

    async def __aenter__(self) -> "Transport":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- routing -------------------------------------------------------------------------

    @property
    def peers(self) -> list[int]:
        """Nodes this one reaches directly."""
        return self.topology.neighbors(self.node_id)

    def route(self, peer: int, nic: str | None = None) -> Route:
        """The direct route to adjacent ``peer`` (over NIC ``nic`` when given, else the first);
        TransportError when there is none."""
        routes = self.topology.routes(self.node_id, peer)
        if not routes:
            raise TransportError(f"node {self.node_id} shares no network with node {peer}")
        if nic is None:
            return routes[0]
        for r in routes:
            if r.local_nic == nic:
                return r
        raise TransportError(f"node {self.node_id} cannot reach node {peer} over NIC {nic!r}")

    @property
    def dead(self) -> set[int]:
        """Nodes marked dead (:meth:`mark_dead`; read it, change it through the methods)."""
        return self.router.dead

    def mark_dead(self, peer: int, incarnation: int | None = None) -> None:
        """``peer``'s process ``incarnation`` (None: the registered one,
        :attr:`peer_incarnations`) failed: sends to it fail at once (also those already
        retrying), and control traffic is routed around it (routes are recomputed over the
        live nodes). Unless this node has already admitted a proven message of a newer process
        of ``peer`` than that one (:meth:`Ingest.newer_life`, remembered whenever it came):
        then ``peer`` is revived at once under the newer incarnation (or the registered one,
        if newer still), as a message of it arriving after this call would revive it
        (:meth:`_revived`): the new process relays, and the nodes behind it stay reachable."""
        inc = self._pipeline.newer_life(peer, incarnation)
        if inc is not None:
            self._revived(Revive(peer, max(inc, self.peer_incarnations.get(peer, inc))))
            return
        self.router.mark_dead(peer)
        self._links_changed()  # (a send waiting for its connection fails now)

    def newer_life(self, peer: int, incarnation: int | None = None) -> int | None:
        """The newest incarnation of ``peer`` that an admitted, proven message carried, when it
        is newer than ``incarnation`` (None: the registered one, :attr:`peer_incarnations`): a
        process of ``peer`` started after that one was heard (it is gone); else None
        (:meth:`Ingest.newer_life`: remembered whenever it came, whatever views said since)."""
        return self._pipeline.newer_life(peer, incarnation)

    def register_incarnation(self, peer: int, incarnation: int) -> None:
        """``peer``'s registered process is ``incarnation`` unless a newer one is registered
        already (:attr:`peer_incarnations` never goes down: a newer process registered since
        means the one named here is gone, and its messages stay rejected)."""
        known = self.peer_incarnations
        known[peer] = max(incarnation, known.get(peer, incarnation))

    def revive(self, peer: int) -> None:
        """``peer`` is a member again (a new view): route through it again."""
        self.router.revive(peer)

    def next_hops(self, dst: int, *, exclude: int | None = None, rotate: int = 0,
                  to_dead: bool = False, shortest: bool = False) -> list[int]:
        """Neighbours to relay through towards ``dst`` (:func:`p2psync.topology.paths.next_hops`)."""
        return self.router.next_hops(dst, exclude=exclude, rotate=rotate, to_dead=to_dead, shortest=shortest)

    def _link_up(self, peer: int) -> bool:
        """Whether this node's connection to adjacent ``peer`` is up as far as it knows (a
        transport that cannot tell says yes): relayed data prefers such a next hop."""
        return self._connected(peer, True)

    def _links_changed(self) -> None:
        """A connection came up (or a node was marked dead): the sends waiting for a
        connection look again (:meth:`_shape_when_connected`). Subclasses call it."""
        waiters, self._link_waiters = self._link_waiters, []
        wake(waiters)

    def _peers_changed(self) -> None:
        """A connection to a peer went down (it exited, or its link broke): the
        :meth:`wait_gone` calls look again. Subclasses call it."""
        waiters, self._gone_waiters = self._gone_waiters, []
        wake(waiters)

    def gone(self, peer: int) -> bool:
        """Whether both this node's connections to adjacent ``peer`` are down (it exited, or
        its link broke), as far as this node knows (a transport that cannot tell says no)."""
        return not self._connected(peer, True) and not self._connected(peer, False)

    def half_down(self, peer: int) -> bool:
        """Whether either of this node's connections to adjacent ``peer`` is down (a
        reconnection may be under way: its leaving cannot be seen)."""
        return not (self._connected(peer, True) and self._connected(peer, False))

    async def wait_gone(self, peers: Collection[int], timeout: float) -> bool:
        """Wait until every node of ``peers`` is :meth:`gone`, at most ``timeout`` seconds;
        whether they all are."""
        end = clock.now() + timeout
        watched = self._gone_watched
        for p in peers:
            watched[p] += 1
        try:
            while not all(self.gone(p) for p in peers):
                left = end - clock.now()
                if left <= 0:
                    return False
                await _woken(self._gone_waiters, left)
            return True
        finally:
            for p in peers:
                watched[p] -= 1
                if not watched[p]:
                    del watched[p]

    def watches_gone(self, peer: int) -> bool:
        """Whether a :meth:`wait_gone` call waits for ``peer`` now (a medium that sees a node
        leave wakes only those)."""
        return peer in self._gone_watched

    def _unreachable(self, peer: int, route: Route, budget: float) -> PeerUnreachable:
        """What a send to adjacent ``peer`` that got nowhere within ``budget`` raises."""
        return PeerUnreachable(f"node {self.node_id}: node {peer} unreachable over NIC {route.local_nic} "
                               f"for {budget:g}s", peers=(peer,))

    def _connected(self, peer: int, bulk: bool) -> bool:
        """Whether this node's connection to adjacent ``peer`` on the bulk (else the control)
        channel is up as far as it knows (a transport that cannot tell says yes): a shaped
        send waits for it before it enters the shaper (:meth:`_shape_when_connected`)."""
        return True

    def link_state(self, peer: int) -> str:
        """For an error message about ``peer``: whether this node's control and bulk
        connections to it are up (adjacent peers only), and the messages this node rejected
        so far, by reason (a peer whose every message is dropped on arrival looks silent)."""
        if not self.topology.routes(self.node_id, peer):
            links = f"node {peer} is not adjacent"
        else:
            links = (f"control link to node {peer} {'up' if self._connected(peer, False) else 'down'}, "
                     f"bulk link {'up' if self._connected(peer, True) else 'down'}")
        dropped = ", ".join(f"{r} {n}" for r, n in sorted(self.rejected.items())) or "none"
        return f"{links}; messages rejected here: {dropped}"

    @property
    def relayed(self) -> int:
        """Messages this node passed on for others."""
        return self.relaying.relayed

    # -- send / receive ------------------------------------------------------------------

    @abstractmethod
    def _transmit(self, peer: int, route: Route, frames: list[Any], *, bulk: bool = False,
                  unordered: bool = False) -> None:
        """Hand frames to the peer (``bulk``: on the data channel, else the control channel)
        without waiting; raise :class:`NotReady` when it should be retried. ``unordered``: the
        message may overtake, or be overtaken by, others to the same peer (see :meth:`send`)."""

    async def send(self, peer: int, tag: str, arrays: Sequence[Any] = (), *, kind: MessageKind = "data",
                   step: int = 0, meta: Mapping[str, Any] | None = None,
                   codecs: Sequence[str] | None = None, nic: str | None = None,
                   timeout: float | None = None, checked: bool = False, unordered: bool = False,
                   relay: bool = False, to_dead: bool = False, any_path: bool = False) -> None:
        """Send one message; retries until ``timeout`` while the peer is unreachable.

        Arrays are sent without copying, and this returns once the message is queued, not
        transmitted: ZeroMQ's IO thread may read the arrays later, so never modify an array
        after sending it (send a copy if you must reuse the buffer).

        ``checked``: the caller has verified that every floating-point array is finite (e.g. a
        piece it received, which this transport checked on arrival, or one it just checked
        itself), so the scan that raises :class:`~p2psync.errors.Diverged` is skipped.

        ``unordered`` (``data`` only): nothing relies on this message's order relative to other
        messages to ``peer`` (e.g. its tag is used once), so it may take a faster path that
        does not keep it: a datagram to a peer on this host (:mod:`p2psync.transport.local`).
        Otherwise messages between two nodes arrive in the order they were sent.

        ``relay`` (``data`` only): ``peer`` need not be adjacent; when it is not, the message
        goes hop by hop through live nodes (:mod:`p2psync.transport.relay`; ``nic`` is then
        ignored), in no particular order relative to other messages to ``peer``. PeerFailure
        when no live path leads there. Without it a data send to a node that is not adjacent
        is a TransportError.

        ``to_dead`` (control kinds only): send it even when ``peer`` is marked dead, as a reply
        is (a node cut off from the run asks the nodes it marked dead itself what the run's view
        is now); only to an adjacent peer: one that is not is reached through live relays only.
        ``any_path`` (control kinds only): reach ``peer`` by any way, even when it and every
        node between are marked dead here (:meth:`Relay.control
        <p2psync.transport.relay.Relay.control>`): a new coordinator's proof of life of the
        nodes it would remove, which it may have judged on the wrong side of a healed split.
        """
        if self._closed:
            raise TransportError("transport is closed")
        if kind == "data" and not checked and not all(all_finite(a) for a in arrays):
            raise diverged(self.node_id, tag)
        budget = self.default_timeout if timeout is None else timeout
        if kind in RELAY_KINDS and nic is None and peer != self.node_id \
                and not self.topology.routes(self.node_id, peer) and self.topology.has(peer):
            # (a reply goes back even to a node marked dead: it asked, so it lives, and it may
            # be a removed node that must learn it was fenced)
            await self.relaying.control(peer, dict(kind=kind, tag=tag, step=step, arrays=arrays, codecs=codecs,
                                                   meta=meta, run=self.run_id, inc=self.incarnation), budget,
                                        any_path=any_path)
            return
        if relay and kind == "data" and peer != self.node_id and not self.topology.routes(self.node_id, peer) \
                and self.topology.has(peer):
            await self.relaying.data(peer, dict(kind=kind, tag=tag, step=step, arrays=arrays, codecs=codecs,
                                                meta=meta, run=self.run_id, inc=self.incarnation), budget)
            return
        frames = encode(kind=kind, src=self.node_id, tag=tag, step=step, arrays=arrays, codecs=codecs, meta=meta,
                        run=self.run_id, inc=self.incarnation)
        route, bulk = self.route(peer, nic), kind not in RELAY_KINDS
        if bulk and self.shaper is None and self._send_now(peer, route, frames, unordered):
            return  # the common case: it went at once, no coroutine below this one
        await self._send_direct(peer, route, budget, frames, bulk=bulk, unordered=unordered,
                                to_dead=kind == "reply" or ((to_dead or any_path) and not bulk))

    async def send_control(self, peer: int, tag: str, *, kind: MessageKind, meta: Mapping[str, Any] | None = None,
                           arrays: Sequence[Any] = (), timeout: float | None = None,
                           attempt: int = 0, to_dead: bool = False, any_path: bool = False) -> None:
        """Send a control message; when ``peer`` is not adjacent, attempt ``k`` relays through
        the k-th candidate first hop first (so a retry goes around a relay that died).
        ``to_dead``: an adjacent ``peer`` gets it even when marked dead; ``any_path``: any
        ``peer`` does, by any way (see :meth:`send`)."""
        if kind not in RELAY_KINDS:
            raise ValueError(f"{kind!r} is not a control kind")
        if attempt == 0 or peer == self.node_id or self.topology.routes(self.node_id, peer) \
                or not self.topology.has(peer):
            await self.send(peer, tag, arrays, kind=kind, meta=meta, timeout=timeout, to_dead=to_dead,
                            any_path=any_path)
            return
        if self._closed:
            raise TransportError("transport is closed")
        budget = self.default_timeout if timeout is None else timeout
        await self.relaying.control(peer, dict(kind=kind, tag=tag, step=0, arrays=arrays, codecs=None, meta=meta,
                                               run=self.run_id, inc=self.incarnation), budget, rotate=attempt,
                                    any_path=any_path)

    def window(self, peer: int) -> ByteWindow:
        """The flow-control window of bulk bytes to ``peer``."""
        w = self._windows.get(peer)
        if w is None:
            w = self._windows[peer] = ByteWindow(self.window_bytes)
        return w

    async def _send_direct(self, peer: int, route: Route, budget: float, frames: list[Any], *,
                           bulk: bool = False, unordered: bool = False, to_dead: bool = False) -> None:
        """Send to an adjacent peer. ``bulk`` (tensors) waits for room in the peer's window
        (backpressure, bounded by ``budget``); control never waits for bulk. ``to_dead``: send
        even when the peer is marked dead (replies)."""
        if not bulk:
            await self._shape_and_deliver(peer, route, budget, frames, False, to_dead=to_dead)
            return
        nbytes = frames_len(frames)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        win = self.window(peer)
        try:
            held = win.try_acquire(nbytes)
            if held is None:
                held = await win.acquire(nbytes, budget)
        except (asyncio.TimeoutError, TimeoutError):
            raise PeerUnreachable(f"node {self.node_id}: node {peer} took no more bulk bytes for "
                                  f"{budget:g}s (flow-control window of {win.capacity} bytes full)",
                                  peers=(peer,)) from None
        try:
            await self._shape_and_deliver(peer, route, max(0.0, deadline - loop.time()), frames, True, unordered)
        finally:
            win.release(held)

    def _send_now(self, peer: int, route: Route, frames: list[Any], unordered: bool = False) -> bool:
        """Hand bulk frames to adjacent ``peer`` at once if its flow-control window and its
        connection take them: whether they went (False: it has to wait, :meth:`_send_direct`).
        PeerFailure when ``peer`` is marked dead."""
        win, nbytes = self.window(peer), frames_len(frames)
        held = win.try_acquire(nbytes)
        if held is None:
            return False
        try:
            return self._attempt(peer, route, frames, nbytes, True, unordered)
        finally:
            win.release(held)

    def _shape_and_deliver(self, peer: int, route: Route, budget: float, frames: list[Any],
                           bulk: bool, unordered: bool = False, to_dead: bool = False) -> Awaitable[None]:
        """The delivery to await: straight to ``_deliver``, or through the shaper. A plain
        function returning the awaitable, not a coroutine: one frame less on every send."""
        if self.shaper is None:
            return self._deliver(peer, route, budget, frames, bulk=bulk, unordered=unordered, to_dead=to_dead)
        # a shaped message leaves later: capture its bytes now, as a real NIC would (a Fill's
        # inputs, such as a borrowed piece, are given back once this send returns)
        frames = [bytes(f) if isinstance(f, memoryview) else f for f in placed(frames)]
        if not self._connected(peer, bulk):
            return self._shape_when_connected(peer, route, budget, frames, bulk, unordered, to_dead)
        nbytes = frames_len(frames)
        return self.shaper.submit(
            peer, nbytes, lambda: self._attempt(peer, route, frames, nbytes, bulk, unordered, to_dead),
            lambda: self._retry(peer, route, budget, frames, nbytes, bulk, unordered, to_dead),
            control=not bulk, nic=route.local_nic)

    async def _shape_when_connected(self, peer: int, route: Route, budget: float, frames: list[Any], bulk: bool,
                                    unordered: bool, to_dead: bool) -> None:
        """A shaped send while this node's connection to ``peer`` is down: it enters the shaper
        once the connection is up, within ``budget`` (then with what is left of it), else fails
        as an unshaped send would (PeerUnreachable; PeerFailure when ``peer`` is marked dead;
        TransportError once this transport closes).
        Accepting it into the shaper at once would report it sent, to be dropped on delivery:
        a relay whose first hop's link is cut would never try its other next hops. A send to
        the same peer made after the connection came up, before this one resumed, may go out
        before it (as with an unshaped send's retries, :meth:`_deliver`)."""
        deadline = clock.now() + budget
        while True:
            if self._closed:
                raise TransportError(f"node {self.node_id}: transport closed")
            if self._connected(peer, bulk):
                break
            if peer in self.router.dead and not to_dead:
                raise PeerFailure(f"node {self.node_id}: node {peer} has failed", peers=(peer,))
            left = deadline - clock.now()
            if left <= 0:
                raise self._unreachable(peer, route, budget)
            await _woken(self._link_waiters, left)
        await self._shape_and_deliver(peer, route, max(0.0, deadline - clock.now()), frames, bulk, unordered,
                                      to_dead)

    def _attempt(self, peer: int, route: Route, frames: list[Any], nbytes: int, bulk: bool,
                 unordered: bool = False, to_dead: bool = False) -> bool:
        """One try at handing the frames (``nbytes`` in all) over: whether they went (False:
        retry later). A peer marked dead fails at once, unless ``to_dead``."""
        if peer in self.router.dead and not to_dead:
            raise PeerFailure(f"node {self.node_id}: node {peer} has failed", peers=(peer,))
        try:
            self._transmit(peer, route, frames, bulk=bulk, unordered=unordered)
        except NotReady:
            return False
        st = self.nic_stats[route.local_nic]
        st.bytes_sent += nbytes
        st.msgs_sent += 1
        return True

    async def _deliver(self, peer: int, route: Route, budget: float, frames: list[Any], *,
                       bulk: bool = False, unordered: bool = False, to_dead: bool = False) -> None:
        nbytes = frames_len(frames)
        if not self._attempt(peer, route, frames, nbytes, bulk, unordered, to_dead):
            await self._retry(peer, route, budget, frames, nbytes, bulk, unordered, to_dead)

    async def _retry(self, peer: int, route: Route, budget: float, frames: list[Any], nbytes: int, bulk: bool,
                     unordered: bool, to_dead: bool) -> None:
        """After a try that failed: try again, pausing longer each time (0.5 ms, doubling up to
        50 ms), until it goes or ``budget`` seconds from now have passed (PeerUnreachable)."""
        deadline = clock.now() + budget
        delay = 0.0005
        while True:
            if clock.now() >= deadline:
                raise self._unreachable(peer, route, budget)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
            if self._attempt(peer, route, frames, nbytes, bulk, unordered, to_dead):
                return

    def recv(self, tag: str, timeout: float | None = None, *,
             peer: int | None = None) -> Coroutine[Any, Any, Message]:
        """The next message with ``tag``; raises PeerTimeout after ``timeout`` seconds
        (None: the transport's ``default_timeout``, never "forever": use :meth:`listen`).
        ``peer``: the node it is expected from, so that ``Scope.abort(exc, peer=...)`` can
        fail it. (The mailbox's coroutine itself: one frame less on every receive.)"""
        return self.mailbox.get(tag, self.default_timeout if timeout is None else timeout, peer=peer)

    def retire(self, tag: str) -> None:
        """The receive of exactly ``tag`` is over (answered or given up): a message with it that
        is queued now, or arrives later with nobody waiting, is dropped (reason ``retired``)."""
        self.mailbox.retire(tag, exact=True)

    def scope(self, *roots: str) -> Scope:
        """A :class:`~p2psync.transport.mailbox.Scope` owning the receives under ``roots`` (tag
        prefixes) begun from now on: the handle an operation's owner aborts or cancels."""
        return self.mailbox.scope(*roots)

    def listen(self, tag: str) -> Coroutine[Any, Any, Message]:
        """The next message with ``tag``, with no time limit: for the receive loops of servers
        (RPC requests, view events, gradients from whichever peer sends next), which must stay
        up however long their peers are quiet. Raises TransportError once the transport closes."""
        return self.mailbox.get(tag, None)

    def recv_nowait(self, tag: str) -> Message | None:
        """A message with this tag that has already arrived, or None."""
        return self.mailbox.get_nowait(tag)

    def recv_any(self, prefix: str, timeout: float | None = None) -> Coroutine[Any, Any, Message]:
        """The oldest message whose tag starts with ``prefix``; PeerTimeout after ``timeout``
        seconds (None: ``default_timeout``)."""
        return self.mailbox.get_prefix(prefix, self.default_timeout if timeout is None else timeout)

    # -- ingest --------------------------------------------------------------------------

    def _count_rejected(self, nic: str, who: str, reason: str) -> str | None:
        """Count one rejection for ``reason`` (and against ``nic``); the log note when this is
        the first of (``who``, ``reason``), else None."""
        self.rejected[reason] += 1
        if nic in self.nic_stats:
            self.nic_stats[nic].rejected += 1
        return self._log_once.check(who, reason)

    def _count_offence(self, peer: int, reason: str, detail: str) -> None:
        self._reject("", str(peer), reason, detail)

    def _mailbox_drop(self, msg: Message, reason: str) -> None:
        """The mailbox dropped a queued or arriving message (budget, expiry, retired tag); a
        borrowed one gives its shared memory back (nobody will read it)."""
        msg.release()
        note = self._count_rejected(msg.nic or "", str(msg.src), reason)
        if note is not None:
            log.info("node %d: mailbox dropped message %r from node %d: %s (logged once per "
                     "peer and reason)%s", self.node_id, msg.tag, msg.src, reason, note)

    def _reject(self, nic: str, peer: str, reason: str, detail: str, *, per_peer: bool = True) -> None:
        """Count a rejected message (or handshake) and log the first of each (``peer``,
        ``reason``); ``per_peer=False`` when the sender chose ``peer`` (an unknown routing id or
        key): logged once per (NIC, reason) instead, every one still counted."""
        note = self._count_rejected(nic, peer if per_peer else f"NIC {nic}", reason)
        if note is not None:
            log.warning("node %d NIC %s: rejected message from %s: %s %s%s%s", self.node_id, nic, peer, reason,
                        detail, "" if per_peer else " (logged once per NIC and reason; every one is counted)",
                        note)

    def _ingest(self, nic: str, peer_id: int | None, peer_label: str, frames: Sequence[Any],
                lease: Releasable | None = None) -> None:
        """Act on the ingest pipeline's decision for one received message (:mod:`.ingest`):
        record what it proves alive, revive a node it proves restarted, then deliver, forward or
        count it rejected; never raises. ``lease``: some frames view memory to give back (shared
        memory): lent to a borrower, else copied (:meth:`lend`)."""
        st = self.nic_stats[nic]
        st.bytes_recv += frames_len(frames)
        st.msgs_recv += 1
        msg: Message | None = None
        try:
            decision = self._pipeline.admit(frames, peer_id, self.run_id)
            msg = decision.message
            if decision.alive:  # arrival times (:attr:`last_arrival`)
                now = clock.now()
                for node in decision.alive:
                    self.last_arrival[node] = now
            if decision.revive is not None:
                self._revived(decision.revive)
            if isinstance(decision, Reject):
                self._reject(nic, peer_label, decision.reason, decision.detail, per_peer=peer_id is not None)
                if msg is not None:
                    msg.release()
                return
            admitted = decision.message
            admitted.nic = nic
            origin = admitted.header.src
            if peer_id is not None and peer_id != origin:  # a reply to its origin goes back this way first
                self.router.heard(origin, peer_id)
            held, lease = lease, None
            if isinstance(decision, Forward):
                self._pass_on(admitted, decision.came_from, held)
                return
            # for this node: its shared memory lent to a borrower (else copied, :meth:`lend`); a
            # tensor message with NaN or infinity is rejected here unless its consumer checks it
            # (:meth:`defer_finite`)
            if held is not None:
                self.lending.place(admitted, held)
            if admitted.header.kind == "data" and not self.finite_checks.admits(admitted, origin):
                admitted.release()
                return
            self.mailbox.deliver(admitted)
        except ProtocolError as exc:
            self._reject(nic, peer_label, exc.reason, exc.detail)
            if msg is not None:
                msg.release()  # not delivered (e.g. the mailbox is full): nothing reads it
        except Exception as exc:  # defensive: a bug here must not kill the receive loop
            self._reject(nic, peer_label, "internal", repr(exc)[:200])
            if msg is not None:
                msg.release()
        finally:
            if lease is not None:  # not decoded: nothing reads its frames
                lease.release()

    def _revived(self, revive: Revive) -> None:
        """An admitted message proved a restarted node's new incarnation: register it, and the
        node is reachable again (the membership view decides whether it is a member)."""
        self.peer_incarnations[revive.node] = revive.incarnation
        self.revive(revive.node)

    def _pass_on(self, msg: Message, came_from: int, lease: Releasable | None) -> None:
        """Forward a message for another node; what came through shared memory is copied out
        first (the next send may outlive any loan). Its destination checks its values."""
        if lease is not None:
            try:
                own(msg)
            finally:
                lease.release()
        self.relaying.forward(msg, came_from)

    # -- untrusted values ------------------------------------------------------------------

    @property
    def offences(self) -> Counter[int]:
        """Node -> tensor pieces with non-finite values it sent (rejected)."""
        return self.finite_checks.offences

    @property
    def offence_listeners(self) -> list[Callable[[int, str], None]]:
        """Called with (node, reason) for every offence (the membership client reports it)."""
        return self.finite_checks.listeners

    def defer_finite(self, prefix: str) -> contextlib.AbstractContextManager[None]:
        """While open, ``data`` messages whose tag starts with ``prefix`` are delivered without
        the NaN / infinity scan: the consumer (the collectives, which fuse the check with the
        add that reads the piece anyway) promises to call :meth:`check_finite` on every one it
        uses (:meth:`FiniteChecks.defer <p2psync.transport.finite_checks.FiniteChecks.defer>`)."""
        return self.finite_checks.defer(prefix)

    def check_finite(self, src: int, arr: np.ndarray, what: str, *, raise_: bool = True) -> NonFinitePiece | None:
        """If the floating-point array ``arr`` that node ``src`` sent holds NaN or infinity: count
        an offence of ``src`` and raise (or, ``raise_=False``, return) :class:`NonFinitePiece`;
        finite values and other dtypes pass (None)."""
        return self.finite_checks.check(src, arr, what, raise_=raise_)

    def lend(self, prefix: str, depth: int) -> contextlib.AbstractContextManager[None]:
        """While open, ``data`` messages tagged ``prefix`` plus ``depth`` more dot-separated
        parts keep the frames that came through shared memory as views of the sender's ring:
        the consumer calls ``msg.release()`` once it has read them (no copy). What is not
        released when the scope closes is copied and released then
        (:mod:`p2psync.transport.lending`)."""
        return self.lending.scope(prefix, depth)

    # -- stats ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters as plain values: per-NIC :class:`NicStats`, rejections by reason, relayed
        messages and offences per node."""
        return {"nics": {k: asdict(v) for k, v in self.nic_stats.items()},
                "rejected": dict(self.rejected), "relayed": self.relayed,
                "offences": {str(k): v for k, v in sorted(self.offences.items())}}

    async def _close_shaper(self) -> None:
        if self.shaper is not None:
            await self.shaper.close()

    def _closing(self) -> None:
        self._closed = True
        self.relaying.cancel()
        self.mailbox.close(TransportError(f"node {self.node_id}: transport closed"))
        self._links_changed()  # (the sends waiting for a connection fail now)


__all__ = ["DEFAULT_RELAY_BUDGET_BYTES", "DEFAULT_TIMEOUT", "NicStats", "NotReady", "Transport", "all_finite"]

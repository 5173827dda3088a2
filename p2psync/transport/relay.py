"""Relaying messages hop by hop over live nodes.

A :class:`Relay`, held by :class:`~p2psync.transport.base.Transport`, moves control messages
(``rpc``, ``reply``, ``event``, ``hb``) to nodes that are not adjacent: shortest paths over the
nodes not marked dead (:class:`~p2psync.transport.router.Router`), a reply back through the
neighbour its request came from first (:meth:`~p2psync.transport.router.Router.reply_hops`), a
retry over another first hop (``rotate``), forwarding of what passes through this node (owned tasks, drained on close),
and, in a keyed cluster, the origin's digest and counter on what this node relays for itself
(checked at the destination by the ingest pipeline, :mod:`p2psync.transport.relay_auth`). It
hands frames to adjacent nodes only through the callables it is given (the transport's send
path).

**Relayed data.** A ``data`` message whose sender asks for it (``send(..., relay=True)``: the
collectives' transfers between members that are not adjacent) takes the same header route
(``dst``, ``hops``, and in a keyed cluster the origin's digest and a counter of its own data
lane), with what bulk needs instead of what control needs:

* every hop takes a neighbour on a *shortest* live path (never a longer one, so nothing
  wanders), the first whose connection is up (lowest id first from a lower origin to a higher
  destination, highest first the other way), and sends on the bulk channel through that
  neighbour's flow-control window (backpressure as for a direct send); the same route for
  every message between two nodes while the nodes and links stay up, so pieces mostly keep
  their order (the replay window needs no more);
* a relay forwards at once when the window and the socket take the message; otherwise it
  holds the message in a task until they do, for at most ``default_timeout``. What it holds
  is bounded: beyond ``relay_budget_bytes`` (all destinations together) a relayed data message
  is dropped and counted (``relay_budget``); its operation then fails on its timeout as for a
  lost peer. A relay never lends a passing message's shared memory (it is copied out) and
  never scans it for NaN: its destination does, and blames its origin, which in a keyed cluster
  it has verified;
* a relayed data message keeps no order relative to other messages between the same two
  nodes (the collectives' pieces are sent unordered anyway).

The resends of a request spread over the equal-cost next hops at every relay
(:func:`resend_number`), as the origin's resends spread over its first hops.

**No loops.** A relay knows only its own links: a next hop whose link is cut is skipped (a
send over it fails at once), and the neighbour taken instead may route the message back,
through links it believes up, towards the node it came from (on BCube(4, 2) cut in two, 5 ->
6 -> 7 -> 5 -> ... until the hop limit). So a relayed control message lists the nodes it
passed (its header's ``path``, the latest :data:`~p2psync.wire.PATH_KEPT`), and no relay passes
it on to one of them: it takes a way that is new, or none (PeerUnreachable; its sender's
resend tries another first hop).

A message passing through this node towards a node it has declared dead is still forwarded,
to a live neighbour of that node: in a keyed cluster a relay cannot verify the origin of what
it forwards, so it does not revive a node on a relayed message's word (see
:mod:`p2psync.transport.ingest`), yet a restarted node's registration reply
must reach it before the view that readmits it does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Awaitable, Callable, Mapping, Protocol, cast

from p2psync.errors import P2PSyncError, PeerFailure, PeerUnreachable, ProtocolError
from p2psync.topology import Route, Topology
from p2psync.transport.relay_auth import relay_digest
from p2psync.transport.router import Router
from p2psync.wire import PATH_KEPT, Message, WireLimits, encode, frames_len, parse_header, placed

log = logging.getLogger("p2psync.transport")


class SendDirect(Protocol):
    """Send frames to adjacent ``peer`` over ``route`` within ``budget`` seconds (``bulk``:
    through its flow-control window; ``to_dead``: even when it is marked dead); PeerFailure or
    PeerUnreachable when it cannot."""

    def __call__(self, peer: int, route: Route, budget: float, frames: list[Any], *, bulk: bool = False,
                 unordered: bool = False, to_dead: bool = False) -> Awaitable[None]: ...


def resend_number(fields: Mapping[str, Any]) -> int:
    """Which resend of a request a relayed control message is: the int ``att`` of its meta
    (the RPC client numbers the first hops it tries, ``RpcClient.call``), else 0. A relay
    puts the ``att``-th of its equal-cost next hops first (``Router.next_hops`` ``spread``):
    the resends of a request take every equal-cost way, not only the lowest id's, which may
    lead into a partition no node has noticed yet (the node behind it was declared failed
    though a longer way was open)."""
    meta = fields.get("meta")
    att = meta.get("att") if isinstance(meta, Mapping) else None
    return att if type(att) is int and att > 0 else 0


class Relay:
    """The relaying of one node (see the module docstring)."""

    def __init__(self, *, node_id: int, topology: Topology, router: Router, limits: WireLimits,
                 default_timeout: float, budget_bytes: int, keys: Mapping[int, bytes] | None,
                 route: Callable[[int], Route], send_direct: SendDirect,
                 send_now: Callable[[int, Route, list[Any]], bool], link_up: Callable[[int], bool],
                 shaped: Callable[[], bool]) -> None:
        """``budget_bytes``: relayed data this node holds at most while next hops are busy;
        ``keys``: the key this node shares with each other node (keyed cluster), else None.
        The send path: ``route`` (the direct route to an adjacent node), ``send_direct``
        (send there, waiting within a budget), ``send_now`` (hand bulk frames over at once if
        the peer's window and connection take them: whether they went), ``link_up``
        (whether the connection to an adjacent node is up, as far as the transport knows) and
        ``shaped`` (whether a shaper decides when bulk leaves: then nothing is handed over at
        once)."""
        if budget_bytes < 1:
            raise ValueError("relay_budget_bytes must be >= 1")
        self.node_id = node_id
        self.topology = topology
        self.router = router
        self.limits = limits
        self.default_timeout = default_timeout
        self.budget_bytes = budget_bytes
        self.keys = keys
        self._route = route
        self._send_direct = send_direct
        self._send_now = send_now
        self._link_up = link_up
        self._shaped = shaped
        #: messages this node passed on for others
        self.relayed = 0
        #: bytes of relayed data this node holds until the next hop takes them
        self.held = 0
        #: the most bytes held for relaying at once so far
        self.peak_held = 0
        #: insertion-ordered, so that cancelling them goes in the same order in every run
        self._tasks: dict[asyncio.Task[None], None] = {}
        #: counters of the relayed messages this node signs (control, data lanes)
        self._ctr = itertools.count(1)
        self._data_ctr = itertools.count(1)

    # -- control ---------------------------------------------------------------------------

    async def control(self, dst: int, fields: dict[str, Any], budget: float, rotate: int = 0, *,
                      any_path: bool = False) -> None:
        """Send a control message of this node (``fields``: :func:`~p2psync.wire.encode`'s,
        without the addresses) to ``dst``, which is not adjacent; ``rotate``: relay through the
        k-th candidate first hop first; ``any_path``: when ``dst`` is marked dead here, directly
        when adjacent, else towards its live neighbours, else through any neighbour towards it
        (``Router.blind_hops``: the nodes marked dead on the way may be live; removed nodes
        still running too, so only a proof of life takes it). PeerUnreachable when no next hop
        takes it in time."""
        await self._relay(self.node_id, dst, 0, fields, budget, rotate=rotate, any_path=any_path)

    async def _relay(self, origin: int, dst: int, hops: int, fields: dict[str, Any],
                     budget: float, came_from: int | None = None, rotate: int = 0, any_path: bool = False,
                     passed: tuple[int, ...] = ()) -> None:
        """``passed``: the nodes the message passed before ``came_from`` (its ``path``); it goes
        to none of them, nor back to ``came_from``, and carries them and ``came_from`` on."""
        reply = fields["kind"] == "reply"  # goes back even to a node marked dead (it asked)
        if came_from is not None:
            fields = {**fields, "path": (*passed, came_from)[-PATH_KEPT:]}
        if (reply or any_path) and dst in self.router.dead and self.topology.routes(self.node_id, dst):
            frames = encode(src=origin, dst=dst, hops=hops, **fields)
            try:  # (one immediate try when the link is down: the ways below get the budget)
                await self._send_direct(dst, self._route(dst), budget if self._link_up(dst) else 0.0, frames,
                                        to_dead=True)
                return
            except PeerFailure:
                pass
        hops_list = (self.router.reply_hops(dst, exclude=came_from, rotate=rotate, avoid=passed) if reply else
                     self.router.next_hops(dst, exclude=came_from, rotate=rotate,
                                            to_dead=any_path or came_from is not None,
                                            spread=resend_number(fields) if came_from is not None else 0,
                                            avoid=passed))
        if not hops_list and any_path:  # its live neighbours are marked dead here too: any way there
            hops_list = self.router.blind_hops(dst, exclude=came_from, avoid=passed)
        if not hops_list:
            raise PeerUnreachable(f"node {self.node_id}: no live path to node {dst}", peers=(dst,))
        if origin == self.node_id and self.keys is not None:  # number and sign it for the destination
            fields = {**fields, "ctr": next(self._ctr)}
            frames = encode(src=origin, dst=dst, hops=hops, **fields)
            digest = relay_digest(self.keys[dst], parse_header(cast(bytes, frames[0]), self.limits), frames[1:])
            frames = encode(src=origin, dst=dst, hops=hops, auth=digest, **fields)
        else:
            frames = encode(src=origin, dst=dst, hops=hops, **fields)
        last: PeerFailure | None = None
        # first pass: one immediate try per hop, so a neighbour whose connection is gone (a
        # relay that died but is not yet declared dead) costs nothing; then share the budget
        for share in (0.0, budget / len(hops_list)):
            for nb in hops_list:
                try:
                    await self._send_direct(nb, self._route(nb), share, frames, to_dead=nb in self.router.dead)
                    return
                except PeerFailure as exc:  # includes PeerUnreachable: try the next hop
                    last = exc
        raise PeerUnreachable(f"node {self.node_id}: cannot relay to node {dst}: {last}", peers=(dst,))

    # -- relayed data ----------------------------------------------------------------------

    async def data(self, dst: int, fields: dict[str, Any], budget: float) -> None:
        """Send a ``data`` message (``fields``: :func:`~p2psync.wire.encode`'s) to ``dst``, which
        is not adjacent, through relays (see the module docstring); in a keyed cluster signed
        for ``dst`` and numbered in this node's data lane. PeerFailure when ``dst`` has failed
        or no live path leads there, PeerUnreachable when the next hop takes nothing in time."""
        if dst in self.router.dead:
            raise PeerFailure(f"node {self.node_id}: node {dst} has failed", peers=(dst,))
        me = self.node_id
        if self.keys is not None:
            fields = {**fields, "ctr": next(self._data_ctr)}
            frames = placed(encode(src=me, dst=dst, hops=0, **fields))  # a Fill is computed once, here
            digest = relay_digest(self.keys[dst], parse_header(cast(bytes, frames[0]), self.limits), frames[1:])
            frames = placed(encode(src=me, dst=dst, hops=0, auth=digest, **fields))  # (Fills: owned now)
        else:
            frames = placed(encode(src=me, dst=dst, hops=0, **fields))
        if not self._relay_now(me, dst, frames, None):
            await self._relay_bulk(me, dst, frames, budget, None)

    def _bulk_hops(self, origin: int, dst: int, came_from: int | None) -> list[int]:
        """The next hops for relayed data from ``origin``: on a shortest live path, those whose
        connection is up first; in id order within each when ``origin < dst``, else in reverse
        (the two directions between two nodes take different relays where there is a choice,
        e.g. 1 -> 3 through 0 and 3 -> 1 through 2 on ring-4)."""
        hops = self.router.next_hops(dst, exclude=came_from, shortest=True)
        if not hops:
            raise PeerUnreachable(f"node {self.node_id}: no live path to node {dst}", peers=(dst,))
        if origin > dst:
            hops.reverse()
        return sorted(hops, key=lambda nb: not self._link_up(nb))

    def _relay_now(self, origin: int, dst: int, frames: list[Any], came_from: int | None) -> bool:
        """Hand relayed data to its first next hop at once if that hop takes it (no coroutine,
        no task); False: it has to wait (:meth:`_relay_bulk`). Never with a shaper (whose queue
        decides when bulk leaves)."""
        if self._shaped():
            return False
        nb = self._bulk_hops(origin, dst, came_from)[0]
        return self._send_now(nb, self._route(nb), frames)

    async def _relay_bulk(self, origin: int, dst: int, frames: list[Any], budget: float,
                          came_from: int | None) -> None:
        """Relayed data to the next hop towards ``dst``, waiting for its window (the budget
        shared among the candidate hops, the next tried when one fails)."""
        hops = self._bulk_hops(origin, dst, came_from)
        last: PeerFailure | None = None
        for nb in hops:
            try:
                await self._send_direct(nb, self._route(nb), budget / len(hops), frames, bulk=True)
                return
            except PeerFailure as exc:  # includes PeerUnreachable: try the next hop
                last = exc
        raise PeerUnreachable(f"node {self.node_id}: cannot relay to node {dst}: {last}", peers=(dst,))

    def _forward_data(self, msg: Message, came_from: int, fields: dict[str, Any]) -> None:
        """Pass on a ``data`` message for another node: at once when the next hop takes it,
        else held (within ``budget_bytes``) until it does; ProtocolError (counted by the
        caller) when it is refused here."""
        h = msg.header
        dst = cast(int, h.dst)
        if dst in self.router.dead:
            raise ProtocolError("relay", f"data for node {dst}, which has failed")
        frames = encode(src=h.src, dst=dst, hops=h.hops + 1, **fields)
        try:
            if self._relay_now(h.src, dst, frames, came_from):
                self.relayed += 1
                return
        except PeerFailure as exc:
            raise ProtocolError("relay", f"data for node {dst}: {exc}") from None
        nbytes = frames_len(frames)
        if self.held + nbytes > self.budget_bytes:
            raise ProtocolError("relay_budget", f"{nbytes} bytes for node {dst} do not fit in the "
                                f"{self.budget_bytes} bytes this node holds for relaying")
        self.held += nbytes
        self.peak_held = max(self.peak_held, self.held)

        async def go() -> None:
            try:
                await self._relay_bulk(h.src, dst, frames, self.default_timeout, came_from)
                self.relayed += 1
            except P2PSyncError as exc:
                log.info("node %d: dropped relayed data %r for node %d: %s", self.node_id, h.tag, dst, exc)
            finally:
                self.held -= nbytes

        self._own(asyncio.get_running_loop().create_task(go()))

    # -- passing on ------------------------------------------------------------------------

    def forward(self, msg: Message, came_from: int) -> None:
        """Pass on a message for another node (one the ingest pipeline routed on: its hop count
        and destination are valid), never back to ``came_from``; ProtocolError when it is
        refused here."""
        h = msg.header
        fields = dict(kind=h.kind, tag=h.tag, step=h.step, arrays=msg.arrays,
                      codecs=[f.codec for f in h.frames], meta=h.meta, run=h.run, inc=h.inc, auth=h.auth,
                      ctr=h.ctr)
        if h.kind == "data":
            self._forward_data(msg, came_from, fields)
            return

        async def go() -> None:
            try:
                await self._relay(h.src, h.dst, h.hops + 1, fields,  # type: ignore[arg-type]
                                  min(self.default_timeout, 5.0), came_from, passed=h.path)
                self.relayed += 1
            except P2PSyncError as exc:
                log.info("node %d: dropped relayed message for node %s: %s", self.node_id, h.dst, exc)

        self._own(asyncio.get_running_loop().create_task(go()))

    def _own(self, task: asyncio.Task[None]) -> None:
        self._tasks[task] = None
        task.add_done_callback(lambda t: self._tasks.pop(t, None))

    async def drain(self, timeout: float = 1.0) -> None:
        """Let the messages this node is relaying for others go out (before closing)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    def cancel(self) -> None:
        """Stop relaying what is still held (the transport closes)."""
        for t in list(self._tasks):
            t.cancel()


__all__ = ["Relay", "SendDirect", "resend_number"]

"""Relaying messages hop by hop over live nodes (split from :mod:`.base`).

:class:`Relaying` is the part of :class:`~p2psync.transport.base.Transport` that moves control
messages (``rpc``, ``reply``, ``event``, ``hb``) to nodes that are not adjacent: shortest paths
over the nodes not marked dead (a distance cache dropped whenever that set changes),
``send_control`` retries over another first hop, forwarding of what passes through this node
(owned tasks, drained on close), and, in a keyed cluster, the origin's digest and counter on
what this node relays for itself and their check at the destination
(:mod:`p2psync.transport.relay_auth`).

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

A message passing through this node towards a node it has declared dead is still forwarded,
to a live neighbour of that node: in a keyed cluster a relay cannot verify the origin of what
it forwards, so it does not revive a node on a relayed message's word (see
:meth:`p2psync.transport.base.Transport._ingest`), yet a restarted node's registration reply
must reach it before the view that readmits it does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Mapping, Sequence, cast

from p2psync.errors import P2PSyncError, PeerFailure, PeerUnreachable, ProtocolError, TransportError
from p2psync.topology import Route, Topology
from p2psync.topology.paths import hop_distances, next_hops
from p2psync.transport.relay_auth import relay_digest
from p2psync.wire import RELAY_KINDS, Message, MessageKind, WireLimits, encode, frames_len, parse_header, placed

log = logging.getLogger("p2psync.transport")


class Relaying:
    """Mixin of :class:`~p2psync.transport.base.Transport` (which sets these attributes)."""

    topology: Topology
    node_id: int
    limits: WireLimits
    default_timeout: float
    dead: set[int]
    relayed: int
    run_id: int
    incarnation: int
    relay_keys: dict[int, bytes] | None
    _dist: dict[int, dict[int, int]]
    _relay_tasks: set[asyncio.Task[None]]
    _closed: bool
    #: counters of the relayed messages this node signs (control, data), and the ones it
    #: accepted (keyed)
    _relay_ctr: "itertools.count[int]"
    _relay_data_ctr: "itertools.count[int]"
    shaper: Any
    #: bytes of relayed data this node holds until the next hop takes them, and their bound
    _relay_held: int
    relay_budget_bytes: int

    def route(self, peer: int, nic: str | None = None) -> Route:
        raise NotImplementedError

    async def send(self, peer: int, tag: str, arrays: Sequence[Any] = (), *, kind: MessageKind = "data",
                   step: int = 0, meta: Mapping[str, Any] | None = None,
                   codecs: Sequence[str] | None = None, nic: str | None = None,
                   timeout: float | None = None, to_dead: bool = False) -> None:
        raise NotImplementedError

    async def _send_direct(self, peer: int, route: Route, budget: float, frames: list[Any], *,
                           bulk: bool = False, unordered: bool = False, to_dead: bool = False) -> None:
        raise NotImplementedError

    def window(self, peer: int) -> Any:
        raise NotImplementedError

    def _attempt(self, peer: int, route: Route, frames: list[Any], nbytes: int, bulk: bool,
                 unordered: bool = False) -> bool:
        raise NotImplementedError

    def _link_up(self, peer: int) -> bool:
        """Whether this node's connection to adjacent ``peer`` is up as far as it knows (a
        transport that cannot tell says yes): relayed data prefers such a next hop."""
        return True

    def mark_dead(self, peer: int) -> None:
        """``peer`` failed: sends to it fail at once (also those already retrying), and control
        traffic is routed around it (routes are recomputed over the live nodes)."""
        if peer not in self.dead:
            self.dead.add(peer)
            self._dist.clear()

    def revive(self, peer: int) -> None:
        """``peer`` is a member again (a new view): route through it again."""
        if peer in self.dead:
            self.dead.discard(peer)
            self._dist.clear()

    def _distances(self, src: int) -> dict[int, int]:
        """Hop counts from ``src`` over the live nodes (cached until a node dies or revives)."""
        if src not in self._dist:
            self._dist[src] = hop_distances(self.topology, src, avoid=self.dead)
        return self._dist[src]

    def next_hops(self, dst: int, *, exclude: int | None = None, rotate: int = 0,
                  to_dead: bool = False, shortest: bool = False) -> list[int]:
        """Neighbours to relay through towards ``dst`` (:func:`p2psync.topology.paths.next_hops`)."""
        return next_hops(self.topology, self.node_id, dst, dead=self.dead, distances=self._distances,
                         exclude=exclude, rotate=rotate, to_dead=to_dead, shortest=shortest)

    async def send_control(self, peer: int, tag: str, *, kind: MessageKind, meta: Mapping[str, Any] | None = None,
                           arrays: Sequence[Any] = (), timeout: float | None = None,
                           attempt: int = 0, to_dead: bool = False) -> None:
        """Send a control message; when ``peer`` is not adjacent, attempt ``k`` relays through
        the k-th candidate first hop (so a retry goes around a relay that died). ``to_dead``:
        an adjacent ``peer`` gets it even when marked dead (see ``Transport.send``)."""
        if kind not in RELAY_KINDS:
            raise ValueError(f"{kind!r} is not a control kind")
        if attempt == 0 or peer == self.node_id or self.topology.routes(self.node_id, peer) \
                or not self.topology.has(peer):
            await self.send(peer, tag, arrays, kind=kind, meta=meta, timeout=timeout, to_dead=to_dead)
            return
        if self._closed:
            raise TransportError("transport is closed")
        budget = self.default_timeout if timeout is None else timeout
        await self._relay(self.node_id, peer, 0, dict(kind=kind, tag=tag, step=0, arrays=arrays,
                          codecs=None, meta=meta, run=self.run_id, inc=self.incarnation),
                          budget, rotate=attempt)

    async def _relay(self, origin: int, dst: int, hops: int, fields: dict[str, Any],
                     budget: float, came_from: int | None = None, rotate: int = 0) -> None:
        reply = fields["kind"] == "reply"  # goes back even to a node marked dead (it asked)
        if reply and dst in self.dead and self.topology.routes(self.node_id, dst):
            frames = encode(src=origin, dst=dst, hops=hops, **fields)
            try:
                await self._send_direct(dst, self.route(dst), budget, frames, to_dead=True)
                return
            except PeerFailure:
                pass
        hops_list = self.next_hops(dst, exclude=came_from, rotate=rotate, to_dead=came_from is not None or reply)
        if not hops_list:
            raise PeerUnreachable(f"node {self.node_id}: no live path to node {dst}", peers=(dst,))
        if origin == self.node_id and self.relay_keys is not None:  # number and sign it for the destination
            fields = {**fields, "ctr": next(self._relay_ctr)}
            frames = encode(src=origin, dst=dst, hops=hops, **fields)
            digest = relay_digest(self.relay_keys[dst], parse_header(cast(bytes, frames[0]), self.limits), frames[1:])
            frames = encode(src=origin, dst=dst, hops=hops, auth=digest, **fields)
        else:
            frames = encode(src=origin, dst=dst, hops=hops, **fields)
        last: PeerFailure | None = None
        # first pass: one immediate try per hop, so a neighbour whose connection is gone (a
        # relay that died but is not yet declared dead) costs nothing; then share the budget
        for share in (0.0, budget / len(hops_list)):
            for nb in hops_list:
                try:
                    await self._send_direct(nb, self.route(nb), share, frames)
                    return
                except PeerFailure as exc:  # includes PeerUnreachable: try the next hop
                    last = exc
        raise PeerUnreachable(f"node {self.node_id}: cannot relay to node {dst}: {last}", peers=(dst,))

    # -- relayed data ----------------------------------------------------------------------

    async def _send_relayed(self, dst: int, fields: dict[str, Any], budget: float) -> None:
        """Send a ``data`` message (``fields``: :func:`~p2psync.wire.encode`'s) to ``dst``, which
        is not adjacent, through relays (see the module docstring); in a keyed cluster signed
        for ``dst`` and numbered in this node's data lane. PeerFailure when ``dst`` has failed
        or no live path leads there, PeerUnreachable when the next hop takes nothing in time."""
        if dst in self.dead:
            raise PeerFailure(f"node {self.node_id}: node {dst} has failed", peers=(dst,))
        me = self.node_id
        if self.relay_keys is not None:
            fields = {**fields, "ctr": next(self._relay_data_ctr)}
            frames = placed(encode(src=me, dst=dst, hops=0, **fields))  # a Fill is computed once, here
            digest = relay_digest(self.relay_keys[dst], parse_header(cast(bytes, frames[0]), self.limits), frames[1:])
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
        hops = self.next_hops(dst, exclude=came_from, shortest=True)
        if not hops:
            raise PeerUnreachable(f"node {self.node_id}: no live path to node {dst}", peers=(dst,))
        if origin > dst:
            hops.reverse()
        return sorted(hops, key=lambda nb: not self._link_up(nb))

    def _relay_now(self, origin: int, dst: int, frames: list[Any], came_from: int | None) -> bool:
        """Hand relayed data to its first next hop at once if that hop's window and connection
        take it (no coroutine, no task); False: it has to wait (:meth:`_relay_bulk`). Never
        with a shaper (whose queue decides when bulk leaves)."""
        if self.shaper is not None:
            return False
        nb = self._bulk_hops(origin, dst, came_from)[0]
        win, nbytes = self.window(nb), frames_len(frames)
        held = win.try_acquire(nbytes)
        if held is None:
            return False
        try:
            return self._attempt(nb, self.route(nb), frames, nbytes, True)
        finally:
            win.release(held)

    async def _relay_bulk(self, origin: int, dst: int, frames: list[Any], budget: float,
                          came_from: int | None) -> None:
        """Relayed data to the next hop towards ``dst``, waiting for its window (the budget
        shared among the candidate hops, the next tried when one fails)."""
        hops = self._bulk_hops(origin, dst, came_from)
        last: PeerFailure | None = None
        for nb in hops:
            try:
                await self._send_direct(nb, self.route(nb), budget / len(hops), frames, bulk=True)
                return
            except PeerFailure as exc:  # includes PeerUnreachable: try the next hop
                last = exc
        raise PeerUnreachable(f"node {self.node_id}: cannot relay to node {dst}: {last}", peers=(dst,))

    def _forward_data(self, msg: Message, came_from: int, fields: dict[str, Any]) -> None:
        """Pass on a ``data`` message for another node: at once when the next hop takes it,
        else held (within ``relay_budget_bytes``) until it does; ProtocolError (counted by the
        caller) when it is refused here."""
        h = msg.header
        dst = cast(int, h.dst)
        if dst in self.dead:
            raise ProtocolError("relay", f"data for node {dst}, which has failed")
        frames = encode(src=h.src, dst=dst, hops=h.hops + 1, **fields)
        try:
            if self._relay_now(h.src, dst, frames, came_from):
                self.relayed += 1
                return
        except PeerFailure as exc:
            raise ProtocolError("relay", f"data for node {dst}: {exc}") from None
        nbytes = frames_len(frames)
        if self._relay_held + nbytes > self.relay_budget_bytes:
            raise ProtocolError("relay_budget", f"{nbytes} bytes for node {dst} do not fit in the "
                                f"{self.relay_budget_bytes} bytes this node holds for relaying")
        self._relay_held += nbytes

        async def go() -> None:
            try:
                await self._relay_bulk(h.src, dst, frames, self.default_timeout, came_from)
                self.relayed += 1
            except P2PSyncError as exc:
                log.info("node %d: dropped relayed data %r for node %d: %s", self.node_id, h.tag, dst, exc)
            finally:
                self._relay_held -= nbytes

        task = asyncio.get_running_loop().create_task(go())
        self._relay_tasks.add(task)
        task.add_done_callback(self._relay_tasks.discard)

    def _forward(self, msg: Message, came_from: int) -> None:
        """Pass on a message for another node (one the ingest pipeline routed on: its hop count
        and destination are valid); ProtocolError when it is refused here."""
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
                                  min(self.default_timeout, 5.0), came_from)
                self.relayed += 1
            except P2PSyncError as exc:
                log.info("node %d: dropped relayed message for node %s: %s", self.node_id, h.dst, exc)

        task = asyncio.get_running_loop().create_task(go())
        self._relay_tasks.add(task)
        task.add_done_callback(self._relay_tasks.discard)

    async def _drain_relays(self, timeout: float = 1.0) -> None:
        """Let control messages this node is relaying for others go out before closing."""
        if self._relay_tasks:
            await asyncio.wait(set(self._relay_tasks), timeout=timeout)


__all__ = ["Relaying"]

"""Relaying control messages hop by hop over live nodes (split from :mod:`.base`).

:class:`Relaying` is the part of :class:`~p2psync.transport.base.Transport` that moves control
messages (``rpc``, ``reply``, ``event``, ``hb``) to nodes that are not adjacent: shortest paths
over the nodes not marked dead (a distance cache dropped whenever that set changes),
``send_control`` retries over another first hop, forwarding of what passes through this node
(owned tasks, drained on close), and, in a keyed cluster, the origin's digest and counter on
what this node relays for itself and their check at the destination
(:mod:`p2psync.transport.relay_auth`).

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
from p2psync.transport.relay_auth import ReplayWindow, relay_digest, verify
from p2psync.wire import MAX_HOPS, RELAY_KINDS, Message, MessageKind, WireLimits, encode, parse_header

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
    #: counters of the relayed messages this node signs, and the ones it accepted (keyed)
    _relay_ctr: "itertools.count[int]"
    _replays: ReplayWindow

    def route(self, peer: int, nic: str | None = None) -> Route:
        raise NotImplementedError

    async def send(self, peer: int, tag: str, arrays: Sequence[Any] = (), *, kind: MessageKind = "data",
                   step: int = 0, meta: Mapping[str, Any] | None = None,
                   codecs: Sequence[str] | None = None, nic: str | None = None,
                   timeout: float | None = None) -> None:
        raise NotImplementedError

    async def _send_direct(self, peer: int, route: Route, budget: float, frames: list[Any], *,
                           bulk: bool = False, unordered: bool = False, to_dead: bool = False) -> None:
        raise NotImplementedError

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
                  to_dead: bool = False) -> list[int]:
        """Neighbours to relay through towards ``dst`` (:func:`p2psync.topology.paths.next_hops`)."""
        return next_hops(self.topology, self.node_id, dst, dead=self.dead, distances=self._distances,
                         exclude=exclude, rotate=rotate, to_dead=to_dead)

    async def send_control(self, peer: int, tag: str, *, kind: MessageKind, meta: Mapping[str, Any] | None = None,
                           arrays: Sequence[Any] = (), timeout: float | None = None,
                           attempt: int = 0) -> None:
        """Send a control message; when ``peer`` is not adjacent, attempt ``k`` relays through
        the k-th candidate first hop (so a retry goes around a relay that died)."""
        if kind not in RELAY_KINDS:
            raise ValueError(f"{kind!r} is not a control kind")
        if attempt == 0 or peer == self.node_id or self.topology.routes(self.node_id, peer) \
                or not self.topology.has(peer):
            await self.send(peer, tag, arrays, kind=kind, meta=meta, timeout=timeout)
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

    def _relayed_ok(self, msg: Message, frames: Sequence[Any]) -> bool:
        """A relayed message (its origin is not the neighbour that handed it over): in a keyed
        cluster it must carry its origin's digest and counter, verified here if it is for this
        node (a counter seen before is a replay). Returns whether its origin is proven: only
        then may it count as proof of the origin's life or revive it."""
        if self.relay_keys is None:
            return True
        h = msg.header
        if h.auth is None or h.ctr is None:
            raise ProtocolError("relay_auth", f"relayed message from node {h.src} without its origin's digest")
        if h.dst != self.node_id:
            return False  # for another node: its destination checks it
        key = self.relay_keys.get(h.src)
        if key is None or not verify(key, h, frames[1:]):
            raise ProtocolError("relay_auth", f"relayed message claiming origin node {h.src}: its digest "
                                "does not verify (forged or altered on the way)")
        if not self._replays.accept(h.src, h.inc, h.ctr):
            raise ProtocolError("relay_replay", f"relayed message {h.tag!r} from node {h.src} (incarnation "
                                f"{h.inc}, counter {h.ctr}) was delivered before, or is too old")
        return True

    def _forward(self, msg: Message, came_from: int) -> None:
        h = msg.header
        if h.hops + 1 > MAX_HOPS:
            raise ProtocolError("relay", f"hop limit reached for message to node {h.dst}")
        if h.dst not in self.topology.ids:
            raise ProtocolError("relay", f"unknown destination {h.dst}")
        fields = dict(kind=h.kind, tag=h.tag, step=h.step, arrays=msg.arrays,
                      codecs=[f.codec for f in h.frames], meta=h.meta, run=h.run, inc=h.inc, auth=h.auth,
                      ctr=h.ctr)

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

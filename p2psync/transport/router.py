"""Shortest paths from one node over the live nodes of its topology.

A :class:`Router` keeps the set of nodes marked dead and the hop counts over the graph without
them (computed on demand per source node, dropped whenever the set changes), and answers which
neighbours lead towards a destination (:func:`p2psync.topology.paths.next_hops`). It does no
IO; the transport consults it to relay (:mod:`p2psync.transport.relay`), refuse sends to dead
nodes, and to tell the ingest pipeline which nodes are dead.

**Replies go back the way their request came.** For every origin, the router remembers the
neighbour through which that origin's latest relayed message reached this node
(:meth:`Router.heard`); a reply to that origin is handed to that neighbour first
(:meth:`Router.reply_hops`), at the origin's responder and at every relay on the way back, so it
retraces the path its request has just crossed. Shortest paths are computed over the nodes this
node has marked dead only: when a relay dies, the nodes that do not know it yet (every node but
the coordinator, until its view declares it) keep routing towards it, and a node next to it has
no other way forward. A requester that goes around the dead relay (its retries take other first
hops) is then answered around it too, instead of losing every reply until the relay is declared.
"""

from __future__ import annotations

from typing import Collection

from p2psync.topology import Topology
from p2psync.topology.paths import hop_distances, next_hops


class Router:
    """Routing of node ``node_id`` over the live nodes of ``topology``."""

    def __init__(self, topology: Topology, node_id: int) -> None:
        self.topology = topology
        self.node_id = node_id
        #: nodes marked dead (changed only by :meth:`mark_dead` and :meth:`revive`)
        self.dead: set[int] = set()
        self._dist: dict[int, dict[int, int]] = {}
        #: origin -> the neighbour its latest relayed message reached this node through
        self.back: dict[int, int] = {}
        self._neighbors = frozenset(topology.neighbors(node_id))

    def heard(self, origin: int, via: int) -> None:
        """A message from ``origin`` reached this node through neighbour ``via`` (admitted by the
        ingest pipeline; ``via == origin`` for a direct one, which sets nothing)."""
        if via != origin and via in self._neighbors:
            self.back[origin] = via

    def mark_dead(self, node: int) -> None:
        """Route around ``node`` from now on."""
        if node not in self.dead:
            self.dead.add(node)
            self._dist.clear()

    def revive(self, node: int) -> None:
        """Route through ``node`` again."""
        if node in self.dead:
            self.dead.discard(node)
            self._dist.clear()

    def distances(self, src: int) -> dict[int, int]:
        """Hop counts from ``src`` over the live nodes (cached until a node dies or revives);
        from another node than this one, never through this one: a neighbour whose only way to
        a destination leads back through this node is no next hop towards it (on a ring that a
        dead node made a line, a resend over "the other first hop" would run into the line's
        dead end)."""
        if src not in self._dist:
            avoid = self.dead if src == self.node_id else self.dead | {self.node_id}
            self._dist[src] = hop_distances(self.topology, src, avoid=avoid)
        return self._dist[src]

    def next_hops(self, dst: int, *, exclude: int | None = None, rotate: int = 0,
                  to_dead: bool = False, shortest: bool = False, spread: int = 0,
                  avoid: Collection[int] = ()) -> list[int]:
        """Neighbours to relay through towards ``dst`` (:func:`p2psync.topology.paths.next_hops`)."""
        return next_hops(self.topology, self.node_id, dst, dead=self.dead, distances=self.distances,
                         exclude=exclude, rotate=rotate, to_dead=to_dead, shortest=shortest, spread=spread,
                         avoid=avoid)

    def blind_hops(self, dst: int, *, exclude: int | None = None, avoid: Collection[int] = ()) -> list[int]:
        """Neighbours towards ``dst`` over the whole topology, the nodes marked dead included
        (never back through this node), nearest first, then by id: the way left for a message
        meant to reach a node this node may have judged wrongly (a probe of a node marked dead
        whose live neighbours are marked dead too, after a split that healed). Not cached."""
        dist = hop_distances(self.topology, dst, avoid={self.node_id})
        cands = [b for b in self._neighbors if b != exclude and b in dist and b not in avoid]
        return sorted(cands, key=lambda b: (dist[b], b))

    def reply_hops(self, dst: int, *, exclude: int | None = None, rotate: int = 0,
                   avoid: Collection[int] = ()) -> list[int]:
        """Neighbours to relay a reply through towards ``dst`` (which may be marked dead: it
        asked), never ``exclude`` nor one of ``avoid``: ``dst`` itself when adjacent and live,
        else the neighbour ``dst``'s latest relayed message came through first (:meth:`heard`)
        unless that one is marked dead, then :meth:`next_hops` (``to_dead``) in its order; when there is none, that neighbour even though marked dead
        (it relayed the request, so it relays; the replier may have marked it while cut off)."""
        hops = self.next_hops(dst, exclude=exclude, rotate=rotate, to_dead=True, avoid=avoid)
        back = self.back.get(dst)
        if back is None or back == exclude or back in avoid or (hops and hops[0] == dst):
            return hops  # (``dst`` adjacent and live: directly)
        if back in self.dead:  # with no live way, back through it all the same: it just relayed the request
            return hops or [back]
        return [back, *(h for h in hops if h != back)]


__all__ = ["Router"]

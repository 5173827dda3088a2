"""Shortest paths from one node over the live nodes of its topology.

A :class:`Router` keeps the set of nodes marked dead and the hop counts over the graph without
them (computed on demand per source node, dropped whenever the set changes), and answers which
neighbours lead towards a destination (:func:`p2psync.topology.paths.next_hops`). It does no
IO; the transport consults it to relay (:mod:`p2psync.transport.relay`), refuse sends to dead
nodes, and to tell the ingest pipeline which nodes are dead.
"""

from __future__ import annotations

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
        """Hop counts from ``src`` over the live nodes (cached until a node dies or revives)."""
        if src not in self._dist:
            self._dist[src] = hop_distances(self.topology, src, avoid=self.dead)
        return self._dist[src]

    def next_hops(self, dst: int, *, exclude: int | None = None, rotate: int = 0,
                  to_dead: bool = False, shortest: bool = False) -> list[int]:
        """Neighbours to relay through towards ``dst`` (:func:`p2psync.topology.paths.next_hops`)."""
        return next_hops(self.topology, self.node_id, dst, dead=self.dead, distances=self.distances,
                         exclude=exclude, rotate=rotate, to_dead=to_dead, shortest=shortest)


__all__ = ["Router"]

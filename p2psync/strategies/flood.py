"""Flooding a message from its origin to every live member down a BFS spanning tree rooted at
the origin, over direct links (shared by ASGD's gradients and ``diloco-async``'s
pseudo-gradients).

A node forwards what it takes to its children in the tree of its own live set, with the bytes
as they arrived (the origin encodes once; relays never re-encode, so every node decodes the
same values). On a mesh the tree is a direct send to everyone; on a ring the message is passed
along. When the live members are not joined by links among themselves (ring-4 with members 1
and 3 only), the trees span their relay links (:func:`~p2psync.topology.paths.group_links`) and
a send to a child that is not adjacent is relayed by the nodes in between, members or not.
Each send is bounded by ``send_timeout``; a dropped one is counted (:attr:`Flood.dropped`) and
logged, never raised: what a receiver does about a message that never came is its strategy's
business (ASGD: nothing; ``diloco-async``: a hole in its stream, re-formed away).

The trees are kept for one live set at a time (dropped when it changes), so they never outgrow
one set however many views pass.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np

from p2psync.errors import P2PSyncError
from p2psync.strategies.base import StrategyContext
from p2psync.tasks import TaskSet
from p2psync.topology.paths import group_links, spanning_tree

log = logging.getLogger("p2psync.flood")


class Flood:
    """One strategy's flooding of messages under ``tag`` (see the module docstring)."""

    def __init__(self, ctx: StrategyContext, tag: str, *, name: str, send_timeout: float) -> None:
        self.ctx, self.tag, self.send_timeout = ctx, tag, send_timeout
        #: the nodes the trees span (the current view's members and this node)
        self.alive: set[int] = set(ctx.topology.ids)
        self._trees: dict[int, dict[int, list[int]]] = {}
        self._trees_over: frozenset[int] = frozenset()
        #: sends in flight; each fails alone (a dropped send is counted by the send itself)
        self.sends = TaskSet(f"{name}-send", isolated=True)
        #: sends that did not go out within ``send_timeout``
        self.dropped = 0

    def children(self, origin: int) -> list[int]:
        """This node's children in ``origin``'s spanning tree over the live nodes."""
        alive = frozenset(self.alive)
        if alive != self._trees_over:
            self._trees.clear()
            self._trees_over = alive
        tree = self._trees.get(origin)
        if tree is None:
            group = sorted(alive | {origin})
            try:
                tree = spanning_tree(self.ctx.topology, group, root=origin,
                                     links=group_links(self.ctx.topology, group))
            except ValueError:  # not connected even through other nodes
                tree = {}
            self._trees[origin] = tree
        return [c for c in tree.get(self.ctx.node_id, []) if c in self.alive]

    def forward(self, origin: int, arrays: list[np.ndarray], *, step: int, meta: Mapping[str, Any],
                codec: str) -> None:
        """Send ``arrays`` (encoded with ``codec``, as they are) to this node's children in
        ``origin``'s tree, in the background (the caller takes each message once)."""
        for child in self.children(origin):
            self.sends.spawn(self._send(child, arrays, step, dict(meta), codec))

    async def _send(self, peer: int, arrays: list[np.ndarray], step: int, meta: dict[str, Any], codec: str) -> None:
        try:
            await self.ctx.transport.send(peer, self.tag, arrays, step=step, meta=meta, codecs=[codec] * len(arrays),
                                          timeout=self.send_timeout, relay=True)
        except P2PSyncError as exc:
            self.dropped += 1
            log.info("node %d: %s to node %d dropped: %s", self.ctx.node_id, self.tag, peer, exc)

    async def close(self, grace: float) -> None:
        """Sends in flight get ``grace`` seconds to go out, then are cancelled."""
        await self.sends.close(grace=grace)


__all__ = ["Flood"]

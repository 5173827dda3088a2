"""Allreduce over any group of nodes: a ring when the group has one over direct links, else a tree.

Ring (reduce-scatter then allgather, 2(N-1) rounds; each node sends 2(N-1)/N of the data): the
node at ring position i sends chunk (i - s) to its successor and adds chunk (i - s - 1) from its
predecessor in round s of the reduce-scatter; after N-1 rounds it owns the full sum of chunk
(i + 1); the allgather passes the finished chunks around. Every final chunk is computed once and
copied, so all nodes end **bitwise identical**.

Tree (star, or any group without a ring): partial sums flow up a BFS spanning tree to the root,
the total flows back down.

Every receive has a timeout; on error the caller's array is left untouched (the work happens on
a copy), so a failed collective never leaves a half-applied result.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from p2psync.errors import ProtocolError
from p2psync.topology import Topology
from p2psync.topology.paths import hamiltonian_cycle, spanning_tree, tree_parent, tree_root
from p2psync.transport import Transport


@dataclass(frozen=True)
class GroupPlan:
    """How a group reduces: ``ring`` (node order) or ``tree`` (children map)."""

    group: tuple[int, ...]
    ring: tuple[int, ...] | None
    tree: dict[int, list[int]] | None

    @staticmethod
    def for_group(topo: Topology, group: Sequence[int]) -> "GroupPlan":
        group = tuple(sorted(group))
        cycle = hamiltonian_cycle(topo, group)
        if cycle is not None:
            return GroupPlan(group, tuple(cycle), None)
        return GroupPlan(group, None, spanning_tree(topo, group))


async def _ring(t: Transport, buf: np.ndarray, order: Sequence[int], tag: str, timeout: float) -> None:
    n = len(order)
    i = order.index(t.node_id)
    right, left = order[(i + 1) % n], order[(i - 1) % n]
    bounds = np.linspace(0, buf.size, n + 1).astype(np.int64)
    chunk = [buf[bounds[k]:bounds[k + 1]] for k in range(n)]

    for s in range(n - 1):  # reduce-scatter
        out_k, in_k = (i - s) % n, (i - s - 1) % n
        send = t.send(right, f"{tag}.rs{s}", [chunk[out_k].copy()], timeout=timeout)
        msg, _ = await asyncio.gather(t.recv(f"{tag}.rs{s}", timeout=timeout), send)
        if msg.src != left or msg.arrays[0].shape != chunk[in_k].shape:
            raise ProtocolError("chunk", f"{tag}: unexpected chunk from node {msg.src}")
        chunk[in_k] += msg.arrays[0]
    for s in range(n - 1):  # allgather
        out_k, in_k = (i + 1 - s) % n, (i - s) % n
        send = t.send(right, f"{tag}.ag{s}", [chunk[out_k].copy()], timeout=timeout)
        msg, _ = await asyncio.gather(t.recv(f"{tag}.ag{s}", timeout=timeout), send)
        chunk[in_k][...] = msg.arrays[0]


async def _tree(t: Transport, buf: np.ndarray, children: dict[int, list[int]], tag: str,
                timeout: float) -> None:
    me = t.node_id
    kids = children[me]
    parent = tree_parent(children, me)
    for k in kids:  # fixed order: deterministic sums
        msg = await t.recv(f"{tag}.up.{k}", timeout=timeout)
        buf += msg.arrays[0]
    if parent is not None:
        await t.send(parent, f"{tag}.up.{me}", [buf.copy()], timeout=timeout)
        msg = await t.recv(f"{tag}.down", timeout=timeout)
        buf[...] = msg.arrays[0]
    elif tree_root(children) != me:
        raise ValueError(f"node {me} has no parent in the tree but is not its root")
    await asyncio.gather(*(t.send(k, f"{tag}.down", [buf], timeout=timeout) for k in kids))


async def allreduce(t: Transport, array: np.ndarray, plan: GroupPlan, *, tag: str,
                    timeout: float = 30.0, average: bool = False) -> np.ndarray:
    """Sum (or mean) ``array`` across ``plan.group``; returns a new array, identical on every node."""
    if t.node_id not in plan.group:
        raise ValueError(f"node {t.node_id} is not in the group {plan.group}")
    buf = np.array(array, copy=True).reshape(-1)
    if len(plan.group) > 1:
        if plan.ring is not None:
            await _ring(t, buf, plan.ring, tag, timeout)
        elif plan.tree is not None:
            await _tree(t, buf, plan.tree, tag, timeout)
    if average:
        buf /= len(plan.group)
    return buf.reshape(np.shape(array))

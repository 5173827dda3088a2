"""Paths over a topology restricted to a group of nodes: rings and spanning trees. Pure.

A ring allreduce needs a Hamiltonian cycle of the group's adjacency graph (every hop between
adjacent nodes). ring/mesh/BCube have one (BCube: a Gray-code walk); a star has none, and then
a spanning tree rooted at the best-connected node is used instead.
"""

from __future__ import annotations

from typing import Sequence

from p2psync.errors import ConfigError
from p2psync.topology.model import Topology


def _adjacency(topo: Topology, group: Sequence[int]) -> dict[int, list[int]]:
    members = set(group)
    if len(members) != len(group):
        raise ConfigError(f"group has duplicate nodes: {list(group)}")
    for g in group:
        topo.node(g)
    return {g: [b for b in topo.neighbors(g) if b in members] for g in group}


def hamiltonian_cycle(topo: Topology, group: Sequence[int], *, budget: int = 200_000) -> list[int] | None:
    """A cycle through every node of ``group`` over direct links, starting at min(group).

    Depth-first search with a Warnsdorff order (fewest onward choices first); gives up after
    ``budget`` expansions and returns None. Groups of 1 and 2 are trivially rings (2 if adjacent).
    """
    adj = _adjacency(topo, group)
    n = len(adj)
    if n == 0:
        raise ConfigError("empty group")
    start = min(adj)
    if n == 1:
        return [start]
    if n == 2:
        other = next(g for g in adj if g != start)
        return [start, other] if other in adj[start] else None
    path = [start]
    seen = {start}
    steps = 0

    def dfs() -> bool:
        nonlocal steps
        steps += 1
        if steps > budget:
            return False
        cur = path[-1]
        if len(path) == n:
            return start in adj[cur]
        options = [b for b in adj[cur] if b not in seen]
        options.sort(key=lambda b: (sum(1 for c in adj[b] if c not in seen), b))
        for b in options:
            path.append(b)
            seen.add(b)
            if dfs():
                return True
            path.pop()
            seen.discard(b)
        return False

    return list(path) if dfs() else None


def spanning_tree(topo: Topology, group: Sequence[int], root: int | None = None) -> dict[int, list[int]]:
    """BFS tree of ``group`` as ``{node: children}``; root defaults to the best-connected node."""
    adj = _adjacency(topo, group)
    if root is None:
        root = max(adj, key=lambda g: (len(adj[g]), -g))
    if root not in adj:
        raise ConfigError(f"root {root} is not in the group")
    children: dict[int, list[int]] = {g: [] for g in adj}
    seen = {root}
    frontier = [root]
    while frontier:
        nxt = []
        for a in frontier:
            for b in sorted(adj[a]):
                if b not in seen:
                    seen.add(b)
                    children[a].append(b)
                    nxt.append(b)
        frontier = nxt
    if len(seen) != len(adj):
        raise ConfigError(f"group {sorted(adj)} is not connected over direct links")
    return children


def tree_root(children: dict[int, list[int]]) -> int:
    kids = {c for cs in children.values() for c in cs}
    (root,) = [g for g in children if g not in kids]
    return root


def tree_parent(children: dict[int, list[int]], node: int) -> int | None:
    for p, cs in children.items():
        if node in cs:
            return p
    return None

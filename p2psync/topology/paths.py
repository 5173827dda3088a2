"""Paths over a topology restricted to a group of nodes: rings and spanning trees. Pure.

A ring allreduce needs a Hamiltonian cycle of the group's adjacency graph (every hop between
adjacent nodes). ring/mesh/BCube have one (BCube: a Gray-code walk); a star has none, and then
a spanning tree rooted at the best-connected node is used instead.
"""

from __future__ import annotations

from typing import Callable, Collection, Mapping, Sequence

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


def hop_distances(topo: Topology, src: int, *, avoid: Collection[int] = ()) -> dict[int, int]:
    """Hop counts from ``src`` over direct links (breadth first), never entering a node of
    ``avoid`` (dead nodes); empty when ``src`` itself is avoided. A relaying transport caches
    one per source: ``hop_distances(topo, 3, avoid={5})[7]`` is 3's distance to 7 around 5."""
    dist: dict[int, int] = {} if src in avoid else {src: 0}
    frontier = list(dist)
    while frontier:
        nxt = []
        for a in frontier:
            for b in topo.neighbors(a):
                if b not in dist and b not in avoid:
                    dist[b] = dist[a] + 1
                    nxt.append(b)
        frontier = nxt
    return dist


def next_hops(topo: Topology, me: int, dst: int, *, dead: Collection[int],
              distances: Callable[[int], Mapping[int, int]], exclude: int | None = None,
              rotate: int = 0, to_dead: bool = False) -> list[int]:
    """Neighbours of ``me`` to relay through towards ``dst``: shortest live path first, live
    ones only (``distances(b)``: :func:`hop_distances` from ``b`` around ``dead``, cached by the
    caller). ``rotate`` > 0 moves the first ``rotate`` candidates to the end (a retry over
    another first hop); ``to_dead``: when ``dst`` is dead, aim at its live neighbours."""
    goals = {dst: 0}
    if to_dead and dst in dead:
        goals = {nb: 1 for nb in topo.neighbors(dst) if nb not in dead and nb != me}

    def cost(b: int) -> int | None:
        d = distances(b)
        return min((d[g] + c for g, c in goals.items() if g in d), default=None)

    costs = {b: cost(b) for b in topo.neighbors(me) if b not in dead and b != exclude}
    cands = sorted((b for b, c in costs.items() if c is not None), key=lambda b: (costs[b], b))
    if rotate and cands:
        k = rotate % len(cands)
        cands = cands[k:] + cands[:k]
    return cands

"""Paths over a topology restricted to a group of nodes: rings and spanning trees. Pure.

A ring allreduce needs a Hamiltonian cycle of the group's adjacency graph (every hop between
adjacent nodes). ring/mesh/BCube have one (BCube: a Gray-code walk); a star has none, and then
a spanning tree rooted at the best-connected node is used instead.

A group whose members are not joined by links among themselves (ring-4 without nodes 0 and 2:
members 1 and 3) is planned over its *relay links* (:func:`relay_links`): two members are
linked when a shortest path through non-members joins them, and the nodes on it forward what
one sends to the other. Those links depend on the topology only, never on which nodes are
alive, so every member plans the same rings and trees; whether the live nodes still join the
group is a separate question (:func:`live_cut`), asked with the caller's own dead set.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Collection, Iterator, Mapping, Sequence

from p2psync.errors import ConfigError
from p2psync.topology.model import Topology

#: member -> {member it reaches: the nodes between them on the way (empty: a direct link)}
Links = Mapping[int, Mapping[int, tuple[int, ...]]]


def _adjacency(topo: Topology, group: Sequence[int]) -> dict[int, list[int]]:
    members = set(group)
    if len(members) != len(group):
        raise ConfigError(f"group has duplicate nodes: {list(group)}")
    for g in group:
        topo.node(g)
    return {g: [b for b in topo.neighbors(g) if b in members] for g in group}


def _weights(topo: Topology, group: Sequence[int],
             links: Links | None) -> tuple[dict[int, list[int]], Callable[[int, int], int]]:
    """The adjacency of ``group`` (direct links, or ``links``) and the cost of one of its edges:
    0 for every direct link, the number of relays for a relay link."""
    if links is None:
        return _adjacency(topo, group), lambda a, b: 0
    _adjacency(topo, group)  # validates the group
    return {g: sorted(links[g]) for g in group}, lambda a, b: len(links[a][b])


def relay_links(topo: Topology, group: Sequence[int]) -> dict[int, dict[int, tuple[int, ...]]]:
    """The members of ``group`` that each member reaches directly or through non-members only,
    with the nodes in between: ``links[a][b]`` is ``()`` for a direct link, else the interior of
    a shortest path from ``a`` to ``b`` whose interior holds no member (the first one a
    breadth-first search from ``a`` finds, neighbours in id order). On ring-4,
    ``relay_links(ring(4), [1, 3]) == {1: {3: (0,)}, 3: {1: (0,)}}``. Depends on the topology
    only (not on which nodes are alive): every member computes the same links."""
    _adjacency(topo, group)
    members = set(group)
    nbrs: dict[int, list[int]] = {}
    out: dict[int, dict[int, tuple[int, ...]]] = {}
    for a in group:
        prev: dict[int, int] = {a: a}
        found: dict[int, tuple[int, ...]] = {}
        frontier = [a]
        while frontier:
            nxt = []
            for x in frontier:
                if x not in nbrs:
                    nbrs[x] = topo.neighbors(x)
                for b in nbrs[x]:
                    if b in prev:
                        continue
                    prev[b] = x
                    if b in members:  # reached: never through another member
                        path, y = [], x
                        while y != a:
                            path.append(y)
                            y = prev[y]
                        found[b] = tuple(reversed(path))
                    else:
                        nxt.append(b)
            frontier = nxt
        out[a] = found
    return out


def shortest_links(topo: Topology, group: Sequence[int]) -> dict[int, dict[int, tuple[int, ...]]]:
    """Every other member of ``group`` that each member reaches, with the interior of a shortest
    path to it through *any* nodes, members included (``()``: a direct link; the first path a
    breadth-first search from the member finds, neighbours in id order): the links of a plan in
    which every member sends to every other (:func:`~p2psync.collectives.plan.plan_direct`). On
    ring-4, ``shortest_links(ring(4), [0, 1, 2, 3])[0] == {1: (), 3: (), 2: (1,)}``. Depends on
    the topology only; ConfigError when the topology does not join the group."""
    _adjacency(topo, group)
    members = set(group)
    out: dict[int, dict[int, tuple[int, ...]]] = {}
    for a in group:
        prev: dict[int, int] = {a: a}
        frontier = [a]
        while frontier:
            nxt = []
            for x in frontier:
                for b in topo.neighbors(x):
                    if b not in prev:
                        prev[b] = x
                        nxt.append(b)
            frontier = nxt
        found: dict[int, tuple[int, ...]] = {}
        for b in group:
            if b == a:
                continue
            if b not in prev:
                raise ConfigError(f"group {sorted(members)} is not connected: node {a} reaches no path to {b}")
            path, y = [], prev[b]
            while y != a:
                path.append(y)
                y = prev[y]
            found[b] = tuple(reversed(path))
        out[a] = found
    return out


def direct_links(topo: Topology, group: Sequence[int]) -> dict[int, dict[int, tuple[int, ...]]]:
    """The links among ``group``'s members over their own direct links only (see :data:`Links`)."""
    return {g: {b: () for b in nbs} for g, nbs in _adjacency(topo, group).items()}


def group_links(topo: Topology, group: Sequence[int]) -> dict[int, dict[int, tuple[int, ...]]] | None:
    """None when ``group``'s own direct links join it (rings and trees over it stay as they
    are), else its :func:`relay_links`; ConfigError when not even the whole topology joins it."""
    if joined(direct_links(topo, group)):
        return None
    links = relay_links(topo, group)
    if not joined(links):
        raise ConfigError(f"group {sorted(group)} is not connected, even through other nodes")
    return links


def joined(links: Links) -> bool:
    """Whether ``links`` join every member (one connected component)."""
    if not links:
        return True
    start = min(links)
    seen, todo = {start}, [start]
    while todo:
        for b in links[todo.pop()]:
            if b not in seen:
                seen.add(b)
                todo.append(b)
    return len(seen) == len(links)


def hamiltonian_cycle(topo: Topology, group: Sequence[int], *, budget: int = 200_000,
                      links: Links | None = None) -> list[int] | None:
    """A cycle through every node of ``group`` over direct links (or over ``links``, e.g.
    :func:`relay_links`: then relay links with fewer relays are tried first), starting at
    min(group).

    Depth-first search with a Warnsdorff order (fewest onward choices first); gives up after
    ``budget`` expansions and returns None. Groups of 1 and 2 are trivially rings (2 if adjacent).
    """
    adj, cost = _weights(topo, group, links)
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

    def onward(cur: int) -> Iterator[int]:
        options = [b for b in adj[cur] if b not in seen]
        options.sort(key=lambda b: (cost(cur, b), sum(1 for c in adj[b] if c not in seen), b))
        return iter(options)

    # an explicit stack (one iterator of onward choices per node on the path), not recursion:
    # the path of a group of a thousand nodes is deeper than Python's recursion limit
    stack = [onward(start)]
    steps = 1
    while stack:
        b = next(stack[-1], None)
        if b is None:  # every choice after path[-1] failed: step back
            stack.pop()
            seen.discard(path.pop())
            continue
        steps += 1
        if steps > budget:
            return None
        path.append(b)
        seen.add(b)
        if len(path) == n:
            if start in adj[b]:
                return list(path)
            seen.discard(path.pop())
            continue
        stack.append(onward(b))
    return None


def spanning_tree(topo: Topology, group: Sequence[int], root: int | None = None, *,
                  links: Links | None = None) -> dict[int, list[int]]:
    """BFS tree of ``group`` as ``{node: children}`` over direct links (or over ``links``, e.g.
    :func:`relay_links`: a parent then takes the children with fewer relays first); root
    defaults to the best-connected node (with ``links``: the most direct links, then the most
    links). ConfigError when the links do not join the group."""
    adj, cost = _weights(topo, group, links)
    if root is None:
        root = max(adj, key=lambda g: (sum(1 for b in adj[g] if not cost(g, b)), len(adj[g]), -g))
    if root not in adj:
        raise ConfigError(f"root {root} is not in the group")
    children: dict[int, list[int]] = {g: [] for g in adj}
    seen = {root}
    frontier = [root]
    while frontier:
        nxt = []
        for a in frontier:
            for b in sorted(adj[a], key=lambda b: (cost(a, b), b)):
                if b not in seen:
                    seen.add(b)
                    children[a].append(b)
                    nxt.append(b)
        frontier = nxt
    if len(seen) != len(adj):
        how = "over direct links" if links is None else "even through other nodes"
        raise ConfigError(f"group {sorted(adj)} is not connected {how}")
    return children


@dataclass(frozen=True)
class Cut:
    """How the live nodes split a group (:func:`live_cut`): ``parts``, the members each set of
    live nodes still joins (in order of their lowest member), and ``bridges``, dead nodes
    that would join some of them again: each one on its own (``together`` False) or, when no
    single one would, those on a path with the fewest dead nodes from the first part to
    another (``together`` True; empty when not even the dead nodes join them)."""

    group: tuple[int, ...]
    parts: tuple[tuple[int, ...], ...]
    bridges: tuple[int, ...]
    together: bool

    def describe(self) -> str:
        """One sentence for an error message."""
        names = " and ".join(str(list(p)) for p in self.parts) if len(self.parts) == 2 \
            else ", ".join(str(list(p)) for p in self.parts)
        text = (f"group {list(self.group)} is cut apart over the live nodes: members {names} cannot reach "
                f"each other, directly or through any live node")
        if not self.bridges:
            return text + " (no path joins them even through the dead nodes)"
        if len(self.bridges) == 1:
            return text + f"; dead node {self.bridges[0]} would have connected them"
        if self.together:
            return text + f"; dead nodes {list(self.bridges)} together would have connected them"
        if len(self.parts) == 2:
            return text + f"; any one of dead nodes {list(self.bridges)} would have connected them"
        return text + f"; dead nodes {list(self.bridges)} would each have joined some of them"


def live_cut(topo: Topology, group: Sequence[int], dead: Collection[int]) -> Cut | None:
    """None when the nodes not in ``dead`` join every member of ``group`` (members count as
    live: a dead member is the failure of whoever sends to it); else the :class:`Cut`.
    ``live_cut(ring(4), [1, 3], {0, 2})`` names parts ``(1,), (3,)`` and bridges ``(0, 2)``."""
    members = sorted(set(group))
    avoid = set(dead) - set(members)
    region: dict[int, int] = {}  # live node -> index of the part whose members it joins
    parts: list[tuple[int, ...]] = []
    for m in members:
        if m in region:
            continue
        k = len(parts)
        region[m] = k
        comp, todo = [m], [m]
        while todo:
            for b in topo.neighbors(todo.pop()):
                if b not in region and b not in avoid:
                    region[b] = k
                    comp.append(b)
                    todo.append(b)
        parts.append(tuple(sorted(set(comp) & set(members))))
    if len(parts) == 1:
        return None
    singles = tuple(d for d in sorted(avoid)
                    if len({region[nb] for nb in topo.neighbors(d) if nb in region}) >= 2)
    if singles:
        return Cut(tuple(members), tuple(parts), singles, False)
    # no single dead node joins two parts: the fewest dead nodes from part 0 to another (0-1 BFS)
    cost: dict[int, int] = {n: 0 for n, k in region.items() if k == 0}
    prev: dict[int, int] = {}
    todo_q = deque(cost)
    end: int | None = None
    while todo_q:
        a = todo_q.popleft()
        if region.get(a, 0) != 0:
            end = a
            break
        for b in topo.neighbors(a):
            c = cost[a] + (1 if b in avoid else 0)
            if c < cost.get(b, c + 1):
                cost[b], prev[b] = c, a
                (todo_q.append if b in avoid else todo_q.appendleft)(b)
    path: list[int] = []
    while end is not None and end in prev:
        end = prev[end]
        if end in avoid:
            path.append(end)
    return Cut(tuple(members), tuple(parts), tuple(sorted(path)), True)


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
              rotate: int = 0, to_dead: bool = False, shortest: bool = False, spread: int = 0,
              avoid: Collection[int] = ()) -> list[int]:
    """Neighbours of ``me`` to relay through towards ``dst``: shortest live path first, live
    ones only (``distances(b)``: :func:`hop_distances` from ``b`` around ``dead``, cached by the
    caller), never ``exclude`` nor one of ``avoid`` (nodes the message has passed already). ``rotate`` > 0 moves the first ``rotate`` candidates to the end (a retry over
    another first hop); ``spread``: among the candidates on a shortest path (equal cost), the
    ``spread``-th comes first (a relay passing on the k-th resend of a request: successive
    resends take every equal-cost way, not only the lowest id's, which may lead into a cut);
    ``to_dead``: when ``dst`` is dead, aim at its live neighbours; ``shortest``: only the
    neighbours on a shortest live path (every hop gets closer, so what is forwarded never
    wanders)."""
    # the cost of a neighbour: its distance to ``dst``, or to ``dst``'s nearest live neighbour
    # plus one (``to_dead``); None when it reaches neither (every relayed message asks this)
    goals = [nb for nb in topo.neighbors(dst) if nb not in dead and nb != me] \
        if to_dead and dst in dead else None
    costs: dict[int, int] = {}
    for b in topo.neighbors(me):
        if b in dead or b == exclude or b in avoid:
            continue
        d = distances(b)
        c = d.get(dst) if goals is None else min((d[g] + 1 for g in goals if g in d), default=None)
        if c is not None:
            costs[b] = c
    cands = sorted(costs, key=lambda b: (costs[b], b))
    if spread and cands:
        tier = sum(1 for b in cands if costs[b] == costs[cands[0]])
        k = spread % tier
        cands = cands[k:tier] + cands[:k] + cands[tier:]
    if shortest and cands:
        cands = [b for b in cands if costs[b] == costs[cands[0]]]
    if rotate and cands:
        k = rotate % len(cands)
        cands = cands[k:] + cands[:k]
    return cands

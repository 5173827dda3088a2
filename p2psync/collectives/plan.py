"""Collective plans: which node sends which pieces to whom, over which NIC, in which round. Pure.

A tensor is cut into ``pieces`` (about 1 MiB each). A :class:`Plan` has two phases:

* ``rs`` (reduce-scatter) rounds of *reduce* transfers: the receiver adds the pieces in;
* ``ag`` (allgather) rounds of *copy* transfers: the receiver overwrites the pieces.

After the ``rs`` phase ``owner[node]`` lists the piece ranges that node holds fully reduced;
the ``ag`` phase spreads them to everyone. Allreduce runs both phases, reduce-scatter the first,
allgather the second. Every transfer goes between adjacent nodes over the sender's NIC on
their shared network.

Algorithms:

* ``ring``: reduce-scatter + allgather around a Hamiltonian cycle of the group, 2(N-1) rounds;
  each node sends 2(N-1)/N of the data. Node at ring position i owns chunk i.
* ``mesh`` (Canary Fig. 14): every node sends chunk j to node j (reduce), then every node sends
  its chunk to all others (copy): 2 rounds, 2(N-1)/N of the data per node. Needs a clique.
* ``bcube`` (Canary §4.4.2, Table 2, after BML): the tensor is split into beta parts, one per
  "thread" tau[t]; part t visits the levels in the order t, t+1, ..., so in every round each
  level (and so each NIC) carries one part. In a level-l step each node splits its current
  segment of the part into alpha sub-segments and sends sub-segment j to the cube neighbour
  whose level-l digit is j (reduce), keeping its own; after beta steps it owns 1/N of the part
  fully reduced; the allgather retraces the steps in reverse (copy).
* ``star``: leaves push everything to the hub (reduce), the hub sends the sum back (copy): the
  parameter-server baseline.
* ``tree``: any connected group: reduce up a BFS spanning tree, broadcast down.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from p2psync.errors import ConfigError
from p2psync.topology import Topology, bcube_digits
from p2psync.topology.paths import hamiltonian_cycle, spanning_tree

ALGOS = ("auto", "ring", "mesh", "bcube", "star", "tree")

Range = tuple[int, int]


@dataclass(frozen=True)
class Transfer:
    """One send in a round: ``src`` sends pieces [lo, hi) to adjacent ``dst`` over its NIC
    ``nic``; ``reduce``: the receiver adds them in (reduce-scatter), else overwrites (allgather)."""

    src: int
    dst: int
    nic: str  # the sender's NIC
    lo: int  # piece range [lo, hi)
    hi: int
    reduce: bool


@dataclass(frozen=True)
class Plan:
    """A collective's schedule over ``group`` for a tensor cut into ``pieces``: the
    reduce-scatter rounds ``rs``, the allgather rounds ``ag`` and, after ``rs``, the piece
    ranges each node holds fully reduced (``owner``). Built by :func:`make_plan` (or a
    ``plan_*`` builder); run by the collectives' executor (executor.py:
    ``self._plans[key] = make_plan(self.topo, g, key[1], key[2])``)."""

    algo: str
    group: tuple[int, ...]
    pieces: int
    rs: tuple[tuple[Transfer, ...], ...]
    ag: tuple[tuple[Transfer, ...], ...]
    owner: dict[int, tuple[Range, ...]] = field(default_factory=dict)

    def sent_by(self, node: int) -> int:
        """Pieces ``node`` sends in a full allreduce."""
        return sum(t.hi - t.lo for rnd in (*self.rs, *self.ag) for t in rnd if t.src == node)


def split(lo: int, hi: int, k: int) -> list[Range]:
    """``k`` contiguous, nearly equal sub-ranges of [lo, hi) (some empty when hi - lo < k)."""
    n = hi - lo
    return [(lo + (n * j) // k, lo + (n * (j + 1)) // k) for j in range(k)]


class _Builder:
    def __init__(self, topo: Topology, algo: str, group: Sequence[int], pieces: int) -> None:
        self.topo = topo
        self.algo = algo
        self.group = tuple(group)
        self.pieces = pieces
        self.rs: list[list[Transfer]] = []
        self.ag: list[list[Transfer]] = []
        self.owner: dict[int, list[Range]] = {g: [] for g in group}

    def nic(self, src: int, dst: int, level: int | None = None) -> str:
        routes = self.topo.routes(src, dst)
        if level is not None:
            routes = tuple(r for r in routes if r.local_nic == f"l{level}") or routes
        if not routes:
            raise ConfigError(f"{self.algo} plan: nodes {src} and {dst} share no network")
        return routes[0].local_nic

    def add(self, phase: list[list[Transfer]], rnd: int, src: int, dst: int, rng: Range, reduce: bool,
            level: int | None = None) -> None:
        if rng[1] <= rng[0]:
            return
        while len(phase) <= rnd:
            phase.append([])
        phase[rnd].append(Transfer(src, dst, self.nic(src, dst, level), rng[0], rng[1], reduce))

    def build(self) -> Plan:
        return Plan(self.algo, self.group, self.pieces, tuple(tuple(r) for r in self.rs),
                    tuple(tuple(r) for r in self.ag),
                    {g: tuple(r for r in rs if r[1] > r[0]) for g, rs in self.owner.items()})


def plan_ring(topo: Topology, group: Sequence[int], pieces: int, order: Sequence[int] | None = None) -> Plan:
    """Ring allreduce around ``order`` (default: a Hamiltonian cycle of ``group`` over direct
    links; ConfigError when there is none); see the module docstring."""
    order = list(order) if order is not None else hamiltonian_cycle(topo, group)
    if order is None:
        raise ConfigError(f"ring plan: group {sorted(group)} has no ring over direct links")
    b = _Builder(topo, "ring", sorted(group), pieces)
    n = len(order)
    chunks = split(0, pieces, n)
    for s in range(n - 1):
        for i, node in enumerate(order):
            right = order[(i + 1) % n]
            b.add(b.rs, s, node, right, chunks[(i - s - 1) % n], True)
            b.add(b.ag, s, node, right, chunks[(i - s) % n], False)
    for i, node in enumerate(order):
        b.owner[node].append(chunks[i])
    return b.build()


def plan_mesh(topo: Topology, group: Sequence[int], pieces: int) -> Plan:
    """Mesh allreduce (Canary Fig. 14) over a ``group`` that is a clique (ConfigError otherwise)."""
    g = sorted(group)
    for a in g:
        for c in g:
            if a != c and not topo.routes(a, c):
                raise ConfigError(f"mesh plan: nodes {a} and {c} are not adjacent")
    b = _Builder(topo, "mesh", g, pieces)
    chunks = split(0, pieces, len(g))
    for j, owner in enumerate(g):
        b.owner[owner].append(chunks[j])
        for other in g:
            if other != owner:
                b.add(b.rs, 0, other, owner, chunks[j], True)
                b.add(b.ag, 0, owner, other, chunks[j], False)
    return b.build()


def plan_star(topo: Topology, group: Sequence[int], pieces: int, hub: int | None = None) -> Plan:
    """Star allreduce through ``hub`` (default: the topology's ``hub`` parameter, else the
    lowest id): leaves reduce into it, it copies the sum back."""
    g = sorted(group)
    hub = hub if hub is not None else int(topo.params.get("hub", g[0]))
    if hub not in g:
        raise ConfigError(f"star plan: hub {hub} is not in the group")
    b = _Builder(topo, "star", g, pieces)
    b.owner[hub].append((0, pieces))
    for leaf in g:
        if leaf != hub:
            b.add(b.rs, 0, leaf, hub, (0, pieces), True)
            b.add(b.ag, 0, hub, leaf, (0, pieces), False)
    return b.build()


def plan_tree(topo: Topology, group: Sequence[int], pieces: int, root: int | None = None) -> Plan:
    """Reduce up a BFS spanning tree of ``group`` rooted at ``root`` (default: the
    best-connected node), then copy down. Also the broadcast plan: executor.py runs its ``ag``
    phase only (``plan_tree(self.topo, g, ..., root=root)``)."""
    children = spanning_tree(topo, group, root)
    kids = {c for cs in children.values() for c in cs}
    (root,) = [n for n in children if n not in kids]
    depth = {root: 0}
    frontier = [root]
    while frontier:
        nxt = []
        for p in frontier:
            for c in children[p]:
                depth[c] = depth[p] + 1
                nxt.append(c)
        frontier = nxt
    deepest = max(depth.values())
    b = _Builder(topo, "tree", sorted(group), pieces)
    b.owner[root].append((0, pieces))
    for parent, cs in children.items():
        for c in cs:
            b.add(b.rs, deepest - depth[c], c, parent, (0, pieces), True)
            b.add(b.ag, depth[parent], parent, c, (0, pieces), False)
    return b.build()


def plan_bcube(topo: Topology, group: Sequence[int], pieces: int) -> Plan:
    """BCube allreduce (Canary §4.4.2) over the whole BCube(alpha, beta) topology, one part per
    level so every NIC carries traffic in every round; ConfigError for another topology or a
    subset."""
    alpha, beta = int(topo.params.get("alpha", 0)), int(topo.params.get("beta", 0))
    if topo.kind != "bcube" or alpha < 2 or beta < 1:
        raise ConfigError("bcube plan needs a BCube topology (kind 'bcube' with alpha and beta)")
    g = sorted(group)
    if g != list(range(alpha**beta)) or topo.ids != g:
        raise ConfigError("bcube plan covers the whole BCube; use ring/tree for a subset")
    b = _Builder(topo, "bcube", g, pieces)
    digits = {x: bcube_digits(x, alpha, beta) for x in g}
    # current segment per (node, part), and the history of segments before each split
    cur = {(x, t): rng for x in g for t, rng in enumerate(split(0, pieces, beta))}
    hist: dict[tuple[int, int, int], Range] = {}

    def cube(x: int, level: int) -> list[int]:
        return [y for y in g if all((digits[x][k] == digits[y][k]) != (k == level) for k in range(beta))]

    for k in range(beta):  # reduce-scatter
        new = {}
        for t in range(beta):
            level = (t + k) % beta
            for x in g:
                seg = cur[(x, t)]
                hist[(x, t, k)] = seg
                subs = split(seg[0], seg[1], alpha)
                for y in cube(x, level):
                    b.add(b.rs, k, x, y, subs[digits[y][level]], True, level)
                new[(x, t)] = subs[digits[x][level]]
        cur = new
    for (x, _part), seg in cur.items():
        b.owner[x].append(seg)
    for step, k in enumerate(reversed(range(beta))):  # allgather, steps retraced
        for t in range(beta):
            level = (t + k) % beta
            for x in g:
                for y in cube(x, level):
                    b.add(b.ag, step, x, y, cur[(x, t)], False, level)
                cur[(x, t)] = hist[(x, t, k)]
    return b.build()


def make_plan(topo: Topology, group: Sequence[int], pieces: int, algo: str = "auto") -> Plan:
    """Choose and build a plan. ``auto``: the topology's own algorithm for the whole cluster
    (bcube, star, mesh, ring); for a subset: mesh if it is a clique, else ring, else tree."""
    g = sorted(set(group))
    if len(g) != len(group) or not g:
        raise ConfigError(f"bad group {list(group)}")
    if pieces < 0:
        raise ConfigError("pieces must be >= 0")
    if algo not in ALGOS:
        raise ConfigError(f"unknown collective algorithm {algo!r} (choose from {', '.join(ALGOS)})")
    if algo == "auto":
        whole = g == topo.ids
        clique = all(topo.routes(a, c) for a in g for c in g if a != c)
        if whole and topo.kind == "bcube" and len(g) > 1:
            algo = "bcube"
        elif whole and topo.kind == "star":
            algo = "star"
        elif clique and topo.kind != "ring" and len(g) > 2:
            algo = "mesh"
        elif len(g) == 1 or hamiltonian_cycle(topo, g) is not None:
            algo = "ring"
        else:
            algo = "tree"
    builders = {"ring": plan_ring, "mesh": plan_mesh, "bcube": plan_bcube, "star": plan_star,
                "tree": plan_tree}
    return builders[algo](topo, g, pieces)

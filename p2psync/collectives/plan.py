"""Collective plans: which node sends which pieces to whom, over which NIC, in which round. Pure.

A tensor is cut into ``pieces`` (about 1 MiB each). A :class:`Plan` has two phases:

* ``rs`` (reduce-scatter) rounds of *reduce* transfers: the receiver adds the pieces in;
* ``ag`` (allgather) rounds of *copy* transfers: the receiver overwrites the pieces.

After the ``rs`` phase ``owner[node]`` lists the piece ranges that node holds fully reduced;
the ``ag`` phase spreads them to everyone. Allreduce runs both phases, reduce-scatter the first,
allgather the second. A transfer goes between adjacent nodes over the sender's NIC on their
shared network, except in a group whose members are not joined by links among themselves
(ring-4 without nodes 0 and 2: members 1 and 3): its ring or tree is planned over relay links
(:func:`~p2psync.topology.paths.relay_links`), and a transfer between members that are not
adjacent names the non-members its pieces pass through (``via``); the transport relays them
hop by hop over live nodes (``Transport.send(..., relay=True)``). A group that its own links
join keeps exactly the plan it would have without relays. Relay links depend on the topology
only, so every member builds the same plan; whether the live nodes still join the group is
:func:`check_live`'s question, asked before each run of such a plan.

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
* ``direct``: ``mesh`` over any connected group: every member sends chunk j straight to its
  owner, member j (reduce), and every owner sends its chunk to every other member (copy), 2
  rounds; between members that are not adjacent the pieces are relayed along a shortest path
  (members included: :func:`~p2psync.topology.paths.shortest_links`), forwarded unchanged. Each
  member's contribution is therefore encoded once and summed (in float32) at the piece's owner,
  and the owner's sum encoded once for everyone, where a ring or a tree re-encodes growing
  partial sums at every hop: the plan a 4-bit codec needs (``e3m0``; DiLoCo's outer allreduce
  uses it). Each member sends 2(N-1)/N of the data, as a ring; the links carry more (the
  relayed hops: on ring-4 a third more, on ring-N about N/4 times a ring's).
* ``tree``: any connected group: reduce up a BFS spanning tree, broadcast down.

``auto`` over a group that needs relays: a ring over relay links when there is one, else a tree.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from functools import cached_property
from typing import Collection, Sequence

from p2psync.errors import ConfigError, GroupCutOff
from p2psync.topology import Topology, bcube_digits
from p2psync.topology.paths import (Cut, Links, group_links, hamiltonian_cycle, live_cut, relay_links, shortest_links,
                                    spanning_tree)

ALGOS = ("auto", "ring", "mesh", "bcube", "star", "tree", "direct")

Range = tuple[int, int]


@dataclass(frozen=True)
class Transfer:
    """One send in a round: ``src`` sends pieces [lo, hi) to ``dst`` over its NIC ``nic``;
    ``reduce``: the receiver adds them in (reduce-scatter), else overwrites (allgather).
    ``via``: empty when ``dst`` is adjacent; else the non-members a shortest path through
    non-members passes (``nic`` leads to the first), and the transport relays the pieces
    (over whichever live path is shortest when they are sent)."""

    src: int
    dst: int
    nic: str  # the sender's NIC
    lo: int  # piece range [lo, hi)
    hi: int
    reduce: bool
    via: tuple[int, ...] = ()


@dataclass(frozen=True)
class Plan:
    """A collective's schedule over ``group`` for a tensor cut into ``pieces``: the
    reduce-scatter rounds ``rs``, the allgather rounds ``ag`` and, after ``rs``, the piece
    ranges each node holds fully reduced (``owner``), and the nodes its relayed transfers
    pass through (``relays``; empty when every transfer crosses one link). Built by
    :func:`make_plan` (or a ``plan_*`` builder); run by the collectives' executor (executor.py:
    ``self._plans[key] = make_plan(self.topo, g, key[1], key[2])``)."""

    algo: str
    group: tuple[int, ...]
    pieces: int
    rs: tuple[tuple[Transfer, ...], ...]
    ag: tuple[tuple[Transfer, ...], ...]
    owner: dict[int, tuple[Range, ...]] = field(default_factory=dict)
    relays: frozenset[int] = frozenset()

    @cached_property
    def by_node(self) -> dict[int, tuple[tuple[Transfer, ...], array[int]]]:
        """Per node, the transfers it sends or receives, in order of phase (``rs`` first), round
        and place in the round, with the round of each (``rs`` rounds 0, 1, ...; the ``ag``
        rounds after them: ``len(rs)``, ``len(rs) + 1``, ...); a node in no transfer is
        absent. Made once per plan, on first use (what every node's schedule starts from)."""
        ts: dict[int, list[Transfer]] = {}
        rounds: dict[int, array[int]] = {}
        for r, rnd in enumerate((*self.rs, *self.ag)):
            for t in rnd:
                for node in (t.src,) if t.src == t.dst else (t.src, t.dst):
                    if node not in ts:
                        ts[node], rounds[node] = [], array("i")
                    ts[node].append(t)
                    rounds[node].append(r)
        return {node: (tuple(ts[node]), rounds[node]) for node in ts}

    @cached_property
    def cuts(self) -> dict[frozenset[int], tuple[Topology, Cut | None]]:
        """:func:`check_live`'s answers by the dead nodes it was asked about (with the topology
        asked over): a plan outlives many operations and the dead set rarely changes."""
        return {}

    def sent_by(self, node: int) -> int:
        """Pieces ``node`` sends in a full allreduce."""
        return sum(t.hi - t.lo for rnd in (*self.rs, *self.ag) for t in rnd if t.src == node)


def split(lo: int, hi: int, k: int) -> list[Range]:
    """``k`` contiguous, nearly equal sub-ranges of [lo, hi) (some empty when hi - lo < k)."""
    n = hi - lo
    return [(lo + (n * j) // k, lo + (n * (j + 1)) // k) for j in range(k)]


class _Builder:
    def __init__(self, topo: Topology, algo: str, group: Sequence[int], pieces: int,
                 links: Links | None = None) -> None:
        """``links``: the relay links the plan was made over (transfers between members that
        are not adjacent go through the nodes they name), None for direct links only."""
        self.topo = topo
        self.algo = algo
        self.group = tuple(group)
        self.pieces = pieces
        self.links = links
        self.rs: list[list[Transfer]] = []
        self.ag: list[list[Transfer]] = []
        self.owner: dict[int, list[Range]] = {g: [] for g in group}
        self.relays: set[int] = set()

    def via(self, src: int, dst: int) -> tuple[int, ...]:
        if self.links is None or self.topo.routes(src, dst):
            return ()
        return self.links[src][dst]

    def nic(self, src: int, dst: int, level: int | None = None) -> str:
        via = self.via(src, dst)
        routes = self.topo.routes(src, via[0] if via else dst)
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
        via = self.via(src, dst)
        self.relays.update(via)
        phase[rnd].append(Transfer(src, dst, self.nic(src, dst, level), rng[0], rng[1], reduce, via))

    def build(self) -> Plan:
        return Plan(self.algo, self.group, self.pieces, tuple(tuple(r) for r in self.rs),
                    tuple(tuple(r) for r in self.ag),
                    {g: tuple(r for r in rs if r[1] > r[0]) for g, rs in self.owner.items()},
                    frozenset(self.relays))


#: dead sets whose :func:`check_live` answer a plan keeps (cleared when there are this many)
MAX_CUTS_KEPT = 64


def check_live(plan: Plan, topo: Topology, dead: Collection[int]) -> None:
    """Raise :class:`~p2psync.errors.GroupCutOff` when ``plan`` relays through other nodes and
    the nodes not in ``dead`` no longer join its members (which members are cut off from which,
    and which dead nodes would have joined them); a plan over direct links never does."""
    if not plan.relays:
        return
    key = frozenset(dead)
    hit = plan.cuts.get(key)
    if hit is None or hit[0] is not topo:
        if len(plan.cuts) >= MAX_CUTS_KEPT:
            plan.cuts.clear()
        hit = plan.cuts[key] = (topo, live_cut(topo, plan.group, key))
    cut = hit[1]
    if cut is not None:
        raise GroupCutOff(cut.describe(), parts=cut.parts, peers=cut.bridges)


def plan_ring(topo: Topology, group: Sequence[int], pieces: int, order: Sequence[int] | None = None) -> Plan:
    """Ring allreduce around ``order`` (default: a Hamiltonian cycle of ``group`` over direct
    links, else over its relay links; ConfigError when there is none); see the module
    docstring."""
    links: Links | None = None
    if order is None:
        order = hamiltonian_cycle(topo, group)
        if order is None:
            links = relay_links(topo, group)
            order = hamiltonian_cycle(topo, group, links=links)
    else:
        order = list(order)
        if any(not topo.routes(a, c) for a, c in zip(order, order[1:] + order[:1]) if a != c):
            links = relay_links(topo, group)
            if any(c not in links[a] for a, c in zip(order, order[1:] + order[:1]) if a != c):
                raise ConfigError(f"ring plan: order {order} has neighbours that no path through non-members joins")
    if order is None:
        raise ConfigError(f"ring plan: group {sorted(group)} has no ring, even through other nodes")
    b = _Builder(topo, "ring", sorted(group), pieces, links)
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
    return _all_to_owner(_Builder(topo, "mesh", g, pieces))


def plan_direct(topo: Topology, group: Sequence[int], pieces: int) -> Plan:
    """The mesh allreduce over any group the topology joins, relayed along shortest paths
    between members that are not adjacent (see the module docstring); ConfigError when the
    topology does not join the group."""
    g = sorted(group)
    return _all_to_owner(_Builder(topo, "direct", g, pieces, shortest_links(topo, g)))


def _all_to_owner(b: _Builder) -> Plan:
    """Member j owns chunk j: every other member reduces its chunk j into it in round 0, and it
    copies the sum to every other member in round 0 of the allgather."""
    g = b.group
    chunks = split(0, b.pieces, len(g))
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
    best-connected node), then copy down; over the group's direct links when they join it,
    else over its relay links. Also the broadcast plan: executor.py runs its ``ag`` phase only
    (``plan_tree(self.topo, g, ..., root=root)``)."""
    links = group_links(topo, group)
    children = spanning_tree(topo, group, root, links=links)
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
    b = _Builder(topo, "tree", sorted(group), pieces, links)
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
    (bcube, star, mesh, ring); for a subset: mesh if it is a clique, else ring, else tree; for
    a subset its own links do not join: a ring over its relay links, else a tree over them."""
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
            links = group_links(topo, g)
            algo = "ring" if links is not None and hamiltonian_cycle(topo, g, links=links) is not None else "tree"
    builders = {"ring": plan_ring, "mesh": plan_mesh, "bcube": plan_bcube, "star": plan_star,
                "tree": plan_tree, "direct": plan_direct}
    return builders[algo](topo, g, pieces)

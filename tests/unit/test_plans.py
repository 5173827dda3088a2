"""Collective plans are data: check them by simulating who contributed to every piece."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2psync.collectives.plan import (check_live, make_plan, plan_bcube, plan_direct, plan_mesh, plan_ring, plan_tree,
                                      split)
from p2psync.errors import ConfigError, GroupCutOff
from p2psync.topology import bcube, mesh, ring, star
from p2psync.topology.paths import live_cut, relay_links


def simulate(plan, topo):
    """contrib[node][piece] = vector counting each member's contribution."""
    g = list(plan.group)
    pos = {n: i for i, n in enumerate(g)}
    state = {n: np.zeros((plan.pieces, len(g)), dtype=np.int64) for n in g}
    for n in g:
        state[n][:, pos[n]] = 1
    for phase in (plan.rs, plan.ag):
        for rnd in phase:
            snap = {n: s.copy() for n, s in state.items()}
            for t in rnd:
                # no transfer over a NIC pair that shares no network; a relayed one names a path
                # through non-members, leaving by the NIC towards its first node
                hops = [t.src, *t.via, t.dst]
                assert any(r.local_nic == t.nic for r in topo.routes(t.src, hops[1])), t
                assert all(topo.routes(a, c) for a, c in zip(hops, hops[1:])), t
                # (a direct plan relays through any node, members too: they forward bytes unchanged)
                assert (plan.algo == "direct" or not set(t.via) & set(g)) and set(t.via) <= plan.relays, t
                assert bool(t.via) == (not topo.routes(t.src, t.dst)), t
                assert t.src in pos and t.dst in pos and 0 <= t.lo < t.hi <= plan.pieces
                if t.reduce:
                    state[t.dst][t.lo:t.hi] += snap[t.src][t.lo:t.hi]
                else:
                    state[t.dst][t.lo:t.hi] = snap[t.src][t.lo:t.hi]
        if phase is plan.rs:  # owners hold exactly one contribution per member
            owned = np.zeros(plan.pieces, dtype=np.int64)
            for n, ranges in plan.owner.items():
                for lo, hi in ranges:
                    assert (state[n][lo:hi] == 1).all(), (n, lo, hi)
                    owned[lo:hi] += 1
            assert (owned == 1).all()  # every piece has exactly one owner
    for n in g:
        assert (state[n] == 1).all(), f"node {n} does not end with every piece reduced once"
    return state


@pytest.mark.parametrize("topo,algo", [
    (ring(4), "ring"), (ring(5), "auto"), (mesh(4), "mesh"), (mesh(5), "ring"),
    (bcube(2, 2), "bcube"), (bcube(3, 2), "bcube"), (bcube(2, 3), "bcube"), (star(5), "star"),
    (star(5), "tree"), (bcube(3, 2), "ring"), (bcube(2, 2), "tree"),
    (ring(4), "direct"), (ring(7), "direct"), (bcube(3, 2), "direct"), (star(5), "direct"), (mesh(4), "direct"),
])
@pytest.mark.parametrize("pieces", [0, 1, 3, 7, 36, 101])
def test_plan_invariants(topo, algo, pieces):
    plan = make_plan(topo, topo.ids, pieces, algo)
    simulate(plan, topo)


def _encodings(plan):
    """Per piece, how many times a value of it is encoded on its way: a reduce transfer sends
    the sender's values as they stand then (its own, or a partial sum it holds), a copy the
    owner's sealed sum (encoded once, forwarded unchanged). Returns, per (owner's) piece, the
    most encodings any one member's contribution went through before it reached the owner's
    sum: 1 for a plan that sends each contribution straight to its owner."""
    g = list(plan.group)
    # depth[n][k]: encodings behind the partial sum node n holds for piece k (0: its own value)
    depth = {n: np.zeros(plan.pieces, dtype=np.int64) for n in g}
    for rnd in plan.rs:
        snap = {n: d.copy() for n, d in depth.items()}
        for t in rnd:
            depth[t.dst][t.lo:t.hi] = np.maximum(depth[t.dst][t.lo:t.hi], snap[t.src][t.lo:t.hi] + 1)
    return max((int(depth[n][lo:hi].max()) for n, rs in plan.owner.items() for lo, hi in rs if hi > lo), default=0)


@pytest.mark.parametrize("topo", [ring(4), ring(8), bcube(2, 2), bcube(3, 2), star(5), mesh(5)])
def test_direct_plan_encodes_every_contribution_once(topo):
    """The plan a 4-bit codec needs: each member's values reach the piece's owner in one
    encoded transfer (relays forward the bytes), where the ring's partial sums are encoded N-1
    times on the way; every member sends 2(N-1)/N of the data, as a ring."""
    n, pieces = topo.size, 12 * topo.size
    direct = plan_direct(topo, topo.ids, pieces)
    simulate(direct, topo)
    assert _encodings(direct) == 1
    assert len(direct.rs) == len(direct.ag) == 1
    for node in topo.ids:
        assert direct.sent_by(node) == 2 * (n - 1) * pieces // n
    if topo.kind == "ring":
        assert _encodings(make_plan(topo, topo.ids, pieces, "ring")) == n - 1
        # ring-4: node 0 reaches node 2 through node 1 (the lower id of the two shortest ways)
        assert {t.via for t in direct.rs[0] if (t.src, t.dst) == (0, 2)} == {(1,)} if n == 4 else True
        assert direct.relays and direct.relays <= frozenset(topo.ids)
    if topo.kind == "mesh":
        assert not direct.relays


def test_direct_plan_of_a_subset_and_a_dead_relay():
    """A subset relays through whatever joins it; a plan whose relays died names the cut."""
    topo = ring(6)
    plan = make_plan(topo, [0, 3], 10, "direct")
    simulate(plan, topo)
    assert {(t.src, t.via) for t in plan.rs[0]} == {(0, (1, 2)), (3, (2, 1))}  # lower ids first
    check_live(plan, topo, dead={1})  # around the other side of the ring
    with pytest.raises(GroupCutOff):
        check_live(plan, topo, dead={1, 5})


def test_auto_picks_topology_algorithm():
    assert make_plan(bcube(3, 2), range(9), 10).algo == "bcube"
    assert make_plan(star(5), range(5), 10).algo == "star"
    assert make_plan(mesh(4), range(4), 10).algo == "mesh"
    assert make_plan(ring(6), range(6), 10).algo == "ring"
    assert make_plan(bcube(2, 2), [0, 1, 3], 10).algo == "tree"  # 0-1-3 is a path, not a ring
    assert make_plan(mesh(6), [1, 4], 10).algo == "ring"


def test_traffic_volumes():
    n, p = 4, 400
    r = plan_ring(ring(n), range(n), p)
    m = plan_mesh(mesh(n), range(n), p)
    for node in range(n):
        assert r.sent_by(node) == 2 * (n - 1) * p // n  # 2(N-1)/N of the data
        assert m.sent_by(node) == 2 * (n - 1) * p // n
    assert len(r.rs) == len(r.ag) == n - 1 and len(m.rs) == len(m.ag) == 1


def test_bcube_uses_every_nic_in_every_round_and_balances_them():
    topo = bcube(3, 2)
    plan = plan_bcube(topo, range(9), 9 * 2 * 10)
    assert len(plan.rs) == len(plan.ag) == 2  # beta steps per phase
    for rnd in (*plan.rs, *plan.ag):
        for node in range(9):
            nics = {t.nic for t in rnd if t.src == node}
            assert nics == {"l0", "l1"}  # both levels work in parallel (Table 2)
    per_nic = {(x, nic): 0 for x in range(9) for nic in ("l0", "l1")}
    for rnd in (*plan.rs, *plan.ag):
        for t in rnd:
            per_nic[(t.src, t.nic)] += t.hi - t.lo
    vals = np.array(list(per_nic.values()))
    assert vals.max() <= 1.1 * vals.min()


def test_bcube_matches_table2_for_w00():
    # Table 2: after the two allgather(-reduce) steps W(0,0) holds pieces fully reduced over all
    # nine workers; it owns 1/9 of each of the two thread parts
    plan = plan_bcube(bcube(3, 2), range(9), 36)
    assert len(plan.owner[0]) == 2
    assert sum(hi - lo for lo, hi in plan.owner[0]) == 4  # 36 pieces / 9 workers


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_groups(data):
    kind = data.draw(st.sampled_from(["ring", "mesh", "bcube", "star"]))
    topo = {"ring": ring(7), "mesh": mesh(6), "bcube": bcube(2, 3), "star": star(6)}[kind]
    size = data.draw(st.integers(1, topo.size))
    group = data.draw(st.permutations(topo.ids))[:size]
    pieces = data.draw(st.integers(0, 40))
    plan = make_plan(topo, group, pieces)
    simulate(plan, topo)
    # relays only where the group's own links do not join it (else exactly the plan of before);
    # a plan of no pieces moves nothing, through relays or not
    assert bool(plan.relays) == (pieces > 0 and not _connected(topo, group))
    bcast = plan_tree(topo, group, pieces, root=group[0])
    simulate(bcast, topo)
    assert bool(bcast.relays) == (pieces > 0 and not _connected(topo, group))


def _connected(topo, group):
    g = set(group)
    seen, todo = {group[0]}, [group[0]]
    while todo:
        for b in topo.neighbors(todo.pop()):
            if b in g and b not in seen:
                seen.add(b)
                todo.append(b)
    return seen == g


def test_split():
    assert split(0, 10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert split(5, 7, 4) == [(5, 5), (5, 6), (6, 6), (6, 7)]


def test_bad_inputs():
    with pytest.raises(ConfigError):
        make_plan(ring(4), [0, 0], 3)
    with pytest.raises(ConfigError):
        make_plan(ring(4), [0, 1], 3, algo="nope")
    with pytest.raises(ConfigError):
        plan_mesh(ring(4), range(4), 3)
    with pytest.raises(ConfigError):
        plan_bcube(ring(4), range(4), 3)


def test_ring4_pair_without_a_link_is_planned_through_a_non_member():
    """Members 1 and 3 of ring-4 share no link: a ring of two over relay links, through node 0
    (the lowest id on a shortest path through non-members), every member building the same."""
    topo = ring(4)
    assert relay_links(topo, [1, 3]) == {1: {3: (0,)}, 3: {1: (0,)}}
    plan = make_plan(topo, [3, 1], 10)
    assert plan.algo == "ring" and plan.relays == {0}
    assert {(t.src, t.dst, t.via, t.nic) for rnd in (*plan.rs, *plan.ag) for t in rnd} == \
        {(1, 3, (0,), "left"), (3, 1, (0,), "right")}
    simulate(plan, topo)
    assert plan.sent_by(1) == plan.sent_by(3) == 10  # each sends half in each phase
    check_live(plan, topo, dead={2})  # node 0 alive: fine (the transport goes through it)
    check_live(plan, topo, dead={0})  # node 2 alive: fine (the transport goes around 0)
    assert make_plan(topo, [1, 3], 10, "tree").relays == {0}
    assert make_plan(topo, [0, 1, 2], 10).relays == frozenset()  # its own links join it


def test_groups_their_own_links_join_keep_the_plan_they_had():
    """A group joined by its own links plans exactly as before (no relays), whatever is dead;
    an explicit ring that the group's links lack goes over relay links instead of failing."""
    assert make_plan(ring(5), [0, 1, 3, 4], 8).algo == "tree"  # 3-4-0-1: a path, no ring
    assert not make_plan(ring(5), [0, 1, 3, 4], 8).relays
    r = make_plan(ring(5), [0, 1, 3, 4], 8, "ring")
    assert r.relays == {2}
    simulate(r, ring(5))
    for group in ([0, 2, 3], [1, 4], [0, 5]):
        plan = make_plan(mesh(6), group, 12)
        assert not plan.relays and plan == make_plan(mesh(6), group, 12)
        check_live(plan, mesh(6), dead=set(range(6)) - set(group))  # nothing to ask of the dead


def test_bcube_members_on_no_common_network():
    """BCube(3,2): 0, 4 and 8 differ in both digits, so no two share a network; each pair is
    joined through the one node that shares a digit with both."""
    topo = bcube(3, 2)
    assert relay_links(topo, [0, 4, 8]) == {0: {4: (1,), 8: (2,)}, 4: {0: (1,), 8: (5,)},
                                            8: {0: (2,), 4: (5,)}}
    plan = make_plan(topo, [0, 4, 8], 30)
    assert plan.algo == "ring" and plan.relays == {1, 2, 5}
    simulate(plan, topo)
    check_live(plan, topo, dead={1, 2, 5})  # other paths remain (e.g. 0-3-4, 0-6-8)
    # every neighbour of node 0 dead: any one of them would join it to node 4 again
    cut = live_cut(topo, [0, 4], dead={1, 2, 3, 6})
    assert cut is not None and cut.parts == ((0,), (4,)) and cut.bridges == (1, 2, 3, 6)


def test_star_leaves_through_a_departed_hub():
    topo = star(5)
    plan = make_plan(topo, [1, 2, 3, 4], 16)
    assert plan.algo == "ring" and plan.relays == {0}
    simulate(plan, topo)


def test_a_group_the_live_nodes_do_not_join_is_a_clear_error():
    """Ring-4 without its nodes 0 and 2: members 1 and 3 are cut apart; the error names them
    and the dead nodes that would have joined them, and is a PeerFailure (strategies wait for
    a newer view), not a ConfigError."""
    topo = ring(4)
    plan = make_plan(topo, [1, 3], 4)
    with pytest.raises(GroupCutOff) as info:
        check_live(plan, topo, dead={0, 2})
    msg = str(info.value)
    assert "members [1] and [3] cannot reach each other" in msg
    assert "any one of dead nodes [0, 2] would have connected them" in msg
    assert info.value.parts == ((1,), (3,)) and info.value.peers == (0, 2)
    assert not isinstance(info.value, ConfigError)
    # no single dead node would do: the fewest that would, together
    cut = live_cut(ring(8), [1, 5], {0, 2, 3, 6, 7})
    assert cut is not None and cut.together and cut.bridges == (2, 3)
    assert "dead nodes [2, 3] together would have connected them" in cut.describe()
    cut = live_cut(ring(8), [1, 5], {0, 3, 6, 7})
    assert cut is not None and cut.describe().endswith("dead node 3 would have connected them")
    cut = live_cut(ring(8), [1, 3, 5], {0, 2, 4, 6})
    assert cut is not None and cut.parts == ((1,), (3,), (5,)) and cut.bridges == (2, 4)
    assert live_cut(ring(8), [1, 5], {0}) is None  # the other way round


def test_a_ring_of_a_thousand_nodes_is_planned_without_recursing_node_by_node():
    """The Hamiltonian cycle's search keeps its path on an explicit stack: a ring deeper than
    Python's recursion limit is planned as a ring, and the line a kill leaves as a tree."""
    topo = ring(1200)
    plan = make_plan(topo, topo.ids, 1)
    assert plan.algo == "ring" and sum(len(r) for r in plan.rs) == sum(len(r) for r in plan.ag) == 1199
    assert all(topo.routes(t.src, t.dst) for r in plan.rs for t in r)
    line = make_plan(topo, [i for i in topo.ids if i != 600], 1)
    assert line.algo == "tree" and not line.relays and sum(len(r) for r in line.rs) == 1198


def test_a_small_tensor_is_not_cut_into_pieces_smaller_than_the_spread_floor():
    """With a spread floor (the simulator's SPREAD_FLOOR_BYTES) a tensor is spread over the
    members only in pieces that large: a 64-byte vector over 1024 members is one piece (one
    message per hop), not 16 of one element; a large one is still spread over every member,
    and ``piece_bytes`` still caps a piece. Without one (real runs) it is spread down to one
    element a piece, so that every owner of a piece sees a sum that overflows."""
    from p2psync.collectives.executor import SPREAD_FLOOR_BYTES, Collectives
    from p2psync.transport.memory import MemoryHub

    topo = ring(4)
    ep = MemoryHub(topo).endpoint(0)
    c = Collectives(ep, spread_floor_bytes=SPREAD_FLOOR_BYTES)
    assert c._pieces(np.zeros(16, np.float32), 1024) == 1
    floor = SPREAD_FLOOR_BYTES // 4
    assert c._pieces(np.zeros(4 * floor, np.float32), 4) == 4
    assert c._pieces(np.zeros(2 * floor, np.float32), 4) == 2
    assert Collectives(ep, piece_bytes=64, spread_floor_bytes=SPREAD_FLOOR_BYTES)._pieces(np.zeros(64, np.float32), 4) == 4
    assert Collectives(ep)._pieces(np.zeros(16, np.float32), 1024) == 16
    with pytest.raises(ConfigError):
        Collectives(ep, spread_floor_bytes=-1)


def test_the_kept_answer_of_check_live_follows_the_dead_set_and_the_topology():
    """check_live keeps its answer per dead set on the plan: the same question answered again
    (cut, then whole again, then cut), a changed dead set (a set that is later changed in place
    included) asked afresh, and a plan asked over another topology not given the other's answer."""
    topo = ring(4)
    plan = make_plan(topo, [1, 3], 4)
    dead = {0}
    for _ in range(2):
        check_live(plan, topo, dead=dead)
        dead.add(2)  # changed in place: now cut
        with pytest.raises(GroupCutOff):
            check_live(plan, topo, dead=dead)
        dead.discard(2)
    check_live(plan, topo, dead=dead)
    with pytest.raises(GroupCutOff):
        check_live(plan, topo, dead={0, 2})
    # mesh-4 joins 1 and 3 directly: the same plan asked over it is not cut
    check_live(plan, mesh(4), dead={0, 2})

"""Canary's BCube / mesh schedule and its additive routing (spec ../shared/specs/canary.md §6.3,
§6.4, §8 C14-C17): exact sums in lockstep, the per-NIC counts, Table 2's states on node 0, and
exactly-once delivery under random asynchronous interleavings."""

from __future__ import annotations

import random
from typing import Iterator

import numpy as np
import pytest

from p2psync.strategies.canary.flow import Datum, Flow
from p2psync.strategies.canary.plan import Layout, layout_for
from p2psync.topology import bcube, mesh, ring


def flows_for(layout: Layout, n: int, piece: int = 1 << 30) -> dict[int, Flow]:
    slots = layout.slots(n, piece)
    return {x: Flow(layout, x, slots) for x in layout.group}


def own(flow: Flow, vec: np.ndarray, it: int = 0) -> None:
    for s in flow.slots:
        flow.add(s, 0, Datum(vec[s.lo:s.hi].astype(np.float64), 1, 1 << flow.me, it, it))


def exchange(flows: dict[int, Flow], x: int, thread: int, step: int, y: int) -> None:
    """``x`` pushes its outbox for (step, y); ``y`` takes it and answers with its own outbox
    for ``x`` (Canary's push and immediate reply, spec §6.5)."""
    fx, fy = flows[x], flows[y]
    for s in fx.send_slots(thread, step, y):
        d = fx.take_outbox(step, y, s)
        if d is not None:
            fy.add(s, step + 1, d, x)
    for s in fy.send_slots(thread, step, x):
        d = fy.take_outbox(step, x, s)
        if d is not None:
            fx.add(s, step + 1, d, y)


def lockstep_steps(flows: dict[int, Flow], layout: Layout) -> Iterator[int]:
    """The synchronous schedule: every node runs step k of every thread before step k + 1; the
    exchanges of one step are symmetric pairs (each pair once). Yields each step once it is done
    (``for k in lockstep_steps(flows, layout):`` looks at the state after step k)."""
    for k in range(layout.steps):
        for t in range(layout.levels):
            for x in layout.group:
                for y in layout.peers(x, t, k):
                    if x < y:
                        exchange(flows, x, t, k, y)
        yield k


def lockstep(flows: dict[int, Flow], layout: Layout) -> None:
    """The whole synchronous schedule (:func:`lockstep_steps`)."""
    for _ in lockstep_steps(flows, layout):
        pass


def result(flow: Flow, n: int) -> tuple[np.ndarray, list[int], int]:
    out = np.zeros(n)
    counts, mask = [], -1
    for s in flow.slots:
        d = flow.take_result(s)
        counts.append(d.count if d else 0)
        mask &= d.mask if d else 0
        if d is not None:
            out[s.lo:s.hi] = d.vec
    return out, counts, mask


@pytest.mark.parametrize("alpha,beta", [(2, 2), (3, 2), (4, 2), (5, 2), (2, 3), (3, 3)])
def test_bcube_schedule_gives_every_node_the_exact_sum(alpha, beta):
    topo = bcube(alpha, beta)
    layout = layout_for(topo, topo.ids)
    assert layout.kind == "bcube" and layout.levels == beta and layout.alpha == alpha
    n = 61
    rng = np.random.default_rng(alpha * 10 + beta)
    vecs = {x: rng.integers(-50, 50, n).astype(np.float64) for x in topo.ids}
    flows = flows_for(layout, n)
    for x in topo.ids:
        own(flows[x], vecs[x])
    lockstep(flows, layout)
    total = sum(vecs.values())
    for x in topo.ids:
        got, counts, mask = result(flows[x], n)
        assert np.array_equal(got, total), x
        assert counts == [topo.size] * len(flows[x].slots) and mask == (1 << topo.size) - 1
        assert not flows[x].outbox  # nothing left behind


@pytest.mark.parametrize("alpha,beta", [(2, 2), (3, 2), (4, 2), (2, 3), (3, 3)])
def test_every_nic_carries_beta_plus_one_times_alpha_minus_one_slots(alpha, beta):
    """C15, C16: α·β slots per worker; (β+1)(α−1) slot sends per NIC per round, and in every
    step the β threads use β distinct levels, each transfer inside a cube of that level."""
    topo = bcube(alpha, beta)
    layout = layout_for(topo, topo.ids)
    assert len(layout.slots(10_000, 1 << 30)) == alpha * beta
    for x in topo.ids:
        assert layout.nic_sends(x) == {lvl: (beta + 1) * (alpha - 1) for lvl in range(beta)}
        for k in range(layout.steps):
            levels = [layout.level(t, k) for t in range(beta)]
            assert sorted(levels) == list(range(beta))
            for t in range(beta):
                for y in layout.peers(x, t, k):
                    nic = f"l{layout.level(t, k)}"
                    assert any(r.local_nic == nic for r in topo.routes(x, y))


def test_bcube_3x2_has_54_slots_in_all_and_6_per_nic():
    topo = bcube(3, 2)
    layout = layout_for(topo, topo.ids)
    assert sum(len(layout.slots(6 * 100, 1 << 30)) for _ in topo.ids) == 54
    assert layout.nic_sends(0) == {0: 6, 1: 6}


def test_table_2_states_on_node_0():
    """C14: on W_(0,0) (node 0) of BCube(3,2): after AG-1 it holds ⟨τ0,0⟩ of W_(0,*) and ⟨τ1,0⟩
    of W_(*,0); after AG-2 both of every worker; after AR-1 every slot of every worker."""
    topo = bcube(3, 2)
    layout = layout_for(topo, topo.ids)
    n = 6
    flows = flows_for(layout, n)
    for x in topo.ids:  # worker x contributes 10**x to every element: sums show who is in
        own(flows[x], np.full(n, 10.0**x))
    s00 = next(s for s in flows[0].slots if s.thread == 0 and s.owner == 0)
    s10 = next(s for s in flows[0].slots if s.thread == 1 and s.owner == 0)

    def who(slot) -> set[int]:
        d = flows[0].result.get(slot.index)
        return {x for x in topo.ids if d is not None and int(d.vec[0] // 10.0**x) % 10 == 1}

    steps = [(who(s00), who(s10)) for _ in lockstep_steps(flows, layout)]
    w0_ = {0, 1, 2}  # W_(0,*): level-0 cube of node 0
    w_0 = {0, 3, 6}  # W_(*,0): level-1 cube
    everyone = set(topo.ids)
    assert steps[0] == (w0_, w_0)
    assert steps[1] == (everyone, everyone)
    assert all(len(who(s)) == 9 for s in flows[0].slots)  # AR-1: every slot, every worker


def test_mesh_fig_10_example():
    """C17: N = 3, g_w = [10w+1, 10w+2, 10w+3] (1-based w) -> [63, 66, 69] everywhere."""
    topo = mesh(3)
    layout = layout_for(topo, topo.ids)
    assert layout.kind == "mesh" and layout.levels == 1 and layout.alpha == 3
    flows = flows_for(layout, 3)
    for x in topo.ids:
        own(flows[x], np.array([10.0 * (x + 1) + 1, 10.0 * (x + 1) + 2, 10.0 * (x + 1) + 3]))
    lockstep(flows, layout)
    for x in topo.ids:
        assert result(flows[x], 3)[0].tolist() == [63, 66, 69]


def test_groups_that_are_not_a_whole_bcube_use_the_mesh_layout():
    topo = bcube(2, 2)
    assert layout_for(topo, [0, 1, 3]).kind == "mesh"
    lay = layout_for(ring(4), [0, 1, 2, 3])
    assert lay.kind == "mesh" and lay.peers(0, 0, 0) == (1, 2, 3)
    assert layout_for(ring(4), [2]).peers(2, 0, 0) == ()


@pytest.mark.parametrize("kind", ["bcube32", "bcube22", "bcube23", "mesh5"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_asynchronous_interleavings_deliver_every_contribution_exactly_once(kind, seed):
    """Nodes run their steps in a random order, some add their gradient late (after others
    finished their round), results are taken at random times: summed over all the rounds a
    node takes, every contribution arrives exactly once (no loss, no double count)."""
    topo = {"bcube32": bcube(3, 2), "bcube22": bcube(2, 2), "bcube23": bcube(2, 3), "mesh5": mesh(5)}[kind]
    layout = layout_for(topo, topo.ids)
    rng = random.Random(seed)
    n = 23
    gen = np.random.default_rng(seed)
    flows = flows_for(layout, n, piece=3)
    rounds = 3
    vecs = {(x, r): gen.integers(-9, 9, n).astype(np.float64) for x in topo.ids for r in range(rounds)}
    taken = {x: np.zeros(n) for x in topo.ids}
    counts = {x: 0 for x in topo.ids}
    # each node's program: per round, own gradient, then every (thread, step, peer) exchange
    programs = {x: [("own", r) for r in range(rounds)] for x in topo.ids}
    for x in topo.ids:
        prog = []
        for r in range(rounds):
            prog.append(("own", r))
            steps = [(t, k, y) for k in range(layout.steps) for t in range(layout.levels)
                     for y in layout.peers(x, t, k)]
            prog += [("x", s) for s in steps]
            prog.append(("take", r))
        programs[x] = prog
    pcs = {x: 0 for x in topo.ids}
    while any(pcs[x] < len(programs[x]) for x in topo.ids):
        x = rng.choice([x for x in topo.ids if pcs[x] < len(programs[x])])
        op, arg = programs[x][pcs[x]]
        pcs[x] += 1
        if op == "own":
            own(flows[x], vecs[(x, arg)], it=arg)
        elif op == "x":
            t, k, y = arg
            exchange(flows, x, t, k, y)
        else:
            got, cs, _ = result(flows[x], n)
            taken[x] += got
            counts[x] += sum(cs)
    for _ in range(layout.steps + 1):  # drain what still sits in outboxes
        lockstep(flows, layout)
    total = sum(vecs.values())
    for x in topo.ids:
        got, cs, _ = result(flows[x], n)
        taken[x] += got
        counts[x] += sum(cs)
        assert np.array_equal(taken[x], total), (x, taken[x] - total)
        assert counts[x] == topo.size * rounds * len(flows[x].slots)


def test_a_slot_from_the_wrong_stage_is_refused():
    topo = bcube(2, 2)
    layout = layout_for(topo, topo.ids)
    slots = layout.slots(8, 1 << 30)
    owned = next(s for s in slots if layout.owns(0, s))
    other = next(s for s in slots if not layout.owns(0, s))
    with pytest.raises(ValueError):
        layout.route(0, owned, layout.levels + 1)  # an owned slot never comes in the AR step
    with pytest.raises(ValueError):
        layout.route(0, other, 1)  # a slot it does not own never comes in the allgather

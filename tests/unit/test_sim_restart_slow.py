"""Restarts and slow links in the simulator (p2psync/sim/faults.py, cluster.py, invariants.py):
their text form, their draw, the invariants on crafted views, and runs of the real membership
where a restarted node rejoins and a slowed node is declared failed only when it must be."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest

from p2psync.coordinator.detector import RTT_WINDOW
from p2psync.coordinator.membership_state import reborn, walled_in
from p2psync.coordinator.peer_status import left_out
from p2psync.coordinator.views import View
from p2psync.errors import ConfigError
from p2psync.sim import invariants as inv
from p2psync.sim.cluster import SimCluster, SimOptions
from p2psync.sim.faults import Fault, draw, parse_faults
from p2psync.sim.loop import VirtualLoop, run
from p2psync.topology import groups, mesh, ring

ALL_HELD = {"one_coordinator_per_term": "held", "faults_detected_in_bound": "held", "no_false_failure": "held",
            "one_view_at_end": "held", "bounded_queues": "held"}


def test_a_restart_of_a_node_killed_in_an_even_split_owns_the_declaration_of_its_old_process() -> None:
    # ring-8 without node 0 is a line 1..7: the kill of 4 leaves 1-3 | 5-7, no majority, and
    # nobody may be removed; its restart joins them again, and the old process of 4, still a
    # member, must be declared in the restart's bound (the new one is admitted only then)
    ring8 = {i: [(i - 1) % 8, (i + 1) % 8] for i in range(8)}
    members = tuple(range(1, 8))
    kill, restart = Fault(kind="kill", at=20.0, nodes=(4,)), Fault(kind="restart", at=25.0, nodes=(4,))
    assert inv.cut_by(kill, [kill], members, ring8) is None
    assert inv.cut_by(restart, [kill, restart], members, ring8) == [4]
    base = [_v(0, n, members, coord=1) for n in members]
    declared = [*base, _v(25.8, 5, (1, 2, 3, 5, 6, 7), epoch=2, coord=5)]
    timing: dict[str, Any] = dict(bound=3.0, failure_timeout=2.0, links=ring8)
    found, verdict = inv.detections([kill, restart], declared, **timing)
    assert verdict == "held" and found[1]["declared_after_s"] == {"4": pytest.approx(0.8)}
    assert inv.no_false_failure([kill, restart], declared, **timing) == "held"
    assert "never declared failed: [4]" in inv.detections([kill, restart], base, **timing)[1]
    # before the restart the split still removes nobody
    early = [*base, _v(22.0, 5, (1, 2, 3, 5, 6, 7), epoch=2, coord=5)]
    assert "no group of nodes holds a majority" in inv.detections([kill, restart], early, **timing)[1]
    # with no majority before it, the restart's nodes may be declared within two bounds: the
    # far arc may have deposed the coordinator meanwhile, and a successor is elected first
    assert inv.leaderless_before(restart, [kill, restart], members, ring8)
    assert not inv.leaderless_before(restart, [restart], members, ring8)
    elected = [*base, _v(30.5, 5, (1, 2, 3, 5, 6, 7), epoch=2, coord=5)]
    assert inv.detections([kill, restart], elected, **timing)[1] == "held"
    assert inv.no_false_failure([kill, restart], elected, **timing) == "held"
    late = [*base, _v(31.5, 5, (1, 2, 3, 5, 6, 7), epoch=2, coord=5)]
    assert "never declared failed: [4]" in inv.detections([kill, restart], late, **timing)[1]
    assert "with no fault on it" in inv.no_false_failure([kill, restart], late, **timing)


def test_a_restart_that_joins_two_even_arcs_again_gets_its_old_process_declared_after_an_election() -> None:
    # membership chaos seed 56848 (ring:16): node 6 fenced, then the kill of 14 split the ring
    # into 7 | 7 with no majority; at its restart 2 s later the arc without the coordinator had
    # been cut off from it for that long and deposed it; the old process of 14 was declared by
    # the new coordinator (term 3) 4.83 s after the restart, past one bound (3.164 s)
    s = simulate(ring(16), "pause:6@5.769+5.782,kill:14@20.359,restart:14@22.315", 40.0)
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    last = s["declared"][-1]
    assert last["node"] == 14 and last["term"] > 0
    assert s["detection_bound_s"] < last["t"] - 22.315 < 2 * s["detection_bound_s"]


def test_reborn_names_the_removed_nodes_whose_new_process_was_heard() -> None:
    named = {3: 1, 4: 1, 5: 1}
    assert reborn([3, 4, 5], named, {3: 1, 4: 2}) == [4]  # 3: its process; 5: nothing heard
    assert reborn([4], {}, {4: 2}) == []  # the view did not name it


def simulate(topo: Any, faults: str, seconds: float, **opts: Any) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        async with SimCluster(topo, faults=parse_faults(faults, topo.ids), opts=SimOptions(**opts)) as c:
            return await c.run(seconds)

    return run(main(), loop=VirtualLoop())


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL)


# -- the text form and the draw ------------------------------------------------------------

def test_restart_and_slow_specs_parse_and_print_back() -> None:
    ids = list(range(16))
    faults = parse_faults("slow:3-4@10+30x10,restart:7@50,slow:3|4@12+5x2.5,kill:7@20", ids)
    assert [f.spec() for f in faults] == ["slow:3-4@10+30x10", "slow:3|4@12+5x2.5", "kill:7@20", "restart:7@50"]
    assert parse_faults(",".join(f.spec() for f in faults), ids) == faults
    slow, across = faults[0], faults[1]
    assert slow.factor == 10 and slow.other == () and slow.end == 40
    # one side: every link of the nodes; two sides: the links joining them
    assert slow.slows(3, 4) and slow.slows(2, 3) and slow.slows(4, 5) and not slow.slows(5, 6)
    assert across.slows(4, 3) and not across.slows(2, 3)
    assert faults[3].duration is None and faults[3].end is None and not faults[3].slows(7, 8)
    for bad in ("restart:3@5+2", "slow:3@5+2", "slow:3@5x2", "kill:3@5x2", "pause:3@5+2x2", "slow:3@5+2x1",
                "slow:0-3|2-5@1+1x2", "restart:1|2@1", "slow:3@5+2x1.2.3", "restart:99@1"):
        with pytest.raises(ConfigError):
            parse_faults(bad, ids)


def test_the_draw_includes_restarts_and_slowdowns_and_prints_back() -> None:
    ids = list(range(16))
    kinds: dict[str, int] = {}
    for seed in range(200):
        for gap in (None, 6.0):
            drawn = draw(random.Random(seed), ids, 3, start=5.0, end=50.0, gap=gap)
            assert drawn == draw(random.Random(seed), ids, 3, start=5.0, end=50.0, gap=gap)
            assert parse_faults(",".join(f.spec() for f in drawn), ids) == drawn
            assert all(5.0 <= f.at <= 50.0 and (f.end is None or f.end <= 50.0) for f in drawn)
            for f in drawn:
                kinds[f.kind] = kinds.get(f.kind, 0) + 1
                if f.kind == "restart":  # the node is running, or was killed before by this draw
                    killed = [g for g in drawn if g.kind == "kill" and g.nodes == f.nodes]
                    assert all(g.at < f.at for g in killed)
    assert set(kinds) == {"kill", "restart", "pause", "partition", "slow"}
    assert min(kinds.values()) >= 50


def test_a_draw_without_restarts_or_slowdowns_keeps_the_three_kinds_draw() -> None:
    # the second stream turns some faults into restarts and slowdowns; the others are the
    # faults the draw of kills, pauses and partitions gives (here: a seed whose draw it leaves)
    ids = list(range(16))
    for seed in range(400):
        drawn = draw(random.Random(seed), ids, 3, start=5.0, end=50.0)
        if all(f.kind in ("kill", "pause", "partition") for f in drawn):
            break
    else:
        pytest.fail("no seed kept the three kinds")
    rng = random.Random(seed)
    expected = []
    used: set[int] = set()
    for _ in range(3):  # the three-kinds draw, written out
        kind = rng.choice(("kill", "pause", "partition"))
        at = round(rng.uniform(5.0, 50.0), 3)
        dur = round(min(rng.uniform(1.0, 20.0), max(50.0 - at, 0.001)), 3)
        if kind == "partition":
            size = rng.randint(1, 8)
            first = rng.randrange(16)
            side = tuple(sorted((first + k) % 16 for k in range(size)))
            expected.append(Fault(kind="partition", at=at, nodes=side, duration=dur,
                                  other=tuple(n for n in ids if n not in side)))
            continue
        n = rng.choice([n for n in ids if n not in used])
        used.add(n)
        expected.append(Fault(kind="kill", at=at, nodes=(n,)) if kind == "kill"
                        else Fault(kind="pause", at=at, nodes=(n,), duration=dur))
    assert drawn == sorted(expected, key=lambda f: f.at)


# -- the invariants on crafted views ---------------------------------------------------------

def _v(t: float, node: int, members: tuple[int, ...], *, term: int = 0, epoch: int = 1, coord: int = 0) -> inv.ViewSeen:
    return inv.ViewSeen(t=t, node=node, term=term, epoch=epoch, coordinator=coord, members=members)


def test_a_kill_counts_until_its_restart_and_a_restart_kills_a_running_node() -> None:
    kill, restart = Fault(kind="kill", at=5.0, nodes=(3,)), Fault(kind="restart", at=9.0, nodes=(3,))
    faults = [kill, restart]
    assert inv.killed_by(faults, 6.0) == {3} and inv.killed_by(faults, 9.0) == set()
    assert inv.until(kill, faults) == 9.0 and inv.until(kill, [kill]) == float("inf")
    base = [_v(0, n, (0, 1, 2, 3, 4)) for n in range(5)]
    removed = [*base, _v(7.0, 1, (0, 1, 2, 4), epoch=2), _v(11.0, 1, (0, 1, 2, 3, 4), epoch=3)]
    assert inv.no_false_failure(faults, removed, bound=3.0) == "held"
    # the new process removed later: no kill covers it
    again = [*removed, _v(20.0, 1, (0, 1, 2, 4), epoch=4)]
    assert "node 3 declared failed" in inv.no_false_failure(faults, again, bound=3.0)
    # a restart of a running node kills it first: its process must be declared in the bound
    alone = [Fault(kind="restart", at=5.0, nodes=(3,))]
    found, verdict = inv.detections(alone, [*base, _v(7.0, 1, (0, 1, 2, 4), epoch=2)], bound=3.0, failure_timeout=2.0)
    assert verdict == "held" and found[0]["declared_after_s"] == {"3": 2.0}
    assert "never declared failed: [3]" in inv.detections(alone, base, bound=3.0, failure_timeout=2.0)[1]
    # a restart of a node killed before kills nothing
    assert inv.detections(faults, removed, bound=3.0, failure_timeout=2.0)[1] == "held"
    # on a ring the nodes behind a restarted node are not cut off (the new process relays)
    links = {i: [(i - 1) % 9, (i + 1) % 9] for i in range(9)}
    before = [Fault(kind="kill", at=2.0, nodes=(3,))]
    # (node 3, killed before and still a member, is the first kill's to get declared)
    assert inv.cut_by(Fault(kind="kill", at=5.0, nodes=(1,)), before, tuple(range(9)), links) == [1, 2]
    assert inv.cut_by(Fault(kind="restart", at=5.0, nodes=(1,)), before, tuple(range(9)), links) == [1]
    # ring-16 without node 6: a kill of node 14 leaves two arcs of 7 (no majority), a restart
    # of it does not (chaos seed 7004)
    ring16 = {i: [(i - 1) % 16, (i + 1) % 16] for i in range(16)}
    members = tuple(n for n in range(16) if n != 6)
    six = [Fault(kind="kill", at=8.0, nodes=(6,))]
    assert inv.cut_by(Fault(kind="kill", at=20.0, nodes=(14,)), six, members, ring16) is None
    assert inv.cut_by(Fault(kind="restart", at=20.0, nodes=(14,)), six, members, ring16) == [14]


def test_one_view_at_end_lets_a_node_restarted_late_be_a_member_or_not() -> None:
    a = _v(9, 0, (0, 1, 2), epoch=4)
    final = {0: a, 1: _v(9, 1, (0, 1, 2), epoch=4), 2: None}
    assert "but the live, unfenced nodes are [0, 1]" in inv.one_view_at_end(final, [0, 1])
    assert inv.one_view_at_end(final, [0, 1], pending=[2]) == "held"
    assert inv.one_view_at_end({0: _v(9, 0, (0, 1), epoch=5), 1: _v(9, 1, (0, 1), epoch=5)}, [0, 1], [2]) == "held"


def test_a_slowdown_puts_at_risk_only_the_members_whose_round_trip_grows_past_the_timeout() -> None:
    links = {i: [j for j in range(5) if j != i] for i in range(5)}  # a mesh
    lat = lambda a, b: 0.1  # noqa: E731
    views = [_v(0, n, (0, 1, 2, 3, 4)) for n in range(5)]
    timing: dict[str, Any] = dict(bound=3.9, failure_timeout=2.0, interval=0.5, links=links, latency=lat)

    def risk(spec: str) -> inv.SlowRisk:
        return inv.slow_risk(parse_faults(spec, range(5))[0], [], views, **timing)

    assert risk("slow:3@5+15x6") == inv.SlowRisk((), (), pytest.approx(1.0))  # 1 s more: fits
    assert risk("slow:3@5+15x9").risk == (3,) and risk("slow:3@5+15x9").must == ()
    assert risk("slow:3@5+15x50").must == (3,)  # 4.9 s more one way, on every way
    assert risk("slow:3@5+2x50").must == ()  # too short to be sure
    assert risk("slow:3|4@5+15x50").must == ()  # 3 reaches 0 directly: 4 is not on its way
    assert risk("slow:0@5+15x50").risk == (0, 1, 2, 3, 4)  # the coordinator slowed: anybody
    # 2-4 may depose node 0 and elect node 2: then 1, across the slowed links, is at risk too
    # (chaos seed 7055)
    assert risk("slow:0-1|2-4@5+15x50").risk == (0, 1, 2, 3, 4)
    assert risk("slow:0-2|3-4@5+15x50").risk == (3, 4)  # 3 and 4 alone cannot depose it
    slow = parse_faults("slow:3@5+15x50", range(5))
    declared = [*views, _v(7.5, 1, (0, 1, 2, 4), epoch=2)]
    assert inv.no_false_failure(slow, declared, **timing) == "held"
    assert inv.detections(slow, views, **timing)[1].endswith("never declared failed: [3]")
    fits = parse_faults("slow:3@5+15x6", range(5))
    assert "node 3 declared failed" in inv.no_false_failure(fits, declared, **timing)
    # a kill while a slowdown is in force: its bound grows by four added round trips
    kill = Fault(kind="kill", at=6.0, nodes=(2,))
    late = [*views, _v(6.0 + 3.9 + 1.0, 1, (0, 1, 3, 4), epoch=2)]
    assert inv.detections([kill], late, **timing)[1] != "held"
    assert inv.detections([*fits, kill], late, **timing)[1] == "held"


# -- runs of the real membership -------------------------------------------------------------

@pytest.mark.parametrize("topo,faults", [
    (ring(8), "restart:3@5"),  # a running node restarted: killed, then its new process joins
    (mesh(8), "kill:2@5,restart:2@12"),  # a killed node started again
    (ring(8), "restart:0@5"),  # the coordinator restarted: node 1 takes over, node 0 joins it
])
def test_a_restarted_node_rejoins_the_final_view(topo: Any, faults: str) -> None:
    s = simulate(topo, faults, 30.0)
    assert s["invariants"] == ALL_HELD
    n = parse_faults(faults, topo.ids)[-1].nodes[0]
    assert s["final_view"]["members"] == list(range(8)) and s["killed"] == [] and s["fenced"] == {}
    (restart,) = s["restarts"]
    assert restart["node"] == n and restart["incarnation"] == 2 and restart["joined_after_s"] is not None
    assert [d["node"] for d in s["declared"]] == [n]  # its previous process, once
    after = s["detections"][0]["declared_after_s"][str(n)]
    assert after <= s["detection_bound_s"]


def test_removing_the_old_process_of_a_restarted_relay_keeps_the_route_through_its_new_one() -> None:
    # ring-8 without node 0 (a line 1..7); the kill of 4 splits it 3|3 and its restart joins
    # it again: coordinator 5, elected with the new process's vote, declared the old process
    # of 4 and marked 4 dead, its only way to 1-3; they deposed 5, node 1 took over with the
    # same vote, marked 5 dead, and declared 5, 6 and 7, alive, and fenced them (chaos seed
    # 317). The new process of a node heard before its old one is removed is routed through.
    s = simulate(ring(8), "pause:0@5.125+7.771,kill:4@20.712,restart:4@25.735", 40.0, latency_s=0.001)
    assert s["invariants"] == ALL_HELD
    assert [(d["node"], d["by"]) for d in s["declared"]] == [(0, 1), (4, 5)]
    assert list(s["fenced"]) == ["0"]
    assert s["final_view"]["members"] == list(range(1, 8))


def test_a_node_restarted_too_late_to_rejoin_is_not_held_against_the_end() -> None:
    # its new process is still asking where the run is (a round trip) when the run ends
    s = simulate(mesh(8), "kill:5@3,restart:5@10.999", 11.0)
    assert s["invariants"] == ALL_HELD
    assert s["restarts"][0]["joined_after_s"] is None
    assert s["final_view"]["members"] == [0, 1, 2, 3, 4, 6, 7]


def test_a_slowed_node_whose_round_trip_fits_the_detector_is_not_declared_failed() -> None:
    # 100 ms links, node 3's six times slower for 15 s: 1.2 s round trips to the coordinator
    # (one more second, and its heartbeats' gap half a second more): the detector's bound fits
    s = simulate(mesh(8), "slow:3@5+15x6", 30.0, latency_s=0.1)
    assert s["invariants"] == ALL_HELD
    assert s["declared"] == [] and s["fenced"] == {}
    assert s["detections"][0] == {"fault": "slow:3@5+15x6", "declared_after_s": {}, "at_risk": []}


def test_a_node_slowed_beyond_the_bound_is_declared_failed_in_it() -> None:
    # fifty times slower: 4.9 s more one way, over every way to the coordinator (each starts
    # with a link of node 3): silent past the bound, declared, then fenced by the answer
    s = simulate(mesh(8), "slow:3@5+15x50", 40.0, latency_s=0.1)
    assert s["invariants"] == ALL_HELD
    assert [d["node"] for d in s["declared"]] == [3]
    assert s["detections"][0]["declared_after_s"]["3"] <= s["detection_bound_s"]
    assert s["final_view"]["members"] == [0, 1, 2, 4, 5, 6, 7]


def test_a_slow_link_on_a_ring_declares_nobody() -> None:
    # ring-8: the link 3-4 ten times slower with 1 ms links (nodes behind it pay 9 ms more)
    s = simulate(ring(8), "slow:3|4@5+10x10", 25.0)
    assert s["invariants"] == ALL_HELD and s["declared"] == []


def test_restarted_nodes_are_declared_once_and_rejoin_on_a_ring_of_16() -> None:
    # node 7's new process took the reply to its previous process's heartbeat (call 1, still
    # on its way) for the reply to its own registration (call 1): never admitted, it counted
    # itself a member while the coordinator still held the old process registered. RPC
    # replies now name the caller's incarnation. Node 1, next to the coordinator, relayed its
    # neighbours' messages at once: that kept its previous process alive at the coordinator,
    # which refused the new one (DuplicateNode) until the start timeout. A neighbour seen in a
    # newer life proves nothing of the registered one by relaying. (Chaos seed 7030:
    # p2psync sim ring:16 --seed 7030 --faults 'restart:7@7.004,pause:10@13.997+2.882,restart:1@24.622'
    # --virtual-seconds 60)
    s = simulate(ring(16), "restart:7@7.004,pause:10@13.997+2.882,restart:1@24.622", 40.0)
    assert s["invariants"] == ALL_HELD
    assert [d["node"] for d in s["declared"]] == [7, 10, 1]
    assert all(r["joined_after_s"] is not None for r in s["restarts"])
    assert s["final_view"]["members"] == [n for n in range(16) if n != 10]


def test_walled_in_tells_whether_the_coordinator_reaches_a_joiner_around_the_removed_nodes() -> None:
    r8 = ring(8)
    assert walled_in(r8, 0, 4, {4}) is None and walled_in(r8, 0, 4, {3, 4, 5}) == [3, 5]
    assert walled_in(r8, 0, 4, {3, 5}) == [3, 5]  # (a joiner revived by its request alone)
    assert walled_in(r8, 0, 4, {3}) is None  # around the other side
    assert walled_in(r8, 0, 1, {1, 2, 7}) is None  # a neighbour of the coordinator
    assert walled_in(r8, 0, 5, {3, 6}) == [4, 6]  # behind 4, which only 3 joins to the run
    assert walled_in(mesh(8), 0, 4, set(range(1, 8))) is None


@pytest.mark.parametrize("faults,members", [
    # nodes 3 and 5 removed (5's pause cuts 4 off behind it), fenced when they resume; node 4's
    # new process reaches the coordinator only through 3 or 5, still running, that nobody
    # routes through: it is not admitted, and it is never declared
    ("pause:3@3+20,pause:5@9+14,restart:4@26", [0, 1, 2, 6, 7]),
    # ... until node 3's new process rejoins: then the run reaches 4 through it
    ("pause:3@3+20,pause:5@9+14,restart:4@26,restart:3@30", [0, 1, 2, 3, 4, 6, 7]),
])
def test_a_restarted_node_that_only_removed_nodes_join_to_the_run_is_admitted_only_once_one_is_back(
        faults: str, members: list[int]) -> None:
    """A joiner whose every way from the coordinator crosses nodes removed from the run (its
    request relayed by one of them, still running) is refused as unreachable, not admitted:
    admitted, no answer or view could reach it, every operation would wait for it, and it
    would be declared failed once its grace ran out though it runs (``walled_in``)."""
    s = simulate(ring(8), faults, 45.0)
    assert s["invariants"] == ALL_HELD
    assert [(d["node"], round(d["t"], 1)) for d in s["declared"]] == [(3, 5.1), (4, 10.6), (5, 11.1)]
    assert s["final_view"]["members"] == members
    assert {r["node"]: r["joined_after_s"] is not None for r in s["restarts"]}[4] == (4 in members)


def test_a_restarted_node_whose_two_ring_neighbours_were_removed_is_not_declared_failed() -> None:
    """Chaos seed 5030 (``p2psync sim ring:16 --seed 5030 --faults
    'pause:7@8.719+8.989,pause:4@24.809+7.045,restart:6@42.067' --virtual-seconds 60``): node
    7 was removed and fenced, then 4 (and 5 and 6, cut off behind it), and 4 and 5 were fenced.
    Node 6's new process reached coordinator 0 only through node 7, removed but still running:
    admitted, it could never be answered (node 8 routes nothing through 7) and was declared
    failed 14 s later, a false failure. Every way to it crosses removed nodes: it is refused
    as unreachable and stays out, cut off (stranded) with nobody declared."""
    s = simulate(ring(16), "pause:7@8.719+8.989,pause:4@24.809+7.045,restart:6@42.067", 60.0)
    assert s["invariants"] == ALL_HELD
    assert [d["node"] for d in s["declared"]] == [7, 4, 5, 6]
    assert s["restarts"][0]["joined_after_s"] is None and s["stranded"] == [6]
    assert s["final_view"]["members"] == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15]


def test_the_nodes_behind_a_kill_must_be_declared_only_while_it_is_not_restarted_in_their_bound() -> None:
    ring8 = {i: [(i - 1) % 8, (i + 1) % 8] for i in range(8)}
    members = tuple(n for n in range(8) if n != 6)  # node 6 removed: the ring is a line 7-0-...-5
    six = Fault(kind="kill", at=1.0, nodes=(6,))
    kill = Fault(kind="kill", at=5.0, nodes=(4,))
    base = [_v(0, n, tuple(range(8))) for n in range(8)] + [_v(3.0, n, members, epoch=2) for n in members]
    alone = [*base, _v(7.0, 0, (0, 1, 2, 3, 5, 7), epoch=3)]  # node 4 declared, 5 behind it not
    with_five = [*base, _v(7.0, 0, (0, 1, 2, 3, 7), epoch=3)]
    assert inv.cut_by(kill, [six, kill], members, ring8) == [4, 5]
    # restarted 1.5 s after the kill: node 5 was cut off for less than the bound
    quick = [six, kill, Fault(kind="restart", at=6.5, nodes=(4,))]
    assert inv.reconnected(kill, quick, members, ring8, [4, 5]) == {5: 6.5}
    assert inv.detections(quick, alone, bound=3.0, failure_timeout=2.0, links=ring8)[1] == "held"
    assert inv.detections(quick, with_five, bound=3.0, failure_timeout=2.0, links=ring8)[1] == "held"
    assert inv.no_false_failure(quick, with_five, bound=3.0, links=ring8) == "held"
    # the killed node itself is declared however soon it is restarted
    assert "never declared failed: [4]" in inv.detections(
        quick, [*base, _v(7.0, 0, members, epoch=3)], bound=3.0, failure_timeout=2.0, links=ring8)[1]
    # restarted after the bound, or never: node 5 must be declared in it
    for late in ([six, kill, Fault(kind="restart", at=8.5, nodes=(4,))], [six, kill]):
        assert "never declared failed: [5]" in inv.detections(late, alone, bound=3.0, failure_timeout=2.0,
                                                               links=ring8)[1]
        assert inv.detections(late, with_five, bound=3.0, failure_timeout=2.0, links=ring8)[1] == "held"
    assert inv.reconnected(kill, [six, kill], members, ring8, [4, 5]) == {5: float("inf")}


def test_the_nodes_behind_a_node_killed_and_restarted_before_its_detection_stay_members() -> None:
    """Chaos seed 1004 (``p2psync sim ring:16 --seed 1004 --faults
    'pause:6@5.673+7.469,kill:13@21.631,restart:13@23.178' --virtual-seconds 60``): node 6
    removed and fenced, the ring is a line; node 13 killed cuts 7 to 12 off, and its new
    process, 1.5 s later, joins them to the run again before their silence is a failure.
    Node 13's old process is declared, 7 to 12 are not: they were cut off for less than the
    bound, as by a pause that short (the invariant had demanded them, as for a kill that
    lasts)."""
    s = simulate(ring(16), "pause:6@5.673+7.469,kill:13@21.631,restart:13@23.178", 40.0)
    assert s["invariants"] == ALL_HELD
    assert [d["node"] for d in s["declared"]] == [6, 13]
    assert s["restarts"][0]["joined_after_s"] is not None
    assert s["final_view"]["members"] == [n for n in range(16) if n != 6]


def test_a_joiner_routes_around_the_nodes_its_first_view_leaves_out() -> None:
    assert left_out(View(epoch=9, members=(1, 2, 3, 5), coordinator=1, departed=(4,)), range(8), 5) == [0, 6, 7]
    assert left_out(View(epoch=1, members=tuple(range(4)), coordinator=0), range(4), 2) == []


@pytest.mark.parametrize("faults,declared,members", [
    # node 0 removed and fenced (still running); node 7's new process joined, routed through 0,
    # which every member routes around. Kill 5: 6 and 7 are cut off from the run with it, and
    # 7, heard through 0, was declared 3.8 s after the kill (bound 3.1 s)
    ("pause:0@3+8,restart:7@20,kill:5@30", [0, 7, 5, 7, 6], [1, 2, 3, 4]),
    # kill 4: 1-3 and 5-7 are three of seven each, no majority; node 7, heard through 0, gave
    # coordinator 1 one (4 of 7), and it declared 4, 5 and 6, live nodes among them
    ("pause:0@3+8,restart:7@20,kill:4@30", [0, 7], [1, 2, 3, 4, 5, 6, 7]),
])
def test_a_restarted_node_routes_around_a_removed_node_still_running(
        faults: str, declared: list[int], members: list[int]) -> None:
    """A restarted process learns the run from a view that lists no change (its first): it
    must mark the nodes that view leaves out dead, as every member did when it removed them
    (``left_out``); routed through a fenced node, its heartbeats reach the coordinator on a
    path the run does not have."""
    s = simulate(ring(8), faults, 40.0)
    assert s["invariants"] == ALL_HELD
    assert [d["node"] for d in s["declared"]] == declared
    assert s["final_view"]["members"] == members


def test_a_restarted_node_is_declared_with_the_members_behind_the_relay_killed_on_its_way() -> None:
    """Chaos seed 9060 (``p2psync sim ring:16 --seed 9060 --faults
    'pause:0@7.751+8.095,restart:15@27.209,kill:10@38.536' --virtual-seconds 60``): node 15's
    new process routed through node 0, removed and fenced but running; the kill of node 10
    cut 11 to 15 off the run, but 15 was heard through 0 until it deposed the coordinator
    that could not answer it, and was declared 3.574 s after the kill (bound 3.164 s)."""
    s = simulate(ring(16), "pause:0@7.751+8.095,restart:15@27.209,kill:10@38.536", 45.0)
    assert s["invariants"] == ALL_HELD
    after = s["detections"][2]["declared_after_s"]
    assert sorted(after, key=int) == ["10", "11", "12", "13", "14", "15"]
    assert max(after.values()) <= s["detection_bound_s"]


@pytest.mark.parametrize("faults", [
    "partition:14|0-13.15@9.272+6.357,pause:5@23.415+4.312,kill:0@39.129",  # chaos seed 11040
    "partition:11-14|0-10.15@6.624+3.741,partition:0-1.14-15|2-13@22.177+3.791,pause:2@34.617+1.861",  # 11086
])
def test_a_member_heard_only_through_removed_relays_is_no_longer_alive(faults: str) -> None:
    """A failover coordinator took over with node 15 in its view but walled in behind removed
    nodes (fenced, still relaying): 15's probes still arrived through them and reset its
    silence while every reply failed (no live path), so 15 was declared seconds after the
    window the pause or partition covers (a false failure). Arrivals from a member the
    coordinator cannot reach around the nodes it marks dead are no proof of life."""
    s = simulate(ring(16), faults, 60.0)
    assert s["invariants"] == ALL_HELD


def test_the_bound_of_a_fault_grows_until_the_members_remeasured_a_slowdowns_round_trip() -> None:
    links = {i: [j for j in range(5) if j != i] for i in range(5)}  # a mesh
    lat = lambda a, b: 0.1  # noqa: E731
    views = [_v(0, n, (0, 1, 2, 3, 4)) for n in range(5)]
    timing: dict[str, Any] = dict(bound=3.9, failure_timeout=2.0, interval=0.5, links=links, latency=lat)
    slow = parse_faults("slow:3@5+15x6", range(5))  # 1 s more a round trip, until 20
    back = inv.remeasured(slow[0], 1.0, 0.5)
    assert back == pytest.approx(20.0 + 1.0 + (RTT_WINDOW + 2) * 0.5)
    for at, held in ((back - 0.1, True), (back + 0.1, False)):  # a kill declared a second late
        kill = Fault(kind="kill", at=at, nodes=(2,))
        late = [*views, _v(at + 3.9 + 1.0, 1, (0, 1, 3, 4), epoch=2)]
        assert (inv.detections([*slow, kill], late, **timing)[1] == "held") is held


@pytest.mark.parametrize("topo,faults,seconds", [
    # two ring links 1549 times slower (a 3.1 s round trip for the nodes behind them) for 8.7 s;
    # the far arc cut off 8.3 s after (chaos seed 12080 on a ring of 16)
    (ring(16), "slow:0-3.14-15|4-13@5+8.7x1549.2,partition:6-10|0-5.11-15@22+5", 30.0),
    # chaos seed 12065: node 0 removed during the slowdown, 23 to 31 behind 17 over 22-23
    (ring(32), "slow:0.23-31|1-22@5.7+7.363x2254.5,kill:17@20.887", 27.0),
])
def test_a_member_heard_again_over_fast_links_after_a_slowdown_is_declared_in_the_bound(
        topo: Any, faults: str, seconds: float) -> None:
    """The members' round-trip estimates (RFC 6298 averages) still held most of a slowdown's
    round trip, as variation, seconds after the links were fast again, and the coordinator's
    detector, which widens its heartbeat timing by several times that variation, waited up to
    4.4 s for a silence: the nodes cut off 8 s after the slowdown were declared 0.5 to 1.2 s past
    the bound. Estimates kept within their latest samples are the fast links' again."""
    s = simulate(topo, faults, seconds)
    assert s["invariants"] == ALL_HELD
    after = s["detections"][1]["declared_after_s"]
    assert after and max(after.values()) <= s["detection_bound_s"]


def test_the_members_behind_a_restarted_coordinator_stay_reachable_through_its_new_process() -> None:
    """Chaos seed 314: with node 3 killed, ring-8 is a line 4-5-6-7-0-1-2 and coordinator 0
    restarts. Its new process relays at once and its messages reached node 4 before node 4
    judged the old one failed, but were forgotten (a new life proves nothing about the
    registered process); marking 0 dead then left node 4 no path to 1 and 2, so it passed
    over both successors, took over with 4-7 and removed 1 and 2, alive behind the new
    process. A newer process heard before the old one is declared keeps the node routed
    through."""
    s = simulate(ring(8), "restart:4@7.858,kill:3@16.636,restart:0@26.87", 40.0, heartbeat=0.5,
                 failure_timeout=2.0, latency_s=0.001)
    assert s["invariants"] == ALL_HELD


@pytest.mark.parametrize("faults", [
    "kill:0@25,restart:0@27.159",
    "slow:5-6|0-4.7-15@11.011+1.651x51,kill:0@25,restart:0@27.159",  # chaos seed 58555
])
def test_a_successor_removes_a_restarted_coordinator_it_judged_while_cut_off_with_it(faults: str) -> None:
    """Chaos seed 58555 (``p2psync sim groups:4x4 --seed 58555 --faults
    'slow:5-6|0-4.7-15@11.011+1.651x51,kill:0@25,restart:0@27.159' --heartbeat 0.5
    --failure-timeout 2 --strategy esync``): coordinator 0 is site 0's gateway; its kill cuts
    its successor 1 off with it. Every node deposes 0 at 27.0 and follows 1; the restart
    reconnects site 0, and 1 wins at 28.0 with a majority reached late, which keeps the nodes
    it judged (a split that healed may have cut them off). The old process of 0 must leave in
    that first view all the same: its new process was heard, the one judged is gone (and the
    new process's traffic must not keep it alive either)."""
    s = simulate(groups(4, 4), faults, 40.0, heartbeat=0.5, failure_timeout=2.0, latency_s=0.001)
    assert s["invariants"] == ALL_HELD
    first = s["declared"][0]
    assert (first["node"], first["by"], first["term"]) == (0, 1, 1)
    assert first["t"] - 25.0 <= s["detection_bound_s"]
    assert s["restarts"][0]["joined_after_s"] < s["detection_bound_s"]

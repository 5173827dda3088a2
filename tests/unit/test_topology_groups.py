"""The mesh of groups (topology/builders.py ``groups``): its structure, link attributes, the
paths between groups through the gateways, argument errors, the JSON round trip, and
``p2psync sim groups:GxS``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2psync.cli.main import main
from p2psync.cli.sim_cmd import topology_arg
from p2psync.errors import ConfigError
from p2psync.topology import LinkAttrs, group_of, groups, is_gateway, load, save
from p2psync.topology.paths import hop_distances, relay_links


@pytest.mark.parametrize("g,s,k", [(4, 4, 1), (3, 5, 1), (3, 4, 2), (1, 3, 1), (5, 1, 1), (2, 3, 3)])
def test_structure(g: int, s: int, k: int) -> None:
    t = groups(g, s, gateways=k)
    assert t.size == g * s and t.ids == list(range(g * s)) and t.kind == "groups"
    assert t.name == f"groups-{g}x{s}" and t.coordinator == 0
    assert t.params["groups"] == g and t.params["size"] == s and t.params["gateways"] == k
    pairs = {(a, b) for a in t.ids for b in t.neighbors(a) if a < b}
    wan_planes = k if g > 1 else 0
    assert len(pairs) == g * s * (s - 1) // 2 + wan_planes * g * (g - 1) // 2
    assert t.is_connected() and t.lonely() == []
    for a in t.ids:
        gateway = is_gateway(a, s, k)
        assert gateway == (a % s < k)
        assert [c.name for c in t.node(a).nics] == (["lan", "wan"] if gateway and g > 1 else ["lan"])
        assert t.neighbors_on(a, "lan") == [b for b in range(group_of(a, s) * s, (group_of(a, s) + 1) * s) if b != a]
        if gateway and g > 1:
            assert t.neighbors_on(a, "wan") == [h * s + a % s for h in range(g) if h != group_of(a, s)]
    assert {n.name for n in t.networks} == {f"group-{h}" for h in range(g)} | {f"wan-{j}" for j in range(wan_planes)}


def test_link_attributes_are_lan_inside_a_group_and_wan_between_gateways() -> None:
    t = groups(4, 4, lan_ms=0.5, wan_ms=30, lan_mbps=10_000, wan_mbps=100)
    lan, wan = LinkAttrs(latency_ms=0.5, bandwidth_mbps=10_000.0), LinkAttrs(latency_ms=30.0, bandwidth_mbps=100.0)
    assert t.default_link == lan
    assert set(t.links) == {(a, b) for a in (0, 4, 8, 12) for b in (0, 4, 8, 12) if a < b}
    assert all(la == wan for la in t.links.values())
    assert t.link(5, 6) == lan and t.link(4, 5) == lan and t.link(12, 4) == wan
    unlimited = groups(2, 2, lan_mbps=None, wan_mbps=None)
    assert unlimited.link(0, 1).bandwidth_mbps is None and unlimited.link(0, 2).bandwidth_mbps is None


def test_defaults_make_the_wan_slower_than_the_lan() -> None:
    t = groups(2, 2)
    lan, wan = t.link(0, 1), t.link(0, 2)
    assert 0 < lan.latency_ms < wan.latency_ms
    assert lan.bandwidth_mbps is not None and wan.bandwidth_mbps is not None
    assert lan.bandwidth_mbps > wan.bandwidth_mbps


def test_traffic_between_groups_relays_through_the_two_gateways() -> None:
    t = groups(4, 4)
    # 5 (group 1, gateway 4) to 14 (group 3, gateway 12): 5 -> 4 -> 12 -> 14
    assert relay_links(t, [5, 14]) == {5: {14: (4, 12)}, 14: {5: (12, 4)}}
    assert hop_distances(t, 5)[14] == 3 and hop_distances(t, 5)[12] == 2 and hop_distances(t, 5)[6] == 1
    # with the gateway of group 1 dead, group 1's other members reach no other group
    assert 14 not in hop_distances(t, 5, avoid={4})
    # two gateways per group: the first plane is taken, and the second survives the first's death
    t2 = groups(3, 4, gateways=2)
    assert relay_links(t2, [2, 11]) == {2: {11: (0, 8)}, 11: {2: (8, 0)}}
    assert hop_distances(t2, 2, avoid={0})[11] == 3


@pytest.mark.parametrize("args,kwargs,field", [
    ((0, 4), {}, "g"), ((4, 0), {}, "s"), ((1, 1), {}, "s"), ((2.0, 4), {}, "g"), ((True, 4), {}, "g"),
    ((4, 4), {"gateways": 0}, "gateways"), ((4, 4), {"gateways": 5}, "gateways"),
    ((4, 4), {"lan_ms": -1}, "lan_ms"), ((4, 4), {"wan_ms": float("nan")}, "wan_ms"),
    ((4, 4), {"lan_mbps": 0}, "lan_mbps"), ((4, 4), {"wan_mbps": float("inf")}, "wan_mbps"),
    ((4, 4), {"wan_mbps": "1000"}, "wan_mbps"),
])
def test_bad_arguments_are_config_errors_naming_them(args: tuple[object, ...], kwargs: dict[str, object],
                                                     field: str) -> None:
    with pytest.raises(ConfigError) as ei:
        groups(*args, **kwargs)  # type: ignore[arg-type]
    assert ei.value.field == field and str(ei.value).startswith(f"{field}: ")


def test_a_topology_file_round_trips(tmp_path: Path) -> None:
    t = groups(3, 4, gateways=2, wan_ms=12.5)
    save(t, tmp_path / "g.json")
    back = load(tmp_path / "g.json")
    assert back.name == t.name and back.kind == t.kind and dict(back.params) == dict(t.params)
    assert back.nodes == t.nodes and back.networks == t.networks
    assert dict(back.links) == dict(t.links) and back.default_link == t.default_link
    assert main(["topo", "check", str(tmp_path / "g.json")]) == 0


def test_sim_parses_groups_and_names_the_form_in_its_errors() -> None:
    t = topology_arg("groups:3x5")
    assert t.kind == "groups" and t.size == 15
    with pytest.raises(ConfigError) as ei:
        topology_arg("groups:0x5")
    assert ei.value.field == "g"
    with pytest.raises(ConfigError, match="groups:GxS"):
        topology_arg("groups:3")


def test_sim_of_a_mesh_of_groups_with_a_kill_holds_every_invariant(tmp_path: Path) -> None:
    assert main(["sim", "groups:4x4", "--faults", "kill:5@5", "--virtual-seconds", "20",
                 "--out", str(tmp_path)]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["nodes"] == 16 and set(s["invariants"].values()) == {"held"} and s["killed"] == [5]
    (d,) = s["detections"]
    assert 0 < d["declared_after_s"]["5"] <= s["detection_bound_s"]


def test_a_dead_gateway_cuts_its_whole_group_off_and_the_invariants_say_so(tmp_path: Path) -> None:
    """Killing group 1's only gateway (4) strands 5, 6 and 7: they are declared failed with it,
    and the invariants count that as the kill's doing."""
    assert main(["sim", "groups:4x4", "--faults", "kill:4@5", "--virtual-seconds", "20",
                 "--out", str(tmp_path)]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert set(s["invariants"].values()) == {"held"} and s["killed"] == [4]
    (d,) = s["detections"]
    assert sorted(d["declared_after_s"]) == ["4", "5", "6", "7"]


def test_sim_with_the_topologys_latencies_uses_the_wan_between_groups(tmp_path: Path) -> None:
    """``--latency-ms -1``: a member of another group reaches the coordinator over a 20 ms WAN
    link, so the rendezvous takes at least a WAN round trip; with 1 ms links far less."""
    runs = {}
    for lat in ("-1", "1"):
        out = tmp_path / lat
        assert main(["sim", "groups:4x4", "--faults", "kill:5@5", "--virtual-seconds", "20",
                     "--latency-ms", lat, "--out", str(out)]) == 0
        runs[lat] = json.loads((out / "summary.json").read_text())
        assert set(runs[lat]["invariants"].values()) == {"held"}
    assert runs["-1"]["rendezvous_s"] >= 2 * 0.020 > 5 * runs["1"]["rendezvous_s"]
    assert runs["-1"]["detection_bound_s"] > runs["1"]["detection_bound_s"]


def test_cli_topo_groups_writes_a_file_that_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "g.json"
    assert main(["topo", "groups", "--groups", "3", "--size", "4", "--gateways", "2", "--wan-ms", "40",
                 "-o", str(out)]) == 0
    t = load(out)
    assert t.size == 12 and t.link(0, 4).latency_ms == 40 and t.link(0, 1).latency_ms == 0.2
    assert t.neighbors_on(1, "wan") == [5, 9]
    assert main(["topo", "groups", "--groups", "3", "--size", "4", "--gateways", "5"]) == 2
    assert "--gateways: must be in 1..s (4), got 5" in capsys.readouterr().err
    assert main(["topo", "groups", "--groups", "0", "--size", "4"]) == 2
    assert "--groups: " in capsys.readouterr().err

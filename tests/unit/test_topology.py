"""Topology: builder invariants, JSON round trip, every validation error names its field."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from p2psync.cli.main import main
from p2psync.errors import ConfigError
from p2psync.topology import (bcube, bcube_digits, dumps, load, loads, mesh, ring, star,
                              topology_from_dict, topology_to_dict)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_ring(n):
    t = ring(n)
    assert t.size == n and t.is_connected()
    for i in t.ids:
        assert set(t.neighbors(i)) == {(i - 1) % n, (i + 1) % n}
        assert t.degree(i) == (1 if n == 2 else 2)
    # the "right" NIC reaches the successor
    assert t.neighbors_on(0, "right") == [1]


@pytest.mark.parametrize("n", [1, 2, 5])
def test_mesh(n):
    t = mesh(n)
    assert all(t.degree(i) == n - 1 for i in t.ids)
    assert all(len(t.node(i).nics) == 1 for i in t.ids)


def test_star():
    t = star(5)
    assert t.degree(0) == 4 and all(t.degree(i) == 1 for i in range(1, 5))
    assert t.routes(1, 2) == ()
    assert t.neighbors(3) == [0]


@pytest.mark.parametrize("alpha,beta", [(2, 1), (2, 2), (3, 2), (2, 3), (4, 2)])
def test_bcube_levels(alpha, beta):
    t = bcube(alpha, beta)
    assert t.size == alpha**beta
    assert len(t.networks) == beta * alpha ** (beta - 1)
    for i in t.ids:
        node = t.node(i)
        assert [c.name for c in node.nics] == [f"l{lv}" for lv in range(beta)]
        di = bcube_digits(i, alpha, beta)
        for level in range(beta):
            nbrs = t.neighbors_on(i, f"l{level}")
            # exactly the alpha-1 nodes that differ from i in digit `level` only
            expect = [j for j in t.ids if j != i and all(
                (a == b) == (k != level) for k, (a, b) in enumerate(zip(di, bcube_digits(j, alpha, beta))))]
            assert nbrs == expect and len(nbrs) == alpha - 1
            for j in nbrs:
                (route,) = t.routes(i, j)
                assert route.local_nic == f"l{level}" == route.remote_nic
        assert t.degree(i) == beta * (alpha - 1)


def test_bcube_3x2_matches_paper_example():
    # Canary Fig. 13: W(0,0) is in level-0 cube with W(0,1), W(0,2) and level-1 cube with W(1,0), W(2,0)
    t = bcube(3, 2)
    assert t.neighbors_on(0, "l0") == [1, 2]
    assert t.neighbors_on(0, "l1") == [3, 6]


def test_addresses_distinct_loopback_and_hosts():
    t = bcube(2, 2)
    addrs = [c.address for n in t.nodes for c in n.nics]
    assert len(set(addrs)) == len(addrs) and all(a.startswith("127.") for a in addrs)
    h = ring(4, hosts=["198.18.0.1", "198.18.0.2"], base_port=4000)
    eps = [(c.address, c.port) for n in h.nodes for c in n.nics]
    assert len(set(eps)) == len(eps)
    assert h.node(2).host == "198.18.0.1"


@pytest.mark.parametrize("topo", [ring(4), mesh(3), star(5), bcube(3, 2)])
def test_json_roundtrip(topo):
    again = loads(dumps(topo))
    assert topology_to_dict(again) == topology_to_dict(topo)


@pytest.mark.parametrize("name", ["ring-4", "mesh-4", "star-5", "bcube-2x2", "bcube-3x2"])
def test_shipped_topologies_load(name):
    t = load(ROOT / "topologies" / f"{name}.json")
    assert t.name == name


def _doc():
    return topology_to_dict(ring(4))


def _mut(fn):
    d = copy.deepcopy(_doc())
    fn(d)
    return d


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda d: d["nodes"][3]["nics"][1].update(port=d["nodes"][2]["nics"][1]["port"],
                                                   address=d["nodes"][2]["nics"][1]["address"]),
         "nodes[3].nics[1].port"),
        (lambda d: d["nodes"][1].update(id=0), "nodes[1].id"),
        (lambda d: d["nodes"][2]["nics"][0].update(network="nowhere"), "nodes[2].nics[0].network"),
        (lambda d: d["nodes"][0]["nics"][0].update(port=70000), "nodes[0].nics[0].port"),
        (lambda d: d["nodes"][0]["nics"][0].update(port="80"), "nodes[0].nics[0].port"),
        (lambda d: d["nodes"][0]["nics"][0].pop("address"), "nodes[0].nics[0].address"),
        (lambda d: d["nodes"][1]["nics"][1].update(name=d["nodes"][1]["nics"][0]["name"]), "nodes[1].nics[1].name"),
        (lambda d: d["nodes"][0].update(nics=[]), "nodes[0].nics"),
        (lambda d: d.update(coordinator=9), "coordinator"),
        (lambda d: d.update(version=7), "version"),
        (lambda d: d.update(bogus=1), "<root>"),
        (lambda d: d["networks"].append({"name": "ring-0-1"}), "networks[4].name"),
        (lambda d: d.update(links=[{"a": 0, "b": 2, "latency_ms": 5}]), "links[0]"),
        (lambda d: d.update(links=[{"a": 0, "b": 1, "latency_ms": -5}]), "links[0].latency_ms"),
        (lambda d: d.update(links=[{"a": 0, "b": 8}]), "links[0].b"),
        (lambda d: d["default_link"].update(bandwidth_mbps=0), "default_link.bandwidth_mbps"),
    ],
)
def test_validation_names_field(mutate, field):
    with pytest.raises(ConfigError) as ei:
        topology_from_dict(_mut(mutate))
    assert ei.value.field == field


def test_unreachable_node_is_named():
    d = topology_to_dict(mesh(3))
    d["networks"].append({"name": "island"})
    d["nodes"][2]["nics"][0]["network"] = "island"
    with pytest.raises(ConfigError) as ei:
        topology_from_dict(d)
    assert ei.value.field == "nodes[2].nics"


def test_disconnected_components():
    d = topology_to_dict(mesh(4))
    d["networks"].append({"name": "b"})
    for i in (2, 3):
        d["nodes"][i]["nics"][0]["network"] = "b"
    with pytest.raises(ConfigError, match="connected"):
        topology_from_dict(d)


def test_bad_json_names_position(tmp_path):
    p = tmp_path / "t.json"
    p.write_text('{"version": 1,,}')
    with pytest.raises(ConfigError, match="line 1 column"):
        load(p)


def test_link_attributes():
    d = _doc()
    d["links"] = [{"a": 0, "b": 1, "latency_ms": 50, "jitter_ms": 2, "bandwidth_mbps": 100}]
    t = topology_from_dict(d)
    assert t.link(1, 0).latency_ms == 50 and t.link(1, 0).bandwidth_mbps == 100
    assert t.link(1, 2).latency_ms == 0


def test_cli_topo_writes_and_checks(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["topo", "bcube", "--alpha", "3", "--beta", "2", "-o", str(out)]) == 0
    assert load(out).size == 9
    assert main(["topo", "check", str(out)]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["topo", "ring", "-n", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "ring"
    bad = tmp_path / "bad.json"
    d = topology_to_dict(ring(3))
    d["nodes"][1]["nics"][0]["port"] = -1
    bad.write_text(json.dumps(d))
    assert main(["topo", "check", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nodes[1].nics[0].port" in err[0]
    assert main(["topo", "ring", "-n", "1"]) == 2


def test_hop_distances_and_next_hops_route_around_dead_nodes():
    from p2psync.topology.paths import hop_distances, next_hops

    t = ring(6)
    assert hop_distances(t, 0) == {0: 0, 1: 1, 5: 1, 2: 2, 4: 2, 3: 3}
    assert hop_distances(t, 0, avoid={1})[2] == 4  # the long way round
    assert hop_distances(t, 1, avoid={1}) == {}

    def hops(dst, dead=(), **kw):
        return next_hops(t, 0, dst, dead=set(dead), distances=lambda b: hop_distances(t, b, avoid=set(dead)), **kw)

    assert hops(3) == [1, 5]  # equal cost: lower id first
    assert hops(2) == [1, 5] and hops(2, rotate=1) == [5, 1]
    assert hops(2, dead={1}) == [5]
    assert hops(3, dead={3}) == [] and hops(3, dead={3}, to_dead=True) == [1, 5]  # its live neighbours
    # spread: the k-th of the equal-cost candidates first, the costlier ones after them
    assert hops(3, spread=1) == [5, 1] and hops(3, spread=2) == [1, 5]
    assert hops(2, exclude=None, spread=1) == [1, 5]  # 1 is nearer: one candidate of least cost
    # avoid: the nodes a relayed message passed already are no next hops, however near
    assert hops(3, avoid=(1,)) == [5] and hops(3, avoid=(1, 5)) == []


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda d: d["nodes"][0]["nics"][0].update(port=True), "nodes[0].nics[0].port"),
        (lambda d: d["nodes"][1]["nics"][0].update(name="eth 0"), "nodes[1].nics[0].name"),
        (lambda d: d["nodes"][1]["nics"][0].update(name=""), "nodes[1].nics[0].name"),
        (lambda d: d["nodes"][2]["nics"][1].update(address="127.0.0.1:80"), "nodes[2].nics[1].address"),
        (lambda d: d["nodes"][2]["nics"][1].update(network=["ring-0-1"]), "nodes[2].nics[1].network"),
        (lambda d: d["nodes"][3]["nics"][0].update(mtu=1500), "nodes[3].nics[0]"),
        (lambda d: d["nodes"][3]["nics"].__setitem__(0, "eth0"), "nodes[3].nics[0]"),
        (lambda d: d["nodes"][3].update(host=7), "nodes[3].host"),
        (lambda d: d["networks"][0].update(name="a b"), "networks[0].name"),
    ],
)
def test_the_fast_checks_of_large_topologies_still_name_the_field(mutate, field):
    """NICs are checked by a fast path first (no field names built); whatever it does not
    accept goes through the full checks, which name the field."""
    with pytest.raises(ConfigError) as ei:
        topology_from_dict(_mut(mutate))
    assert ei.value.field == field


@pytest.mark.parametrize("topo", [ring(5), mesh(4), star(5), bcube(3, 2)], ids=["ring", "mesh", "star", "bcube"])
def test_adjacency_is_the_routes(topo):
    """neighbors / degree / adjacent / is_connected, computed once from the networks' members,
    say exactly what the routes say."""
    for a in topo.ids:
        by_routes = sorted(b for b in topo.ids if topo.routes(a, b))
        assert topo.neighbors(a) == by_routes and topo.degree(a) == len(by_routes)
        assert [b for b in topo.ids if topo.adjacent(a, b)] == by_routes
    assert topo.is_connected() and topo.lonely() == []


def test_a_ring_of_30000_nodes_loads_and_validates():
    """Validation is linear in the NICs (it was quadratic: every node scanned every route);
    bench/topology_scale.py times it. The collector is back on afterwards."""
    import gc

    text = dumps(ring(30000, base_port=1024))
    topo = loads(text)
    assert topo.size == 30000 and topo.neighbors(0) == [1, 29999] and topo.is_connected()
    assert gc.isenabled()
    d = json.loads(text)
    d["nodes"][29999]["nics"][1]["port"] = 70000  # a bad field at the very end is still named
    with pytest.raises(ConfigError) as ei:
        topology_from_dict(d)
    assert ei.value.field == "nodes[29999].nics[1].port"


def test_a_topology_file_that_cannot_be_written_is_a_clear_error(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a folder below a regular file: never writable, even by root
    assert main(["topo", "ring", "-n", "3", "-o", str(blocked / "r.json")]) == 2
    err = capsys.readouterr().err
    assert f"cannot write topology {blocked / 'r.json'}: Not a directory" in err and "Traceback" not in err

"""The environment contract of ``p2psync run ... -- CMD`` (p2psync.api.env) and RunConfig JSON."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from p2psync.api.env import (ENV_CONFIG, ENV_LOCAL_RANK, ENV_NODE, ENV_RANK, ENV_RUN_DIR, ENV_STRATEGY,
                             ENV_TOPOLOGY, ENV_WORLD_SIZE, from_env, node_env, node_run_dir)
from p2psync.errors import ConfigError
from p2psync.topology import Topology, load, ring, save
from p2psync.training.config import RunConfig

pytestmark = pytest.mark.timeout(30)


def _relabel(topo: Topology, ids: list[int]) -> Topology:
    """``topo`` with node ids ``ids`` (unsorted on purpose), to check rank = index in sorted ids."""
    from p2psync.topology import topology_from_dict, topology_to_dict

    d = topology_to_dict(topo)
    old = [n["id"] for n in d["nodes"]]
    for n, new in zip(d["nodes"], ids):
        n["id"] = new
    mapping = dict(zip(old, ids))
    d["coordinator"] = mapping[d.get("coordinator", 0)]
    for link in d.get("links", []):
        link["a"], link["b"] = mapping[link["a"]], mapping[link["b"]]
    return topology_from_dict(d)


@pytest.fixture
def setup(tmp_path):
    path = tmp_path / "r3.json"
    save(ring(3), path)
    cfg = RunConfig(topology=str(path), strategy="asgd", strategy_options=(("max_inflight", "4"),),
                    codec="int8", peer_timeout=12.5, shaper="inproc", run_id="r", seed=7,
                    partition="dirichlet", on_failure="stop", steps=None, epochs=None, out=str(tmp_path))
    return cfg, load(path)


def test_runconfig_json_round_trip(setup):
    cfg, _ = setup
    assert RunConfig.from_json(cfg.to_json()) == cfg
    other = replace(cfg, epochs=3, time_limit=5.0, threads=2, data_dir=None, error_feedback=True)
    back = RunConfig.from_json(other.to_json())
    assert back == other and isinstance(back.epochs, float) and back.strategy_options == (("max_inflight", "4"),)


@pytest.mark.parametrize("doc,match", [
    ("[1]", "JSON object"),
    ('{"topology": "t", "lr": "fast"}', "lr: expected float"),
    ('{"topology": "t", "lr": -1}', "--lr"),
    ('{"topology": "t", "bogus": 1}', "bogus"),
    ('{"topology": "t", "steps": true}', "steps: expected int"),
    ('{"topology": "t", "strategy_options": [["a", 1]]}', "strategy_options"),
    ('{"lr": 0.1}', "topology"),
    ("{", "not JSON"),
])
def test_runconfig_from_bad_json(doc, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_json(doc)


def test_node_env_and_back(setup, tmp_path):
    cfg, topo = setup
    run_dir = node_run_dir(tmp_path, "r", 2)
    assert run_dir.is_dir() and run_dir == (tmp_path / "r" / "node-2").absolute()
    env = node_env(cfg, topo, 2, run_dir=run_dir, local_rank=2, local_world_size=3)
    assert env[ENV_NODE] == "2" and env[ENV_RANK] == "2" and env[ENV_WORLD_SIZE] == "3"
    assert env[ENV_STRATEGY] == "asgd" and env[ENV_RUN_DIR] == str(run_dir)
    assert all(isinstance(v, str) for v in env.values())
    ne = from_env(env)
    assert ne is not None
    assert (ne.node_id, ne.rank, ne.world_size, ne.local_rank, ne.local_world_size) == (2, 2, 3, 2, 3)
    assert ne.strategy == "asgd" and ne.run_dir == run_dir and str(ne.topology) == cfg.topology
    assert ne.config == replace(cfg, progress=False)


def test_rank_is_index_in_sorted_ids(tmp_path):
    topo = _relabel(ring(3), [7, 2, 5])
    path = tmp_path / "t.json"
    save(topo, path)
    cfg = RunConfig(topology=str(path))
    ranks = {i: node_env(cfg, topo, i, run_dir=None, local_rank=0, local_world_size=1)[ENV_RANK]
             for i in (7, 2, 5)}
    assert ranks == {2: "0", 5: "1", 7: "2"}
    env = node_env(cfg, topo, 7, run_dir=None, local_rank=0, local_world_size=1)
    assert ENV_RUN_DIR not in env
    ne = from_env(env)
    assert ne is not None and ne.rank == 2 and ne.run_dir is None
    with pytest.raises(ConfigError, match="no such node"):
        node_env(cfg, topo, 3, run_dir=None, local_rank=0, local_world_size=1)


def test_single_node_mode():
    assert from_env({}) is None
    assert from_env({"RANK": "3", ENV_TOPOLOGY: "x.json"}) is None


def test_minimal_env_without_config(setup):
    cfg, _ = setup
    ne = from_env({ENV_NODE: "1", ENV_TOPOLOGY: cfg.topology, ENV_STRATEGY: "esync"})
    assert ne is not None and ne.strategy == "esync" and ne.config.strategy == "esync"
    assert ne.rank == 1 and ne.local_rank == 0 and ne.local_world_size == 1 and ne.run_dir is None


def test_strategy_variable_wins_over_config(setup):
    cfg, topo = setup
    env = node_env(cfg, topo, 0, run_dir=None, local_rank=0, local_world_size=1)
    ne = from_env({**env, ENV_STRATEGY: "ssgd"})
    assert ne is not None and ne.strategy == ne.config.strategy == "ssgd" and ne.config.codec == "int8"


@pytest.mark.parametrize("var,value,match", [
    (ENV_NODE, "one", "P2PSYNC_NODE: 'one' is not an integer"),
    (ENV_NODE, "", "P2PSYNC_NODE: '' is not an integer"),
    (ENV_NODE, "-1", "P2PSYNC_NODE: '-1' must be >= 0"),
    (ENV_NODE, "9", "P2PSYNC_NODE: '9': no such node"),
    (ENV_TOPOLOGY, "", "P2PSYNC_TOPOLOGY: not set"),
    (ENV_CONFIG, "{oops", "P2PSYNC_CONFIG: not JSON"),
    (ENV_CONFIG, json.dumps({"topology": "t", "lr": 0}), "P2PSYNC_CONFIG: --lr must be a positive"),
    (ENV_RANK, "x", "RANK: 'x' is not an integer"),
    (ENV_RANK, "0", "RANK: '0' disagrees with P2PSYNC_NODE='1'"),
    (ENV_WORLD_SIZE, "4", "WORLD_SIZE: '4' disagrees"),
    (ENV_LOCAL_RANK, "3", "LOCAL_RANK: '3' is not below LOCAL_WORLD_SIZE=3"),
    (ENV_RUN_DIR, "", "P2PSYNC_RUN_DIR: empty"),
    (ENV_STRATEGY, "", "P2PSYNC_STRATEGY: empty"),
])
def test_malformed_variables_name_themselves(setup, var, value, match):
    cfg, topo = setup
    env = node_env(cfg, topo, 1, run_dir=None, local_rank=1, local_world_size=3)
    env[var] = value
    with pytest.raises(ConfigError, match=match):
        from_env(env)


def test_missing_topology_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read topology"):
        from_env({ENV_NODE: "0", ENV_TOPOLOGY: str(tmp_path / "nope.json")})



def test_host_nodes_by_the_topologys_addresses():
    from p2psync.api.env import host_nodes

    local = ring(4)  # loopback addresses: every node on this host
    assert [host_nodes(local, i) for i in local.ids] == [[0, 1, 2, 3]] * 4
    spread = ring(4, hosts=["198.18.0.1", "198.18.0.1", "198.18.0.2", "198.18.0.3"])
    assert host_nodes(spread, 0) == [0, 1] and host_nodes(spread, 1) == [0, 1]
    assert host_nodes(spread, 2) == [2] and host_nodes(spread, 3) == [3]

"""The environment contract between ``p2psync run TOPOLOGY [options] -- CMD`` and the script.

The launcher starts CMD once per node with these variables added to its environment
(``node_env``); ``p2psync.attach`` / ``Session`` inside the script read them back (``from_env``):

``P2PSYNC_TOPOLOGY``  absolute path of the topology JSON file
``P2PSYNC_NODE``      this node's id in the topology (absent: the script runs as a single node)
``P2PSYNC_STRATEGY``  the synchronization strategy
``P2PSYNC_CONFIG``    the whole run config as JSON (``RunConfig.to_json``): strategy options,
                      codec, timeouts, shaper, WAN profile, run id, seed, partition, ...
``P2PSYNC_RUN_DIR``   a directory of this node's own, ``<out>/<run_id>/node-<id>/`` (checkpoints
                      of different nodes never collide; ``--node K`` with a command therefore
                      needs ``--run-id``)
``RANK`` / ``WORLD_SIZE``  torchrun's names: index of the node id among the sorted topology ids,
                      number of nodes
``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``  among the topology's nodes on this host (:func:`host_nodes`:
                      every node when the launcher starts them all)
``P2PSYNC_UNAUTHENTICATED_WARNED``  ``1`` when the launcher already said that the cluster has no
                      keys (:data:`p2psync.transport.keys.ENV_WARNED`): the node does not repeat it

``OMP_NUM_THREADS``   torch's threads (:func:`thread_env`): ``--threads``, else the cores divided
                      among the topology's nodes on this host, unless the environment sets it

With ``--node K`` the launcher gives node K's copy exactly what it gives that copy when it
starts every node (``p2psync.cli.launch.script_env``).

``P2PSYNC_TOPOLOGY`` and ``P2PSYNC_STRATEGY`` win over the same fields of ``P2PSYNC_CONFIG``,
so one of them can be changed by hand. Nothing is read at import time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

from p2psync.errors import ConfigError, translate
from p2psync.files import reason
from p2psync.topology import Topology, load
from p2psync.transport.shm import same_host
from p2psync.training.config import RunConfig

ENV_TOPOLOGY = "P2PSYNC_TOPOLOGY"
ENV_NODE = "P2PSYNC_NODE"
ENV_STRATEGY = "P2PSYNC_STRATEGY"
ENV_CONFIG = "P2PSYNC_CONFIG"
ENV_RUN_DIR = "P2PSYNC_RUN_DIR"
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"


@dataclass(frozen=True, kw_only=True)
class NodeEnv:
    """What the launcher told one node's script (``from_env``)."""

    topology: Path
    node_id: int
    strategy: str
    config: RunConfig
    run_dir: Path | None
    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1


def node_run_dir(out: str | Path, run_id: str, node_id: int) -> Path:
    """``<out>/<run_id>/node-<id>/`` as an absolute path, created."""
    path = (Path(out) / run_id / f"node-{node_id}").absolute()
    with translate({OSError: lambda e: ConfigError(f"cannot create node {node_id}'s folder {path}: {reason(e)}")}):
        path.mkdir(parents=True, exist_ok=True)
    return path


def node_env(cfg: RunConfig, topo: Topology, node_id: int, *, run_dir: Path | None, local_rank: int,
             local_world_size: int) -> dict[str, str]:
    """The variables to add to the environment of node ``node_id``'s script (only those)."""
    if node_id not in topo.ids:
        raise ConfigError(f"node {node_id}: no such node in {cfg.topology} (ids {topo.ids})")
    if not 0 <= local_rank < local_world_size:
        raise ConfigError(f"local rank {local_rank} is not in [0, {local_world_size})")
    topo_path = str(Path(cfg.topology).absolute())
    child = replace(cfg, topology=topo_path, progress=False)
    env = {
        ENV_TOPOLOGY: topo_path,
        ENV_NODE: str(node_id),
        ENV_STRATEGY: cfg.strategy,
        ENV_CONFIG: child.to_json(),
        ENV_RANK: str(topo.ids.index(node_id)),
        ENV_WORLD_SIZE: str(topo.size),
        ENV_LOCAL_RANK: str(local_rank),
        ENV_LOCAL_WORLD_SIZE: str(local_world_size),
    }
    if run_dir is not None:
        env[ENV_RUN_DIR] = str(Path(run_dir).absolute())
    return env


def host_nodes(topo: Topology, node_id: int) -> list[int]:
    """The nodes of ``topo`` on the same host as ``node_id``, by their NIC addresses (sorted
    ids, ``node_id`` among them): when every NIC of ``node_id`` has a loopback
    address, every node whose NICs all have one; otherwise every node with an address in
    common with ``node_id`` (``p2psync topo --hosts H1,H1,H2`` puts two nodes on H1)."""
    mine = {nic.address for nic in topo.node(node_id).nics}
    loopback = all(same_host(a) for a in mine)
    out = []
    for i in topo.ids:
        theirs = {nic.address for nic in topo.node(i).nics}
        if i == node_id or (all(same_host(a) for a in theirs) if loopback else mine & theirs):
            out.append(i)
    return out


def from_env(environ: Mapping[str, str]) -> NodeEnv | None:
    """This process's node, as the launcher described it in ``environ`` (e.g. ``os.environ``).

    None when ``P2PSYNC_NODE`` is not set (the script runs as a single node). A malformed or
    inconsistent value raises ``ConfigError`` naming the variable and the value. Reads the
    topology file (to check the node id and compute the rank)."""
    raw_node = environ.get(ENV_NODE)
    if raw_node is None:
        return None
    node_id = _int(environ, ENV_NODE, minimum=0)
    topo_path = environ.get(ENV_TOPOLOGY, "")
    if not topo_path:
        raise ConfigError(f"not set, but {ENV_NODE}={raw_node!r} is (p2psync run sets both)",
                          field=ENV_TOPOLOGY)
    cfg = _config(environ, topo_path)
    topo = load(topo_path)
    if node_id not in topo.ids:
        raise ConfigError(f"{raw_node!r}: no such node in {topo_path} (ids {topo.ids})", field=ENV_NODE)
    rank, world_size = topo.ids.index(node_id), topo.size
    for name, want in ((ENV_RANK, rank), (ENV_WORLD_SIZE, world_size)):
        if name in environ and _int(environ, name, minimum=0) != want:
            raise ConfigError(f"{environ[name]!r} disagrees with {ENV_NODE}={raw_node!r}: node {node_id} "
                              f"has rank {rank} of {world_size} in {topo_path}", field=name)
    local_world_size = _int(environ, ENV_LOCAL_WORLD_SIZE, minimum=1) if ENV_LOCAL_WORLD_SIZE in environ else 1
    local_rank = _int(environ, ENV_LOCAL_RANK, minimum=0) if ENV_LOCAL_RANK in environ else 0
    if local_rank >= local_world_size:
        raise ConfigError(f"{environ[ENV_LOCAL_RANK]!r} is not below {ENV_LOCAL_WORLD_SIZE}={local_world_size}",
                          field=ENV_LOCAL_RANK)
    raw_dir = environ.get(ENV_RUN_DIR)
    if raw_dir is not None and not raw_dir:
        raise ConfigError("empty (a directory path, or not set)", field=ENV_RUN_DIR)
    return NodeEnv(topology=Path(topo_path), node_id=node_id, strategy=cfg.strategy, config=cfg,
                   run_dir=Path(raw_dir) if raw_dir else None, rank=rank, world_size=world_size,
                   local_rank=local_rank, local_world_size=local_world_size)


def _config(environ: Mapping[str, str], topo_path: str) -> RunConfig:
    strategy = environ.get(ENV_STRATEGY)
    if strategy is not None and not strategy:
        raise ConfigError("empty (a strategy name, or not set)", field=ENV_STRATEGY)
    raw = environ.get(ENV_CONFIG)
    try:
        cfg = RunConfig(topology=topo_path) if raw is None else RunConfig.from_json(raw)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (value {_short(raw)})", field=ENV_CONFIG) from None
    try:
        return replace(cfg, topology=topo_path, strategy=strategy or cfg.strategy)
    except ConfigError as exc:
        raise ConfigError(str(exc), field=ENV_STRATEGY) from None


def _int(environ: Mapping[str, str], name: str, *, minimum: int) -> int:
    raw = environ[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{raw!r} is not an integer", field=name) from None
    if value < minimum:
        raise ConfigError(f"{raw!r} must be >= {minimum}", field=name)
    return value


def _short(text: str | None, limit: int = 200) -> str:
    s = repr(text)
    return s if len(s) <= limit else s[:limit] + "..."


#: the variable torch (and OpenMP, MKL) read at start for their thread pools
ENV_THREADS = "OMP_NUM_THREADS"


def thread_env(asked: int | None, default: int | None) -> dict[str, str]:
    """Threads for a user's command (torch reads ``OMP_NUM_THREADS`` when it starts): ``--threads``
    when given; else the launcher's share of the cores, unless the user's environment already
    says. (Several copies of a script on one host, each with torch's default of one thread per
    core, oversubscribe the cores: on 2 cores three copies of the example ran 3-4x slower; the
    built-in job sets its threads itself. torchrun does the same.)"""
    if asked is not None:
        return {ENV_THREADS: str(asked)}
    if default is not None and ENV_THREADS not in os.environ:
        return {ENV_THREADS: str(default)}
    return {}

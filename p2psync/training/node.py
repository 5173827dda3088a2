"""One node of a run: builds the replica, joins the cluster, trains, reports.

Order: load data and build the model first (slow, node-local), then bind the transport and
rendezvous with the coordinator (every node starts training at about the same moment), train
with the chosen strategy, then a bounded finish barrier so no node closes its sockets while
peers still need it. The coordinator node also hosts the membership service and writes the
run's ``summary.json``.

Coordinator failover (issue 10 item 6): every node has a
:class:`~p2psync.coordinator.failover.CoordinatorHost`, so when the coordinator dies the lowest
live id takes over membership and the strategy's coordinator services, the survivors re-send
their finish stats to it, and the node coordinating at the end writes ``summary.json`` (and
``config.json`` if it is missing), listing the dead coordinator among the failed nodes.

A node started while its run is going (the same ``--node`` restarted with the same
``--run-id``, after the coordinator declared its previous process failed) is admitted as a
joiner: the registration reply says ``joined``, and the strategy fetches the state from live
peers in ``start()`` before training (issue 10 item 5).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2psync.collectives import Collectives
from p2psync.coordinator import MembershipClient, RpcClient, RpcServer
from p2psync.coordinator.failover import CoordinatorHost
from p2psync.errors import ConfigError, P2PSyncError
from p2psync.strategies.base import StrategyContext, get_strategy
from p2psync.topology import Topology, load, topology_to_dict
from p2psync.training.config import RunConfig
from p2psync.training.data import load_dataset
from p2psync.training.hetero import parse_profiles
from p2psync.training.loop import train_loop
from p2psync.training.metrics import MetricsWriter
from p2psync.training.models import build_model
from p2psync.training.partition import partition
from p2psync.training.trainer import Trainer, make_optimizer, resolve_device
from p2psync.transport import ZmqEndpoint
from p2psync.transport.shaping import load_wan_profile, make_shaper

log = logging.getLogger("p2psync.node")


RELAY_LINGER_S = 0.5
#: how long a starting node asks the others whether their run is already going
DISCOVER_S = 1.5


def relays_for_others(topo: Topology, node_id: int, coordinator: int | None = None) -> bool:
    """True when a neighbour of ``node_id`` reaches the coordinator (``coordinator``, default
    the topology's) only through relays."""
    c = topo.coordinator if coordinator is None else coordinator
    return any(nb != c and not topo.routes(nb, c) for nb in topo.neighbors(node_id))


def wire_run_id(topo: Topology, run_id: str | None) -> int:
    """The run id every header carries: 64 bits of SHA-256 over the topology and ``--run-id``.

    Every node of a run derives the same value with no extra round trip: the launcher passes
    the same ``--run-id`` to all its nodes, and multi-host runs must pass the same ``--run-id``
    on every host (without one, the id depends on the topology only, and consecutive runs on
    the same ports are told apart by the incarnations alone). The options are deliberately left
    out: a node started with different options must still reach the coordinator, which rejects
    it with a clear "different configuration" error instead of a silent ``wrong_run`` drop."""
    blob = json.dumps({"topology": topology_to_dict(topo), "run": run_id or ""}, sort_keys=True,
                      default=str).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little")


def default_run_id(topo: Topology, strategy: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{topo.name}-{strategy}"


def build_trainer(cfg: RunConfig, topo: Topology, node_id: int) -> Trainer:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    data = load_dataset(cfg.data, data_dir=cfg.data_dir, synthetic_size=cfg.synthetic_size)
    parts = partition(data.y_train, topo.size, cfg.partition, seed=cfg.seed,
                      alpha=cfg.dirichlet_alpha, shards_per_part=cfg.shards_per_node)
    rank = topo.ids.index(node_id)
    torch.manual_seed(cfg.seed)  # identical initial weights on every node
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    device = resolve_device(cfg.device)
    model.to(device)  # before the optimizer takes the parameters (Trainer keeps it there)
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.momentum, cfg.weight_decay)
    profile = parse_profiles(cfg.slowdown, cfg.slowdown_schedule, cfg.step_time,
                             cfg.slowdown_mode).get(node_id)
    return Trainer(model=model, optimizer=opt, data=data, indices=parts[rank],
                   batch_size=cfg.batch_size, seed=cfg.seed * 1000 + node_id, device=device,
                   slowdown=profile)


def summarize(run_id: str, topo: Topology, cfg: RunConfig, finished: dict[int, Any],
              failed: list[int]) -> dict[str, Any]:
    nodes = {str(k): v for k, v in sorted(finished.items()) if isinstance(v, dict)}
    accs = [v["final_accuracy"] for v in nodes.values() if v.get("final_accuracy") is not None]
    return {
        "run_id": run_id, "topology": topo.name, "strategy": cfg.strategy,
        "config": cfg.agreed(), "nodes": nodes, "failed": failed,
        "accuracy_mean": float(np.mean(accs)) if accs else None,
        "accuracy_min": float(np.min(accs)) if accs else None,
        "wall_s": max((v["wall_s"] for v in nodes.values()), default=None),
        "samples_per_s": sum(v["samples_per_s"] for v in nodes.values()),
        "bytes_sent": sum(v["bytes_sent"] for v in nodes.values()),
    }


async def run_node(cfg: RunConfig, node_id: int) -> dict[str, Any]:
    """Run one node to the end. Returns its final stats; raises P2PSyncError on failure."""
    topo = load(cfg.topology)
    if node_id not in topo.ids:
        raise ConfigError(f"--node {node_id}: no such node in {cfg.topology} (ids {topo.ids})")
    strategy_cls = get_strategy(cfg.strategy)
    trainer = build_trainer(cfg, topo, node_id)
    if cfg.wan:
        load_wan_profile(cfg.wan, topo)  # validate before starting anything
    transport = ZmqEndpoint(topology=topo, node_id=node_id, default_timeout=cfg.peer_timeout)
    transport.shaper = make_shaper(cfg.shaper, topo, node_id, wan=cfg.wan, seed=cfg.seed)
    transport.run_id = wire_run_id(topo, cfg.run_id)
    server = RpcServer(transport)
    rpc = RpcClient(transport, local=server)
    membership = MembershipClient(transport=transport, rpc=rpc, coordinator=topo.coordinator,
                                  heartbeat_interval=cfg.heartbeat, failure_timeout=cfg.failure_timeout,
                                  phi_threshold=cfg.phi_threshold)
    host = CoordinatorHost(
        server=server, membership=membership, expected=topo.ids,
        services=lambda srv: strategy_cls.coordinator_services(srv, topo, dict(cfg.strategy_options)),
        start_timeout=cfg.start_timeout, failure_timeout=cfg.failure_timeout,
        heartbeat_interval=cfg.heartbeat, phi_threshold=cfg.phi_threshold,
        run_info={"run_id": cfg.run_id or default_run_id(topo, cfg.strategy)},
        allow_join=cfg.on_failure == "continue")
    metrics = None
    strategy = None
    try:
        await transport.start()
        server.start()
        # a run already going (this node restarted): join it wherever it is coordinated now
        running = await membership.discover(timeout=DISCOVER_S)
        if running is None and node_id == topo.coordinator:
            host.host()
        info = await membership.register(cfg.fingerprint(), timeout=cfg.start_timeout + 5)
        run_id = cfg.run_id or str(info["run_id"])
        host.run_info["run_id"] = run_id  # a node that takes over answers with the run's id
        run_dir = Path(cfg.out) / run_id
        run_dir.mkdir(parents=True, exist_ok=True)

        def write_config() -> None:
            (run_dir / "config.json").write_text(json.dumps(
                {"run_id": run_id, "topology": topo.name, **asdict(cfg)}, indent=2, default=str))

        if host.coordinating:
            write_config()
        metrics = MetricsWriter(run_dir / f"node-{node_id}.jsonl")
        membership.start()
        ctx = StrategyContext(node_id=node_id, topology=topo, transport=transport, rpc=rpc,
                              rpc_server=server, membership=membership, replica=trainer,
                              collectives=Collectives(transport, piece_bytes=cfg.piece_kib << 10,
                                                      timeout=cfg.peer_timeout, codec=cfg.codec,
                                                      error_feedback=cfg.error_feedback,
                                                      algo=cfg.collective),
                              peer_timeout=cfg.peer_timeout, options=dict(cfg.strategy_options),
                              on_failure=cfg.on_failure, joining=bool(info.get("joined")))
        strategy = strategy_cls(ctx)
        membership.listeners.append(strategy.on_peer_failure)
        membership.view_listeners.append(strategy.on_view)
        await strategy.start()

        def nic_bytes() -> dict[str, dict[str, int]]:
            return {k: {"sent": v.bytes_sent, "recv": v.bytes_recv} for k, v in transport.nic_stats.items()}

        n_train = len(trainer.data.y_train)
        time_limit = cfg.time_limit
        if time_limit is not None and info.get("joined") and membership.run_started is not None:
            # --time is the run's budget: a joiner trains until the run's end, not a full budget
            time_limit = max(0.0, time_limit - (time.monotonic() - membership.run_started))
        stats = await train_loop(node_id=node_id, strategy=strategy, trainer=trainer, metrics=metrics,
                                 max_steps=cfg.max_steps(n_train, topo.size), time_limit=time_limit,
                                 eval_every=cfg.eval_every, eval_seconds=cfg.eval_seconds,
                                 nic_bytes=nic_bytes)
        stats["rejected"] = dict(transport.rejected)
        await membership.finish(stats, timeout=max(30.0, cfg.peer_timeout))
        if relays_for_others(topo, node_id, membership.coordinator):
            # the coordinator's finish replies to nodes behind this one pass through it
            await asyncio.sleep(RELAY_LINGER_S)
        service = host.service
        if service is not None and host.coordinating:
            if not (run_dir / "config.json").exists():  # took over on another host
                write_config()
            summary = summarize(run_id, topo, cfg, service.state.finished, sorted(service.state.failed))
            summary["coordinator"] = node_id  # not the topology's when it took over
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return stats
    finally:
        if strategy is not None:
            try:
                await strategy.close()
            except P2PSyncError:
                pass
        await membership.close()
        await host.close()
        await server.close()
        await transport.close()
        trainer.close()
        if metrics is not None:
            metrics.close()

"""One node's runtime: transport, RPC, membership, coordinator failover, the strategy, and the
finish barrier (moved here from the built-in job's ``run_node``, so users' scripts get exactly
the same runtime through :class:`~p2psync.api.session.Session`).

Order: bind the transport, ask whether a run is already going (a restarted node joins it),
host the coordinator services if this node is the topology's coordinator of a fresh run,
rendezvous with the coordinator, then build and start the strategy on the given replica. At
the end a bounded finish barrier keeps every node's sockets open while peers still need them;
the node coordinating then writes the run's ``summary.json`` (after a failover that is the
node that took over, listing the dead coordinator among the failed). A node whose loop ended
while the others train on (it departs) stays in the barrier beyond its bound as long as those
others pass tensors through it (:func:`relay_wanted`): their collectives, state syncs and
final averages never depend on which nodes happened to leave first.

A node started while its run is going (the same ``--node`` restarted with the same
``--run-id``, after the coordinator declared its previous process failed) is admitted as a
joiner: the registration reply says ``joined``, and the strategy fetches the state from live
peers in ``start()`` before training.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any, Collection

import numpy as np

from p2psync import clock
from p2psync.collectives import Collectives
from p2psync.coordinator.stack import membership_stack
from p2psync.coordinator.views import View
from p2psync.coordinator.votes import FileVotes
from p2psync.errors import P2PSyncError, ProtocolError
from p2psync.files import WriteFailures, write_text_or_warn
from p2psync.model import Replica
from p2psync.strategies.base import Strategy, StrategyContext, get_strategy, parse_options
from p2psync.topology import Topology, topology_to_dict
from p2psync.training.config import RunConfig
from p2psync.topology.paths import direct_links, hop_distances, joined
from p2psync.coordinator.membership_client import MembershipClient
from p2psync.transport import SocketOptions, ZmqEndpoint
from p2psync.transport.base import Transport
from p2psync.transport.incarnation import next_incarnation
from p2psync.transport.keys import node_keys
from p2psync.wire.schema import valid_run_id
from p2psync.transport.shaping import load_wan_profile, make_shaper

log = logging.getLogger("p2psync.node")

#: how long a node that relays for others stays after the finish barrier, at most (it leaves
#: as soon as those others are gone)
RELAY_LINGER_S = 0.5
#: how long a node waits in the finish barrier at least (the peer timeout when longer)
BARRIER_S = 30.0
#: how long a starting node asks the others whether their run is already going
DISCOVER_S = 1.5


def relayed_neighbours(topo: Topology, node_id: int, coordinator: int | None = None,
                       gone: Collection[int] = ()) -> list[int]:
    """The neighbours of ``node_id`` that the coordinator (``coordinator``, default the
    topology's) reaches only through relays, with ``node_id`` as the last one on a shortest
    path: one hop farther from the coordinator than ``node_id`` (so two nodes never wait for
    each other). Paths avoid the nodes ``gone`` (they relay nothing)."""
    c = topo.coordinator if coordinator is None else coordinator
    dist = hop_distances(topo, c, avoid=gone)
    if node_id not in dist:
        return []
    return [nb for nb in topo.neighbors(node_id) if dist.get(nb) == dist[node_id] + 1 and dist[nb] >= 2]


def reply_relays(topo: Topology, node_id: int, view: View | None, coordinator: int) -> list[int]:
    """The neighbours whose finish-barrier replies may pass through ``node_id`` at the run's end
    (:func:`relayed_neighbours`) over the nodes that still run: the members of ``view`` and the
    departed ones, which wait in the barrier for their reply too (a departed node that relays
    for members stays until the barrier completes); only the others are gone."""
    running = set(view.members) | set(view.departed) if view is not None else set(topo.ids)
    return relayed_neighbours(topo, node_id, coordinator, set(topo.ids) - running)


def _ids(value: Any) -> list[int]:
    """The node ids in a list a peer sent (anything else: none)."""
    return [n for n in value if type(n) is int] if isinstance(value, list) else []


def relay_wanted(topo: Topology, node_id: int, members: Collection[int], dead: Collection[int] = ()) -> bool:
    """Whether ``members`` (the view's members that have not finished; ``node_id`` is not one
    any more) pass tensors through ``node_id``: their own links do not join them (so their
    collectives relay through non-members: :mod:`p2psync.collectives.plan`), and a shortest
    path over live nodes (not in ``dead``) between two of them that are not adjacent passes
    ``node_id``. On ring-4, ``relay_wanted(ring(4), 0, [1, 3])`` is True."""
    group = sorted(set(members) - {node_id})
    if len(group) < 2 or joined(direct_links(topo, group)):
        return False
    avoid = set(dead) - {node_id}
    mine = hop_distances(topo, node_id, avoid=avoid)
    for k, a in enumerate(group):
        if a not in mine:
            continue
        da = hop_distances(topo, a, avoid=avoid - {a})
        for b in group[k + 1:]:
            if b in mine and b in da and not topo.routes(a, b) and mine[a] + mine[b] == da[b]:
                return True
    return False


async def finish_barrier(membership: MembershipClient, transport: Transport, topo: Topology, stats: dict[str, Any], *,
                         timeout: float, depart: bool) -> dict[str, Any]:
    """A node's part of the finish barrier, up to the moment its process may end: send its
    ``stats`` to the coordinator and wait for the barrier's reply (``{}``: it failed; with
    ``depart`` the node leaves the view, and while members still training pass tensors
    through it (:func:`relay_wanted`) it asks again); then, where the coordinator's replies to
    nodes behind it pass through it (:func:`reply_relays`), stay until they are gone (a node
    leaves once it has its reply: its connections close), at most :data:`RELAY_LINGER_S` (the
    whole wait when one of them is down already: a reconnect under way cannot be seen
    leaving). Returns the barrier's reply (``finished``, ``failed``)."""
    node_id = transport.node_id
    rep = await membership.finish(stats, timeout=timeout, depart=depart)
    while depart and rep:  # (an empty reply: the barrier failed, nobody to wait for)
        view = membership.view
        done = {n for key in ("finished", "failed") for n in _ids(rep.get(key))}
        waiting = [m for m in view.members if m not in done] if view is not None else []
        if not relay_wanted(topo, node_id, waiting, transport.dead):
            break
        log.info("node %d: members %s still train and pass tensors through this node: it stays in "
                 "the finish barrier", node_id, waiting)
        rep = await membership.finish(stats, timeout=timeout, depart=depart)
    behind = reply_relays(topo, node_id, membership.view, membership.coordinator)
    if behind:
        if any(transport.half_down(p) for p in behind):
            await asyncio.sleep(RELAY_LINGER_S)
        else:
            await transport.wait_gone(behind, RELAY_LINGER_S)
    return rep


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
    """``<time>-<topology name>-<strategy>``, the name reduced to the run id's safe characters."""
    name = re.sub(r"[^A-Za-z0-9_.+-]+", "-", topo.name).strip(".-") or "topology"
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{strategy}"[:128]


def checked_run_id(value: Any, coordinator: int) -> str:
    """The run id the coordinator's registration reply names: it becomes a folder name, so
    it must be a plain one (``valid_run_id``); anything else is remote bad input."""
    if not valid_run_id(value):
        raise ProtocolError("run_id", f"coordinator {coordinator} named the run {str(value)[:140]!r}: not a "
                            "plain folder name (1-128 characters of A-Z a-z 0-9 _ . + -, no '/', no '..')")
    return str(value)


def finite_values(obj: Any) -> Any:
    """``obj`` with NaN and infinite floats replaced by None (the wire refuses them, and JSON
    has no such numbers), in nested dicts and lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_values(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite_values(v) for v in obj]
    return obj


def summarize(run_id: str, topo: Topology, cfg: RunConfig, finished: dict[int, Any],
              failed: list[int]) -> dict[str, Any]:
    """The run's ``summary.json``: the agreed configuration (a script's run: without the built-in
    job's options, :meth:`RunConfig.record`), each finished node's stats, the
    failed nodes, and totals (mean / min final accuracy, wall time, throughput, bytes sent; a
    language model's ``final_val_bpb`` (the nodes' mean), ``tokens_per_s`` and ``data``).
    Written by the coordinating node in :meth:`NodeRuntime.finish`."""
    nodes = {str(k): v for k, v in sorted(finished.items()) if isinstance(v, dict)}
    accs = [v["final_accuracy"] for v in nodes.values() if v.get("final_accuracy") is not None]
    return {
        "run_id": run_id, "topology": topo.name, "strategy": cfg.strategy,
        "config": {k: v for k, v in cfg.agreed().items() if k in cfg.record()}, "nodes": nodes, "failed": failed,
        "accuracy_mean": float(np.mean(accs)) if accs else None,
        "accuracy_min": float(np.min(accs)) if accs else None,
        "wall_s": max((v.get("wall_s") or 0.0 for v in nodes.values()), default=None),
        "samples_per_s": sum(v.get("samples_per_s") or 0.0 for v in nodes.values()),
        "bytes_sent": sum(v.get("bytes_sent") or 0 for v in nodes.values()),
        **_lm_totals(nodes),
    }


def _lm_totals(nodes: dict[str, Any]) -> dict[str, Any]:
    """A language model's totals: mean / max final validation bits per byte, tokens/s of every
    node together, and the data set's identity (the first node's ``data``); {} otherwise."""
    out: dict[str, Any] = {}
    bpbs = [v["final_val_bpb"] for v in nodes.values() if isinstance(v.get("final_val_bpb"), (int, float))]
    if bpbs:
        out["final_val_bpb"] = float(np.mean(bpbs))
        out["val_bpb_max"] = float(np.max(bpbs))
    toks = [v["tokens_per_s"] for v in nodes.values() if isinstance(v.get("tokens_per_s"), (int, float))]
    if toks:
        out["tokens_per_s"] = float(sum(toks))
    data = next((v["data"] for v in nodes.values() if isinstance(v.get("data"), dict)), None)
    if data is not None:
        out["data"] = data
    return out


class NodeRuntime:
    """Everything of one node but the model: start, strategy, finish, close (one owner)."""

    def __init__(self, *, cfg: RunConfig, topo: Topology, node_id: int) -> None:
        self.cfg = cfg
        self.topo = topo
        self.node_id = node_id
        self.strategy_cls = get_strategy(cfg.strategy)
        parse_options(self.strategy_cls, dict(cfg.strategy_options), topology=topo)  # before anything starts
        if cfg.wan:
            load_wan_profile(cfg.wan, topo)  # validate before starting anything
        keys = node_keys(cfg.keys, topo, node_id, topo_path=cfg.topology)
        self.transport = ZmqEndpoint(topology=topo, node_id=node_id, default_timeout=cfg.peer_timeout, keys=keys,
                                     options=SocketOptions(shm=cfg.shm),
                                     shaper=make_shaper(cfg.shaper, topo, node_id, wan=cfg.wan, seed=cfg.seed,
                                                        nic_mbps=cfg.nic_mbps))
        self.transport.run_id = wire_run_id(topo, cfg.run_id)
        #: this node's writes it can do without (records, checkpoints): a disk error is said
        #: once per kind and counted, never fatal (p2psync/files.py)
        self.write_failures = WriteFailures(f"node {node_id}")
        # larger than every earlier process of this node in this run's folder took, whatever
        # the clock did (a run without --run-id has no folder before the rendezvous: the clock)
        node_dir = Path(cfg.out) / cfg.run_id / f"node-{node_id}" if cfg.run_id else None
        self.transport.incarnation = next_incarnation(node_dir, failures=self.write_failures)
        strategy_cls = self.strategy_cls
        stack = membership_stack(
            self.transport, topo, heartbeat=cfg.heartbeat, failure_timeout=cfg.failure_timeout,
            phi_threshold=cfg.phi_threshold, quorum_timeout=cfg.quorum_timeout, start_timeout=cfg.start_timeout,
            services=lambda srv: strategy_cls.coordinator_services(srv, topo, dict(cfg.strategy_options)),
            run_info={"run_id": cfg.run_id or default_run_id(topo, cfg.strategy)},
            allow_join=cfg.on_failure == "continue", votes=FileVotes(node_dir) if node_dir is not None else None)
        self.server, self.rpc, self.membership, self.host = stack.server, stack.rpc, stack.membership, stack.host
        #: one per node: the identical start and the strategy share its plans and residuals
        self.collectives = Collectives(self.transport, piece_bytes=cfg.piece_kib << 10, timeout=cfg.peer_timeout,
                                       codec=cfg.codec, error_feedback=cfg.error_feedback, algo=cfg.collective)
        self.strategy: Strategy | None = None
        self.info: dict[str, Any] = {}
        self.run_id = cfg.run_id or ""
        #: the run's folder (known before the rendezvous when --run-id names it, as for every
        #: node the launcher starts: a refused registration's marker goes there)
        self.run_dir = Path(cfg.out) / cfg.run_id if cfg.run_id else Path(cfg.out)
        self._started = False
        #: what :meth:`close` closes, last opened first (the strategy joins it when started)
        self._resources = contextlib.AsyncExitStack()
        for closing in (self.transport.close, self.server.close, self.host.close, self.membership.close):
            self._resources.push_async_callback(closing)

    @property
    def joined(self) -> bool:
        """This node registered after the run started (a restarted node joining it)."""
        return bool(self.info.get("joined"))

    def _write_config(self) -> None:
        """The run's ``config.json`` (best effort: a disk error is said once, the run goes on)."""
        text = json.dumps({"run_id": self.run_id, "topology": self.topo.name, **self.cfg.record()}, indent=2,
                          default=str)
        write_text_or_warn(self.run_dir / "config.json", text, what="run configuration", failures=self.write_failures)

    async def rendezvous(self) -> None:
        """Bind, find or host the run, register. Sets :attr:`run_id` and :attr:`run_dir`."""
        self._started = True
        await self.transport.start()
        self.server.start()
        # a run already going (this node restarted): join it wherever it is coordinated now
        running = await self.membership.discover(timeout=DISCOVER_S)
        if running is None and self.node_id == self.topo.coordinator:
            self.host.host()
        self.info = await self.membership.register(self.cfg.fingerprint(), timeout=self.cfg.start_timeout + 5)
        self.run_id = self.cfg.run_id or checked_run_id(self.info.get("run_id"), self.membership.coordinator)
        self.host.run_info["run_id"] = self.run_id  # a node that takes over answers with the run's id
        self.run_dir = Path(self.cfg.out) / self.run_id
        with self.write_failures.guard("run folder", self.run_dir, "no records, checkpoints or summary from "
                                       "this node"):
            self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.host.coordinating:
            self._write_config()
        self.membership.start()
        await self.membership.first_view(timeout=self.cfg.start_timeout)  # before any strategy starts

    async def start_strategy(self, replica: Replica, *, max_steps: int | None = None) -> Strategy:
        """Build the run's strategy over ``replica`` (its :class:`StrategyContext`), subscribe
        it to membership failures and views, and ``await strategy.start()``; it is closed with
        the runtime. Called after :meth:`rendezvous` by the session's step loop:
        ``strategy = await rt.start_strategy(self.replica, max_steps=bounded)``."""
        cfg, transport = self.cfg, self.transport
        ctx = StrategyContext(node_id=self.node_id, topology=self.topo, transport=transport, rpc=self.rpc,
                              rpc_server=self.server, membership=self.membership, replica=replica,
                              collectives=self.collectives,
                              peer_timeout=cfg.peer_timeout, options=dict(cfg.strategy_options),
                              on_failure=cfg.on_failure, joining=self.joined, max_steps=max_steps,
                              buffers=cfg.buffers, audit_every=cfg.audit_every,
                              quorum_timeout=cfg.quorum_timeout)
        strategy = self.strategy = self.strategy_cls(ctx)
        self._resources.push_async_callback(self._close_strategy, strategy)
        self.membership.listeners.append(strategy.on_peer_failure)
        self.membership.view_listeners.append(strategy.on_view)
        # the codecs' kernels loaded before the first step, not in the first exchange; off the
        # event loop (several seconds on a cold cache): heartbeats go on meanwhile
        for codec in {c.spec: c for c in strategy.codecs()}.values():
            await asyncio.to_thread(codec.warm)
        await strategy.start()
        self.membership.joined_training()
        return strategy

    def time_left(self) -> float | None:
        """The run's --time budget left for this node (a joiner ends with the run)."""
        limit = self.cfg.time_limit
        if limit is not None and self.joined and self.membership.run_started is not None:
            return max(0.0, limit - (clock.now() - self.membership.run_started))
        return limit

    def nic_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes sent and received so far per NIC (``{"l0": {"sent": ..., "recv": ...}}``),
        logged in every step's metrics record."""
        return {k: {"sent": v.bytes_sent, "recv": v.bytes_recv} for k, v in self.transport.nic_stats.items()}

    async def finish(self, stats: dict[str, Any], *, depart: bool = False) -> None:
        """The finish barrier (``depart``: this node leaves the view, the others re-form
        without it); the node coordinating then writes ``summary.json``."""
        stats["rejected"] = dict(self.transport.rejected)
        stats["write_failures"] = self.write_failures.as_dict()
        stats["shm_frames"] = self.transport.shm_frames
        stats["offences"] = {str(n): c for n, c in sorted(self.transport.offences.items())}
        await finish_barrier(self.membership, self.transport, self.topo, finite_values(stats),
                             timeout=max(BARRIER_S, self.cfg.peer_timeout), depart=depart)
        service = self.host.service
        if service is not None and self.host.coordinating and self.membership.fenced is None:
            if not service.state.has_quorum(clock.now()):
                st = service.state
                log.error("node %d: coordinates no majority of the run at its end: summary.json is not written "
                          "(the majority's coordinator writes it); agreed view %s, members %s, silent %s, blocked %s",
                          self.node_id, sorted(st.agreement.members) if st.agreement is not None else None,
                          st.alive_nodes, st.detector.suspects(clock.now()), st.blocked)
                return
            if not (self.run_dir / "config.json").exists():  # took over on another host
                self._write_config()
            summary = summarize(self.run_id, self.topo, self.cfg, service.state.finished,
                                sorted(service.state.failed))
            summary["coordinator"] = self.node_id  # not the topology's when it took over
            summary["term"] = service.state.term
            summary["excluded"] = {str(n): why for n, why in sorted(service.state.excluded.items())}
            summary["rejoined"] = {str(n): k for n, k in sorted(service.state.rejoined.items())}
            if service.state.ended:  # joiners the run ended without (they came back as it ended)
                summary["ended"] = sorted(service.state.ended)
            write_text_or_warn(self.run_dir / "summary.json", json.dumps(summary, indent=2), what="run summary",
                               failures=self.write_failures)

    @staticmethod
    async def _close_strategy(strategy: Strategy) -> None:
        try:
            await strategy.close()
        except P2PSyncError:  # the run is over: a peer gone meanwhile changes nothing
            pass

    async def close(self) -> None:
        """Close the strategy, membership, coordinator host, RPC server and transport, in
        that order; each one is closed even when one before it fails. Safe to call twice."""
        await self._resources.aclose()


__all__ = ["DISCOVER_S", "NodeRuntime", "checked_run_id", "default_run_id", "finite_values", "relay_wanted",
           "relayed_neighbours", "reply_relays", "summarize",
           "wire_run_id"]

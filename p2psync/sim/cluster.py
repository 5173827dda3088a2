"""N nodes of the real membership over the in-memory transport, in virtual time, with faults.

:class:`SimCluster` builds, for every node of a topology, exactly what a node runtime builds
for membership (:class:`~p2psync.api.runtime.NodeRuntime`): a transport, an RPC server and
client, a :class:`~p2psync.coordinator.MembershipClient` and a
:class:`~p2psync.coordinator.failover.CoordinatorHost` (the topology's coordinator hosts the
run; every node can take over). The transport is the simulated medium's (:mod:`p2psync.sim.medium`)
with per-link one-way latency from the in-process shaper; each node runs as an actor of the
:class:`~p2psync.sim.loop.VirtualLoop` (it must be the running loop). No strategy runs here:
:class:`~p2psync.sim.training.TrainingCluster` adds one on every node.

Faults (:mod:`p2psync.sim.faults`), at virtual times counted from the end of the rendezvous:

* **kill**: the node's endpoint leaves the medium (sends to it are retried, then fail, as to
  a node whose connection is down) and the node is held for good: it runs nothing more.
* **pause**: the node is held (its timers, tasks and the messages delivered to it wait) and
  released after the duration: it resumes late, as after ``SIGSTOP`` / ``SIGCONT``.
* **partition**: every link between the two sides is down for the duration (a send across is
  retried within its budget, as over a connection that is down).
* **restart**: a node still running is killed first; then a new process of it starts as a
  launcher would start it again: fresh transport, RPC, membership client and coordinator host
  (:class:`SimNode`), the next incarnation, run as a new actor (the old one stays held), and
  the rendezvous of ``NodeRuntime`` for a run that may be going: it asks every node for the
  run's view (:data:`DISCOVER_S`), hosts the run only when nobody knows of one and it is the
  topology's coordinator, and registers (a join: the coordinator refuses it while its
  previous process is not declared failed, and it asks again until the start timeout); once
  registered, :meth:`SimCluster._rejoined` starts what the new process runs next (nothing
  here; :class:`~p2psync.sim.training.TrainingCluster` starts its strategy as a joiner).
* **exit** (not injected): a process whose rendezvous or strategy fails with an error ends as
  a real one does once its runtime closed (:meth:`SimCluster._exit`): it is gone like a killed
  one, and the invariants count its exit as a kill at that time (``exited`` in the summary;
  its detection is marked ``exit``), so its peers must detect it in the bound and re-form.
* **end** (not injected): with a strategy, a process ends after the run's finish barrier
  (:meth:`SimCluster._leave`): its runtime closes and it leaves the medium. No fault: the
  membership's invariants judge the run as it stood when the first process ended
  (``ended_at_s`` in the summary; ``left``: when each ended), and ``quiet_end`` what
  happened after.
* **slow**: the slowed links' one-way latency is multiplied by the factor for the duration
  (the largest factor when several slowdowns slow one link), in both directions; what was
  sent before keeps its latency, and a link's shaper delivers in order (what is sent after
  the end waits for what was sent before it). A relayed control message on the express path
  (:class:`SimTransport`) pays the latencies of its path as they are when it is sent, so it
  may overtake one sent over that path before the slowdown ended.

Every message goes to its receiver as a callback of the receiver's actor, one loop iteration
after it was handed over (after the link latency when the link has one): a held receiver
takes it once released, in order.

:meth:`SimCluster.run` returns the summary: virtual and wall seconds, the views every node
applied (counted) and the final one, the detections, messages per node, the largest queues
(``queues``: the most messages and bytes any node's mailbox held unclaimed at once, the most
bytes any node held for relaying, and the messages dropped because a queue was full), and the
invariants (:mod:`p2psync.sim.invariants`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Hashable, Sequence

from p2psync.collectives.executor import SPREAD_FLOOR_BYTES
from p2psync.coordinator.detector import DEFAULT_FLOOR, DEFAULT_INTERVAL, DEFAULT_THRESHOLD
from p2psync.coordinator.votes import MemoryVotes
from p2psync.coordinator.rpc import RpcServer
from p2psync.coordinator.stack import membership_stack
from p2psync.coordinator.views import View
from p2psync.errors import ConfigError, Fenced, P2PSyncError, RunEnded, SimulationError
from p2psync.sim import invariants as inv
from p2psync.sim.faults import Fault
from p2psync.sim.loop import ACTOR, VirtualLoop
from p2psync.sim.medium import SimHub, SimTransport
from p2psync.tasks import gather_or_cancel
from p2psync.topology import Topology
from p2psync.topology.paths import hop_distances
from p2psync.transport.shaping import InprocShaper, LinkSpec

log = logging.getLogger("p2psync.sim")

#: how long a restarted node asks the others whether the run is going (as
#: ``p2psync.api.runtime.DISCOVER_S``, the real node's)
DISCOVER_S = 1.5


@dataclass(frozen=True)
class SimOptions:
    """The membership's settings (as ``p2psync run`` takes them), the links' latency
    (``latency_s`` one way per link; None: the topology's link attributes) and the NICs' rate."""

    heartbeat: float = DEFAULT_INTERVAL
    failure_timeout: float = DEFAULT_FLOOR
    phi_threshold: float = DEFAULT_THRESHOLD
    check_interval: float = 0.1
    peer_timeout: float = 5.0
    start_timeout: float = 60.0
    quorum_timeout: float = 300.0
    latency_s: float | None = 0.001
    #: every NIC of a node sends at most this many Mb/s (``p2psync run --nic-mbps``; None: only
    #: the links' own bandwidth limits them)
    nic_mbps: float | None = None
    #: relayed control messages take the express path when it is clear (:class:`SimTransport`);
    #: only with ``latency_s`` (a link of the topology's attributes may have jitter or loss)
    express: bool = True
    #: the training's collectives cut a tensor into pieces of at least this many bytes to spread
    #: it over the members (``Collectives(spread_floor_bytes=...)``): the default keeps the tiny
    #: simulated model in one piece, so that thousands of nodes stay cheap; 0 spreads it over
    #: every member as a real run does (each owns a piece)
    spread_floor_bytes: int = SPREAD_FLOOR_BYTES


class SimNode:
    """One process of a node: its membership stack (see the module docstring). ``incarnation``
    numbers the node's processes from 1 (the wall clock's would differ between runs); the
    first runs as the actor ``node_id``, a restarted one as ``(node_id, incarnation)``."""

    def __init__(self, *, hub: SimHub, node_id: int, opts: SimOptions, incarnation: int = 1,
                 services: Callable[[RpcServer], None] | None = None) -> None:
        topo = hub.topology
        self.id = node_id
        self.incarnation = incarnation
        self.actor: Hashable = node_id if incarnation == 1 else (node_id, incarnation)
        #: the links' specs without slowdowns (:meth:`reshape`)
        self.links = _links(topo, node_id, opts)
        nics = {nic.name: opts.nic_mbps * 1e6 for nic in topo.node(node_id).nics} if opts.nic_mbps else None
        self.transport = SimTransport(hub=hub, node_id=node_id, default_timeout=opts.peer_timeout,
                                      shaper=InprocShaper(self.links, nic_bandwidth_bps=nics) if self.links else None)
        self.transport.run_id = 1
        self.transport.incarnation = incarnation
        stack = membership_stack(self.transport, topo, heartbeat=opts.heartbeat, failure_timeout=opts.failure_timeout,
                                 phi_threshold=opts.phi_threshold, quorum_timeout=opts.quorum_timeout,
                                 start_timeout=opts.start_timeout, check_interval=opts.check_interval,
                                 run_info={"run_id": "sim"}, services=services,
                                 votes=hub.votes.setdefault(node_id, MemoryVotes()))
        self.server, self.rpc, self.membership, self.host = stack.server, stack.rpc, stack.membership, stack.host
        self.opts = opts
        self.fenced_at: float | None = None
        self.killed_at: float | None = None
        #: why this process ended on its own (a failed rendezvous, a strategy's error, a fence),
        #: as a real one exits after such a failure (None: it did not; ``killed_at`` says when)
        self.exited: str | None = None
        #: when this process ended after the run's finish barrier (virtual seconds; None: it did not)
        self.left_at: float | None = None
        #: this process was started by the launcher after its previous one was fenced (not by a fault)
        self.relaunched = False
        #: the coordinator's answer to this process's registration (``joined``: it joined a
        #: run already going, as ``NodeRuntime.info``)
        self.info: dict[str, Any] = {}
        #: a restarted process: when it started, when it registered (None: not yet), and why
        #: its rendezvous failed (None: it did not)
        self.started_at: float | None = None
        self.joined_at: float | None = None
        self.failed: str | None = None
        #: its registration was refused as the run ended (:class:`RunEnded`; one the run departed
        #: while it still joined the training is fenced so: its membership's ``fenced``)
        self.run_ended = False
        #: a restarted process's rendezvous (None: the node's first process)
        self.rendezvous: asyncio.Task[None] | None = None
        #: the last view this process applied
        self.last: inv.ViewSeen | None = None

    async def start(self) -> None:
        """Bind, host the run (the topology's coordinator), register, start heartbeats: the
        rendezvous of ``NodeRuntime`` for a fresh run (no run to discover)."""
        await self.transport.start()
        self.server.start()
        if self.id == self.transport.topology.coordinator:
            self.host.host()
        self.info = await self.membership.register("sim", timeout=self.opts.start_timeout + 5)
        self.membership.start()

    @property
    def joined(self) -> bool:
        """This process registered after the run started (a restarted node joining it: its
        strategy starts as a joiner, as ``NodeRuntime.joined``)."""
        return bool(self.info.get("joined"))

    async def restart(self) -> None:
        """The rendezvous of ``NodeRuntime`` for a process started while the run may be going:
        bind, ask every node for the run's view, host the run only when nobody knows of one and
        this is the topology's coordinator, register (a join), start heartbeats."""
        await self.transport.start()
        self.server.start()
        running = await self.membership.discover(timeout=DISCOVER_S)
        if running is None and self.id == self.transport.topology.coordinator:
            self.host.host()
        self.info = await self.membership.register("sim", timeout=self.opts.start_timeout + 5)
        self.membership.start()
        await self.membership.first_view(timeout=self.opts.start_timeout)

    def reshape(self, hub: SimHub) -> None:
        """Set the latency of this node's links to what the slowdowns in force give."""
        shaper = self.transport.shaper
        if not isinstance(shaper, InprocShaper):
            return
        for nb, spec in self.links.items():
            link = shaper.links.get(nb)
            if link is not None:
                f = hub.factor(self.id, nb)
                link.spec = spec if f == 1.0 else replace(spec, latency_s=spec.latency_s * f)

    async def close(self) -> None:
        """Close membership, host, RPC server and transport, in that order, as
        ``NodeRuntime.close`` does (the RPC server gives the replies being computed time to
        go out, the transport sends what its shapers hold)."""
        for closing in (self.membership.close, self.host.close, self.server.close, self.transport.close):
            try:
                await closing()
            except P2PSyncError as exc:
                log.info("node %d: closing: %s", self.id, exc)


def _links(topo: Topology, node: int, opts: SimOptions) -> dict[int, LinkSpec]:
    """The link to each neighbour that has latency (relayed messages pay it on every hop)."""
    specs = {nb: (LinkSpec(latency_s=opts.latency_s) if opts.latency_s is not None
                  else LinkSpec.from_attrs(topo.link(node, nb))) for nb in topo.neighbors(node)}
    return {nb: s for nb, s in specs.items() if not s.trivial}


def _latency(topo: Topology, opts: SimOptions) -> Callable[[int, int], float]:
    """The one-way latency of the link between neighbours (what :func:`_shaper` gives them)."""
    if opts.latency_s is not None:
        fixed = opts.latency_s
        return lambda a, b: fixed
    return lambda a, b: LinkSpec.from_attrs(topo.link(a, b)).latency_s


def _longest_rtt(topo: Topology, opts: SimOptions) -> float:
    """The round trip over the longest path to the coordinator, at the largest link latency."""
    hops = max(hop_distances(topo, topo.coordinator).values(), default=0)
    lat = opts.latency_s if opts.latency_s is not None else max(
        (topo.link(a, b).latency_ms / 1e3 for a in topo.ids for b in topo.neighbors(a)), default=0.0)
    return 2 * hops * lat


def detection_bound(topo: Topology, opts: SimOptions) -> float:
    """How long after a fault it must be declared: the failure timeout, two heartbeat
    intervals and a check interval, plus four round trips over the longest path to the
    coordinator (a heartbeat's, and an election's when the coordinator is the one that failed)."""
    return opts.failure_timeout + 2 * opts.heartbeat + opts.check_interval + 4 * _longest_rtt(topo, opts)


def line_probe_s(topo: Topology, opts: SimOptions) -> float:
    """How long a node probing the coordinator's line of successors waits for one before it
    passes it over: a heartbeat interval and two round trips (``CoordinatorHost.probe_time``)."""
    return opts.heartbeat + 2 * _longest_rtt(topo, opts)


class SimCluster:
    """Every node of ``topo`` in simulation (see the module docstring); ``async with`` closes
    every node, whatever happened. Build and run it on a :class:`VirtualLoop`."""

    def __init__(self, topo: Topology, *, opts: SimOptions | None = None, faults: Sequence[Fault] = ()) -> None:
        self.topo = topo
        self.opts = opts or SimOptions()
        self.faults = sorted(faults, key=lambda f: f.at)
        for f in self.faults:
            unknown = sorted((set(f.nodes) | set(f.other)) - set(topo.ids))
            if unknown:
                raise ConfigError(f"fault {f.spec()}: nodes {unknown} are not in topology {topo.name}")
        self.hub = SimHub(topo, latency=_latency(topo, self.opts), express=self.opts.express and self.opts.latency_s is not None)
        #: every node's current process
        self.nodes = {i: self._node(i) for i in topo.ids}
        #: the processes restarts replaced (killed, held for good)
        self.retired: list[SimNode] = []
        self.views: list[inv.ViewSeen] = []
        self.t0 = 0.0
        self._timers: list[asyncio.TimerHandle] = []
        self._restarts: list[asyncio.Task[None]] = []
        #: :meth:`close` began: no process exits or starts any more
        self._closing = False
        #: what the processes did on their own, not injected: each exit (:meth:`_exit`) as the
        #: kill it amounts to, each start by the launcher as a restart (a subclass's)
        self.lifecycle: list[Fault] = []
        #: the faults that began (a run that ends sooner than its virtual seconds: not all)
        self.begun: list[Fault] = []
        #: when the first process ended after the finish barrier (:meth:`_leave`; None: none
        #: did): the membership's invariants judge the run as it stood then
        self.ended_at: float | None = None
        for node in self.nodes.values():
            self._listen(node)

    def _node(self, i: int, incarnation: int = 1) -> SimNode:
        """Process ``incarnation`` of node ``i`` (1: its first; a subclass adds what its
        nodes host: :mod:`p2psync.sim.training`)."""
        return SimNode(hub=self.hub, node_id=i, opts=self.opts, incarnation=incarnation)

    def _listen(self, node: SimNode) -> None:
        node.membership.view_listeners.append(self._recorder(node))
        node.membership.fence_listeners.append(self._fence_recorder(node))

    def _recorder(self, node: SimNode) -> Callable[[View], None]:
        def seen(v: View) -> None:
            node.last = self._seen(node, v)
            self.views.append(node.last)
        return seen

    def _seen(self, node: SimNode, v: View) -> inv.ViewSeen:
        return inv.ViewSeen(t=self._loop().time() - self.t0, node=node.id, term=v.term, epoch=v.epoch,
                            coordinator=v.coordinator, members=tuple(v.members), departed=tuple(v.departed),
                            incarnation=node.incarnation)

    def _fence_recorder(self, node: SimNode) -> Callable[[Fenced], None]:
        def fenced(_: Fenced) -> None:
            if node.fenced_at is None:
                node.fenced_at = self._loop().time() - self.t0
        return fenced

    def _as_simulation(self, delay: float, callback: Callable[..., object], *args: Any) -> None:
        """Call ``callback(*args)`` ``delay`` virtual seconds from now as the simulation itself
        (no actor: a held node does not park it); cancelled by :meth:`close`."""
        ctx = contextvars.copy_context()
        ctx.run(ACTOR.set, None)
        self._timers.append(self._loop().call_later(delay, callback, *args, context=ctx))

    @staticmethod
    def _loop() -> VirtualLoop:
        loop = asyncio.get_running_loop()
        if not isinstance(loop, VirtualLoop):
            raise SimulationError("a SimCluster runs on a VirtualLoop (p2psync.sim.loop.run)")
        return loop

    async def __aenter__(self) -> "SimCluster":
        self._loop()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> float:
        """Start every node (each as its actor) and wait for the rendezvous; returns the
        virtual seconds it took. Fault times count from its end."""
        loop = self._loop()
        t = loop.time()
        # one failing start (a rendezvous that timed out) cancels the others
        await gather_or_cancel([loop.spawn(n.start(), actor=i, name=f"start-{i}") for i, n in self.nodes.items()])
        self.t0 = loop.time()
        self.views = [replace(v, t=v.t - self.t0) for v in self.views]  # (recorded with t0 = 0)
        for node in self.nodes.values():
            node.last = None if node.last is None else replace(node.last, t=node.last.t - self.t0)
        for f in self.faults:
            self._timers.append(loop.call_at(self.t0 + f.at, self._begin, f))
            if f.end is not None:
                self._timers.append(loop.call_at(self.t0 + f.end, self._end, f))
        return self.t0 - t

    def _begin(self, f: Fault) -> None:
        loop = self._loop()
        if self.ended_at is not None:  # the run is over (its processes end): nothing left to hit
            log.info("sim t=%.3f: %s does not begin: the run ended at %.3f", loop.time() - self.t0, f.spec(),
                     self.ended_at)
            return
        self.begun.append(f)
        self.hub.faults += 1
        log.info("sim t=%.3f: %s", loop.time() - self.t0, f.spec())
        if f.kind in ("kill", "restart"):
            for n in f.nodes:
                self._kill(self.nodes[n])
            if f.kind == "restart":
                for n in f.nodes:
                    self._restart(n)
        elif f.kind == "pause":
            for n in f.nodes:
                loop.hold(self.nodes[n].actor)
        elif f.kind == "slow":
            self.hub.slow.append(f)
            self._reshape()
        else:
            self.hub.cuts.append((frozenset(f.nodes), frozenset(f.other)))
            self.hub.links_changed()

    def _kill(self, node: SimNode) -> float:
        """The node's process stops for good (see the module docstring); returns when (virtual
        seconds after the rendezvous), the first time."""
        if node.killed_at is not None:
            return node.killed_at
        loop = self._loop()
        at = node.killed_at = loop.time() - self.t0
        self.hub.leave(node.transport)
        loop.hold(node.actor)
        return at

    def _exit(self, node: SimNode, why: str, fenced: Fenced | None = None) -> None:
        """The process ``node`` ended on its own after a failure (``why``; ``fenced``: it was
        removed from the run), as a real process exits once its runtime closed: it is gone
        like a killed one (its peers must detect it where it was still a member), and the
        invariants count its exit as a kill at that time (:meth:`all_faults`). Its actor is
        held from now on; then :meth:`_exited`."""
        if node.killed_at is not None or self._closing:
            return
        node.exited = why
        self.hub.faults += 1
        at = self._kill(node)
        self.lifecycle.append(Fault("kill", at=max(0.0, at), nodes=(node.id,)))
        log.info("sim t=%.3f: node %d exited: %s", at, node.id, why)
        self._exited(node, fenced)

    async def _leave(self, node: SimNode) -> None:
        """The process ``node`` ends after the run's finish barrier, as a real one exits: its
        runtime closes (:meth:`SimNode.close`: it leaves the medium) and it runs nothing more;
        no fault (nobody must detect it). The first such end sets :attr:`ended_at`. Called
        as the node's actor."""
        if node.killed_at is not None or node.left_at is not None or self._closing:
            return
        loop = self._loop()
        if self.ended_at is None:
            self.ended_at = loop.time() - self.t0
        node.left_at = -1.0  # (ending: once only)
        svc = node.host.service
        if node.host.coordinating and svc is not None and node.membership.fenced is None:
            # the view it ends with is its service's (its own client would have applied it at
            # its next heartbeat: a view published with the barrier's replies is not in yet)
            v = svc.state.view()
            if node.last is None or (v.term, v.epoch) > (node.last.term, node.last.epoch):
                node.last = self._seen(node, v)
        await node.close()
        node.left_at = loop.time() - self.t0
        loop.hold(node.actor)
        log.info("sim t=%.3f: node %d ended after the finish barrier", node.left_at, node.id)

    def _finished(self, n: int) -> bool:
        """Whether node ``n``'s current process ended its loop at the agreed stop (no: nothing
        here trains; :mod:`p2psync.sim.training`)."""
        return False

    def _exited(self, node: SimNode, fenced: Fenced | None) -> None:
        """Called once the process ``node`` exited on its own: nothing here (nobody starts it
        again); a subclass starts a fenced one again as the launcher does
        (:mod:`p2psync.sim.training`)."""

    def all_faults(self) -> list[Fault]:
        """The faults injected (those that began: a run that ended sooner never saw the
        later ones) and what the processes did on their own (:attr:`lifecycle`), by time."""
        return sorted([*self.begun, *self.lifecycle], key=lambda f: f.at)

    def _restart(self, n: int) -> None:
        """A new process of node ``n`` (its previous one killed): see the module docstring."""
        loop = self._loop()
        old = self.nodes[n]
        self.retired.append(old)
        self.hub.actors[n] = (n, old.incarnation + 1)
        self.hub.contexts.pop(n, None)  # (deliveries run as the new actor)
        node = self.nodes[n] = self._node(n, old.incarnation + 1)
        node.started_at = loop.time() - self.t0
        node.reshape(self.hub)
        self._listen(node)

        async def rendezvous() -> None:
            try:
                await node.restart()
            except P2PSyncError as exc:
                if isinstance(exc, Fenced) and not isinstance(exc, RunEnded):
                    # removed from the run before its first view: it exits as a fenced process
                    self._exit(node, str(exc)[:300], exc)
                    return
                node.failed = f"{type(exc).__name__}: {exc}"[:300]
                node.run_ended = isinstance(exc, RunEnded)
                log.info("node %d: restarted process: %s", n, node.failed)
                self._exit(node, node.failed)
                return
            node.joined_at = loop.time() - self.t0
            self._rejoined(node)

        node.rendezvous = loop.spawn(rendezvous(), actor=node.actor, name=f"restart-{n}")
        self._restarts.append(node.rendezvous)

    def _rejoined(self, node: SimNode) -> None:
        """Called on the actor of ``node``, a restarted process, once its rendezvous registered
        it: nothing here; a subclass starts what the new process runs next (its strategy, as
        a joiner: :mod:`p2psync.sim.training`)."""

    def _reshape(self) -> None:
        """Every link's latency after a slowdown began or ended; the express paths are walked
        again (their latencies were summed when walked)."""
        hub = self.hub
        hub.flush()
        hub.paths.clear()
        hub.hops.clear()
        for node in self.nodes.values():
            node.reshape(hub)

    def _end(self, f: Fault) -> None:
        loop = self._loop()
        if not any(f is g for g in self.begun):
            return
        self.hub.faults += 1
        log.info("sim t=%.3f: end of %s", loop.time() - self.t0, f.spec())
        if f.kind == "pause":
            for n in f.nodes:
                if self.nodes[n].killed_at is None:
                    loop.release(self.nodes[n].actor)
        elif f.kind == "slow":
            self.hub.slow.remove(f)
            self._reshape()
        elif f.kind == "partition":
            self.hub.cuts.remove((frozenset(f.nodes), frozenset(f.other)))
            self.hub.links_changed()

    async def run(self, virtual_seconds: float) -> dict[str, Any]:
        """Start, run until ``virtual_seconds`` after the rendezvous, and summarize (the nodes
        stay up until :meth:`close`)."""
        loop = self._loop()
        wall0 = time.perf_counter()
        rendezvous = await self.start()
        await self._run_until(self.t0 + virtual_seconds)
        await self._settle()
        return self.summary(virtual_seconds=virtual_seconds, rendezvous_s=rendezvous,
                            wall_s=time.perf_counter() - wall0)

    async def _run_until(self, deadline: float) -> None:
        """Let the nodes run until the loop time ``deadline`` (a subclass may end sooner)."""
        await asyncio.sleep(max(0.0, deadline - self._loop().time()))

    async def _settle(self) -> None:
        """What runs between the end of the virtual seconds and the summary: here, the wait
        until every process's own exit (:meth:`_exit`) had the time its detection may take
        (two detection bounds and a probe of the line of successors: a coordinator's
        successor is elected first), as the faults drawn end that long before the end of a
        run (a subclass lets its nodes' work end first: :mod:`p2psync.sim.training`)."""
        loop = self._loop()
        grace = 2 * detection_bound(self.topo, self.opts) + line_probe_s(self.topo, self.opts)
        while self.lifecycle and (wait := self.t0 + max(f.at for f in self.lifecycle) + grace - loop.time()) > 0:
            await asyncio.sleep(wait)

    def summary(self, *, virtual_seconds: float, rendezvous_s: float, wall_s: float) -> dict[str, Any]:
        """What the run did and whether every invariant held (see the module docstring)."""
        opts = self.opts
        bound = detection_bound(self.topo, opts)
        self.hub.flush()
        # the detections until the first process ended after the finish barrier (the others end
        # around then: nobody is left to detect; a declaration after is ``quiet_end``'s too);
        # each process's last view (one that ended applied none since)
        end_t = self.ended_at
        views = self.views if end_t is None else [v for v in self.views if v.t <= end_t]
        final: dict[int, inv.ViewSeen | None] = {i: n.last for i, n in self.nodes.items()}
        links = {i: list(self.topo.neighbors(i)) for i in self.topo.ids}
        gone = {i for i, n in self.nodes.items() if n.killed_at is not None or n.membership.fenced is not None}
        # the nodes that kills and removals (nobody relays through a removed node; the
        # membership alone restarts no fenced node) cut off from the group holding a majority of the
        # newest view for good can learn nothing more; with no such group nothing can change
        newest = max((v for v in final.values() if v is not None), key=lambda v: (v.term, v.epoch), default=None)
        groups = inv.components(links, gone)
        major = next((g for g in groups if newest is not None
                      and 2 * len(g & set(newest.members)) > len(newest.members)), None)
        up = [i for i in self.nodes if i not in gone]
        cut_off = {i for i in up if major is not None and i not in major}
        # a restarted process that had no time to rejoin before the run ended may be a member or not
        horizon = virtual_seconds if end_t is None else min(virtual_seconds, end_t)
        late = horizon - inv.rejoin_bound(bound, DISCOVER_S)
        pending = {i for i in up if (n := self.nodes[i]).started_at is not None and n.joined_at is None
                   and n.failed is None and n.started_at > late}
        left_behind: set[int] = set()
        if end_t is not None and newest is not None:
            # the run ended without the nodes its last view does not name: declared failed,
            # nobody is left to tell them (they would be fenced once heard)
            left_behind = {i for i in up if i not in newest.members and i not in newest.departed
                           and self.nodes[i].left_at is None}
            # a node killed less than a bound before the end, or once its loop had finished (the
            # coordinator declares no node that finished), may be listed or not
            pending |= {i for i, n in self.nodes.items() if n.killed_at is not None
                        and (n.killed_at > end_t - bound or self._finished(i))}
        live = [i for i in up if i not in cut_off and i not in pending and i not in left_behind]
        faults = self.all_faults()
        found, detected = inv.detections(faults, views, bound=bound, failure_timeout=opts.failure_timeout,
                                         line_s=line_probe_s(self.topo, opts),
                                         links=links, interval=opts.heartbeat, latency=self.hub.base_latency,
                                         horizon=math.inf if end_t is None else end_t)
        for f, rec in zip(faults, found):  # (a process's own exit, or the launcher's restart: not injected)
            if any(f is g for g in self.lifecycle):
                rec["exit" if f.kind == "kill" else "relaunch"] = True
        end = next((final[i] for i in live if final[i] is not None), None)
        msgs = {str(i): {"sent": 0, "recv": 0} for i in self.nodes}
        for n in [*self.retired, *self.nodes.values()]:
            msgs[str(n.id)]["sent"] += sum(s.msgs_sent for s in n.transport.nic_stats.values())
            msgs[str(n.id)]["recv"] += sum(s.msgs_recv for s in n.transport.nic_stats.values())
        coord = end.coordinator if end is not None else self.topo.coordinator
        queues = self._queues()
        first = next(iter(self.nodes.values())).transport
        return {
            "topology": self.topo.name, "nodes": len(self.nodes), "virtual_s": virtual_seconds,
            "rendezvous_s": round(rendezvous_s, 6), "wall_s": round(wall_s, 3),
            "detection_bound_s": round(bound, 6), "faults": [f.spec() for f in self.faults],
            **({"faults_not_begun": [f.spec() for f in self.faults if not any(f is g for g in self.begun)]}
               if len(self.begun) < len(self.faults) else {}),
            "views_applied": len(self.views),
            "final_view": None if end is None else {"term": end.term, "epoch": end.epoch,
                                                    "coordinator": end.coordinator, "members": list(end.members)},
            "declared": [{"t": round(d.t, 6), "node": d.node, "by": d.coordinator, "term": d.term}
                         for d in inv.declarations(self.views)],
            "fenced": {str(i): round(n.fenced_at, 6) for i, n in self.nodes.items() if n.fenced_at is not None},
            "killed": [i for i, n in self.nodes.items() if n.killed_at is not None and n.exited is None],
            "exited": [{"node": n.id, "incarnation": n.incarnation, "at": round(n.killed_at, 6), "error": n.exited,
                        **({"fenced": True} if n.fenced_at is not None else {})}
                       for n in sorted([*self.retired, *self.nodes.values()], key=lambda n: (n.id, n.incarnation))
                       if n.exited is not None and n.killed_at is not None],
            "restarts": [{"node": n.id, "incarnation": n.incarnation, "at": round(n.started_at, 6),
                          "joined_after_s": None if n.joined_at is None else round(n.joined_at - n.started_at, 6),
                          **({"error": n.failed} if n.failed is not None else {}),
                          **({"relaunch": True} if n.relaunched else {})}
                         for n in sorted([*self.retired, *self.nodes.values()], key=lambda n: (n.id, n.incarnation))
                         if n.started_at is not None],
            "detections": found,
            "messages": msgs,
            "coordinator_msgs_per_s": round((msgs[str(coord)]["sent"] + msgs[str(coord)]["recv"])
                                            / max(virtual_seconds, 1e-9), 3),
            "link_refusals": self.hub.refused,
            "stranded": sorted(cut_off),
            **({"left_behind": sorted(left_behind)} if left_behind else {}),
            "queues": {"peak_pending": max(q.peak_pending for q in queues.values()),
                       "peak_bytes": max(q.peak_bytes for q in queues.values()),
                       "peak_relay_bytes": max(q.peak_relay_bytes for q in queues.values()),
                       "overflows": sum(sum(q.overflows.values()) for q in queues.values())},
            "majority_at_end": major is not None,
            "expressed": {"messages": self.hub.expressed, "relay_hops": self.hub.express_hops},
            "invariants": {
                "one_coordinator_per_term": inv.one_coordinator_per_term(self.views),
                "faults_detected_in_bound": detected,
                "no_false_failure": inv.no_false_failure(faults, self.views, bound=bound, links=links,
                                                         failure_timeout=opts.failure_timeout,
                                                         interval=opts.heartbeat, latency=self.hub.base_latency),
                "one_view_at_end": (inv.one_view_at_end(final, live, pending, ended=end_t is not None)
                                    if major is not None or newest is None
                                    else inv.one_view_per_group(final, [sorted(g) for g in groups])),
                "bounded_queues": inv.bounded_queues(queues, mailbox_budget=first.mailbox.budget_bytes,
                                                     relay_budget=first.relaying.budget_bytes,
                                                     senders=len(self.nodes)),
                **({} if end_t is None else {"quiet_end": inv.quiet_end(self.views, faults, end_t, bound=bound)}),
            },
            **({} if end_t is None else {"ended_at_s": round(end_t, 6), "left": {
                str(i): round(n.left_at, 6) for i, n in self.nodes.items() if n.left_at is not None}}),
        }

    def _queues(self) -> dict[int, inv.Queues]:
        """Each node's queue peaks and overflows (:class:`~p2psync.sim.invariants.Queues`),
        over all its processes (a restart's earlier ones included)."""
        out: dict[int, inv.Queues] = {}
        for n in [*self.retired, *self.nodes.values()]:
            t = n.transport
            q = inv.Queues(peak_pending=t.mailbox.peak_pending, peak_bytes=t.mailbox.peak_bytes,
                           peak_relay_bytes=t.relaying.peak_held,
                           overflows={k: t.rejected[k] for k in inv.OVERFLOWS if t.rejected[k]})
            was = out.get(n.id)
            out[n.id] = q if was is None else was | q
        return out

    async def close(self) -> None:
        """Stop the faults, release every held node and close every node, the processes
        restarts replaced too; an error of a restarted process's rendezvous other than a
        P2PSyncError (recorded in the summary) is raised then."""
        loop = self._loop()
        self._closing = True
        for t in self._timers:
            t.cancel()
        for task in self._restarts:
            task.cancel()
        nodes = [*self.retired, *self.nodes.values()]
        for n in nodes:
            loop.release(n.actor)
        self.hub.cuts.clear()
        self.hub.links_changed()
        self.hub.faults += 1
        ended = await asyncio.gather(*self._restarts, return_exceptions=True)
        await asyncio.gather(*(loop.spawn(n.close(), actor=n.actor) for n in nodes))
        for r in ended:  # (a failed rendezvous is recorded: anything else is a defect)
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                raise r


__all__ = ["DISCOVER_S", "SimCluster", "SimHub", "SimNode", "SimOptions", "SimTransport", "detection_bound"]

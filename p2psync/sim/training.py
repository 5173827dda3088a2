"""A strategy on every simulated node: its real decisions and collectives, in virtual time.

:class:`TrainingCluster` is a :class:`~p2psync.sim.cluster.SimCluster` whose nodes also train:
each builds the strategy exactly as :meth:`NodeRuntime.start_strategy
<p2psync.api.runtime.NodeRuntime.start_strategy>` does (a :class:`StrategyContext` over the
node's in-memory transport, RPC, membership client and :class:`Collectives`; the strategy's
coordinator services hosted with the membership service and taken over with it; the strategy
subscribed to failures and views), over a :class:`~p2psync.sim.replica.SimReplica` (a tiny
numpy model whose iterations take ``step_time`` virtual seconds), and runs the step loop of
:meth:`StepDriver._drive <p2psync.api.driver.StepDriver._drive>`: wait for a majority when
cut off from it, ``strategy.run_step(step, want_stop)``, move to the step the report names,
until a report says ``stop``, then, where the strategy promises one model, the driver's replica
audit over its group (its outcome is each node's ``audit``). Operations are re-formed over the
survivors as in a real run with ``--on-failure continue`` (the default: the strategies'
:class:`~p2psync.strategies.failure.Reform` policy). A fenced process stops training (its
progress is void) and exits; as the launcher with ``--on-failure continue`` does, a new
process of it starts :data:`RELAUNCH_S` later (at most :data:`RELAUNCHES` times per node, not
once a node finished: the run is over) and joins as a restarted one (``relaunch`` in the
summary's ``restarts``; the invariants count the exit as a kill and the new start as a
restart). A process whose strategy fails with an error exits too (and is not started again);
a killed one is held with the rest of its code.

Restarts: a restarted node's new process (:meth:`SimCluster._restart
<p2psync.sim.cluster.SimCluster._restart>`) has a fresh replica (the run's initial model, not
its previous process's state) and a fresh record. Once its rendezvous registered it, its
strategy is built as ``NodeRuntime.start_strategy`` builds it after a rendezvous that joined a
run going (``joining`` from the coordinator's answer, :attr:`SimNode.joined
<p2psync.sim.cluster.SimNode.joined>`): its ``start()`` adopts the live members' state and
step (:mod:`p2psync.strategies.regroup`), and its step loop runs as the new process's actor.
Per node, :attr:`TrainingCluster.runs`, ``replicas`` and ``tasks`` hold the current process's;
the processes restarts replaced are kept in :attr:`TrainingCluster.earlier`.

Stopping: every node wants to stop (``want_stop``, as ``--time``; a joiner's budget ends with
the run's) from the run's virtual seconds on, and with a step budget (``TrainingSpec.steps``,
as ``--steps``, which the strategy knows as ``max_steps``) from its last step on; the strategy
agrees on the step. A node whose
loop ended at the agreed stop runs the audit, then the finish barrier and the linger of a
relay exactly as ``NodeRuntime.finish`` does (:func:`~p2psync.api.runtime.finish_barrier`:
the coordinator's reply once every node finished or was declared failed), and its process
ends (:meth:`SimCluster._leave <p2psync.sim.cluster.SimCluster._leave>`: its transport
closes, sending what its shapers hold, and it leaves the medium). After the virtual seconds
the cluster waits for the loops of the nodes not killed to end (and for the restarted
processes still registering, whose loops then start), at most :data:`SETTLE_S` virtual
seconds, then summarizes.

What the summary adds (``training``): the strategy, its step unit, the replicas' promise, and
per node its current process's outcome (``finished``: its loop ended at an agreed stop;
``killed``, ``fenced``, ``error`` with the error (a restarted process's failed rendezvous
too; the process then exits, :meth:`SimCluster._exit <p2psync.sim.cluster.SimCluster._exit>`,
and the others re-form without it), ``running``: not ended within the settle time), the step it reached, the steps (or
rounds) it ran, the states it adopted (a joiner's start counts one), its local iterations,
its last loss, the strategy's count of re-formed operations where it reports one, and its
model hash (:meth:`~p2psync.sim.replica.SimReplica.model_hash`); for a restarted node also its
``incarnation``, when it joined the training (``joined_training_at``), the same figures of
the processes it replaced (``earlier``) and, when it is excused (below), ``excused``; and
``rejoined``, the restarted nodes that finished; and per node that finished its barrier's
reply (``barrier``) and when it came (``barrier_at``). Four invariants:

* ``strategy_finished``: every node that is neither killed nor fenced nor cut off for good
  from the majority (the membership invariants' live nodes), nor excused, ended its loop at
  an agreed stop; a restarted node that joined the training included. Excused
  (:func:`excused`): a restarted process that had not joined the training by the agreed stop
  (the first node's finish) when it registered less than a re-form bound
  (:func:`~p2psync.strategies.regroup.regroup_bound`, the time a member waits for a newer
  view) before that stop, or had not registered by the end though restarted too late to
  (:func:`~p2psync.sim.invariants.rejoin_bound`, as the membership invariants excuse it).
  Such a process ends with the run as a real one does: the coordinator departs it once the
  others finished, or refuses its registration after the stop
  (:class:`~p2psync.errors.RunEnded`: ``fenced``, not started again).
  When no group of live nodes holds a majority of the newest view at the end
  (``majority_at_end`` false: kills and removals cut the topology), no member may step, so none can reach a stop: ``not
  promised: ...``, unless some node finished all the same, which is a violation.
* ``same_model_at_end``: where the strategy promises one model (``identical_replicas`` of
  ``every_step`` or ``end``), every node that finished (a restarted one too: its strategy
  adopted the members' state) holds the same model: the replica
  audit's digests (:func:`~p2psync.strategies.audit.first_mismatch`) name the nodes whose
  model differs from the lowest finished id's and the first tensor that differs. A strategy
  that promises no such thing (``never``: DTS, ASGD, ESync as declared) gets
  ``not promised: ...``, which is no violation and no proof either; so does a run where no
  node finished because no group held a majority at the end.

* ``finish_barrier`` (:func:`finish_barrier_held`): every node that finished got the barrier's
  reply, complete (every node of the topology finished or declared failed) and the same at
  every node, within two detection bounds and a probe of the line of successors after the last
  loop ended (a member killed right before the stop is declared failed meanwhile).
* ``no_crash``: no process's training raised an error other than a
  :class:`~p2psync.errors.P2PSyncError` (that would be a defect: the process crashes).

Strategies: those of :data:`SIMULATED`; any other is refused with a
:class:`~p2psync.errors.ConfigError` naming it and why (:func:`check_strategy`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np

from p2psync.api.runtime import BARRIER_S, finish_barrier
from p2psync.collectives import Collectives, OpId
from p2psync.coordinator.rpc import RpcServer
from p2psync.errors import ConfigError, Fenced, P2PSyncError, ReplicaMismatch, RunEnded
from p2psync.sim import invariants as inv
from p2psync.sim.cluster import DISCOVER_S, SimCluster, SimNode, SimOptions, detection_bound, line_probe_s
from p2psync.sim.faults import Fault
from p2psync.sim.replica import SimReplica
from p2psync.strategies.audit import audit_replicas, first_mismatch
from p2psync.strategies.base import Strategy, StrategyContext, get_strategy, parse_options
from p2psync.strategies.regroup import regroup_bound
from p2psync.topology import Topology

log = logging.getLogger("p2psync.sim")

#: the strategies a simulated node runs (their replica needs are all met by SimReplica)
SIMULATED: tuple[str, ...] = ("ssgd", "esync", "dts", "diloco", "asgd", "preduce", "bsp", "asp", "ssp", "dssp",
                               "elastic_bsp")
#: why the others are not simulated
REFUSED: dict[str, str] = {
    "canary": "its colayers leave during backward through gradient-ready hooks, which the simulated replica "
              "has no backward pass to fire",
}
#: virtual seconds the cluster waits, after the run's virtual seconds, for the loops to end
SETTLE_S = 60.0
#: with a step budget, how often (virtual seconds) the cluster looks whether the run is over
END_POLL_S = 0.5
#: virtual seconds from a fenced process's exit to the start of its new process: the
#: launcher's poll and a Python process's start
RELAUNCH_S = 2.0
#: the new processes the launcher starts per node after fences (``cli.launch.MAX_RESTARTS``)
RELAUNCHES = 3


def check_strategy(name: str) -> type[Strategy]:
    """The class of strategy ``name`` if the simulation runs it; ConfigError naming it (and
    why, or the registry's choices when the name is unknown) otherwise."""
    cls = get_strategy(name)  # ConfigError listing the choices when unknown
    if name not in SIMULATED:
        why = REFUSED.get(name, "it is not among the strategies the simulation was checked with")
        raise ConfigError(f"p2psync sim --strategy {name}: not simulated ({why}); simulated strategies: "
                          f"{', '.join(SIMULATED)}")
    return cls


def parse_step_time(text: str) -> tuple[float, dict[int, float]]:
    """``--step-time``: ``SECONDS`` for every node, optionally followed by ``NODE:SECONDS``
    overrides (``0.1,3:0.5``: node 3 takes 0.5 s per iteration, the others 0.1 s), or only
    overrides (the others 0.1 s); ConfigError naming the bad part."""
    default, per = 0.1, {}
    for k, part in enumerate(p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(?:(\d+):)?([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)", part)
        if m is None or (m.group(1) is None and k > 0):
            raise ConfigError(f"--step-time {text!r}: {part!r} is not SECONDS (first) or NODE:SECONDS")
        if m.group(1) is None:
            default = float(m.group(2))
        else:
            per[int(m.group(1))] = float(m.group(2))
    return default, per


@dataclass(frozen=True)
class TrainingSpec:
    """What every node trains: ``strategy`` with its ``--opt`` ``options``, ``step_time``
    virtual seconds per iteration (``step_times``: per-node overrides), gradients drawn from
    ``seed``."""

    strategy: str
    step_time: float = 0.1
    step_times: Mapping[int, float] = field(default_factory=dict)
    options: Mapping[str, str] = field(default_factory=dict)
    seed: int = 0
    #: the step budget (``p2psync run --steps``): every node wants to stop after this many
    #: steps, and the strategy knows it (``StrategyContext.max_steps``); None: time only
    steps: int | None = None

    def __post_init__(self) -> None:
        cls = check_strategy(self.strategy)
        parse_options(cls, dict(self.options))
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps {self.steps}: must be at least 1")
        for t in (self.step_time, *self.step_times.values()):
            if not t >= 0:
                raise ConfigError(f"--step-time: {t!r} is not a number of seconds >= 0")

    def args(self) -> str:
        """The command-line options that give this spec (the replay command)."""
        times = ",".join([repr(float(self.step_time)),
                          *(f"{n}:{float(t)!r}" for n, t in sorted(self.step_times.items()))])
        return f"--strategy {self.strategy} --step-time {times}" + (
            f" --steps {self.steps}" if self.steps is not None else "") + "".join(
            f" --opt {shlex.quote(f'{k}={v}')}" for k, v in sorted(self.options.items()))


@dataclass
class NodeTraining:
    """One node's training so far (see the module docstring for ``outcome``)."""

    outcome: str = "starting"
    #: the step its loop runs next
    step: int = 0
    #: steps (or rounds) run, and of those the ones that adopted a peer's state instead
    reports: int = 0
    adopted: int = 0
    loss: float | None = None
    #: the strategy's count of re-formed operations, as its last report gave it (if it counts them)
    reforms: int | None = None
    error: str | None = None
    #: the error was no P2PSyncError: the process crashed (a defect; the ``no_crash`` invariant)
    crashed: bool = False
    #: the replica audit at the agreed stop (strategies that promise one model): ``passed``,
    #: ``mismatch: ...`` or ``incomplete: ...``
    audit: str | None = None
    finished_at: float | None = None
    #: the replica's digests when its loop ended at the agreed stop (None: it did not)
    digests: list[tuple[str, bytes]] | None = None
    strategy: Strategy | None = None
    #: the process (1: the node's first; a restarted one counts on) and, for a restarted one,
    #: when its strategy's start returned (it joined the training; None: not yet)
    incarnation: int = 1
    trained_at: float | None = None
    #: the finish barrier's reply after the agreed stop (``{}``: it failed; None: not run) and
    #: when it came
    barrier: dict[str, Any] | None = None
    barrier_at: float | None = None


@dataclass
class Earlier:
    """A process a restart replaced (killed, held for good): its membership stack, its
    training, its replica and its step loop (None: it had none yet)."""

    node: SimNode
    run: NodeTraining
    replica: SimReplica
    task: asyncio.Task[None] | None


def excused(*, started_at: float | None, joined_at: float | None, failed: str | None, trained_at: float | None,
            stop: float, pending: bool, join_s: float) -> bool:
    """Pure: whether a node's current process is excused from ending at the agreed stop (see
    the module docstring). ``started_at`` / ``joined_at`` / ``failed``: its start, its
    registration and its rendezvous error, as :class:`SimNode` records them (``started_at``
    None: the node's first process, never excused); ``trained_at``: when its strategy's
    start returned (None: never); ``stop``: when the first node ended at the agreed stop (or
    the end of the run when none did); ``pending``: the membership invariants excuse it
    (restarted too late to register, not registered yet); ``join_s``: the seconds a joiner
    is allowed after its registration to join the members' training."""
    if started_at is None or failed is not None:
        return False
    if trained_at is not None and trained_at <= stop:
        return False
    if joined_at is None:
        return pending
    return joined_at > stop - join_s


class TrainingCluster(SimCluster):
    """A :class:`SimCluster` whose every node runs ``training``'s strategy (see the module
    docstring). ``async with`` closes the strategies, then the nodes."""

    def __init__(self, topo: Topology, *, training: TrainingSpec, opts: SimOptions | None = None,
                 faults: Sequence[Fault] = ()) -> None:
        self.training = training
        self.strategy_cls = check_strategy(training.strategy)
        parse_options(self.strategy_cls, dict(training.options), topology=topo)
        unknown = sorted(set(training.step_times) - set(topo.ids))
        if unknown:
            raise ConfigError(f"--step-time: nodes {unknown} are not in topology {topo.name}")
        super().__init__(topo, opts=opts, faults=faults)
        #: per node, its current process's replica, training and step loop (a restart
        #: replaces them: :attr:`earlier` keeps the replaced ones)
        self.replicas = {i: self._replica(i) for i in topo.ids}
        self.runs = {i: NodeTraining() for i in topo.ids}
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.earlier: list[Earlier] = []
        #: virtual seconds after the rendezvous from which every node wants to stop
        self.stop_at = float("inf")
        #: per node, the processes the launcher started after fences (:meth:`_exited`)
        self.relaunches: dict[int, int] = {}
        for node in self.nodes.values():
            node.membership.fence_listeners.append(self._fence_stopper(node, self.runs[node.id]))

    def _node(self, i: int, incarnation: int = 1) -> SimNode:
        cls, topo, options = self.strategy_cls, self.topo, dict(self.training.options)
        return SimNode(hub=self.hub, node_id=i, opts=self.opts, incarnation=incarnation,
                       services=lambda srv: cls.coordinator_services(srv, topo, options))

    def _replica(self, i: int) -> SimReplica:
        """A new process's model: the run's initial one (a restarted process does not keep
        its previous process's state)."""
        t = self.training
        return SimReplica(node_id=i, seed=t.seed, step_time=t.step_times.get(i, t.step_time))

    def _fence_stopper(self, node: SimNode, rec: NodeTraining) -> Callable[[Fenced], None]:
        def fenced(exc: Fenced) -> None:
            # as the step driver: a fenced process's progress is void, its loop ends now and
            # the process exits once the code that fenced it ran (:meth:`_exited` starts it
            # again); one that ended at the agreed stop is finished (the launcher leaves it out)
            if rec.outcome == "finished":
                return
            rec.outcome = "fenced"
            self._as_simulation(0.0, self._exit, node, str(exc)[:300], exc)
            task = self.tasks.get(node.id)
            if task is not None and self.nodes[node.id] is node:
                task.cancel()
        return fenced

    def _restart(self, n: int) -> None:
        """:meth:`SimCluster._restart`; the new process gets a fresh replica and training
        record (its previous process's go to :attr:`earlier`); its strategy starts once it
        registered (:meth:`_rejoined`)."""
        self.earlier.append(Earlier(node=self.nodes[n], run=self.runs[n], replica=self.replicas[n],
                                    task=self.tasks.pop(n, None)))
        super()._restart(n)
        node = self.nodes[n]
        rec = self.runs[n] = NodeTraining(incarnation=node.incarnation)
        self.replicas[n] = self._replica(n)
        node.membership.fence_listeners.append(self._fence_stopper(node, rec))

    def _exited(self, node: SimNode, fenced: Fenced | None) -> None:
        """As the launcher with ``--on-failure continue``: a process fenced while the run goes
        on (one it may rejoin) is started again :data:`RELAUNCH_S` later, at most
        :data:`RELAUNCHES` times per node; the new process joins as a restarted one does."""
        if fenced is None or not fenced.rejoin or self._closing or self.relaunches.get(node.id, 0) >= RELAUNCHES:
            return
        self._as_simulation(RELAUNCH_S, self._relaunch, node)

    def _relaunch(self, node: SimNode) -> None:
        """The launcher starts a new process of the fenced ``node`` (see :meth:`_exited`)."""
        n = node.id
        if self._closing or self.nodes[n] is not node or any(r.outcome == "finished" for r in self.runs.values()):
            return  # (a fault restarted it meanwhile, or the run is over: the launcher leaves it out)
        self.relaunches[n] = self.relaunches.get(n, 0) + 1
        at = self._loop().time() - self.t0
        log.info("sim t=%.3f: node %d was fenced: the launcher starts it again (%d/%d)", at, n, self.relaunches[n],
                 RELAUNCHES)
        self.lifecycle.append(Fault("restart", at=at, nodes=(n,)))
        self._restart(n)
        self.nodes[n].relaunched = True

    def _finished(self, n: int) -> bool:
        return self.runs[n].outcome == "finished"

    def _rejoined(self, node: SimNode) -> None:
        """The restarted process ``node`` registered: its strategy and step loop start as its
        actor, as a joiner when the coordinator says it joined a run going (``joining``, as
        ``NodeRuntime.start_strategy`` sets it)."""
        if self._closing or self.nodes[node.id] is not node:
            return
        self.tasks[node.id] = self._loop().spawn(self._train(node.id), actor=node.actor,
                                                 name=f"train-{node.id}.{node.incarnation}")

    async def run(self, virtual_seconds: float) -> dict[str, Any]:
        """As :meth:`SimCluster.run`; every node wants to stop from ``virtual_seconds`` on."""
        self.stop_at = virtual_seconds
        return await super().run(virtual_seconds)

    async def _run_until(self, deadline: float) -> None:
        """Until the virtual seconds are over; with a step budget, sooner once a process ended
        after the finish barrier and no loop of a node not killed goes on (the run is over:
        the faults drawn for later do not happen)."""
        if self.training.steps is None:
            return await super()._run_until(deadline)
        loop = self._loop()
        while loop.time() < deadline:
            up = [i for i, n in self.nodes.items() if n.killed_at is None]
            if self.ended_at is not None and all(self.tasks.get(i) is None or self.tasks[i].done() for i in up):
                return
            await asyncio.sleep(min(END_POLL_S, deadline - loop.time()))

    async def start(self) -> float:
        """The rendezvous, then every node's strategy and step loop (each as its actor)."""
        took = await super().start()
        loop = self._loop()
        for i, node in self.nodes.items():
            self.tasks[i] = loop.spawn(self._train(i), actor=node.actor, name=f"train-{i}")
        return took

    def context(self, i: int) -> StrategyContext:
        """The strategy context of node ``i``'s current process, as ``NodeRuntime.start_strategy``
        builds it (``joining``: the process joined a run going)."""
        node, opts = self.nodes[i], self.opts
        return StrategyContext(node_id=i, topology=self.topo, transport=node.transport, rpc=node.rpc,
                               rpc_server=node.server, membership=node.membership, replica=self.replicas[i],
                               collectives=Collectives(node.transport, timeout=opts.peer_timeout,
                                                       spread_floor_bytes=opts.spread_floor_bytes),
                               peer_timeout=opts.peer_timeout, options=dict(self.training.options),
                               on_failure="continue", joining=node.joined, quorum_timeout=opts.quorum_timeout,
                               max_steps=self.training.steps)

    async def _train(self, i: int) -> None:
        """The strategy and step loop of node ``i``'s current process (``StepDriver._drive``
        without the gate, checkpoints and records); started as that process's actor."""
        rec, node, loop = self.runs[i], self.nodes[i], self._loop()
        membership, budget = node.membership, self.training.steps
        try:
            strategy = rec.strategy = self.strategy_cls(self.context(i))
            membership.listeners.append(strategy.on_peer_failure)
            membership.view_listeners.append(strategy.on_view)
            await strategy.start()
            membership.joined_training()
            rec.step, rec.outcome = strategy.start_step, "training"
            rec.trained_at = loop.time() - self.t0
            # a joiner's start adopted a live member's state (every simulated strategy's does, or raises)
            rec.adopted += strategy.ctx.joining
            while True:
                want_stop = loop.time() - self.t0 >= self.stop_at or (budget is not None and rec.step + 1 >= budget)
                if not membership.has_quorum:  # cut off from the majority: no step until heard
                    await membership.wait_quorum(self.opts.quorum_timeout)
                rep = await strategy.run_step(rec.step, want_stop)
                rec.reports += 1
                rec.adopted += bool(rep.extra.get("adopted"))
                rec.step = rec.step + 1 if rep.next_step is None else rep.next_step
                if isinstance(rep.extra.get("reforms"), int):
                    rec.reforms = rep.extra["reforms"]
                if np.isfinite(rep.loss):
                    rec.loss = rep.loss
                if rep.stop:
                    rec.outcome, rec.finished_at = "finished", loop.time() - self.t0
                    rec.digests = self.replicas[i].digests_now()
                    if strategy.identical_replicas != "never":
                        await self._audit(rec, self.replicas[i], strategy)
                    # as NodeRuntime.finish: the barrier (and the linger of a relay), then the process ends
                    rec.barrier = await finish_barrier(node.membership, node.transport, self.topo,
                                                       {"node": i, "step": rec.step},
                                                       timeout=max(BARRIER_S, self.opts.peer_timeout), depart=False)
                    rec.barrier_at = loop.time() - self.t0
                    await self._leave(node)
                    return
        except Fenced:
            rec.outcome = "fenced"
        except Exception as exc:  # (an error that is no P2PSyncError is a defect: the process crashes)
            rec.outcome, rec.error = "error", f"{type(exc).__name__}: {exc}"[:500]
            if isinstance(exc, P2PSyncError):
                log.info("node %d: training ended: %s", i, rec.error)
            else:
                rec.crashed = True
                log.error("node %d: training crashed: %s", i, rec.error, exc_info=exc)
            self._exit(node, rec.error)  # (its process exits, as the step driver's does)

    async def _audit(self, rec: NodeTraining, replica: SimReplica, strategy: Strategy) -> None:
        """The step driver's audit at the agreed stop (:func:`~p2psync.strategies.audit.audit_replicas`
        over the strategy's group), recorded in :attr:`NodeTraining.audit`."""
        ctx = strategy.ctx
        try:
            await audit_replicas(ctx.collectives, await replica.digests(),
                                 tag=OpId("audit", "end", ctx.epoch).tag, group=ctx.group, step=rec.step)
            rec.audit = "passed"
        except ReplicaMismatch as exc:
            rec.audit = f"mismatch: {exc}"[:500]
        except P2PSyncError as exc:  # a member failed meanwhile: not completed, as in a real run
            rec.audit = f"incomplete: {type(exc).__name__}: {exc}"[:500]

    async def _settle(self) -> None:
        """Wait for the loops of the nodes not killed to end, and for the rendezvous of the
        restarted processes still registering (a loop starts when one ends), at most
        :data:`SETTLE_S` in all (and at least two re-form bounds' worth of it); then for the
        detection of the processes' exits (:meth:`SimCluster._settle`)."""
        loop = self._loop()
        deadline = loop.time() + max(SETTLE_S, 2 * regroup_bound(self.opts.failure_timeout, self.opts.heartbeat))
        while loop.time() < deadline:
            up = [i for i, n in self.nodes.items() if n.killed_at is None]
            pending = [t for i in up if (t := self.tasks.get(i)) is not None and not t.done()]
            pending += [t for i in up if (t := self.nodes[i].rendezvous) is not None and not t.done()]
            if not pending:
                break
            await asyncio.wait(pending, timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED)
        await super()._settle()  # (the exits' detections)

    def summary(self, *, virtual_seconds: float, rendezvous_s: float, wall_s: float) -> dict[str, Any]:
        """:meth:`SimCluster.summary` with ``training`` and the two training invariants (see
        the module docstring)."""
        out = super().summary(virtual_seconds=virtual_seconds, rendezvous_s=rendezvous_s, wall_s=wall_s)
        loop = self._loop()
        now = loop.time() - self.t0
        nodes: dict[str, Any] = {}
        for i, rec in self.runs.items():
            node = self.nodes[i]
            nodes[str(i)] = {"outcome": _outcome(node, rec), **_record(rec, self.replicas[i]),
                             **({"error": rec.error or node.failed} if rec.error or node.failed else {})}
            if rec.incarnation > 1:
                nodes[str(i)]["incarnation"] = rec.incarnation
                if rec.trained_at is not None:
                    nodes[str(i)]["joined_training_at"] = round(rec.trained_at, 6)
        for e in self.earlier:  # the processes restarts replaced, oldest first
            nodes[str(e.node.id)].setdefault("earlier", []).append(
                {"incarnation": e.run.incarnation, "outcome": _outcome(e.node, e.run), **_record(e.run, e.replica)})
        finished = sorted(i for i in self.runs if nodes[str(i)]["outcome"] == "finished")
        stop = min((self.runs[i].finished_at or now for i in finished), default=now)
        bound = detection_bound(self.topo, self.opts)
        horizon = virtual_seconds if self.ended_at is None else min(virtual_seconds, self.ended_at)
        late = horizon - inv.rejoin_bound(bound, DISCOVER_S)
        join_s = regroup_bound(self.opts.failure_timeout, self.opts.heartbeat)
        for i, node in self.nodes.items():
            trained = self.runs[i].trained_at
            if (node.run_ended or isinstance(node.membership.fenced, RunEnded)) and (trained is None or trained > stop):
                nodes[str(i)]["excused"] = "came back as the run ended (RunEnded)"
            elif excused(started_at=node.started_at, joined_at=node.joined_at, failed=node.failed,
                         trained_at=self.runs[i].trained_at, stop=stop, join_s=join_s,
                         pending=node.started_at is not None and node.started_at > late):
                nodes[str(i)]["excused"] = "restarted too late to join the training before the agreed stop"
        gone = (set(out["killed"]) | {int(k) for k in out["fenced"]} | set(out["stranded"])
                | set(out.get("left_behind", ())))
        live = [i for i in self.nodes if i not in gone and "excused" not in nodes[str(i)]]
        steps = [nodes[str(i)]["step"] for i in finished]
        cls = self.strategy_cls
        out["training"] = {
            "strategy": cls.name, "unit": cls.step_unit, "promise": cls.identical_replicas,
            "step_time_s": self.training.step_time,
            "options": dict(self.training.options),
            "ended_at_s": round(now, 6),
            "finished": len(finished),
            "rejoined": sorted(i for i in finished if self.runs[i].incarnation > 1),
            "steps": {"min": min(steps), "max": max(steps)} if steps else None,
            "nodes": nodes,
        }
        # the models as each loop ended at the agreed stop, and now (nothing may change them since)
        digests = {i: d for i in finished if (d := self.runs[i].digests) is not None}
        later = {i: self.replicas[i].digests_now() for i in finished}
        crashes = [f"node {e.node.id} (process {e.run.incarnation}): {e.run.error}" for e in self.earlier
                   if e.run.crashed] + [f"node {i} (process {r.incarnation}): {r.error}"
                                        for i, r in self.runs.items() if r.crashed]
        out["invariants"]["no_crash"] = inv.HELD if not crashes else (
            "a process's training raised an error other than a P2PSyncError (a defect): " + "; ".join(crashes[:10]))
        out["invariants"]["finish_barrier"] = finish_barrier_held(
            self.runs, self.topo.ids, bound=2 * bound + line_probe_s(self.topo, self.opts),
            killed={i for i, n in self.nodes.items() if n.killed_at is not None})
        if out["majority_at_end"]:
            out["invariants"]["strategy_finished"] = strategy_finished(nodes, live)
            out["invariants"]["same_model_at_end"] = same_model(cls.name, cls.identical_replicas, digests, later=later)
        else:
            why = (f"{inv.NOT_PROMISED}: no group of live nodes holds a majority of the newest view at the end, "
                   "so no member may step to an agreed stop")
            out["invariants"]["strategy_finished"] = why if not finished else (
                f"node(s) {finished} finished although no group held a majority of the view at the end")
            out["invariants"]["same_model_at_end"] = (same_model(cls.name, cls.identical_replicas, digests, later=later)
                                                      if digests else why)
        return out

    async def close(self) -> None:
        """Stop every loop, close every strategy, then every node (:meth:`SimCluster.close`),
        the processes restarts replaced too; a restarted process that registers meanwhile
        starts no strategy."""
        loop = self._loop()
        self._closing = True
        procs = [(e.node, e.run, e.task) for e in self.earlier]
        procs += [(node, self.runs[i], self.tasks.get(i)) for i, node in self.nodes.items()]
        tasks = [t for _, _, t in procs if t is not None]
        for t in tasks:
            t.cancel()
        for node, _, _ in procs:
            loop.release(node.actor)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for node, rec, _ in procs:
            if rec.strategy is not None:
                try:
                    await loop.spawn(rec.strategy.close(), actor=node.actor)
                except P2PSyncError as exc:
                    log.info("node %d: closing the strategy: %s", node.id, exc)
        await super().close()


def _outcome(node: SimNode, rec: NodeTraining) -> str:
    """A process's outcome in the summary (see the module docstring)."""
    if node.fenced_at is not None:
        return "finished" if rec.outcome == "finished" else "fenced"
    if node.exited is not None or node.failed is not None:
        return "error"
    if node.killed_at is not None:
        return "killed"
    return "running" if rec.outcome in ("starting", "training") else rec.outcome


def _record(rec: NodeTraining, rep: SimReplica) -> dict[str, Any]:
    """A process's training in the summary (without its outcome)."""
    return {"step": rec.step, "steps_run": rec.reports, "adopted": rec.adopted, "local_iterations": rep.iterations,
            "loss": None if rec.loss is None else round(rec.loss, 6), "model_hash": rep.model_hash(),
            **({"reforms": rec.reforms} if rec.reforms is not None else {}),
            **({"audit": rec.audit} if rec.audit is not None else {}),
            **({"finished_at": round(rec.finished_at, 6)} if rec.finished_at is not None else {}),
            **({"barrier": rec.barrier} if rec.barrier is not None else {}),
            **({"barrier_at": round(rec.barrier_at, 6)} if rec.barrier_at is not None else {})}


def strategy_finished(nodes: Mapping[str, Mapping[str, Any]], live: Sequence[int]) -> str:
    """``held`` when every node of ``live`` finished (``nodes``: the summary's per-node
    training); else which did not, and how they ended."""
    bad = [i for i in live if nodes[str(i)]["outcome"] != "finished"]
    if not bad:
        return inv.HELD
    return "live node(s) that did not end at an agreed stop: " + "; ".join(
        f"{i} ({nodes[str(i)]['outcome']} at step {nodes[str(i)]['step']}"
        + (f": {nodes[str(i)]['error']}" if nodes[str(i)].get("error") else "") + ")" for i in bad[:20]) + (
        f"; and {len(bad) - 20} more" if len(bad) > 20 else "")


def finish_barrier_held(runs: Mapping[int, NodeTraining], expected: Sequence[int], *, bound: float,
                        killed: Collection[int] = ()) -> str:
    """``finish_barrier``: every node of ``runs`` (the current processes) that ended its loop at
    the agreed stop got the barrier's reply, complete (every node of ``expected`` finished,
    declared failed, or ended as a joiner still joining: ``ended``, none that had joined the
    training before the last loop ended), the same at every node, at most ``bound`` after
    the last of them ended its loop (a member killed right before the stop is declared failed
    in the meantime). A node of ``killed`` waits for no reply (its process was killed in the
    barrier)."""
    ended = {i: r for i, r in runs.items() if r.outcome == "finished" and i not in killed}
    if not ended:
        return inv.HELD
    last = max(r.finished_at or 0.0 for r in ended.values())
    bad: list[str] = []
    replies: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for i, r in sorted(ended.items()):
        if r.barrier is None:
            bad.append(f"node {i}: still in the barrier at the end")
            continue
        if not r.barrier:
            bad.append(f"node {i}: the barrier failed (no reply)")
            continue
        fin, failed = tuple(r.barrier.get("finished", ())), tuple(r.barrier.get("failed", ()))
        left_out = set(r.barrier.get("ended", ()))
        wrongly = sorted(n for n in left_out if n in runs and (t := runs[n].trained_at) is not None and t <= last)
        if wrongly:
            bad.append(f"node {i}: the barrier ended nodes {wrongly} as still joining, but they had joined the "
                       "training before the stop")
        replies.setdefault((fin, failed), []).append(i)
        missing = sorted(set(expected) - set(fin) - set(failed) - left_out)
        if missing:
            bad.append(f"node {i}: the barrier ended without nodes {missing} (neither finished nor failed)")
        absent = sorted(set(ended) - set(fin))
        if absent:
            bad.append(f"node {i}: the barrier's reply does not list finished nodes {absent}")
        if r.barrier_at is not None and r.barrier_at - last > bound:
            bad.append(f"node {i}: the reply came {r.barrier_at - last:.3f}s after the last loop ended "
                       f"(bound {bound:.3f}s)")
    if len(replies) > 1:
        bad.append("the replies differ: " + "; ".join(f"nodes {ns}: finished {list(f)}, failed {list(x)}"
                                                     for (f, x), ns in sorted(replies.items())))
    return inv.HELD if not bad else "; ".join(bad[:10]) + ("; ..." if len(bad) > 10 else "")


def same_model(strategy: str, promise: str, digests: Mapping[int, Sequence[tuple[str, bytes]]], *,
               later: Mapping[int, Sequence[tuple[str, bytes]]] | None = None) -> str:
    """``same_model_at_end`` over the ``digests`` of the nodes that finished, taken as their
    loops ended at the agreed stop (node -> the replica's (name, digest) list): ``held``, the
    nodes that differ, ``not promised: ...`` for a strategy that promises no single model, or
    why nothing could be compared. ``later``: the same nodes' digests at the end of the run;
    a model that changed after its stop is a violation too."""
    if promise == "never":
        return (f"{inv.NOT_PROMISED}: {strategy} does not promise equal replicas (identical_replicas = never); "
                "the models were not compared")
    if not digests:
        return "no node finished: no model to compare"
    moved = sorted(i for i, d in (later or {}).items() if i in digests and list(d) != list(digests[i]))
    if moved:
        return f"node(s) {moved} changed their model after the agreed stop"
    group = sorted(digests)
    names = [n for n, _ in digests[group[0]]]
    rows = [np.frombuffer(b"".join(d for _, d in digests[i]), np.uint8) for i in group]
    bad = first_mismatch(group, rows, names)
    if bad is None:
        return inv.HELD
    return (f"node(s) {list(bad.nodes)} hold a different model than node {bad.reference} ({bad.tensors} of "
            f"{len(names)} tensors differ; first: {bad.tensor!r})")


__all__ = ["REFUSED", "RELAUNCHES", "RELAUNCH_S", "SETTLE_S", "SIMULATED", "Earlier", "NodeTraining", "TrainingCluster", "TrainingSpec", "check_strategy",
           "excused", "finish_barrier_held", "parse_step_time", "same_model", "strategy_finished"]

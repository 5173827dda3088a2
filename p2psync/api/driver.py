"""The loop side of a :class:`~p2psync.api.session.Session`: the node's runtime and the step
loop that drives the strategy.

The session's handle lives on the user's thread (the *training thread*); everything here runs
on the node's event loop, in this order:

1. :meth:`StepDriver.start` (``attach``): the runtime's rendezvous, the identical start
   (:mod:`p2psync.api.start`), the membership listeners, the metrics file; then the phase
   turns RUNNING and the step loop starts as the driver's task. ``start`` returns once the
   loop has started the strategy, or the strategy waits for the user's first iteration, or
   the loop ended: the strategy's hooks (averaging during backward) are in place before the
   user's first backward. An error starting the strategy is the run's error (raised at the
   user's next step), not ``attach``'s.
2. :meth:`StepDriver._drive`: the strategy's steps (``run_step``: the failure policy's check,
   then ``train_step``) one after another, each one taking the user's iterations through the
   gate; between steps the quorum wait, the replica audit, the checkpoint, the metrics record
   and the release of the training thread. It ends when a report says ``stop``
   (:attr:`Outcome.AGREED`), when the user's loop ended first (:attr:`Outcome.LOOP_ENDED`: this
   node leaves the run at close), or with an error (:meth:`StepDriver.fail`).
3. :meth:`StepDriver.finish` (``close``): the driver's end, the pending checkpoint, the audit of
   a loop that ended first, the final stats and the finish barrier, then the runtime closes.

Failures reach the driver from any thread (a divergent gradient on the training thread, a view
that ends the run, a fence): :meth:`StepDriver.fail` records the first one in the session's
:class:`~p2psync.api.lifecycle.Lifecycle`, wakes the training thread with it and cancels the
step loop.

Threads: the driver's fields belong to the event loop; :attr:`StepDriver.step` is read by the
training thread (the step it is at), :attr:`StepDriver.stats` once the driver is over.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from p2psync import clock
from p2psync.api import checkpoint
from p2psync.api.gate import StepGate
from p2psync.api.lifecycle import Lifecycle, Phase
from p2psync.api.replica import HookedReplica
from p2psync.api.runtime import NodeRuntime
from p2psync.api.session_state import Checkpoints
from p2psync.api.start import identical_start
from p2psync.collectives import OpId
from p2psync.coordinator import View
from p2psync.errors import (ConfigError, Diverged, Fenced, P2PSyncError, ReplicaMismatch, RunEnded, SumDiverged,
                            TrainingEnded, TrainingError)
from p2psync.files import node_marker, write_text_or_warn
from p2psync.strategies.audit import AuditLog, audit_replicas
from p2psync.strategies.base import StepReport, Strategy
from p2psync.tasks import cancel_all
from p2psync.topology import Topology
from p2psync.training.config import UNBOUNDED_STEPS, RunConfig
from p2psync.training.metrics import MetricsWriter, bytes_sent, peak_rss_bytes

log = logging.getLogger("p2psync.session")

#: seconds at most a node whose own tensors diverged spends telling the coordinator (it then stops)
DIVERGED_REPORT_S = 5.0


class Outcome(enum.Enum):
    """How the step loop ended without an error."""

    #: a report said ``stop``: every member stops at this step (or the loop-end audit showed
    #: that every member's loop ended at the same step with one model)
    AGREED = "agreed"
    #: the user's loop ended before the run agreed to stop: this node departs at close
    LOOP_ENDED = "loop_ended"


@dataclass
class StepLog:
    """What the user's loop reported (``Session.log``) since the last record, and the last
    evaluation; written on the training thread, taken into records on the event loop."""

    pending_loss: float = float("nan")
    pending_samples: int = 0
    logged: dict[str, Any] = field(default_factory=dict)
    last_accuracy: float | None = None
    last_test_loss: float | None = None
    last_val_bpb: float | None = None

    def take(self) -> dict[str, Any]:
        """The values logged since the last call (and forget them)."""
        out, self.logged = self.logged, {}
        return out


class StepDriver:
    """The event-loop side of one session (see the module docstring)."""

    def __init__(self, *, cfg: RunConfig, topo: Topology, node_id: int, max_steps: int, gate: StepGate,
                 life: Lifecycle, ckpt: Checkpoints, reports: StepLog, info: dict[str, Any]) -> None:
        self.cfg = cfg
        self.topo = topo
        self.node_id = node_id
        self.max_steps = max_steps
        self.gate = gate
        self.life = life
        self.ckpt = ckpt
        self.reports = reports
        self.info = info
        #: set by the training thread (``Session.request_stop``): stop at the next agreed step
        self.stop_requested = threading.Event()
        self.replica: HookedReplica | None = None
        self.runtime: NodeRuntime | None = None
        self.strategy: Strategy | None = None
        self.metrics: MetricsWriter | None = None
        self.task: asyncio.Task[None] | None = None
        #: set once the step loop started the strategy, or ended without
        self._strategy_started = asyncio.Event()
        self.outcome: Outcome | None = None
        self.step = 0
        self.stats: dict[str, Any] = {}
        self.t0 = clock.now()
        self.comm_s = 0.0
        self.wait_s = 0.0
        self._last_record: dict[str, Any] | None = None
        #: replica audits: passed, not completed, and the step of the last one passed
        self.audits = AuditLog()

    # -- failures (any thread) -----------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        """End the run on this node with ``exc`` (any thread): the training thread raises it at
        its next step (or now, parked), the step loop is cancelled. Only the first error
        counts."""
        if not self.life.fail(exc):
            return
        self.gate.fail(exc)
        task, loop = self.task, self.gate.loop
        if task is not None and not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)

    def _on_view(self, view: View) -> None:
        """A view that ends the run (most members were reported for non-finite values)."""
        if view.ended:
            self.fail(Diverged(f"training diverged at step {self.step}: coordinator {view.coordinator} ended "
                               f"the run on node {self.node_id}'s view {view.epoch} ({view.ended})"))

    def _on_fenced(self, exc: Fenced) -> None:
        """This node was removed from the run: it stops now (its progress since is void). A
        marker beside its records tells the launcher to start it again (it then rejoins), or,
        when the run ended without it (:class:`RunEnded`), to leave it out."""
        if self.runtime is not None and (exc.rejoin or isinstance(exc, RunEnded)):
            self._mark(self.runtime, exc)
        self.fail(exc)

    def _mark(self, rt: NodeRuntime, exc: Fenced) -> None:
        """The marker the launcher reads when this process has ended (``cli.launch``)."""
        kind = "ended" if isinstance(exc, RunEnded) else "fenced"
        write_text_or_warn(node_marker(rt.run_dir, self.node_id, kind), str(exc) + "\n", what=f"{kind} marker")

    # -- start ---------------------------------------------------------------------------

    async def start(self, replica: HookedReplica) -> None:
        """Join the run with ``replica`` and start the step loop (the phase turns RUNNING).
        On an error the runtime is closed and the error raised."""
        self.replica = replica
        rt = self.runtime = NodeRuntime(cfg=self.cfg, topo=self.topo, node_id=self.node_id)
        ckpt = self.ckpt
        try:
            await rt.rendezvous()
            if ckpt.loaded is not None:
                checkpoint.restore_feedback(ckpt.loaded, (rt.collectives.feedback, rt.collectives.sparse_feedback))
            if not rt.joined:
                at = await identical_start(rt, replica, resuming=ckpt.resuming or ckpt.loaded is not None,
                                           resumed_at=ckpt.resume_step if ckpt.loaded is not None else None)
                if at is not None:  # every member agreed on this step: they all stop here alike
                    if at + 1 > self.max_steps:
                        raise ConfigError(f"node {self.node_id}: the run resumes at step {at}, its budget of "
                                          f"{self.max_steps} steps is spent (raise --steps or --epochs)")
                    ckpt.resume_step = at  # a node behind adopted the state of this later step
            rt.membership.view_listeners.append(self._on_view)
            rt.membership.fence_listeners.append(self._on_fenced)
            if rt.strategy_cls.grad_ready:  # hooked before the user's first backward
                await replica.enable_grad_ready(self._on_grad_ready)
            self.metrics = MetricsWriter(rt.run_dir / f"node-{self.node_id}.jsonl", failures=rt.write_failures)
            self.life.to(Phase.RUNNING)
            self.task = asyncio.get_running_loop().create_task(self._drive(), name="p2psync-driver")
        except BaseException as exc:
            if isinstance(exc, RunEnded):  # its registration came after the agreed stop
                self._mark(rt, exc)
            await rt.close()
            raise
        await _first(self.task, self._strategy_started, self.gate.wanted)

    def _on_grad_ready(self, index: int, offset: int, grad: np.ndarray) -> None:
        if self.strategy is not None:
            self.strategy.on_grad_ready(index, offset, grad)

    # -- the step loop -------------------------------------------------------------------

    def _want_stop(self, limit: float | None) -> bool:
        """This node would stop after the step about to run: asked to, the step budget, or
        the time budget spent."""
        return (self.stop_requested.is_set() or self.step + 1 >= self.max_steps
                or (limit is not None and clock.now() - self.t0 >= limit))

    async def _drive(self) -> None:
        """The strategy's step loop (see the module docstring)."""
        rt, gate, replica = self.runtime, self.gate, self.replica
        if rt is None or replica is None:
            raise TrainingError("the session is not started (attach() first)")
        try:
            bounded = self.max_steps if self.max_steps < UNBOUNDED_STEPS else None
            strategy = self.strategy = await rt.start_strategy(replica, max_steps=bounded)
            if self.ckpt.strategy_state:
                strategy.load_state_dict(self.ckpt.strategy_state)
            self._strategy_started.set()
            self.step = max(strategy.start_step, self.ckpt.resume_step)
            limit = rt.time_left()
            self.t0 = clock.now()
            while True:
                want_stop = self._want_stop(limit)
                if not rt.membership.has_quorum:  # cut off from the majority: no step until heard
                    self.wait_s += await rt.membership.wait_quorum(self.cfg.quorum_timeout)
                rep = await strategy.run_step(self.step, want_stop)
                self.step = self.step + 1 if rep.next_step is None else rep.next_step
                if self._audit_due(strategy, rep.stop, rep.next_step is not None):
                    await self._audit(strategy, "end" if rep.stop else str(self.step))
                self.comm_s += rep.comm_s
                self.wait_s += rep.wait_s
                every = self.cfg.checkpoint_every
                if every and self.step % every == 0:  # the training thread is parked: a consistent state
                    await self._take_checkpoint(rt)
                rec = self._record(rep)
                if rep.stop:  # written at close, with the final evaluation the loop logs
                    self._last_record = rec
                    self.outcome = Outcome.AGREED
                    break
                self._write(rec)
                gate.release()
        except TrainingEnded:  # the user's loop ended before the run agreed to stop
            self.outcome = Outcome.LOOP_ENDED
        except asyncio.CancelledError:  # close(graceful=False), or fail(): not a failure here
            raise
        except Diverged as exc:  # a tensor this node was about to send: name the step
            err = exc if "diverged at step" in str(exc) else \
                Diverged(f"training diverged at step {self.step} on node {self.node_id}: {exc}")
            if isinstance(exc, SumDiverged) and (rt.membership.view is None or not rt.membership.view.ended):
                # the group's sum overflowed here: the run ends on every member (a node's own
                # divergence ends that node only, its departure a failure for the others)
                await rt.membership.report_diverged(str(err), timeout=min(DIVERGED_REPORT_S, self.cfg.peer_timeout))
            self.fail(err)
            raise
        except BaseException as exc:
            self.fail(exc)
            raise
        finally:
            self._strategy_started.set()
            self.life.stopped()
            gate.finish()

    async def _take_checkpoint(self, rt: NodeRuntime) -> None:
        """Take this step's checkpoint (the training thread is parked); it is written when the
        next step's start arrives, with the user state of that moment."""
        path = checkpoint.node_checkpoint(rt.run_dir, self.node_id)
        own = self.loop_state()  # here, before background exchanges go on
        replica = self.replica
        snap = await self.gate.run(lambda: self.ckpt.snapshot(own, replica, user=False))
        self.ckpt.pending = (path, snap)

    def loop_state(self) -> dict[str, Any]:
        """The event loop's part of a checkpoint, copied at once (on the loop)."""
        rt = self.runtime
        coll = rt.collectives if rt is not None else None
        return {"step": self.step, "samples": self.gate.samples, "strategy": self.cfg.strategy,
                "run_id": rt.run_id if rt is not None else self.cfg.run_id,
                "node": self.node_id,
                "strategy_state": copy.deepcopy(self.strategy.state_dict()) if self.strategy is not None else {},
                "feedback": checkpoint.feedback_states((coll.feedback, coll.sparse_feedback) if coll else (None, None))}

    async def loop_state_async(self) -> dict[str, Any]:
        """:meth:`loop_state`, for a caller on another thread."""
        return self.loop_state()

    def _record(self, rep: StepReport) -> dict[str, Any]:
        rt = self.runtime
        if rt is None:
            raise TrainingError("the session is not started (attach() first)")
        now = clock.now() - self.t0
        return {
            "node": self.node_id, "step": self.step, "time": round(now, 4), "loss": rep.loss,
            "compute_s": round(self.gate.compute_s, 4), "comm_s": round(self.comm_s, 4),
            "wait_s": round(self.wait_s, 4), "samples": self.gate.samples,
            "samples_per_s": self.gate.samples / now if now > 0 else 0.0,
            "nics": rt.nic_bytes(), "peak_rss_bytes": peak_rss_bytes(), **rep.extra,
            # nodes whose non-finite tensor pieces this node rejected (they are excluded)
            **({"offences": {str(n): c for n, c in sorted(rt.transport.offences.items())}}
               if rt.transport.offences else {})}

    def _write(self, rec: dict[str, Any]) -> None:
        """Write a step's record with the values logged since the last one."""
        if self.metrics is None:
            raise TrainingError("the session is not started (attach() first)")
        logged = self.reports.take()
        self.metrics.write({**rec, **logged}, flush="accuracy" in logged)

    # -- replica audits ------------------------------------------------------------------

    def _audit_due(self, strategy: Strategy, stop: bool, moved: bool) -> bool:
        """Whether the replicas are compared after this step: at the end of every strategy
        that promises one model, and every ``--audit-every`` steps of those that promise it
        after every step (not after a step that adopted a peer's state, except at the stop: a
        joiner that adopted the operation carrying it audits with the members, whose group
        it is in)."""
        promise = strategy.identical_replicas
        if promise == "never" or (moved and not stop):
            return False
        every = self.cfg.audit_every
        return stop or (promise == "every_step" and every is not None and self.step % every == 0)

    async def _audit(self, strategy: Strategy, label: str) -> None:
        """The replica audit over the strategy's current group (strategies/audit.py): a
        mismatch ends the run (ReplicaMismatch, on every member alike); an audit that cannot
        complete (a member failed meanwhile) is logged and counted, not fatal."""
        if self.replica is None or self.runtime is None:
            raise TrainingError("the session is not started (attach() first)")
        ctx = strategy.ctx
        digests = await self.replica.digests(buffers=self.cfg.buffers != "local")
        try:
            await audit_replicas(self.runtime.collectives, digests, tag=OpId("audit", label, ctx.epoch).tag,
                                 group=ctx.group, step=self.step)
        except ReplicaMismatch:
            raise
        except P2PSyncError as exc:
            self.audits.incomplete += 1
            log.warning("node %d: replica audit after step %d did not complete (%s)", self.node_id, self.step, exc)
            return
        self.audits.passed += 1
        self.audits.last = self.step

    async def _loop_end_audit(self) -> None:
        """The user's loop ended before the run agreed to stop: members whose loops ended at
        the same step (equal shards: all of them) audit their replicas. When every member
        took part the end counts as agreed (the finish barrier, no departure). Bounded: a
        member still training does not take part, the audit is logged as incomplete and this
        node leaves the run."""
        strategy = self.strategy
        if strategy is None or strategy.identical_replicas == "never":
            return
        if strategy.identical_replicas == "end":  # its one model comes from the agreed stop
            log.warning("node %d: the training loop ended before the run agreed to stop: %s averages the replicas "
                        "only at an agreed stop, so the nodes may end with different models (end the loop when "
                        "p2psync.should_stop() is true, with --steps or --time)", self.node_id, strategy.name)
            return
        bound = max(5.0, 2 * self.cfg.failure_timeout + 4 * self.cfg.heartbeat)
        passed = self.audits.passed
        try:
            await asyncio.wait_for(self._audit(strategy, f"loopend.{self.step}"), bound)
            if self.audits.passed > passed:
                # every member's loop ended at this step with one model: an agreed end, so the
                # finish barrier runs as after a stop (no departures, no re-forms, every record)
                self.outcome = Outcome.AGREED
        except asyncio.TimeoutError:
            self.audits.incomplete += 1
            log.warning("node %d: replica audit at the end of the loop (step %d) did not complete within %.0f s "
                        "(another member's loop goes on)", self.node_id, self.step, bound)
        except ReplicaMismatch as exc:
            self.life.fail(exc)

    # -- finish --------------------------------------------------------------------------

    async def finish(self, graceful: bool) -> None:
        """End the node (``close``): with ``graceful``, wait for the step loop, write the pending
        checkpoint, audit a loop that ended first, compute the final stats and run the finish
        barrier; without, cancel the step loop. Either way the hooks are removed, the last
        record is written and the runtime closes."""
        rt, replica = self.runtime, self.replica
        if rt is None or replica is None:
            raise TrainingError("the session is not started (attach() first)")
        try:
            if not graceful:
                await cancel_all([self.task])
                return
            if self.task is not None:
                try:
                    await self.task
                except BaseException as exc:  # recorded as the run's error
                    self.life.fail(exc)
            if self.ckpt.pending is not None and not isinstance(self.life.error, Fenced):
                # the loop is over: its schedulers have stepped (a fenced node's progress is void)
                await self.gate.run(lambda: self.ckpt.write_pending(replica, rt.write_failures))
            if self.life.error is None and self.outcome is Outcome.LOOP_ENDED:
                await self._loop_end_audit()
            if self.life.error is None:
                self.stats = await self._final_stats(rt, replica)
                # a node whose loop ended before the run agreed to stop leaves the view, so
                # the others re-form without it; after an agreed stop nobody waits for it
                await rt.finish(self.stats, depart=self.outcome is Outcome.LOOP_ENDED)
        finally:
            replica.remove_hooks()
            if self.metrics is not None:
                if self._last_record is None and self.reports.logged:
                    self._last_record = {"node": self.node_id, "step": self.step,
                                         "time": round(clock.now() - self.t0, 4)}
                if self._last_record is not None:
                    self._write(self._last_record)
                self.metrics.close()
            await rt.close()

    async def _final_stats(self, rt: NodeRuntime, replica: HookedReplica) -> dict[str, Any]:
        wall = clock.now() - self.t0
        nics = rt.nic_bytes()
        params = await replica.get_params()
        buffers = await replica.get_buffers()
        gate, reports = self.gate, self.reports
        stats: dict[str, Any] = {
            "node": self.node_id, "steps": self.step, "wall_s": round(wall, 3),
            "final_accuracy": reports.last_accuracy, "final_test_loss": reports.last_test_loss,
            "samples": gate.samples,
            "samples_per_s": gate.samples / wall if wall > 0 else 0.0,
            "compute_s": round(gate.compute_s, 3), "comm_s": round(self.comm_s, 3),
            "wait_s": round(self.wait_s, 3), "bytes_sent": bytes_sent({"nics": nics}),
            "bytes_recv": sum(v["recv"] for v in nics.values()), "nics": nics,
            "skipped_steps": gate.skipped,
            # iterations of the user's loop the strategy took (``steps`` counts its train_steps)
            "local_steps": gate.arrivals - gate.skipped,
            # parameters and buffers: equal on every member of a synchronous run (SSGD:
            # bitwise), joiners included
            "params_sha1": _sha1(params, buffers.raw),
            "audits": self.audits.as_dict(),
            # what this node's process held at most, against the model's flat size (bench.memory)
            "peak_rss_bytes": peak_rss_bytes(), "model_bytes": int(params.nbytes),
        }
        if reports.last_val_bpb is not None:
            stats["final_val_bpb"] = reports.last_val_bpb
        per = self.info.get("tokens_per_sample")
        if isinstance(per, int):
            stats["tokens_per_s"] = stats["samples_per_s"] * per
        stats.update({k: v for k, v in self.info.items() if k not in stats})
        return stats


def _sha1(*arrays: np.ndarray) -> str:
    """The first 16 hex digits of the SHA-1 of the arrays' bytes in turn (no copy of them)."""
    h = hashlib.sha1()
    for a in arrays:
        h.update(np.ascontiguousarray(a).data.cast("B"))
    return h.hexdigest()[:16]


async def _first(task: asyncio.Task[None], *events: asyncio.Event) -> None:
    """Wait until ``task`` is done or one of ``events`` is set (``task`` is left running)."""
    if task.done() or any(e.is_set() for e in events):
        return
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait({task, *waits}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_all(waits)


__all__ = ["Outcome", "StepDriver", "StepLog"]

"""``p2psync.Session``: one node of a run inside the user's own process.

Why: there is exactly one way a strategy meets a model — around the optimizer step of a loop it
does not own (docs/architecture.md, "One training path"). The built-in job of ``p2psync run`` and users'
scripts both go through this class; :func:`p2psync.attach` is its implicit form.

Threads: the user's loop runs on the calling thread (the *training thread*); the node's event
loop (uvloop when installed) runs in a background thread owned by the session, with the whole
runtime on it (:class:`~p2psync.api.runtime.NodeRuntime`: transport, membership, coordinator
failover, the strategy). :meth:`Session.attach` installs a hook on the optimizer's ``step``:
each call *arrives* at the :class:`~p2psync.api.gate.StepGate` and waits there only as long as
the strategy says, running the strategy's model jobs (replace gradients, run or skip the local
step, replace parameters and optimizer state). The strategy is driven on the event loop by
:meth:`Session._drive`, step after step, exactly as the built-in job's loop used to drive it;
its ``train_step`` takes the user's iterations through the replica
(:class:`~p2psync.api.replica.HookedReplica`), so every strategy is written once.

Identical start (:mod:`p2psync.api.start`): after the rendezvous every member compares its
trainable parameter count and whether (and at which step) it resumes with the others (a
mismatch is a :class:`ConfigError` naming every node's values) and, on a fresh start, takes
the coordinator's initial parameters; resuming, the members agree on the latest step every one
of them can restore (under SSGD a node behind adopts the state of the node with the latest
checkpoint). A node that joins a running run takes its state from a live peer instead.

Divergence: a gradient holding NaN or infinity ends the run on this node with
:class:`~p2psync.errors.Diverged` ("training diverged at step k on node i") before anything is
sent, as does a view by which the coordinator ended the run (most members were reported for
non-finite values, :mod:`p2psync.coordinator.membership`).

Stopping: the run stops when the strategy agrees on it (synchronous strategies stop every node
at the same step): the ``--time`` / ``--steps`` budget of the configuration, or
:meth:`Session.request_stop`. :attr:`Session.should_stop` then turns true; a loop that keeps
calling ``optimizer.step()`` after that leaves the model as the run ended it (one warning). :meth:`close`
(or leaving the ``with`` block) ends the node: the strategy's pending wait ends, the finish
barrier runs (the training thread keeps serving model jobs meanwhile, e.g. ASGD applying the
last gradients that arrive), metrics and the run's summary are written, sockets close.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
import time
import types
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Coroutine, Iterator, TypeVar

import numpy as np
import torch

from p2psync.api import checkpoint
from p2psync.api.gate import StepGate
from p2psync.api.replica import HookedReplica
from p2psync.api.runtime import NodeRuntime
from p2psync.api.session_state import SessionState
from p2psync.api.start import identical_start
from p2psync.collectives import OpId
from p2psync.coordinator import View
from p2psync.errors import ConfigError, Diverged, Fenced, P2PSyncError, ReplicaMismatch, TrainingEnded, TrainingError
from p2psync.files import write_text_or_warn
from p2psync.tasks import cancel_all
from p2psync.strategies.audit import AuditLog, audit_replicas
from p2psync.strategies.base import Strategy, get_strategy, parse_options
from p2psync.strategies.needs import OptimizerInfo, check
from p2psync.topology import Topology, load
from p2psync.training.config import UNBOUNDED_STEPS, RunConfig
from p2psync.training.flat import FlatModel
from p2psync.training.user_state import UserState
from p2psync.training.metrics import MetricsWriter, bytes_sent
from p2psync.transport import all_finite

log = logging.getLogger("p2psync.session")

T = TypeVar("T")

#: seconds a cancelled runtime operation gets to close its sockets and tasks
CANCEL_GRACE_S = 10.0


class Session(SessionState):
    """One node of a run in this process. Use as a context manager, or call :meth:`close`."""

    def __init__(self, topology: str | Path | None = None, node: int | None = None,
                 strategy: str | None = None, *, config: RunConfig | None = None,
                 max_steps: int | None = None, topo: Topology | None = None, **options: Any) -> None:
        """``Session("cluster.json", 3, "ssgd", lr=..., codec="int8", time_limit=60)``: node 3 of
        the run described by the topology file; ``options`` are :class:`RunConfig` fields
        (``strategy_options``: the strategy's own, as ``(("name", "value"), ...)``). Or
        ``config=`` a whole :class:`RunConfig`. ``node`` is required either way."""
        if config is None:
            if topology is None:
                raise ConfigError("Session: give the topology file (or config=RunConfig(...))")
            known = {f.name for f in fields(RunConfig)} - {"topology", "strategy"}
            unknown = sorted(set(options) - known)
            if unknown:
                raise ConfigError(f"Session: unknown option(s) {unknown} (known: {sorted(known)})")
            config = RunConfig(topology=str(topology), strategy=strategy or "ssgd", **options)
        elif topology is not None or strategy is not None or options:
            raise ConfigError("Session: give either config= or the topology, strategy and options")
        if node is None:
            raise ConfigError("Session: which node of the topology is this process? (node=...)")
        self.cfg = config
        self.topo = topo if topo is not None else load(config.topology)
        if node not in self.topo.ids:
            raise ConfigError(f"node {node}: no such node in {config.topology} (ids {self.topo.ids})")
        # the strategy and its options, checked here: a bad one never reaches the rendezvous
        parse_options(get_strategy(config.strategy), dict(config.strategy_options), topology=self.topo)
        self.node_id = node
        self.max_steps = max_steps if max_steps is not None else (config.steps or UNBOUNDED_STEPS)
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"p2psync-node-{node}",
                                        daemon=True)
        self._thread.start()
        self.gate = StepGate(self._loop)
        self.runtime: NodeRuntime | None = None
        self.strategy: Strategy | None = None
        self.replica: HookedReplica | None = None
        self.metrics: MetricsWriter | None = None
        self._driver: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._stop_requested = False
        self._stopped = False
        self._warned_after_stop = False
        self._closed = False
        self._logged: dict[str, Any] = {}
        self._pending_samples = 0
        self._pending_loss = float("nan")
        self.last_accuracy: float | None = None
        self.last_test_loss: float | None = None
        self.last_val_bpb: float | None = None
        #: facts about this node's job that its final stats carry as they are (the built-in
        #: job: ``data``, its corpus's identity; ``tokens_per_sample``, which adds ``tokens_per_s``)
        self.info: dict[str, Any] = {}
        self.step = 0
        self.stats: dict[str, Any] = {}
        self.t0 = time.monotonic()
        self._comm = self._wait = 0.0
        self._last_record: dict[str, Any] | None = None
        self._resume_step = 0
        self._strategy_state: dict[str, Any] = {}
        self._ended_by_loop = False
        #: a checkpoint loaded before attach (load_state_dict, or --resume), applied by attach,
        #: and where it came from (its file), for errors
        self._loaded: dict[str, Any] | None = None
        self._loaded_from = "the state given to Session.load_state_dict"
        #: --resume was asked for (this node may have no checkpoint of its own)
        self._resuming = False
        #: name -> (get, set) of script state that checkpoints carry (register_state)
        self._extras: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        #: replica audits: passed, not completed, and the step of the last one passed
        self._audits = AuditLog()
        #: a checkpoint waiting for the next step's start (path, state without the user's part)
        self._pending_checkpoint: tuple[Path, dict[str, Any]] | None = None

    # -- training thread: the user's side ----------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the event loop and wait for it here, serving model jobs meanwhile.
        Interrupted (Ctrl+C): the coroutine is cancelled and given a bounded time to clean up."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            self.gate.serve(until=fut.done)
        except BaseException:
            fut.cancel()
            deadline = time.monotonic() + CANCEL_GRACE_S
            try:
                self.gate.serve(until=lambda: fut.done() or time.monotonic() > deadline)
            except BaseException:
                pass
            raise
        return fut.result()

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
               scaler: Any = None) -> torch.optim.Optimizer:
        """Join the run with ``model`` trained by ``optimizer``; returns the same optimizer with
        its ``step`` hooked (so LR schedulers and ``state_dict()`` keep working). The
        optimizer's LR schedulers (found, or named by ``scheduler``: one or a list) and a
        ``scaler`` travel with checkpoints, resume and joins (training/user_state.py)."""
        if self.replica is not None:
            raise ConfigError(f"node {self.node_id}: attach() was called twice (one model per node)")
        if getattr(optimizer, "_p2psync_session", None) is not None:
            raise ConfigError(f"node {self.node_id}: this optimizer is already attached to a session")
        strategy_cls = get_strategy(self.cfg.strategy)  # what it needs of the optimizer, before joining
        check(strategy_cls.name, strategy_cls.needs, OptimizerInfo.of(optimizer))
        if self.cfg.resume is not None and self._loaded is None:  # --resume: this node's checkpoint
            self._load_own_checkpoint(self.cfg.resume, strategy_cls)
        if self._loaded is not None:
            checkpoint.restore_local(self._loaded, model, optimizer, source=self._loaded_from)
            self._restore_extras(self._loaded.get("extra", {}))
            samples = self._loaded.get("samples")
            self.gate.samples = samples if type(samples) is int and samples >= 0 else 0
        flat = FlatModel(model=model, optimizer=optimizer)
        own_step = optimizer.step
        schedulers = tuple(scheduler) if isinstance(scheduler, (list, tuple)) else \
            (scheduler,) if scheduler is not None else ()
        user = UserState(optimizer, schedulers=schedulers, scalers=(scaler,) if scaler is not None else ())
        if self._loaded is not None and isinstance(self._loaded.get("user_state"), dict):
            user.restore(self._loaded["user_state"], absorb=False)  # schedulers made later: at the first step
        self.replica = HookedReplica(flat=flat, gate=self.gate, step=own_step, user_state=user)
        try:
            self._call(self._start())
        except BaseException:
            self.replica = None
            self._closed = True
            self._shutdown_loop()
            raise
        session = self

        def step(self_opt: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
            return session._on_step(own_step, closure)

        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
        optimizer._p2psync_session = self  # type: ignore[attr-defined]
        return optimizer

    def _load_own_checkpoint(self, run_dir: str, strategy_cls: type[Strategy]) -> None:
        """``--resume RUN_DIR``: this node's own checkpoint, which must be its own (its ``node``
        field). Without one, a node of a strategy whose replicas are identical after every step
        starts anyway and takes the state of the node with the latest checkpoint
        (:mod:`p2psync.api.start`); under any other strategy that is a ConfigError."""
        path = checkpoint.node_checkpoint(run_dir, self.node_id)
        identical = strategy_cls.identical_replicas == "every_step"
        self._resuming = True
        if not path.exists() and identical:
            log.warning("node %d: --resume %s: no checkpoint of this node (%s): it takes the state of the node with "
                        "the latest one", self.node_id, run_dir, path)
            return
        state = checkpoint.load(path)
        owner = state.get("node")
        if type(owner) is not int:
            raise ConfigError(f"{path}: the checkpoint does not say which node wrote it (node {owner!r})")
        if owner != self.node_id:
            hint = (f"; with --strategy {strategy_cls.name} remove it: a node without a checkpoint takes the state "
                    "of the node whose checkpoint is the latest" if identical else
                    f"; --strategy {strategy_cls.name} keeps a different replica on each node")
            raise ConfigError(f"{path}: this is node {owner}'s checkpoint, not node {self.node_id}'s (copied from "
                              f"node {owner}'s folder?): a node resumes from its own checkpoint only{hint}")
        self.load_state_dict(state)
        self._loaded_from = str(path)

    def _on_step(self, own_step: Callable[..., Any], closure: Callable[[], Any] | None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self._pending_loss = float(loss)
        if self._error is not None:
            raise self._error
        if self._stopped or self._closed:
            if not self._warned_after_stop:
                self._warned_after_stop = True
                log.warning("node %d: the run has stopped (step %d): optimizer.step() no longer changes the "
                            "model (it stays the run's final one); end the loop when p2psync.should_stop() is true",
                            self.node_id, self.step)
            return loss
        samples, self._pending_samples = self._pending_samples, 0
        if self.replica is None:  # unreachable: step is hooked by attach, which sets the replica
            raise TrainingError("optimizer.step() hooked without a replica")
        self.replica.user_state.on_step()
        self._write_pending_checkpoint()
        grads = self.replica.flat.grads()
        if not all_finite(grads):  # before any strategy can send it: this node's own divergence
            self._fail(Diverged(f"training diverged at step {self.step} on node {self.node_id}: its gradient "
                                "holds NaN or infinity (nothing was sent; no peer is blamed)"))
            raise self._error  # type: ignore[misc]
        self.replica.flush_grad_ready()  # backward's gradients reach the loop before this iteration
        self.gate.arrive(loss=self._pending_loss, samples=samples, grads=grads, params_gen=self.replica.params_gen)
        if self._error is not None:
            raise self._error
        return loss

    def _write_pending_checkpoint(self) -> None:
        """Write the checkpoint taken at the last step, completed with the user's training
        state as it is now (the start of the next step; training thread). A disk error is
        said once per node and counted (``write_failures`` in the node's stats), never fatal:
        the previous checkpoint stays as it was (the write is atomic)."""
        pending, self._pending_checkpoint = self._pending_checkpoint, None
        if pending is None or self.replica is None:
            return
        path, snap = pending
        try:
            checkpoint.save_atomic(path, {**snap, "user_state": self.replica.user_state.capture()})
        except OSError as exc:  # a full disk, a read-only folder: the run goes on without it
            if self.runtime is None:
                raise
            self.runtime.write_failures.failed("checkpoint", path, exc, "the previous checkpoint (if any) is kept")

    def log(self, **values: Any) -> None:
        """Report values of the current step: ``loss``, ``samples`` (batch size), ``accuracy``,
        ``test_loss`` and ``val_bpb`` (evaluations; the last ones are the final stats'
        ``final_accuracy``, ``final_test_loss``, ``final_val_bpb``), anything else goes into the
        metrics record as is."""
        if "loss" in values:
            self._pending_loss = float(values.pop("loss"))
        if "samples" in values:
            self._pending_samples += int(values.pop("samples"))
        if "accuracy" in values:
            self.last_accuracy = float(values["accuracy"])
        if "test_loss" in values:
            self.last_test_loss = float(values["test_loss"])
        if "val_bpb" in values:
            self.last_val_bpb = float(values["val_bpb"])
        self._logged.update(values)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside the block are not averaged (see :func:`p2psync.no_sync`)."""
        replica = self.replica
        if replica is None:
            yield
            return
        before = replica.sync_enabled
        replica.sync_enabled = False
        try:
            yield
        finally:
            replica.sync_enabled = before

    @property
    def should_stop(self) -> bool:
        """True once the run agreed to stop (or failed): end the training loop."""
        return self._stopped or self._error is not None

    def request_stop(self) -> None:
        """Ask the run to stop (agreed with the peers at the next step)."""
        self._stop_requested = True

    def close(self, *, graceful: bool = True) -> dict[str, Any]:
        """End this node: finish barrier, summary, sockets closed. Returns the node's stats.
        Raises the error that ended the run, if any. ``graceful=False`` (an exception or an
        interrupt in the user's code): no finish barrier, the sockets close at once."""
        if self._closed:
            return self.stats
        self._closed = True
        if self.replica is None:
            self._shutdown_loop()
            return self.stats
        self.gate.end()
        try:
            self._call(self._finish(graceful))
        finally:
            self._shutdown_loop()
        if self._error is not None:
            raise self._error
        return self.stats

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close(graceful=False)
        except P2PSyncError:
            pass  # the user's exception is the one to report

    def _fail(self, exc: BaseException) -> None:
        """End the run on this node with ``exc`` (any thread): the training thread raises it at
        its next step, the strategy's driver stops."""
        if self._error is not None:
            return
        self._error = exc
        self.gate.fail(exc)
        driver = self._driver
        if driver is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(driver.cancel)

    def _on_view(self, view: View) -> None:
        """A view that ends the run (most members were reported for non-finite values)."""
        if view.ended:
            self._fail(Diverged(f"training diverged at step {self.step}: coordinator {view.coordinator} ended "
                                f"the run on node {self.node_id}'s view {view.epoch} ({view.ended})"))

    def _on_fenced(self, exc: Fenced) -> None:
        """This node was removed from the run: it stops now (its progress since is void). A
        marker beside its records tells the launcher to start it again (it then rejoins)."""
        if self.runtime is not None and exc.rejoin:
            write_text_or_warn(self.runtime.run_dir / f"node-{self.node_id}.fenced", str(exc) + "\n",
                               what="fence marker")
        self._fail(exc)

    def _shutdown_loop(self) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()

    # -- event loop: the node's side ---------------------------------------------------

    async def _start(self) -> None:
        rt = self.runtime = NodeRuntime(cfg=self.cfg, topo=self.topo, node_id=self.node_id)
        try:
            await rt.rendezvous()
            if not (self.replica is not None):
                raise TrainingError("the session is not started (attach() first)")
            if self._loaded is not None:
                checkpoint.restore_feedback(self._loaded, (rt.collectives.feedback, rt.collectives.sparse_feedback))
            if not rt.joined:
                at = await identical_start(rt, self.replica, resuming=self._resuming or self._loaded is not None,
                                           resumed_at=self._resume_step if self._loaded is not None else None)
                if at is not None:  # every member agreed on this step: they all stop here alike
                    if at + 1 > self.max_steps:
                        raise ConfigError(f"node {self.node_id}: the run resumes at step {at}, its budget of "
                                          f"{self.max_steps} steps is spent (raise --steps or --epochs)")
                    self._resume_step = at  # a node behind adopted the state of this later step
            rt.membership.view_listeners.append(self._on_view)
            rt.membership.fence_listeners.append(self._on_fenced)
            if rt.strategy_cls.grad_ready:  # hooked before the user's first backward
                await self.replica.enable_grad_ready(self._on_grad_ready)
            self.metrics = MetricsWriter(rt.run_dir / f"node-{self.node_id}.jsonl", failures=rt.write_failures)
            self._driver = asyncio.get_running_loop().create_task(self._drive(), name="p2psync-driver")
        except BaseException:
            await rt.close()
            raise

    def _on_grad_ready(self, index: int, offset: int, grad: np.ndarray) -> None:
        if self.strategy is not None:
            self.strategy.on_grad_ready(index, offset, grad)

    def _record(self, rep: Any) -> dict[str, Any]:
        if not (self.runtime is not None):
            raise TrainingError("the session is not started (attach() first)")
        now = time.monotonic() - self.t0
        return {
            "node": self.node_id, "step": self.step, "time": round(now, 4), "loss": rep.loss,
            "compute_s": round(self.gate.compute_s, 4), "comm_s": round(self._comm, 4),
            "wait_s": round(self._wait, 4), "samples": self.gate.samples,
            "samples_per_s": self.gate.samples / now if now > 0 else 0.0,
            "nics": self.runtime.nic_bytes(), **rep.extra,
            # nodes whose non-finite tensor pieces this node rejected (they are excluded)
            **({"offences": {str(n): c for n, c in sorted(self.runtime.transport.offences.items())}}
               if self.runtime.transport.offences else {})}

    def _write(self, rec: dict[str, Any]) -> None:
        """Write a step's record with the values logged since the last one."""
        if not (self.metrics is not None):
            raise TrainingError("the session is not started (attach() first)")
        evaluated = "accuracy" in self._logged
        rec = {**rec, **self._logged}
        self._logged = {}
        self.metrics.write(rec, flush=evaluated)

    async def _drive(self) -> None:
        """The strategy's step loop (what the built-in job's loop used to be)."""
        rt, gate = self.runtime, self.gate
        if not (rt is not None and self.replica is not None):
            raise TrainingError("the session is not started (attach() first)")
        try:
            bounded = self.max_steps if self.max_steps < UNBOUNDED_STEPS else None
            strategy = self.strategy = await rt.start_strategy(self.replica, max_steps=bounded)
            if self._strategy_state:
                strategy.load_state_dict(self._strategy_state)
            self.step = max(strategy.start_step, self._resume_step)
            limit = rt.time_left()
            self.t0 = time.monotonic()
            while True:
                elapsed = time.monotonic() - self.t0
                want_stop = (self._stop_requested or self.step + 1 >= self.max_steps
                             or (limit is not None and elapsed >= limit))
                if not rt.membership.has_quorum:  # cut off from the majority: no step until heard
                    self._wait += await rt.membership.wait_quorum(self.cfg.quorum_timeout)
                rep = await strategy.train_step(self.step, want_stop)
                self.step = self.step + 1 if rep.next_step is None else rep.next_step
                if self._audit_due(strategy, rep.stop, rep.next_step is not None):
                    await self._audit(strategy, "end" if rep.stop else str(self.step))
                self._comm += rep.comm_s
                self._wait += rep.wait_s
                every = self.cfg.checkpoint_every
                if every and self.step % every == 0:  # the training thread is parked: a consistent state
                    path = checkpoint.node_checkpoint(rt.run_dir, self.node_id)
                    own = self._loop_state_now()  # here, before background exchanges go on
                    snap = await gate.run(lambda: self._snapshot(own, user=False))
                    # the schedulers' state of the next step's start: written when it arrives
                    self._pending_checkpoint = (path, snap)
                rec = self._record(rep)
                if rep.stop:  # written at close, with the final evaluation the loop logs
                    self._last_record = rec
                    break
                self._write(rec)
                gate.release()
        except TrainingEnded:  # the user's loop ended before the run agreed to stop
            self._ended_by_loop = True
        except asyncio.CancelledError:  # close(graceful=False), or _fail: not a failure here
            raise
        except Diverged as exc:  # a tensor this node was about to send: name the step
            self._fail(exc if "diverged at step" in str(exc) else
                       Diverged(f"training diverged at step {self.step} on node {self.node_id}: {exc}"))
            raise
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._stopped = True
            gate.finish()

    def _audit_due(self, strategy: Strategy, stop: bool, moved: bool) -> bool:
        """Whether the replicas are compared after this step: at the end of every strategy
        that promises one model, and every ``--audit-every`` steps of those that promise it
        after every step (not after a step that adopted a peer's state)."""
        promise = strategy.identical_replicas
        if promise == "never" or moved:
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
            self._audits.incomplete += 1
            log.warning("node %d: replica audit after step %d did not complete (%s)", self.node_id, self.step, exc)
            return
        self._audits.passed += 1
        self._audits.last = self.step

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
        passed = self._audits.passed
        try:
            await asyncio.wait_for(self._audit(strategy, f"loopend.{self.step}"), bound)
            if self._audits.passed > passed:
                # every member's loop ended at this step with one model: an agreed end, so the
                # finish barrier runs as after a stop (no departures, no re-forms, every record)
                self._ended_by_loop = False
        except asyncio.TimeoutError:
            self._audits.incomplete += 1
            log.warning("node %d: replica audit at the end of the loop (step %d) did not complete within %.0f s "
                        "(another member's loop goes on)", self.node_id, self.step, bound)
        except ReplicaMismatch as exc:
            self._error = exc

    async def _finish(self, graceful: bool) -> None:
        rt = self.runtime
        if not (rt is not None and self.replica is not None):
            raise TrainingError("the session is not started (attach() first)")
        try:
            if not graceful:
                await cancel_all([self._driver])
                return
            if self._driver is not None:
                try:
                    await self._driver
                except BaseException as exc:  # recorded in _error
                    self._error = self._error or exc
            if self._pending_checkpoint is not None and not isinstance(self._error, Fenced):
                # the loop is over: its schedulers have stepped (a fenced node's progress is void)
                await self.gate.run(self._write_pending_checkpoint)
            if self._error is None and self._ended_by_loop:
                await self._loop_end_audit()
            if self._error is None:
                wall = time.monotonic() - self.t0
                nics = rt.nic_bytes()
                params = await self.replica.get_params()
                buffers = await self.replica.get_buffers()
                self.stats = {
                    "node": self.node_id, "steps": self.step, "wall_s": round(wall, 3),
                    "final_accuracy": self.last_accuracy, "final_test_loss": self.last_test_loss,
                    "samples": self.gate.samples,
                    "samples_per_s": self.gate.samples / wall if wall > 0 else 0.0,
                    "compute_s": round(self.gate.compute_s, 3), "comm_s": round(self._comm, 3),
                    "wait_s": round(self._wait, 3), "bytes_sent": bytes_sent({"nics": nics}),
                    "bytes_recv": sum(v["recv"] for v in nics.values()), "nics": nics,
                    "skipped_steps": self.gate.skipped,
                    # iterations of the user's loop the strategy took (``steps`` counts its train_steps)
                    "local_steps": self.gate.arrivals - self.gate.skipped,
                    # parameters and buffers: equal on every member of a synchronous run (SSGD:
                    # bitwise), joiners included
                    "params_sha1": hashlib.sha1(params.tobytes() + buffers.raw.tobytes()).hexdigest()[:16],
                    "audits": self._audits.as_dict(),
                }
                if self.last_val_bpb is not None:
                    self.stats["final_val_bpb"] = self.last_val_bpb
                per = self.info.get("tokens_per_sample")
                if isinstance(per, int):
                    self.stats["tokens_per_s"] = self.stats["samples_per_s"] * per
                self.stats.update({k: v for k, v in self.info.items() if k not in self.stats})
                # a node whose loop ended before the run agreed to stop leaves the view, so
                # the others re-form without it; after an agreed stop nobody waits for it
                await rt.finish(self.stats, depart=self._ended_by_loop)
        finally:
            self.replica.remove_hooks()
            if self.metrics is not None:
                if self._last_record is None and self._logged:
                    self._last_record = {"node": self.node_id, "step": self.step,
                                         "time": round(time.monotonic() - self.t0, 4)}
                if self._last_record is not None:
                    self._write(self._last_record)
                self.metrics.close()
            await rt.close()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


__all__ = ["Session"]

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
:class:`~p2psync.api.driver.StepDriver`, step after step; its ``train_step`` takes the user's
iterations through the replica (:class:`~p2psync.api.replica.HookedReplica`), so every strategy
is written once.

The class is a thin handle on the training thread; the node's side is a
:class:`~p2psync.api.driver.StepDriver` on the event loop, and where the session is (created,
attaching, running, stopped, failed, closing, closed) is one
:class:`~p2psync.api.lifecycle.Lifecycle` that both sides move through its transition table.
Checkpoint state (what was loaded, what scripts register, the checkpoint waiting to be
written) is a :class:`~p2psync.api.session_state.Checkpoints`.

Identical start (:mod:`p2psync.api.start`): after the rendezvous every member compares its
trainable parameter count and whether (and at which step) it resumes with the others (a
mismatch is a :class:`ConfigError` naming every node's values) and, on a fresh start, takes
the coordinator's initial parameters; resuming, the members agree on the latest step every one
of them can restore (under SSGD a node behind adopts the state of the node with the latest
checkpoint). A node that joins a running run takes its state from a live peer instead.

Divergence: a gradient holding NaN or infinity ends the run on this node with
:class:`~p2psync.errors.Diverged` ("training diverged at step k on node i") before anything is
sent, as does a view by which the coordinator ended the run (most members were reported for
non-finite values, :mod:`p2psync.coordinator.membership_state`).

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
import logging
import threading
import types
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Coroutine, Iterator, TypeVar

import torch

from p2psync.api import checkpoint
from p2psync.api.driver import StepDriver, StepLog
from p2psync.api.gate import StepGate
from p2psync.api.lifecycle import Lifecycle, Phase
from p2psync.api.replica import HookedReplica
from p2psync.api.runtime import NodeRuntime
from p2psync.api.session_state import Checkpoints
from p2psync.errors import ConfigError, Diverged, P2PSyncError, TrainingError
from p2psync.strategies.base import Strategy, get_strategy, parse_options
from p2psync.strategies.needs import OptimizerInfo, check
from p2psync.topology import Topology, load
from p2psync.training.config import UNBOUNDED_STEPS, RunConfig
from p2psync.model.flat import FlatModel
from p2psync.training.metrics import MetricsWriter
from p2psync.training.user_state import UserState

log = logging.getLogger("p2psync.session")

T = TypeVar("T")

#: seconds a cancelled runtime operation gets to close its sockets and tasks
CANCEL_GRACE_S = 10.0


class Session:
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
        self.gate = StepGate(self._loop)
        self._thread = threading.Thread(target=self._run_loop, name=f"p2psync-node-{node}", daemon=True)
        self._thread.start()
        self.life = Lifecycle()
        self.replica: HookedReplica | None = None
        #: what the user's loop logged since the last record, and its last evaluation
        self.reports = StepLog()
        #: facts about this node's job that its final stats carry as they are (the built-in
        #: job: ``data``, its corpus's identity; ``tokens_per_sample``, which adds ``tokens_per_s``)
        self.info: dict[str, Any] = {}
        self.ckpt = Checkpoints(strategy=config.strategy)
        self.driver = StepDriver(cfg=config, topo=self.topo, node_id=node, max_steps=self.max_steps, gate=self.gate,
                                 life=self.life, ckpt=self.ckpt, reports=self.reports, info=self.info)
        self._warned_after_stop = False

    # -- what the driver holds, as the user sees it ---------------------------------------

    @property
    def step(self) -> int:
        """The step the run is at (the strategy's step count)."""
        return self.driver.step

    @property
    def stats(self) -> dict[str, Any]:
        """This node's final stats (filled by :meth:`close`)."""
        return self.driver.stats

    @property
    def runtime(self) -> NodeRuntime | None:
        """The node's runtime (transport, membership, ...), once attached."""
        return self.driver.runtime

    @property
    def strategy(self) -> Strategy | None:
        """The running strategy, once the driver started it."""
        return self.driver.strategy

    @property
    def metrics(self) -> MetricsWriter | None:
        return self.driver.metrics

    @property
    def phase(self) -> Phase:
        """Where the session is (:class:`~p2psync.api.lifecycle.Phase`)."""
        return self.life.phase

    @property
    def last_accuracy(self) -> float | None:
        return self.reports.last_accuracy

    @property
    def last_test_loss(self) -> float | None:
        return self.reports.last_test_loss

    @property
    def last_val_bpb(self) -> float | None:
        return self.reports.last_val_bpb

    # -- training thread: the user's side ----------------------------------------------

    def _run_loop(self) -> None:
        """The event loop's thread: the loop runs until it is stopped; then a training thread
        waiting at the gate learns that nothing will serve it any more."""
        try:
            self._loop.run_forever()
        finally:
            self.gate.loop_stopped()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the event loop and wait for it here, serving model jobs meanwhile.
        Interrupted (Ctrl+C): the coroutine is cancelled and given a bounded time to clean up."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        fut.add_done_callback(lambda _: self.gate.nudge())
        try:
            self.gate.serve(until=fut.done)
        except BaseException:
            fut.cancel()
            try:
                self.gate.serve(until=fut.done, timeout=CANCEL_GRACE_S)
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
        if self.life.phase is not Phase.CREATED:
            raise ConfigError(f"node {self.node_id}: attach() on a session that is {self.life.phase.value}")
        if getattr(optimizer, "_p2psync_session", None) is not None:
            raise ConfigError(f"node {self.node_id}: this optimizer is already attached to a session")
        strategy_cls = get_strategy(self.cfg.strategy)  # what it needs of the optimizer, before joining
        check(strategy_cls.name, strategy_cls.needs, OptimizerInfo.of(optimizer))
        ckpt = self.ckpt
        if self.cfg.resume is not None and ckpt.loaded is None:  # --resume: this node's checkpoint
            self._load_own_checkpoint(self.cfg.resume, strategy_cls)
        if ckpt.loaded is not None:
            checkpoint.restore_local(ckpt.loaded, model, optimizer, source=ckpt.loaded_from)
            ckpt.restore_extras(ckpt.loaded.get("extra", {}))
            samples = ckpt.loaded.get("samples")
            self.gate.samples = samples if type(samples) is int and samples >= 0 else 0
        flat = FlatModel(model=model, optimizer=optimizer)
        own_step = optimizer.step
        schedulers = tuple(scheduler) if isinstance(scheduler, (list, tuple)) else \
            (scheduler,) if scheduler is not None else ()
        user = UserState(optimizer, schedulers=schedulers, scalers=(scaler,) if scaler is not None else ())
        if ckpt.loaded is not None and isinstance(ckpt.loaded.get("user_state"), dict):
            user.restore(ckpt.loaded["user_state"], absorb=False)  # schedulers made later: at the first step
        self.replica = HookedReplica(flat=flat, gate=self.gate, step=own_step, user_state=user)
        self.life.to(Phase.ATTACHING)
        try:
            self._call(self.driver.start(self.replica))
        except BaseException:
            self.replica = None
            self.life.close()
            self._shutdown_loop()
            self.life.to(Phase.CLOSED)
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
        self.ckpt.resuming = True
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
        self.ckpt.loaded_from = str(path)

    def _on_step(self, own_step: Callable[..., Any], closure: Callable[[], Any] | None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self.reports.pending_loss = float(loss)
        life = self.life
        if life.error is not None:
            raise life.error
        if life.over:
            if not self._warned_after_stop:
                self._warned_after_stop = True
                log.warning("node %d: the run has stopped (step %d): optimizer.step() no longer changes the "
                            "model (it stays the run's final one); end the loop when p2psync.should_stop() is true",
                            self.node_id, self.step)
            return loss
        samples, self.reports.pending_samples = self.reports.pending_samples, 0
        if self.replica is None:  # unreachable: step is hooked by attach, which sets the replica
            raise TrainingError("optimizer.step() hooked without a replica")
        self.replica.user_state.on_step()
        self._write_pending_checkpoint()
        if not self.replica.arrive(loss=self.reports.pending_loss, samples=samples):  # this node's own divergence
            self.driver.fail(Diverged(f"training diverged at step {self.step} on node {self.node_id}: its gradient "
                                      "holds NaN or infinity (nothing was sent; no peer is blamed)"))
            raise life.error  # type: ignore[misc]
        if life.error is not None:
            raise life.error
        return loss

    def _write_pending_checkpoint(self) -> None:
        """Write the checkpoint taken at the last step (see :meth:`Checkpoints.write_pending
        <p2psync.api.session_state.Checkpoints.write_pending>`)."""
        rt = self.runtime
        self.ckpt.write_pending(self.replica, rt.write_failures if rt is not None else None)

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This node's whole state, what ``--checkpoint-every`` writes (see
        :mod:`p2psync.api.checkpoint`): the step reached, the run it belongs to, the strategy's
        state, copies of the attached model's and optimizer's state, error feedback residuals,
        the RNG states and what :meth:`register_state` added. Call it on the training thread
        (between steps); the parts that background exchanges change (strategy state, residuals)
        are copied on the event loop. Save it with ``torch.save``, load it with
        ``weights_only=True``."""
        loop_part = (self._call(self.driver.loop_state_async()) if self._loop.is_running()
                     and threading.current_thread() is not self._thread else self.driver.loop_state())
        return self.ckpt.snapshot(loop_part, self.replica)

    def register_state(self, name: str, get: Callable[[], Any], set_: Callable[[Any], None]) -> None:
        """Script state that checkpoints carry under ``extra[name]`` (tensors, numbers, strings,
        lists, dicts), e.g. the data sampler's position: ``get()`` when one is written,
        ``set_(value)`` at :meth:`attach` when resuming. Register before :meth:`attach`.
        ``--checkpoint-every`` calls ``get()`` while the training thread is inside the
        ``optimizer.step()`` of the step it saves: count a batch as consumed when it is taken,
        before that call, so a resumed script does not take it again."""
        self.ckpt.register(name, get, set_)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (before :meth:`attach`, which puts the model, optimizer,
        RNG and registered state back): training resumes at its step."""
        if self.replica is not None:
            raise ConfigError("Session.load_state_dict: call it before attach()")
        self.ckpt.load(state)

    # -- the user's loop -----------------------------------------------------------------

    def log(self, **values: Any) -> None:
        """Report values of the current step: ``loss``, ``samples`` (batch size), ``accuracy``,
        ``test_loss`` and ``val_bpb`` (evaluations; the last ones are the final stats'
        ``final_accuracy``, ``final_test_loss``, ``final_val_bpb``), anything else goes into the
        metrics record as is."""
        reports = self.reports
        if "loss" in values:
            reports.pending_loss = float(values.pop("loss"))
        if "samples" in values:
            reports.pending_samples += int(values.pop("samples"))
        if "accuracy" in values:
            reports.last_accuracy = float(values["accuracy"])
        if "test_loss" in values:
            reports.last_test_loss = float(values["test_loss"])
        if "val_bpb" in values:
            reports.last_val_bpb = float(values["val_bpb"])
        reports.logged.update(values)

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
        return self.life.over

    def request_stop(self) -> None:
        """Ask the run to stop (agreed with the peers at the next step)."""
        self.driver.stop_requested.set()

    def close(self, *, graceful: bool = True) -> dict[str, Any]:
        """End this node: finish barrier, summary, sockets closed. Returns the node's stats.
        Raises the error that ended the run, if any. ``graceful=False`` (an exception or an
        interrupt in the user's code): no finish barrier, the sockets close at once."""
        if not self.life.close():
            return self.stats
        try:
            if self.replica is not None:
                self.gate.end()
                self._call(self.driver.finish(graceful))
        finally:
            self._shutdown_loop()
            self.life.to(Phase.CLOSED)
        if self.life.error is not None:
            raise self.life.error
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

    def _shutdown_loop(self) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


__all__ = ["Session"]

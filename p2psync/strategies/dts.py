"""DTS: delayed and temporally sparse updates with error compensation.

Paper: *Distributed Training Across the World*, Sec. 3.1 (delayed update), Sec. 3.2
(temporally sparse update), Sec. 3.3 (both), Table 1 (network requirements). The compensation
itself is pure and lives in :mod:`~p2psync.strategies.dts_state` (one normalized
rule, with the paper's errors corrected there).

Options (``--opt NAME=VALUE``):

* ``t`` (default 4): the delay. **t = 0 means no delay** (Table 1's and Eq. 12-13's
  convention); the paper's Eqs. 3/7/8 count one more (their t = 1 is SSGD), so ``t_Eq3 = t + 1``.
* ``p`` (default 4): the period of the temporally sparse update (windows of p steps).
* ``momentum_compensation`` (default on): compensate SGD's momentum buffers too (Eqs. 7, 8, 10,
  11, 13 corrected); off is the ablation that corrects the weights as if there were no
  momentum: the momentum part of each window's error is never corrected, so with momentum > 0
  the nodes do not end with one model (the flush aligns only what was compensated).

The momentum must stay constant during the run (a scheduler cycling it, like OneCycleLR's
default, is refused when it changes); learning rates may follow any schedule (§4 A11).

Only ``torch.optim.SGD`` without Nesterov and with dampening 0 is accepted (Adam is not linear
in the gradients, so "replace the local gradient by the average" has no closed form for it):
anything else is refused with a clear error at the start.

One step (after the user's backward, on the step hook): the local SGD step with the node's own
gradient (Eq. 2/4); the window accumulators; at a window's end its payload (``[A]`` vanilla,
``[g]`` for p = 1, ``[S, A]`` otherwise: Table 1's "4|w|"; two tensors are two concurrent
allreduces, so a top-k codec selects within each) starts averaging over the group in
the background, through the topology's collectives and the run's codec (``--codec topk:0.01``
is the paper's DGC setting), while the next iterations compute; exactly t steps after the
window's end its average is awaited (the only barrier: it does not block when the exchange
took less than t compute steps) and the correction is applied to the weights and the momentum
buffers. So at most ceil(t/p) exchanges are in flight.

Stopping: the stop flag rides with each window (an exact allreduce next to the payload's), so
every node learns a stop at the same iteration, the window's application point; with a step
budget (``--steps``) every node stops exactly at its last step (known in advance). At the stop
the window in progress is closed early and every window in flight is applied (the flush), so
every node ends with the same model (up to rounding; with a lossy codec, the same decoded
averages). A time limit (``--time``) or ``p2psync.request_stop()`` therefore ends the run up to
``p - 1 + t`` steps late.

Failures and views (docs/architecture.md, "Membership is a sequence of views"): every exchange runs over the
members of the view it started in, with the view epoch in its tag (``dts.win.<r>.e<epoch>``).
With ``--on-failure stop`` a failed peer ends the run with PeerFailure. With ``continue`` (the
default) a failed exchange or a newer view drops every window in flight *without applying any*
(never a half-applied correction: each node keeps its own local steps for them) and the members
of the new view re-synchronize: they average their whole state, weights and momentum buffers
(``dts.<k>.e<epoch>``, through :class:`~p2psync.strategies.regroup.Regroup`, which waits for
the newer view and redoes it over the survivors), and windows restart from the next iteration.
A joiner takes a live member's state first. Like SSGD's last step, the final flush cannot be
re-formed: a view change that lands during it ends the run with an error on the nodes whose
exchanges had not finished.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from p2psync import clock
from p2psync.collectives import OpId, OpStats
from p2psync.coordinator import View
from p2psync.errors import ConfigError, TrainingEnded
from p2psync.model import MODEL_BUFFERS, SGD_COMPENSATION
from p2psync.strategies.base import StepReport, Strategy, StrategyContext, mean_and_agree, register
from p2psync.strategies.needs import Needs
from p2psync.strategies.options import StrategyOptions, option
from p2psync.strategies.dts_state import DtsState, Window, max_in_flight, validate
from p2psync.strategies.failure import FailurePolicy
from p2psync.strategies.regroup import Regroup
from p2psync.tasks import cancel_all, wait_or_event
from p2psync.transport import Scope

log = logging.getLogger("p2psync.dts")

Exchange = tuple[np.ndarray, bool, OpStats]
#: windows in flight at most (each holds one or two model-sized local copies and an exchange)
MAX_IN_FLIGHT = 64


@dataclass
class _Flight:
    """One window whose average is on its way."""

    win: Window
    epoch: int
    tag: str
    task: asyncio.Task[Exchange]
    #: the receives of its exchange (the payload's and the flag's allreduces)
    scope: Scope


class _Broken(Exception):
    """A window's exchange failed or the view changed: re-synchronize."""


@dataclass(frozen=True)
class DTSOptions(StrategyOptions):
    """``--opt`` options of ``--strategy dts`` (see the module docstring)."""

    t: int = option(4, "delay in steps: a window's average is applied t steps after it closes (0: no delay)")
    p: int = option(4, "temporal sparsity: average once per window of p steps")
    momentum_compensation: bool = option(True, "correct SGD's momentum buffers too (off: ablation)")

    def __post_init__(self) -> None:
        validate(self.t, self.p, 0.0)
        if max_in_flight(self.t, self.p) > MAX_IN_FLIGHT:
            raise ConfigError(f"dts: t={self.t}, p={self.p} would keep {max_in_flight(self.t, self.p)} exchanges "
                              f"in flight (ceil(t/p)); at most {MAX_IN_FLIGHT}: raise p or lower t")


@register
class DTS(Strategy):
    """``--strategy dts``: delayed, temporally sparse averaging with compensation (see the
    module docstring)."""

    name = "dts"
    requires = (SGD_COMPENSATION, MODEL_BUFFERS)
    needs = Needs(optimizer="plain_sgd",
                  schedules="honoured: the lr is read at every local step (momentum must stay constant)",
                  buffers="each node's own; whole-state averages (re-forms) take the lowest member's (--buffers)",
                  why="its error compensation replays SGD's own arithmetic (u = mu u + g + wd w, "
                      "w -= lr u) on the delayed average of weights and momentum; it is exact only for an update linear in "
                      "the gradients with those coefficients, which Nesterov, dampening and adaptive "
                      "optimizers are not")
    Options = DTSOptions
    opts: DTSOptions
    failure: FailurePolicy

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.t = self.opts.t
        self.p = self.opts.p
        self.regroup = Regroup(ctx=ctx, name="dts")
        #: the failure policy (re-form or stop) the step driver applies, shared with the regroup
        self.failure = self.regroup.failure
        self.momentum = 0.0
        self.opt_momentum = 0.0
        self.state: DtsState | None = None
        self.flights: dict[int, _Flight] = {}
        self.epoch = self.failure.view().epoch
        self.resyncs = 0  # re-synchronizations done (the same count on every member)
        self._resync_due = False
        self._want_stop = False
        self.windows_sent = 0
        self.windows_applied = 0
        self.windows_dropped = 0
        self.max_flight = 0
        #: windows whose exchange had not finished when they were due (the step blocked; the
        #: final flush, which waits for every window in flight, is not counted)
        self.blocked = 0

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        hyper = await SGD_COMPENSATION.of(self.ctx.replica).sgd_hyper()  # refuses Adam, Nesterov, dampening
        self.opt_momentum = hyper.momentum
        self.momentum = hyper.momentum if self.opts.momentum_compensation else 0.0
        validate(self.t, self.p, self.momentum)
        if self.ctx.joining:  # a live member's state, then its re-sync (which gives the step)
            self.resyncs = await self.regroup.join()
            self._resync_due = True

    def on_peer_failure(self, peer: int) -> None:
        self.failure.on_peer_failure(peer)

    def on_view(self, view: View) -> None:
        self.regroup.on_view(view)

    async def close(self) -> None:
        await self._drop_flights()

    def state_dict(self) -> dict[str, Any]:
        """Whether the node's model is in sync with its peers' right now: a checkpoint taken
        with windows in flight or in progress holds this node's own local steps, so the nodes
        of a resumed run hold different models until they re-synchronize."""
        pending = self.state is not None and (self.state.in_flight > 0 or self.state.in_progress)
        return {"t": self.t, "p": self.p, "in_sync": not pending, "resyncs": self.resyncs}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resuming: if the checkpoint was not taken in sync, the members average their whole
        state at the first step (every node loaded its own checkpoint)."""
        if not state.get("in_sync", True):
            self._resync_due = True

    # -- one step ------------------------------------------------------------------------

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        if self.state is None:
            self.state = DtsState(t=self.t, p=self.p, momentum=self.momentum, base=step)
        try:
            loss, grad = await self.ctx.replica.compute_gradients()
        except TrainingEnded:
            await self._settle()
            raise
        stepped = await SGD_COMPENSATION.of(self.ctx.replica).sgd_step(grad)  # the local step (Eq. 2/4)
        if stepped.hyper.momentum != self.opt_momentum:
            raise ConfigError(f"dts: the optimizer's momentum changed from {self.opt_momentum} to "
                              f"{stepped.hyper.momentum} (a scheduler cycling momentum, e.g. OneCycleLR): "
                              "the compensation assumes a constant momentum (cycle_momentum=False)")
        self._want_stop = self._want_stop or want_stop
        win = self.state.step(step, stepped.grad, stepped.hyper.lr)
        t0 = clock.now()
        extra: dict[str, Any] = {}
        next_step: int | None = None
        stop = self.ctx.max_steps is not None and step + 1 >= self.ctx.max_steps
        try:
            if self._resync_due:
                raise _Broken("joined the run, or resumed from a checkpoint taken between syncs")
            if self.failure.view().epoch != self.epoch:
                raise _Broken(f"view {self.ctx.epoch} replaced view {self.epoch}")
            r = self.state.due(step)
            # the window due is applied before the one closing now is launched (unless it is
            # that one, t = 0): at most ceil(t/p) exchanges are ever in flight
            if r is not None and (win is None or r != win.index):
                stop = await self._apply_due(r, step, extra) or stop
            if win is not None:
                self._launch(win)
            if r is not None and win is not None and r == win.index:
                stop = await self._apply_due(r, step, extra) or stop
            if stop:
                await self._flush(step)
        except _Broken as why:
            next_step = await self._resync(step, str(why))
            # every member agreed on the step and holds the same state: stop together there
            go_on = step + 1 if next_step is None else next_step
            stop = self.ctx.max_steps is not None and go_on >= self.ctx.max_steps
        wait = clock.now() - t0
        return StepReport(loss=loss, stop=stop, comm_s=wait, wait_s=wait, extra={
            **extra, "in_flight": len(self.flights), "windows_sent": self.windows_sent,
            "windows_applied": self.windows_applied, "blocked": self.blocked, "resyncs": self.resyncs,
            "members": len(self.ctx.group)}, next_step=next_step)

    # -- windows -------------------------------------------------------------------------

    async def _apply_due(self, r: int, step: int, extra: dict[str, Any]) -> bool:
        flag, st = await self._apply(self.flights.pop(r), step)
        extra.update(compression=round(st.compression, 3), op_nic_bytes=st.nic_bytes)
        return flag

    def _launch(self, win: Window) -> None:
        if self.state is None:
            return
        view = self.failure.view()
        # the re-sync count keeps a window's tag unique when windows restart within one view
        op = OpId("dts.win", (self.resyncs, win.index), self.epoch)
        tag = op.tag
        first, *more = self.state.payload_parts(win)
        scope = self.ctx.transport.scope(op.root)
        coro = mean_and_agree(self.ctx.collectives, first, self._want_stop, tag=tag, group=view.members,
                              more=more, feedback=("dts", "window"))
        task = asyncio.get_running_loop().create_task(coro, name=f"p2psync-{tag}")
        self.flights[win.index] = _Flight(win=win, epoch=self.epoch, tag=tag, task=task, scope=scope)
        self.windows_sent += 1
        self.max_flight = max(self.max_flight, len(self.flights))

    async def _apply(self, fl: _Flight, step: int, *, flush: bool = False) -> tuple[bool, OpStats]:
        """Wait for a window's average and apply its correction after iteration ``step``."""
        if self.state is None:
            raise _Broken("no state")
        if not fl.task.done() and not flush:
            self.blocked += 1
        try:
            avg, flag, st = await self._await(fl)
        except BaseException:  # kept so that close() or the re-sync cancels and reaps it
            self.flights[fl.win.index] = fl
            raise
        fl.scope.close()
        dw, du = self.state.correction(fl.win, avg, step)
        await SGD_COMPENSATION.of(self.ctx.replica).correct(dw, du)
        self.windows_applied += 1
        return flag, st

    async def _await(self, fl: _Flight) -> Exchange:
        """The average of window ``fl``, under the failure policy. Once: the exchange's result
        or its error (a failed peer's PeerFailure: Stop aborts its receives). Re-forming:
        :class:`_Broken` when a newer view comes first or the exchange fails with an error the
        policy recovers from."""

        async def once(_: View) -> Exchange:
            return await fl.task

        return await self.failure.run(once, lambda: self._await_reforming(fl))

    async def _await_reforming(self, fl: _Flight) -> Exchange:
        if self.ctx.epoch == fl.epoch:
            await wait_or_event(fl.task, self.regroup.next_view)
        if not fl.task.done():
            raise _Broken(f"view {self.ctx.epoch} replaced view {fl.epoch} during window {fl.win.index}")
        exc = fl.task.exception()
        if exc is None:
            return fl.task.result()
        if self.failure.recovers(exc):
            raise _Broken(f"window {fl.win.index} failed: {exc}")
        raise exc

    async def _flush(self, step: int) -> None:
        """End of training: close the window in progress and apply every window in flight."""
        if self.state is None:
            return
        win = self.state.close_partial(step)
        if win is not None:
            self._launch(win)
        for r in sorted(self.flights):
            await self._apply(self.flights.pop(r), step, flush=True)

    async def _settle(self) -> None:
        """The user's loop ended without an agreed stop (the node leaves the run): finish the
        exchanges already started, which the peers are running with this node, and apply
        them; the window in progress is not sent (peers whose loops go on re-sync without
        this node)."""
        if self.state is None:
            return
        try:
            for r in sorted(self.flights):
                await self._apply(self.flights.pop(r), self.state.last, flush=True)
        except _Broken:
            await self._drop_flights()

    async def _drop_flights(self) -> None:
        """Cancel every window in flight; none of them is applied (the node keeps its own local
        steps for them) and their pieces still on their way are dropped."""
        flights = list(self.flights.values())
        self.flights.clear()
        await cancel_all(fl.task for fl in flights)
        for fl in flights:
            fl.scope.retire()  # its pieces still on their way are dropped
        if self.state is not None:
            self.windows_dropped += len(self.state.pending)

    async def _resync(self, step: int, why: str) -> int | None:
        """Members of the current view average their whole state and agree on the step they
        go on at (the highest one's next, so a joiner or a node that ran ahead by up to t
        steps lines up); windows restart there (see the module docstring). Returns the step
        the loop goes on at when it is not ``step + 1``."""
        log.warning("node %d: DTS re-synchronizes after step %d (%s)", self.ctx.node_id, step, why)
        await self._drop_flights()
        self.resyncs, go_on, _ = await self.regroup.average_state(self.resyncs, step)
        self._resync_due = False
        self.epoch = self.ctx.epoch
        self.state = DtsState(t=self.t, p=self.p, momentum=self.momentum, base=go_on)
        return go_on if go_on != step + 1 else None

"""SSGD: synchronous data parallel, the baseline every algorithm is compared with.

Each step every node computes its gradient on its own batch, the gradients are averaged across
the training group with piece-level allreduces (the topology's own plan: ring, mesh, BCube,
star; a tree for a group of survivors that no ring covers), and every node applies the same
averaged gradient. With equal batch sizes this is exactly SGD on the union of the nodes'
batches, and the replicas stay bitwise identical — buffers included: the model's buffers
(BatchNorm statistics) follow ``--buffers`` (strategies/buffers.py) at every step.

When the gradient is averaged (``--opt sync=``):

* ``backward`` (default where the replica has gradient-ready hooks, i.e. every ``attach``
  run): as in torch's DDP, during ``loss.backward()``. Gradients go out in buckets as soon as
  backward produced them (overlapping the rest of backward), and backward returns with the
  group's mean in ``.grad`` (strategies/backward_sync.py). What the user's code sees between
  ``backward()`` and ``optimizer.step()`` — clipping, a scaler's ``unscale_``, logged norms —
  is the mean; ``step()`` then steps with ``.grad`` as the user left it. Several backward
  passes per step (gradient accumulation) are averaged each (the sum of means is the mean of
  sums); ``p2psync.no_sync()`` skips the passes before the last, as DDP's ``no_sync``.
* ``step``: at ``optimizer.step()``, from the gradient as it is then (after the user's
  clipping, which therefore saw the local gradient). A step whose backward averaging failed
  (a member died, a newer view) is redone this way over the survivors.

The stop decision is agreed on in the same step (an exact allreduce next to the gradient's, see
:func:`~p2psync.strategies.base.mean_and_agree`), so all nodes stop at the same step even with
``--time`` and with any codec.

Leaving and joining (:mod:`~p2psync.strategies.regroup`): the group is the current view's
members and the tag carries the view epoch (``ssgd.<step>.e<epoch>``). With
``--on-failure continue`` (default) a step whose allreduce fails is abandoned without applying
anything and redone over the survivors once the view drops the failed peer; a survivor that
fell a step behind, or a joiner, adopts the state of the lowest-id member at the highest step
at the start of that step, so every member ends bitwise equal. With ``--on-failure stop`` a
failed peer ends the run with :class:`PeerFailure` naming it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np

from p2psync import clock
from p2psync.collectives import OpId, OpStats
from p2psync.coordinator import View
from p2psync.errors import ConfigError
from p2psync.strategies.backward_sync import BackwardAverager, BackwardHooks
from p2psync.strategies.base import StepReport, Strategy, StrategyContext, mean_and_agree, register
from p2psync.model import MODEL_BUFFERS, Buffers
from p2psync.strategies.buffers import alongside, own_buffers
from p2psync.strategies.needs import Needs
from p2psync.strategies.options import StrategyOptions, option
from p2psync.strategies.failure import FailurePolicy
from p2psync.strategies.regroup import Adopted, Regroup

log = logging.getLogger("p2psync.ssgd")


@dataclass(frozen=True)
class SSGDOptions(StrategyOptions):
    """``--opt`` options of ``--strategy ssgd`` (see the module docstring)."""

    sync: Literal["backward", "step"] = option(
        "backward", "average gradients during backward, as DDP (backward) or at optimizer.step() (step)")
    bucket_kib: int = option(4096, "backward: gradient bytes per bucket (the first bucket is a quarter)")

    def __post_init__(self) -> None:
        if self.bucket_kib <= 0:
            raise ConfigError("--opt bucket_kib: must be a positive number of KiB")


@register
class SSGD(Strategy):
    """``--strategy ssgd``: one averaged gradient per step over the training group (see the
    module docstring); the smallest complete :class:`~p2psync.strategies.base.Strategy`."""

    name = "ssgd"
    requires = (MODEL_BUFFERS,)
    Options = SSGDOptions
    opts: SSGDOptions
    failure: FailurePolicy
    needs = Needs(clipping="clips the group's mean gradient: backward returns with it, as DDP (--opt sync=step: "
                           "this node's own, averaged at optimizer.step())",
                  buffers="the lowest member's at every step (--buffers broadcast; average: the mean)")
    identical_replicas = "every_step"

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.regroup = Regroup(ctx=ctx, name="ssgd")
        #: the failure policy (re-form or stop) the step driver applies, shared with the regroup
        self.failure = self.regroup.failure
        self.backward: BackwardAverager | None = None
        self._hooks: BackwardHooks | None = None  # the replica, when it averages during backward
        self._warned_redo = False

    async def start(self) -> None:
        if self.ctx.joining:
            self.start_step = await self.regroup.join()
        replica = self.ctx.replica
        if self.opts.sync == "backward" and isinstance(replica, BackwardHooks):
            self.backward = BackwardAverager(ctx=self.ctx, name="ssgd", bucket_bytes=self.opts.bucket_kib * 1024,
                                             sizes=replica.param_sizes())
            await replica.enable_backward_sync(self.backward)
            self._hooks = replica

    def on_peer_failure(self, peer: int) -> None:
        self.regroup.on_peer_failure(peer)
        if self.backward is not None:
            self.backward.on_peer_failure(peer)

    def on_view(self, view: View) -> None:
        self.regroup.on_view(view)
        if self.backward is not None:
            self.backward.on_view(view)

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        bw = self.backward
        armed = False
        if bw is not None:
            got = await self._arm(bw, step, want_stop)
            if isinstance(got, Adopted):
                return StepReport(loss=float("nan"), next_step=got.step,
                                  extra={"adopted": True, "members": len(self.ctx.group)})
            armed = got
        loss, grad = await self.ctx.replica.compute_gradients()
        t0 = clock.now()
        failed_at: float | None = None
        if bw is not None and armed:
            done = await bw.outcome(step)
            if done is not None and self._hooks is not None:
                # averaged during backward: step with .grad as the user left it (what ``grad``
                # holds too: freed first, the optimizer's step needs the memory)
                del grad
                await self._hooks.step_as_is()
                return StepReport(loss=loss, stop=done.stop, comm_s=clock.now() - t0 + done.comm_s,
                                  extra={"compression": round(done.compression, 3), "op_nic_bytes": done.nic_bytes,
                                         "members": len(self.ctx.group), "reforms": self.regroup.reformations,
                                         "passes": done.passes})
            failed_at = bw.failed_at if bw.failed_at is not None else clock.now()
            if not self._warned_redo:
                self._warned_redo = True
                log.warning("node %d: ssgd step %d: the gradient could not be averaged during backward (a member "
                            "failed or the view changed); redone at optimizer.step() over the survivors, so code "
                            "between backward() and step() saw this node's own gradient in that step",
                            self.ctx.node_id, step)
        elif bw is not None:
            await bw.outcome(step)
        mine = await own_buffers(MODEL_BUFFERS.of(self.ctx.replica), self.ctx.buffers)
        out = await self.regroup.run(step, lambda v: self._average(v, step, grad, want_stop, mine),
                                     failed_at=failed_at)
        comm = clock.now() - t0
        if out is None or isinstance(out, Adopted):  # our gradient was for a step we skipped
            return StepReport(loss=loss, comm_s=comm, next_step=out.step if out else step + 1,
                              extra={"adopted": True, "members": len(self.ctx.group)})
        mean, stop, st, bufs = out
        await self.ctx.replica.apply_gradients(mean)
        if bufs is not None:
            await MODEL_BUFFERS.of(self.ctx.replica).set_buffers(bufs)
        if stop and bw is not None:
            bw.close()
        return StepReport(loss=loss, stop=stop, comm_s=comm,
                          extra={"compression": round(st.compression, 3), "op_nic_bytes": st.nic_bytes,
                                 "members": len(self.ctx.group), "reforms": self.regroup.reformations})

    async def close(self) -> None:
        if self.backward is not None:
            self.backward.close()

    async def _arm(self, bw: BackwardAverager, step: int, want_stop: bool) -> Adopted | bool:
        """Let the backward passes of ``step`` be averaged over the current view, once its
        members agree on their state (a new epoch's sync; a node behind adopts instead).
        False: this step runs the plain averaging at ``optimizer.step()`` on every member
        (the first step of a sync that a member redoes, adopts or joins at:
        :func:`~p2psync.strategies.regroup.backward_from`); its backward passes stay local."""
        got = await self.regroup.prepare(step)
        if isinstance(got, Adopted):
            return got
        if got is None:
            bw.pass_through(step)
            return False
        bw.arm(step, want_stop, got)
        return True

    async def _average(self, v: View, step: int, grad: np.ndarray, want_stop: bool,
                       mine: Buffers | None) -> tuple[np.ndarray, bool, OpStats, Buffers | None]:
        tag = OpId("ssgd", step, v.epoch).tag
        coll = self.ctx.collectives
        (mean, stop, st), bufs = await alongside(mean_and_agree(coll, grad, want_stop, tag=tag, group=v.members,
                                                                feedback=("ssgd", "grad")),
                                                 coll, mine, self.ctx.buffers, tag=tag, group=v.members)
        return mean, stop, st, bufs

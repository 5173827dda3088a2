"""SSGD: synchronous data parallel, the baseline every algorithm is compared with.

Each step every node computes its gradient on its own batch, the gradients are averaged across
the training group with one piece-level allreduce (the topology's own plan: ring, mesh, BCube,
star; a tree for a group of survivors that no ring covers), and every node applies the same
averaged gradient. With equal batch sizes this is exactly SGD on the union of the nodes'
batches, and the replicas stay bitwise identical.

The stop decision is agreed on in the same step (an exact allreduce next to the gradient's, see
:func:`~p2psync.strategies.base.mean_and_agree`), so all nodes stop at the same step even with
``--time`` and with any codec.

Leaving and joining (issue 10 item 5, :mod:`~p2psync.strategies.regroup`): the group is the
current view's members and the tag carries the view epoch (``ssgd.<step>.e<epoch>``). With
``--on-failure continue`` (default) a step whose allreduce fails is abandoned without applying
anything and redone over the survivors once the view drops the failed peer; a survivor that
fell a step behind, or a joiner, adopts the state of the lowest-id member at the highest step
at the start of that step, so every member ends bitwise equal. With ``--on-failure stop`` a
failed peer ends the run with :class:`PeerFailure` naming it.
"""

from __future__ import annotations

import time

from p2psync.coordinator import View
from p2psync.strategies.base import StepReport, Strategy, StrategyContext, mean_and_agree, register
from p2psync.strategies.regroup import Adopted, Regroup


@register
class SSGD(Strategy):
    """``--strategy ssgd``: one averaged gradient per step over the training group (see the
    module docstring); the smallest complete :class:`~p2psync.strategies.base.Strategy`."""

    name = "ssgd"

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.regroup = Regroup(ctx=ctx, name="ssgd")

    async def start(self) -> None:
        if self.ctx.joining:
            self.start_step = await self.regroup.join()

    def on_peer_failure(self, peer: int) -> None:
        self.regroup.on_peer_failure(peer)

    def on_view(self, view: View) -> None:
        self.regroup.on_view(view)

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        self.regroup.check()
        loss, grad = await self.ctx.replica.compute_gradients()
        t0 = time.perf_counter()
        coll = self.ctx.collectives
        out = await self.regroup.run(step, lambda v: mean_and_agree(
            coll, grad, want_stop, tag=f"ssgd.{step}.e{v.epoch}", group=v.members))
        comm = time.perf_counter() - t0
        if out is None or isinstance(out, Adopted):  # our gradient was for a step we skipped
            return StepReport(loss=loss, comm_s=comm, next_step=out.step if out else step + 1,
                              extra={"adopted": True, "members": len(self.ctx.group)})
        mean, stop, st = out
        await self.ctx.replica.apply_gradients(mean)
        return StepReport(loss=loss, stop=stop, comm_s=comm,
                          extra={"compression": round(st.compression, 3), "op_nic_bytes": st.nic_bytes,
                                 "members": len(self.ctx.group), "reforms": self.regroup.reforms})

"""SSGD: synchronous data parallel, the baseline every algorithm is compared with.

Each step every node computes its gradient on its own batch, the gradients are averaged across
all nodes with one piece-level allreduce (the topology's own plan: ring, mesh, BCube, star),
and every node applies the same averaged gradient. With equal batch sizes this is exactly SGD on
the union of the nodes' batches, and the replicas stay bitwise identical.

The stop decision is agreed on in the same step (an exact allreduce next to the gradient's, see
:func:`~p2psync.strategies.base.mean_and_agree`), so all nodes stop at the same step even with
``--time`` and with any codec. A failed peer ends the run with :class:`PeerFailure` naming it:
synchronous training cannot proceed without it, and silently continuing would change the
algorithm.
"""

from __future__ import annotations

import time

from p2psync.strategies.base import FailStop, StepReport, Strategy, mean_and_agree, register


@register
class SSGD(Strategy):
    name = "ssgd"

    async def start(self) -> None:
        self.failstop = FailStop(self.ctx, "ssgd", "ssgd.")

    def on_peer_failure(self, peer: int) -> None:
        self.failstop.on_peer_failure(peer)

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        self.failstop.check()
        loss, grad = await self.ctx.replica.compute_gradients()
        t0 = time.perf_counter()
        mean, stop, st = await mean_and_agree(self.ctx.collectives, grad, want_stop, tag=f"ssgd.{step}")
        comm = time.perf_counter() - t0
        self.failstop.check()
        await self.ctx.replica.apply_gradients(mean)
        return StepReport(loss=loss, stop=stop, comm_s=comm,
                          extra={"compression": round(st.compression, 3), "op_nic_bytes": st.nic_bytes})

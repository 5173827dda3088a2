"""SSGD: synchronous data parallel, the baseline every algorithm is compared with.

Each step every node computes its gradient on its own batch, the gradients are averaged across
all nodes with one piece-level allreduce (the topology's own plan: ring, mesh, BCube, star),
and every node applies the same averaged gradient. With equal batch sizes this is exactly SGD on
the union of the nodes' batches, and the replicas stay bitwise identical.

The stop decision rides in the same allreduce (one extra element), so all nodes stop at the same
step even with ``--time``. A failed peer ends the run with :class:`PeerFailure` naming it:
synchronous training cannot proceed without it, and silently continuing would change the
algorithm.
"""

from __future__ import annotations

import time

import numpy as np

from p2psync.strategies.base import FailStop, StepReport, Strategy, register


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
        vec = np.empty(grad.size + 1, dtype=np.float32)
        vec[:-1] = grad
        vec[-1] = 1.0 if want_stop else 0.0
        t0 = time.perf_counter()
        out = await self.ctx.collectives.allreduce(vec, op="mean", tag=f"ssgd.{step}")
        comm = time.perf_counter() - t0
        self.failstop.check()
        await self.ctx.replica.apply_gradients(out[:-1])
        st = self.ctx.collectives.history[-1]
        return StepReport(loss=loss, stop=bool(out[-1] > 0), comm_s=comm,
                          extra={"compression": round(st.compression, 3), "op_nic_bytes": st.nic_bytes})

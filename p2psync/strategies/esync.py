"""ESync (../shared/papers/esync.md): local iterations sized by a State Server, one aggregation
of model deltas per round.

Round t (Alg. 1, Eq. 4-8): every node starts from the same global weights w_t, runs n_i local
iterations with the run's optimizer (momentum buffers stay local), then the deltas
dw_i = w_{t,n_i}^i - w_t are averaged with one allreduce and w_{t+1} = w_t + eps * mean(dw)
(``global_lr`` = eps, default 1). n_i is never told to a node: before every local iteration it
asks the State Server (hosted by the coordinator, Alg. 2) QUERY-STATE and aggregates only on
READY; after aggregating it calls RESET-STATE-SERVER. Before the first round a batch test
measures the node's capability (Alg. 1 line 3).

``mode=blocking`` waits for each answer. ``mode=nonblocking`` (default, §4.2): capability is
the iteration time plus the query's round-trip time; the node keeps training while the answer
is in flight (implicit NOT-READY); when READY arrives it abandons the iteration in progress
(its gradient is discarded) and aggregates the iterations completed so far.

The stop decision rides in the aggregation (one extra element), so every node stops after the
same round. A failed peer ends the run with PeerFailure naming it, like SSGD: the aggregation
needs every node, and re-weighting the mean over survivors mid-round would change Eq. 7.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from p2psync.coordinator.rpc import RpcServer
from p2psync.coordinator.state_server import StateServerService
from p2psync.errors import ConfigError
from p2psync.strategies.base import FailStop, StepReport, Strategy, register
from p2psync.topology import Topology


@register
class ESync(Strategy):
    name = "esync"
    options = {"mode": (str, "nonblocking", "blocking or nonblocking (delayed ACK, §4.2)"),
               "global_lr": (float, 1.0, "eps of Eq. 8"),
               "margin": (float, 0.002, "State Server boundary constant (s), Alg. 2 line 9"),
               "query_timeout": (float, 10.0, "seconds before a State Server query fails")}

    @classmethod
    def coordinator_services(cls, server: RpcServer, topology: Topology, options: dict) -> None:
        margin = float(options.get("margin", cls.options["margin"][1]))
        StateServerService(server, topology.ids, epsilon=margin)

    async def start(self) -> None:
        if self.opts["mode"] not in ("blocking", "nonblocking"):
            raise ConfigError(f"esync mode must be blocking or nonblocking, not {self.opts['mode']!r}")
        self.failstop = FailStop(self.ctx, "esync", "esync.")
        self.round = 0
        self.rtt = 0.0
        self.coord = self.ctx.topology.coordinator
        # Alg. 1 line 3: RUN-BATCH-DATA-TEST measures the capability (gradient discarded)
        t0 = time.perf_counter()
        await self.ctx.replica.compute_gradients()
        self.c = time.perf_counter() - t0
        # everyone starts round 0 together (a slow device's batch test takes longer)
        await self.ctx.collectives.allreduce(np.zeros(1, np.float32), tag="esync.start")
        self.t_e = time.monotonic()

    def on_peer_failure(self, peer: int) -> None:
        self.failstop.on_peer_failure(peer)

    async def _query(self, k: int) -> bool:
        t0 = time.monotonic()
        rep = await self.ctx.rpc.call(self.coord, "esync.query", {
            "k": k, "c": self.c + (self.rtt if self.opts["mode"] == "nonblocking" else 0.0),
            "age": max(0.0, t0 - self.t_e), "rtt": self.rtt}, timeout=self.opts["query_timeout"])
        self.rtt = time.monotonic() - t0
        return bool(rep["ready"])

    async def _finish_iteration(self, t_s: float, loss: float, grad: np.ndarray) -> float:
        """Apply the iteration's gradient (Alg. 1 line 13) and record t_e and c (lines 14-15)."""
        await self.ctx.replica.apply_gradients(grad)
        self.t_e = time.monotonic()
        self.c = self.t_e - t_s
        return loss

    async def _local_iteration(self) -> float:
        t_s = time.monotonic()
        return await self._finish_iteration(t_s, *await self.ctx.replica.compute_gradients())

    async def _blocking(self) -> list[float]:
        losses: list[float] = []
        while not await self._query(len(losses)):
            self.failstop.check()
            losses.append(await self._local_iteration())
        return losses

    async def _nonblocking(self) -> list[float]:
        losses: list[float] = []
        query: asyncio.Task[bool] | None = None
        while True:
            self.failstop.check()
            if query is None:
                query = asyncio.create_task(self._query(len(losses)))
            if query.done():
                if query.result():
                    return losses
                query = None
                continue
            t_s = time.monotonic()
            grads = asyncio.create_task(self.ctx.replica.compute_gradients())
            await asyncio.wait({query, grads}, return_when=asyncio.FIRST_COMPLETED)
            if query.done() and query.result():
                # READY: abandon the iteration in flight; aggregate what is complete
                grads.add_done_callback(lambda t: t.cancelled() or t.exception())
                return losses
            losses.append(await self._finish_iteration(t_s, *await grads))

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        self.failstop.check()
        w_t = await self.ctx.replica.get_params()
        t0 = time.monotonic()
        if self.opts["mode"] == "blocking":
            losses = await self._blocking()
        else:
            losses = await self._nonblocking()
        local_s = time.monotonic() - t0
        w = await self.ctx.replica.get_params()
        vec = np.empty(w.size + 1, dtype=np.float32)
        vec[:-1] = w - w_t  # Eq. 6
        vec[-1] = 1.0 if want_stop else 0.0
        t1 = time.monotonic()
        mean = await self.ctx.collectives.allreduce(vec, op="mean", tag=f"esync.{step}")  # Eq. 7
        blocking = time.monotonic() - t1
        self.failstop.check()
        await self.ctx.replica.set_params(w_t + np.float32(self.opts["global_lr"]) * mean[:-1])  # Eq. 8
        self.round += 1
        t_r = time.monotonic()
        await self.ctx.rpc.call(self.coord, "esync.reset", {"round": self.round, "rtt": self.rtt},
                                timeout=self.opts["query_timeout"])
        self.t_e = t_r
        return StepReport(loss=float(np.mean(losses)) if losses else float("nan"), stop=bool(mean[-1] > 0),
                          comm_s=blocking, wait_s=blocking, extra={
                              "n_local": len(losses), "local_s": round(local_s, 4),
                              "blocking_s": round(blocking, 4), "query_rtt_s": round(self.rtt, 5),
                              "round": self.round,
                              "op_nic_bytes": self.ctx.collectives.history[-1].nic_bytes,
                              "compression": round(self.ctx.collectives.history[-1].compression, 3)})

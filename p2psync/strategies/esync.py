"""ESync (../shared/papers/esync.md): local iterations sized by a State Server, one aggregation
of model deltas per round.

Round t (Alg. 1, Eq. 4-8): every node starts from the same global weights w_t, runs n_i local
iterations with the run's optimizer (momentum buffers stay local), then the deltas
dw_i = w_{t,n_i}^i - w_t are averaged with one allreduce and w_{t+1} = w_t + eps * mean(dw)
(``global_lr`` = eps, default 1). n_i is never told to a node: before every local iteration it
asks the State Server (hosted by the coordinator, Alg. 2) QUERY-STATE and aggregates only on
READY; after aggregating it calls RESET-STATE-SERVER. Before the first round a batch test
measures the node's capability (Alg. 1 line 3).

``mode=blocking`` waits for each answer. ``mode=nonblocking`` (default, §4.2, "delayed ACK"):
capability is the iteration time plus the query's round-trip time; every local iteration sends
its own query as it starts, without waiting for earlier answers, so with an RTT of several
iterations several queries are in flight; silence counts as NOT-READY and the node keeps
training. When a READY arrives (the answer to the k-th iteration's query) the node abandons the
iteration in progress at once (§4.2: "aborts the current (k + delta)-th iteration
immediately"): the compute job is cut short through an abort event (between forward and
backward, and throughout the emulated device time), its batch is not consumed and its samples
are not counted, and the aggregation of the iterations completed so far starts within about one
RTT of the decision, not after the abandoned computation. The answers still in flight are
collected during the aggregation (no late reply is left behind) before RESET-STATE-SERVER.

The stop decision is agreed on next to the aggregation, exactly (never through a lossy codec;
:func:`~p2psync.strategies.base.mean_and_agree`), so every node stops after the same round. A failed peer ends the run with PeerFailure naming it, like SSGD: the aggregation
needs every node, and re-weighting the mean over survivors mid-round would change Eq. 7.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from p2psync.coordinator.rpc import RpcServer
from p2psync.coordinator.state_server import StateServerService
from p2psync.errors import Aborted, ConfigError, P2PSyncError
from p2psync.strategies.base import (FailStop, StepReport, Strategy, StrategyContext, mean_and_agree,
                                     register)
from p2psync.topology import Topology


@register
class ESync(Strategy):
    name = "esync"
    options = {"mode": (str, "nonblocking", "blocking or nonblocking (delayed ACK, §4.2)"),
               "global_lr": (float, 1.0, "eps of Eq. 8"),
               "margin": (float, 0.002, "State Server boundary constant (s), Alg. 2 line 9"),
               "query_timeout": (float, 10.0, "seconds before a State Server query fails")}

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self._queries: set[asyncio.Task[None]] = set()

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
        # at the current coordinator (ctx.coordinator), retried there if it moves; "round" lets
        # a State Server rebuilt after a takeover learn where this device is
        rep = await self.ctx.membership.call_coordinator("esync.query", {
            "k": k, "c": self.c + (self.rtt if self.opts["mode"] == "nonblocking" else 0.0),
            "age": max(0.0, t0 - self.t_e), "rtt": self.rtt, "round": self.round},
            timeout=self.opts["query_timeout"])
        self.rtt = time.monotonic() - t0
        return bool(rep["ready"])

    async def _finish_iteration(self, t_s: float, loss: float, grad: np.ndarray) -> float:
        """Apply the iteration's gradient (Alg. 1 line 13) and record t_e and c (lines 14-15)."""
        await self.ctx.replica.apply_gradients(grad)
        self.t_e = time.monotonic()
        self.c = self.t_e - t_s
        return loss

    async def _blocking(self) -> tuple[list[float], int]:
        losses: list[float] = []
        while not await self._query(len(losses)):
            self.failstop.check()
            t_s = time.monotonic()
            losses.append(await self._finish_iteration(t_s, *await self.ctx.replica.compute_gradients()))
        return losses, 0

    def _ask(self, k: int, signal: asyncio.Event, ready: list[bool], errors: list[BaseException]) -> None:
        """Send the k-th iteration's query without waiting for it (§4.2); a READY answer or a
        failed query is recorded and sets ``signal``."""
        async def ask() -> None:
            try:
                if await self._query(k):
                    ready.append(True)
            except P2PSyncError as exc:
                errors.append(exc)
            finally:
                signal.set()
        task = asyncio.ensure_future(ask())
        self._queries.add(task)
        task.add_done_callback(self._queries.discard)

    async def _nonblocking(self) -> tuple[list[float], int]:
        """Local iterations until a READY answer; returns (losses, abandoned iterations)."""
        losses: list[float] = []
        ready: list[bool] = []
        errors: list[BaseException] = []
        signal = asyncio.Event()
        while True:
            self.failstop.check()
            if errors:
                raise errors[0]
            if ready:
                return losses, 0
            self._ask(len(losses), signal, ready, errors)
            abort = threading.Event()
            t_s = time.monotonic()
            it = asyncio.ensure_future(self.ctx.replica.compute_gradients(abort))
            while not it.done() and not ready and not errors:
                signal.clear()
                woke = asyncio.ensure_future(signal.wait())
                await asyncio.wait({it, woke}, return_when=asyncio.FIRST_COMPLETED)
                woke.cancel()
            if not it.done():  # READY (or a failed query): abandon the iteration in progress
                abort.set()
                try:
                    loss, grad = await it
                except Aborted:
                    if errors:
                        raise errors[0] from None
                    return losses, 1
            else:
                loss, grad = it.result()
            # completed (before READY, or just as it came): it counts
            losses.append(await self._finish_iteration(t_s, loss, grad))

    async def _collect_queries(self) -> None:
        """Wait for the answers still in flight (bounded by the query timeout)."""
        if self._queries:
            await asyncio.gather(*list(self._queries), return_exceptions=True)

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        self.failstop.check()
        w_t = await self.ctx.replica.get_params()
        t0 = time.monotonic()
        if self.opts["mode"] == "blocking":
            losses, abandoned = await self._blocking()
        else:
            losses, abandoned = await self._nonblocking()
        local_s = time.monotonic() - t0
        w = await self.ctx.replica.get_params()
        t1 = time.monotonic()
        mean, stop, st = await mean_and_agree(self.ctx.collectives, w - w_t, want_stop,  # Eq. 6-7
                                              tag=f"esync.{step}")
        blocking = time.monotonic() - t1
        self.failstop.check()
        await self.ctx.replica.set_params(w_t + np.float32(self.opts["global_lr"]) * mean)  # Eq. 8
        await self._collect_queries()
        self.round += 1
        t_r = time.monotonic()
        await self.ctx.membership.call_coordinator("esync.reset", {"round": self.round, "rtt": self.rtt},
                                                   timeout=self.opts["query_timeout"])
        self.t_e = t_r
        return StepReport(loss=float(np.mean(losses)) if losses else float("nan"), stop=stop,
                          comm_s=blocking, wait_s=blocking, extra={
                              "n_local": len(losses), "abandoned": abandoned,
                              "local_s": round(local_s, 4), "blocking_s": round(blocking, 4),
                              "query_rtt_s": round(self.rtt, 5), "round": self.round,
                              "op_nic_bytes": st.nic_bytes, "compression": round(st.compression, 3)})

    async def close(self) -> None:
        for q in list(self._queries):
            q.cancel()
        await asyncio.gather(*list(self._queries), return_exceptions=True)

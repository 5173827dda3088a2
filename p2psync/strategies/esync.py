"""ESync (Li et al., *ESync*): local iterations sized by a State Server, one aggregation
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
RTT of the decision, not after the abandoned computation. A newer membership view ends the local
iterations the same way (the iteration in progress abandoned): the aggregation begins with the
new view's state sync, where members a round behind (their aggregation failed where this node's
succeeded) wait for this node, and the State Server keeps this node NOT-READY while the slowest
member has not started this round, so waiting for READY would deadlock. The answers still in flight are
collected during the aggregation (no late reply is left behind) before RESET-STATE-SERVER.

The stop decision is agreed on next to the aggregation, exactly (never through a lossy codec;
:func:`~p2psync.strategies.base.mean_and_agree`), so every node stops after the same round.

Leaving and joining (:mod:`~p2psync.strategies.regroup`): the aggregation runs
over the current view's members under ``esync.<round>.e<epoch>``. With ``--on-failure
continue`` (default) an aggregation that fails is abandoned (nothing applied) and redone over the
survivors with the same deltas, so Eq. 7 averages over the members of the round's final view;
a member a round behind, or a joiner, adopts the global weights w_t of the round the others are
in (its own local iterations are dropped) and its optimizer state, then trains that round.
Every query carries the view (epoch, members), so the State Server drops departed devices (a
dead device would otherwise stay the slowest forever) and admits joined ones. With
``--on-failure stop`` a failed peer ends the run with PeerFailure naming it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal, Mapping

import numpy as np

from p2psync import clock
from p2psync.collectives import OpId
from p2psync.coordinator import View
from p2psync.coordinator.rpc import RpcServer
from p2psync.coordinator.state_server import StateServerService
from p2psync.errors import Aborted, P2PSyncError
from p2psync.model import MODEL_BUFFERS
from p2psync.strategies.options import StrategyOptions, non_negative, option, positive
from p2psync.strategies.base import StepReport, Strategy, StrategyContext, mean_and_agree, parse_options, register
from p2psync.strategies.failure import FailurePolicy
from p2psync.strategies.regroup import Adopted, Regroup
from p2psync.tasks import AbortEvent, TaskSet, wait_or_event
from p2psync.topology import Topology


@dataclass(frozen=True)
class ESyncOptions(StrategyOptions):
    """``--opt`` options of ``--strategy esync`` (see the module docstring)."""

    mode: Literal["blocking", "nonblocking"] = option("nonblocking", "blocking or nonblocking (delayed ACK, §4.2)")
    global_lr: float = option(1.0, "eps of Eq. 8")
    margin: float = option(0.002, "State Server boundary constant (s), Alg. 2 line 9")
    query_timeout: float = option(10.0, "seconds before a State Server query fails")

    def __post_init__(self) -> None:
        non_negative(self, "margin")
        positive(self, "query_timeout")


@register
class ESync(Strategy):
    """``--strategy esync``: State Server sized local iterations, one model-delta allreduce per
    round (see the module docstring)."""

    name = "esync"
    requires = (MODEL_BUFFERS,)
    Options = ESyncOptions
    step_unit = "round"
    opts: ESyncOptions
    failure: FailurePolicy

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        #: State Server queries in flight (non-blocking mode, §4.2)
        self._queries = TaskSet("esync-query", isolated=True)  # each query records its own outcome
        self.regroup = Regroup(ctx=ctx, name="esync", snapshot=self._snapshot)
        #: the failure policy (re-form or stop) the step driver applies, shared with the regroup
        self.failure = self.regroup.failure
        self.w_round: np.ndarray | None = None  # w_t of the round in progress
        #: set by a new view: ends the local iterations in progress (see the module docstring)
        self._interrupt = asyncio.Event()

    @classmethod
    def coordinator_services(cls, server: RpcServer, topology: Topology, options: Mapping[str, Any]) -> None:
        opts: ESyncOptions = parse_options(cls, options)
        StateServerService(server, topology.ids, epsilon=opts.margin)

    async def start(self) -> None:
        self.round = 0
        self.rtt = 0.0
        # Alg. 1 line 3: RUN-BATCH-DATA-TEST measures the capability (gradient discarded)
        t0 = clock.now()
        await self.ctx.replica.compute_gradients()
        self.c = clock.now() - t0
        if self.ctx.joining:  # take w_t of the round the members are in, then train it
            self.start_step = self.round = await self.regroup.join()
            await self._reset()
        else:
            # everyone starts round 0 together (a slow device's batch test takes longer)
            await self.ctx.collectives.allreduce(np.zeros(1, np.float32), tag="esync.start")
        self.t_e = clock.now()

    def on_peer_failure(self, peer: int) -> None:
        self.regroup.on_peer_failure(peer)

    def on_view(self, view: View) -> None:
        self.regroup.on_view(view)
        self._interrupt.set()

    async def _snapshot(self) -> np.ndarray:
        """The state a lagging member or joiner adopts: w_t of this round + optimizer state."""
        vec = await self.ctx.replica.export_state()
        if self.w_round is not None:
            vec[:self.w_round.size] = self.w_round
        return vec

    async def _reset(self) -> None:
        t_r = clock.now()
        await self.ctx.membership.call_coordinator("esync.reset", {"round": self.round, "rtt": self.rtt,
                                                                   **self._view_args()},
                                                   timeout=self.opts.query_timeout)
        self.t_e = t_r

    def _view_args(self) -> dict[str, object]:
        return {"epoch": self.ctx.epoch, "members": list(self.ctx.group)}

    async def _query(self, k: int) -> bool:
        t0 = clock.now()
        # at the current coordinator (ctx.coordinator), retried there if it moves; "round" lets
        # a State Server rebuilt after a takeover learn where this device is
        rep = await self.ctx.membership.call_coordinator("esync.query", {
            "k": k, "c": self.c + (self.rtt if self.opts.mode == "nonblocking" else 0.0),
            "age": max(0.0, t0 - self.t_e), "rtt": self.rtt, "round": self.round, **self._view_args()},
            timeout=self.opts.query_timeout)
        self.rtt = clock.now() - t0
        return bool(rep["ready"])

    async def _finish_iteration(self, t_s: float, loss: float, grad: np.ndarray) -> float:
        """Apply the iteration's gradient (Alg. 1 line 13) and record t_e and c (lines 14-15)."""
        await self.ctx.replica.apply_gradients(grad)
        self.t_e = clock.now()
        self.c = self.t_e - t_s
        return loss

    async def _blocking(self) -> tuple[list[float], int]:
        losses: list[float] = []
        while not await self._query(len(losses)):
            self.regroup.check()
            if self.regroup.unsynced():
                return losses, 0
            t_s = clock.now()
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
        self._queries.spawn(ask())

    async def _nonblocking(self) -> tuple[list[float], int]:
        """Local iterations until a READY answer; returns (losses, abandoned iterations)."""
        losses: list[float] = []
        ready: list[bool] = []
        errors: list[BaseException] = []
        signal = self._interrupt = asyncio.Event()
        while True:
            self.regroup.check()
            if errors:
                raise errors[0]
            if ready or self.regroup.unsynced():
                return losses, 0
            self._ask(len(losses), signal, ready, errors)
            abort = AbortEvent()
            t_s = clock.now()
            it = asyncio.ensure_future(self.ctx.replica.compute_gradients(abort))
            try:
                while not it.done() and not ready and not errors and not self.regroup.unsynced():
                    signal.clear()
                    await wait_or_event(it, signal)
            except BaseException:  # cancelled (run ending): do not leave the compute job running
                abort.set()
                it.add_done_callback(lambda t: t.cancelled() or t.exception())
                raise
            if not it.done():  # READY, a failed query or a new view: abandon the iteration in progress
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
        await self._queries.wait()

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        w_t = self.w_round = await self.ctx.replica.get_params()
        early = await self.regroup.run(step, None)  # a new view: agree on w_t before training
        if isinstance(early, Adopted):
            return await self._adopted(early, 0.0)
        t0 = clock.now()
        if self.opts.mode == "blocking":
            losses, abandoned = await self._blocking()
        else:
            losses, abandoned = await self._nonblocking()
        local_s = clock.now() - t0
        w = await self.ctx.replica.get_params()
        t1 = clock.now()
        coll, delta = self.ctx.collectives, w - w_t
        out = await self.regroup.run(step, lambda v: mean_and_agree(  # Eq. 6-7
            coll, delta, want_stop, tag=OpId("esync", step, v.epoch).tag, group=v.members, feedback=("esync", "delta")))
        blocking = clock.now() - t1
        if out is None or isinstance(out, Adopted):
            return await self._adopted(out or Adopted(step + 1), blocking)
        mean, stop, st = out
        await self.ctx.replica.set_params(w_t + np.float32(self.opts.global_lr) * mean)  # Eq. 8
        self.w_round = None
        await self._collect_queries()
        self.round += 1
        await self._reset()
        return StepReport(loss=float(np.mean(losses)) if losses else float("nan"), stop=stop,
                          comm_s=blocking, wait_s=blocking, extra={
                              "n_local": len(losses), "abandoned": abandoned,
                              "local_s": round(local_s, 4), "blocking_s": round(blocking, 4),
                              "query_rtt_s": round(self.rtt, 5), "round": self.round,
                              "members": len(self.ctx.group), "reforms": self.regroup.reformations,
                              "op_nic_bytes": st.nic_bytes, "compression": round(st.compression, 3)})

    async def _adopted(self, adopted: Adopted, blocking: float) -> StepReport:
        """This node took a peer's w_t of round ``adopted.step``: its own round is dropped."""
        self.w_round = None
        await self._collect_queries()
        self.round = adopted.step
        await self._reset()
        return StepReport(loss=float("nan"), comm_s=blocking, wait_s=blocking, next_step=adopted.step,
                          extra={"adopted": True, "round": self.round, "members": len(self.ctx.group)})

    async def close(self) -> None:
        await self._queries.close()

"""P-Reduce: the fastest P workers average their models while the others keep computing
(Miao et al., *Heterogeneity-Aware Distributed Machine Learning Training via Partial Reduce*).

Worker, Sec. 3.1.1 Algorithm 2 (spec §1.2, §1.6): every step is the user's own local step
(line 4: the gradient through the user's optimizer, so momentum, weight decay and LR schedules
behave as configured), then READY with the worker's version ``k`` to the controller (line 5),
a wait for a group (line 6) and, in a group S, one weighted allreduce of the models over just
the members (line 7: ``x <- sum_{j in S} w_j x_j``) through the topology's collectives, under
the tag ``preduce.<controller>.<op>.e<epoch>``. Workers outside the group never take part: they
go on computing. The controller (:mod:`p2psync.coordinator.preduce`, hosted by the coordinator
through :mod:`p2psync.coordinator.preduce_service`) forms groups from READY signals in arrival
order, as soon as P are queued, over members connected by direct links (the controller's rule;
the collectives also run over groups that need relays, as the final average may), with the
group-frozen filter of Sec. 4 (spec §1.6, B8).

Options (``--opt NAME=VALUE``):

* ``P``: the group size, 2 <= P <= N. 0 (default) = N // 2 (at least 2): the paper has no
  default (Sec. 5.2.3: "need to be tuned"; its runs use 3 and 5 of 8 and 4 of 16/32).
* ``weights``: ``constant`` (1/P, Alg. 2) or ``dynamic`` (Sec. 3.3: EMA of the members'
  relative iteration numbers, spec §1.4, computed by the controller and sent with the group);
  ``alpha`` (default 0.5, spec B6) and ``approx`` (``conservative``: the paper's rule, missing
  versions go to the stalest member; ``nearest``: to the closest one, spec B7).
* ``avoid_frozen`` (default on), ``window`` (T, 0 = 4 ceil((N-1)/(P-1)), spec B8),
  ``max_defer`` (seconds; negative = one READY interval of the slowest worker).
* ``tail``: when fewer than P workers remain (departures), ``stop`` the run (default) or
  ``shrink`` the groups.
* ``average_momentum`` (default off): the paper never says what happens to momentum buffers at
  a P-reduce (spec B2). Off: they stay local (the paper's prototype "aggregates local models";
  the third-party code does the same). On: the whole optimizer state is averaged with the
  same weights as the parameters (then P = N is exactly all-reduce model averaging also with
  momentum).
* ``group_timeout`` (seconds, default 300): a worker that waited that long for a group fails
  with PeerTimeout (every wait on peers is bounded).

Versions (spec B11): ``k`` counts the worker's local steps and jumps to the group's maximum
after a reduce (dynamic weights need it); the training loop's step (data, LR schedule) is
separate.

Stopping (spec B10, the end-of-training deadlock): the controller decides. The first worker
that wants to stop (its ``--steps`` budget, ``--time`` or ``p2psync.request_stop()``) tells it
with its READY; every queued and later READY is then answered STOP, so no worker waits for a
group that can no longer form. With heterogeneous devices the fast workers therefore end the
run and the slow ones have run fewer local steps, as in the paper's time-to-accuracy runs.
Every worker then takes part in one exact average of its whole state (Alg. 2 line 8: "the
average of the models on all workers"), so every node ends with the same model.

Codecs: the models themselves travel, so dense codecs (fp16, int8, sketch8) apply to model
values; ``topk`` (a selection of a *gradient's* largest entries) would zero 99 % of a model
and is refused with a clear error.

Memory: a step keeps no copy of its gradient (the optimizer steps on ``.grad`` as it stands);
a group's reduce works in the parameter vector it read (the weighted allreduce reduces it in
place) and the final average in the exported state vector, averaged chunk by chunk
(:func:`~p2psync.strategies.regroup.exact_mean`): about one flat copy of the model per round,
one state vector (the model and the optimizer's state) at the end.

Failures: with ``--on-failure stop`` a failed peer ends the run with PeerFailure. With
``continue`` (default) a group whose reduce fails (a member died: its receives are aborted as
soon as the failure detector declares it) is abandoned: nothing is applied, every member keeps
its own model and signals READY again; the controller drops departed workers from its queue at
the next view and admits joiners, which first copy a live neighbour's state. The final average
re-forms over the survivors (:class:`~p2psync.strategies.regroup.Regroup`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from p2psync import clock
from p2psync.collectives import OpId
from p2psync.compress import get_codec
from p2psync.compress.topk import TopK
from p2psync.coordinator import View
from p2psync.coordinator.preduce import Approx, Controller, Tail, Weights
from p2psync.coordinator.preduce_service import PReduceService
from p2psync.coordinator.rpc import RpcServer
from p2psync.errors import ConfigError, NonFinitePiece, PeerFailure, PeerTimeout, ProtocolError, TrainingEnded
from p2psync.strategies.needs import Needs
from p2psync.strategies.options import StrategyOptions, option, positive, require
from p2psync.model import MODEL_BUFFERS, STEP_AS_IS, Buffers
from p2psync.strategies.base import StepReport, Strategy, StrategyContext, parse_options, register
from p2psync.strategies.failure import FailurePolicy, failure_policy
from p2psync.strategies.buffers import alongside, own_buffers
from p2psync.strategies.regroup import Regroup, exact_mean, fetch_state, serve_state
from p2psync.tasks import cancel_all, wait_or_event
from p2psync.topology import Topology

log = logging.getLogger("p2psync.preduce")


@dataclass(frozen=True)
class PReduceOptions(StrategyOptions):
    """``--opt`` options of ``--strategy preduce`` (see the module docstring)."""

    P: int = option(0, "group size, 2 <= P <= N (0: N // 2)")
    weights: Weights = option("constant", "constant (1/P) or dynamic (Sec. 3.3, EMA staleness)")
    alpha: float = option(0.5, "EMA decay of the dynamic weights, in [0, 1)")
    approx: Approx = option("conservative", "dynamic weights: missing versions go to the stalest member "
                            "(conservative, the paper) or the nearest one")
    avoid_frozen: bool = option(True, "group-frozen avoidance (Sec. 4)")
    window: int = option(0, "T, groups in the sync-graph (0: 4 ceil((N-1)/(P-1)))")
    max_defer: float = option(-1.0, "seconds the frozen filter may hold a group (negative: automatic)")
    tail: Tail = option("stop", "fewer than P workers left: stop or shrink the groups")
    average_momentum: bool = option(False, "average the optimizer state with the same weights")
    group_timeout: float = option(300.0, "seconds a worker waits for a group before failing")

    def __post_init__(self) -> None:
        require(0.0 <= self.alpha < 1.0, self, "alpha", "must be in [0, 1)")
        require(self.P >= 0, self, "P", "must be >= 2 (0: N // 2)")
        require(self.window >= 0, self, "window", "must be >= 0 (0: automatic)")
        positive(self, "group_timeout")


def group_size(opts: PReduceOptions, n: int) -> int:
    """The option ``P`` (0: N // 2, at least 2), checked against the run's N nodes."""
    p = opts.P or max(2, n // 2)
    if not 2 <= p <= n:
        raise ConfigError(f"preduce: --opt P={p} must be between 2 and the number of nodes ({n})")
    return p


def controller_options(opts: PReduceOptions, n: int) -> dict[str, Any]:
    """The :class:`~p2psync.coordinator.preduce.Controller` keywords for the strategy options."""
    return {"p": group_size(opts, n), "weights": opts.weights, "alpha": opts.alpha,
            "approx": opts.approx, "avoid_frozen": opts.avoid_frozen,
            "window": opts.window or None,
            "max_defer": None if opts.max_defer < 0 else opts.max_defer,
            "tail": opts.tail}


@dataclass(frozen=True)
class GroupMsg:
    """A validated group answer from the controller."""

    ctl: int
    op: int
    epoch: int
    members: tuple[int, ...]
    weights: tuple[float, ...]
    k: int

    @property
    def tag(self) -> str:
        return OpId("preduce", (self.ctl, self.op), self.epoch).tag


def parse_group(raw: Any, me: int, ids: frozenset[int]) -> GroupMsg:
    """Check the controller's answer (a malformed one is a ProtocolError naming the field)."""
    if not isinstance(raw, dict):
        raise ProtocolError("preduce", "group answer is not a map")
    ints = {k: raw.get(k) for k in ("ctl", "op", "epoch", "k")}
    for k, v in ints.items():
        if type(v) is not int or v < 0:
            raise ProtocolError("preduce", f"group {k} {v!r}"[:80])
    members, weights = raw.get("members"), raw.get("weights")
    if (not isinstance(members, list) or not members or len(set(members)) != len(members)
            or any(type(m) is not int or m not in ids for m in members) or me not in members):
        raise ProtocolError("preduce", f"group members {members!r}"[:80])
    if (not isinstance(weights, list) or len(weights) != len(members)
            or any(isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0
                   for w in weights) or abs(sum(weights) - 1.0) > 1e-6):
        raise ProtocolError("preduce", f"group weights {weights!r}"[:80])
    return GroupMsg(ctl=int(raw["ctl"]), op=int(raw["op"]), epoch=int(raw["epoch"]), k=int(raw["k"]),
                    members=tuple(members), weights=tuple(float(w) for w in weights))


@register
class PReduce(Strategy):
    """``--strategy preduce``: the first P ready workers average their models in a group
    formed by the coordinator's controller (see the module docstring)."""

    name = "preduce"
    requires = (MODEL_BUFFERS, STEP_AS_IS)
    identical_replicas = "end"
    needs = Needs(buffers="each node's own; the final average takes the lowest member's (--buffers)")
    Options = PReduceOptions
    opts: PReduceOptions
    failure: FailurePolicy

    @classmethod
    def check_options(cls, opts: PReduceOptions, topology: Topology) -> None:
        Controller(members=list(topology.ids), **controller_options(opts, topology.size))  # window T vs N

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.p = controller_options(self.opts, ctx.topology.size)["p"]
        if isinstance(get_codec(ctx.collectives.codec), TopK):
            raise ConfigError("preduce averages whole models: --codec topk would keep only the largest 1 % of "
                              "a model's weights; use none, fp16, int8 or sketch8")
        #: the failure policy (re-form or stop) of the strategy's operations, applied by the
        #: step driver; the final average's regroup holds its own, decided alike
        self.failure = failure_policy(ctx, "preduce")
        self.final = Regroup(ctx=ctx, name="preduce.end")
        self.k = 0  # the version (spec B11)
        self.steps = 0  # local steps taken (the training loop's counter)
        self.seq = 0  # READYs sent
        #: the group whose reduce is running, and that reduce's failure (resolved when one of
        #: the group's members fails)
        self._running: tuple[GroupMsg, asyncio.Future[PeerFailure]] | None = None
        self.ops = 0  # groups this worker took part in
        self.failed_groups = 0
        self.solo = 0
        self.last_op = 0

    @property
    def group(self) -> GroupMsg | None:
        """The group whose reduce is running."""
        return self._running[0] if self._running is not None else None

    @classmethod
    def coordinator_services(cls, server: RpcServer, topology: Topology, options: Mapping[str, Any]) -> None:
        opts: PReduceOptions = parse_options(cls, options)
        PReduceService(server, topology, **controller_options(opts, topology.size))

    async def start(self) -> None:
        serve_state(self.ctx, "preduce", lambda: self.steps)
        if self.ctx.joining:
            self.start_step = self.steps = self.k = await fetch_state(self.ctx, "preduce")

    def on_peer_failure(self, peer: int) -> None:
        self.failure.on_peer_failure(peer)
        self.final.on_peer_failure(peer)
        if self._running is None:
            return
        g, failed = self._running
        err = PeerFailure(f"preduce: group {g.op} member {peer} failed", peers=(peer,))
        if peer in g.members and not failed.done() and self.failure.recovers(err):
            # ends the reduce at once, whatever it is doing (reading the model, sending, waiting),
            # to be abandoned; a policy that does not recover has failed its receives already
            failed.set_result(err)

    def on_view(self, view: View) -> None:
        self.final.on_view(view)

    # -- one step ------------------------------------------------------------------------

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        try:
            loss, grad = await self.ctx.replica.compute_gradients()
        except TrainingEnded as ended:
            async def leave(_: View) -> StepReport:  # this node leaves: its departure ends the others' run
                raise ended

            # under the policy: leave, or (re-forming) stop the run with every member's average
            return await self.failure.run(leave, lambda: self._loop_ended(want_stop))
        # Alg. 2 line 4, with .grad as the iteration left it (what ``grad`` holds too: freed
        # first, so neither the optimizer's step nor the reduce keeps a copy of it)
        del grad
        await STEP_AS_IS.of(self.ctx.replica).step_as_is()
        self.steps, self.k = step + 1, self.k + 1
        t0 = clock.now()
        answer = await self._ready(want_stop)  # lines 5-6
        queued = clock.now() - t0
        extra: dict[str, Any] = {"queue_s": round(queued, 5), "k": self.k}
        if answer is None:  # STOP: the run ends with the average of all models (line 8)
            t1 = clock.now()
            await self._final_average()
            wait = queued + clock.now() - t1
            return StepReport(loss=loss, stop=True, comm_s=wait, wait_s=wait, extra={
                **extra, **self._totals(), "final_s": round(clock.now() - t1, 4)})
        t1 = clock.now()
        applied = await self._reduce(answer)  # line 7
        reduced = clock.now() - t1
        extra.update(op=answer.op, group=len(answer.members), applied=applied, reduce_s=round(reduced, 5),
                     weight=round(answer.weights[answer.members.index(self.ctx.node_id)], 5))
        return StepReport(loss=loss, comm_s=reduced, wait_s=queued + reduced, extra={**extra, **self._totals()})

    async def _loop_ended(self, want_stop: bool) -> StepReport:
        """The user's loop ended (a script without ``should_stop()``): this worker reached its
        budget, and the first worker at its budget stops the run (Alg. 2), which ends with the
        average of every member's model, as at an agreed stop."""
        t0 = clock.now()
        answer = await self._ready(True)
        if answer is not None:  # grouped before the stop reached the controller: not counted
            log.info("node %d: preduce: the loop ended while grouped in op %d; stopping", self.ctx.node_id, answer.op)
            await self._reduce(answer)
            while answer is not None:
                answer = await self._ready(True)
        await self._final_average()
        wait = clock.now() - t0
        return StepReport(loss=float("nan"), stop=True, comm_s=wait, wait_s=wait,
                          extra={**self._totals(), "loop_ended": True})

    def _totals(self) -> dict[str, Any]:
        return {"ops_joined": self.ops, "last_op": self.last_op, "failed_groups": self.failed_groups,
                "solo": self.solo, "members": len(self.ctx.group)}

    async def _ready(self, stop: bool) -> GroupMsg | None:
        """READY to the controller; the group it put this worker in, or None for STOP."""
        self.seq += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.opts.group_timeout
        ids = frozenset(self.ctx.topology.ids)
        while True:
            view = self.ctx.view
            call = asyncio.ensure_future(self.ctx.membership.call_coordinator("preduce.ready", {
                "seq": self.seq, "inc": self.ctx.transport.incarnation, "k": self.k, "stop": stop, "epoch": view.epoch, "members": list(view.members)},
                timeout=self.ctx.peer_timeout + 10.0))
            try:
                await wait_or_event(call, self.final.next_view)
            finally:  # a newer view: ask again at once, telling it to the controller
                await cancel_all([call])
            if call.cancelled():
                continue
            rep = call.result()
            if not isinstance(rep, dict):
                raise ProtocolError("preduce", "controller answer is not a map")
            if rep.get("stop"):
                return None
            if "group" in rep:
                return parse_group(rep["group"], self.ctx.node_id, ids)
            if not rep.get("wait"):
                raise ProtocolError("preduce", f"unexpected controller answer {sorted(rep)!r}"[:80])
            if loop.time() > deadline:
                raise PeerTimeout(f"preduce: node {self.ctx.node_id} got no group within "
                                  f"{self.opts.group_timeout:g}s (P={self.p}, members {list(self.ctx.group)})")

    async def _reduce(self, g: GroupMsg) -> bool:
        """The members' weighted average; False when it failed and was abandoned."""
        self.last_op = max(self.last_op, g.op)
        if len(g.members) == 1:  # a solo (tail=shrink with one worker left): nothing to average
            self.solo += 1
            return True
        rep = self.ctx.replica
        whole = self.opts.average_momentum
        failed: asyncio.Future[PeerFailure] = asyncio.get_running_loop().create_future()
        self._running = (g, failed)
        scope = self.ctx.transport.scope(f"{g.tag}.")  # the group's allreduce
        try:
            avg = await self._group_allreduce(g, whole, failed)
        except (PeerFailure, PeerTimeout, ProtocolError) as exc:
            if not self.failure.recovers(exc) or isinstance(exc, NonFinitePiece):
                raise  # (a member's non-finite model ends the run)
            self.failed_groups += 1
            scope.retire()  # its pieces still on their way are dropped
            log.warning("node %d: P-reduce group %d %s abandoned (own model kept): %s", self.ctx.node_id,
                        g.op, list(g.members), exc)
            return False
        finally:
            self._running = None
            scope.close()
        avg = np.asarray(avg, dtype=np.float32)
        await (rep.import_state(avg) if whole else rep.set_params(avg))
        # the group's newest version only once its average is in: an abandoned reduce keeps this
        # worker's own model, and so its own version (the controller's dynamic weights read it)
        self.k = max(self.k, g.k)
        self.ops += 1
        return True

    async def _group_allreduce(self, g: GroupMsg, whole: bool, failed: asyncio.Future[PeerFailure]) -> Any:
        """The group's weighted average, ended with the PeerFailure ``failed`` resolves to as soon
        as a member fails (:meth:`on_peer_failure`), whatever the reduce is doing at that moment
        (cancelling the allreduce also ends its waits for pieces)."""
        rep = self.ctx.replica
        dead = [m for m in g.members if m in self.ctx.transport.dead]
        if dead:  # declared dead before this reduce began: nothing to wait for
            raise PeerFailure(f"preduce: group {g.op} member {dead[0]} has failed", peers=tuple(dead))
        x = await (rep.export_state() if whole else rep.get_params())
        # a fresh vector: handed over, reduced in place (no working copy of the model)
        op = asyncio.ensure_future(self.ctx.collectives.allreduce(
            x, g.members, op="weighted", weights=dict(zip(g.members, g.weights)), tag=g.tag,
            feedback=("preduce", "model"), donate=True))
        del x
        try:
            await asyncio.wait({op, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not op.done():  # a member failed (or this reduce is cancelled)
                await cancel_all([op])
        if op.cancelled():
            raise failed.result()
        return op.result()

    async def _final_average(self) -> None:
        """Alg. 2 line 8: every member ends with the exact mean of the members' states."""
        rep, coll = self.ctx.replica, self.ctx.collectives
        bufs = MODEL_BUFFERS.of(rep)

        async def mean(view: View) -> tuple[Any, Buffers | None]:
            tag = OpId("preduce.end", 0, view.epoch).tag
            # averaged in place, chunk by chunk (a fresh export per attempt)
            return await alongside(exact_mean(coll, await rep.export_state(), view.members, tag=tag), coll,
                                   await own_buffers(bufs, self.ctx.buffers), self.ctx.buffers, tag=tag,
                                   group=view.members)

        out = await self.final.run(0, mean)  # applied once it succeeded (a redo averages the originals)
        if isinstance(out, tuple):
            await rep.import_state(np.asarray(out[0], dtype=np.float32))
            if out[1] is not None:
                await bufs.set_buffers(out[1])

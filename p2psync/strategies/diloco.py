"""DiLoCo: local steps of the user's own optimizer, and every H steps an outer Nesterov step on a
global copy of the model from the averaged pseudo-gradient; Streaming DiLoCo's fragments, sent
in turn and merged τ steps later while training goes on.

Papers: DiLoCo (arXiv 2311.08105, Alg. 1), Streaming DiLoCo (arXiv 2501.18512, Alg. 2, §2.2-2.4);
the pure parts (outer step, merge, schedule, fragment map) are in
:mod:`~p2psync.strategies.diloco_state`.

What each node keeps: θ_g, the global copy (host float32, identical on every member after
every applied outer step) and the outer momentum b (per fragment, created at the fragment's
first outer step); the user's model holds θ_local and the user's optimizer its own state,
which DiLoCo never resets nor synchronizes.

One step (``train_step``): the user's optimizer takes its inner step, untouched (AdamW, an LR
schedule, clipping: whatever the script does). Then, after inner step t:

* **send** (t a multiple of h = H / P_total): fragment f = (t/h − 1) mod P_total;
  Δ = θ_g[f] − θ_local[f]; ``w·Δ`` is summed over the current view's members by the topology's
  collectives with the outer codec (tag ``diloco.<op>.e<epoch>.f<f>``), next to an exact side sum
  of ``[w, stop, non-finite]`` (``.side``), as a background task;
* **apply** (the fragment sent at t − τ): await it (normally done long ago: training went on),
  Δ̄ = Σ w·Δ / Σ w, one outer step on θ_g[f] and b[f] (SGD, ``outer_lr``,
  ``outer_momentum``, Nesterov), then θ_local[f] ← θ_g[f] + α·(θ_local[f] − θ_g[f]) (α = 0 when
  τ = 0: DiLoCo restarts from θ_g). The next Δ of f is measured from θ_g, never from the merged
  value, so the α part re-enters it. Every member applies the same bytes (a lossy codec's
  owner seals decode(encode(sum))), so θ_g stays bitwise identical everywhere (except with
``eager``, below).

Options (``--opt NAME=VALUE``; :class:`DilocoOptions`):

* ``inner_steps`` H (100), ``outer_lr`` (0.7), ``outer_momentum`` (0.9), ``nesterov`` (true);
* ``fragments`` P (1), ``fragment_by`` (``blocks``: repeated blocks dealt to P fragments, plus one
  more for every other parameter; ``flat``: P contiguous ranges), ``fragment_pattern``
  (``strided`` | ``sequential``), ``tau`` (0), ``alpha`` (0.5);
* ``outer_codec`` (the run's ``--codec``; ``e3m0`` for 4-bit), ``error_feedback`` (the run's
  ``--error-feedback``; ``true`` | ``false``);
* ``weighting`` (``uniform`` | ``samples``: each Δ weighted by the samples behind it);
* ``final_sync`` (``full``: one last outer step over the whole model at the stop; ``outer``: the
  outer parameters as they are), ``init_sync`` (true: every member starts from the lowest id's
  parameters), ``join_inner_state`` (``copy``: a joiner takes the leader's inner optimizer state;
  ``fresh``: it keeps its own);
* ``dylu`` (Dynamic Local Updates: after each cycle a node takes
  h_m = max(⌈dylu_min_steps / P⌉, ⌊⌊v_m / max v · H⌋ / P⌋) inner steps per fragment, v its
  measured compute speed, published in every side sum, so slow and fast nodes reach each sum
  together; operations are matched by number, not by step), ``dylu_min_steps`` (5);
* ``eager`` (Eager updates; ``fragments=1``, ``tau=0``, ``weighting=uniform``: a round's sum is
  awaited only at the next round's send, a whole round later, and each node steps its own θ_g
  with its fresh Δ over the members plus the others' Δ of the previous round; the nodes' θ_g
  differ until the stop, which applies a completion step and then an exact mean of θ_g and the
  momentum), ``eager_delay`` (1; more is not built).

Bad or unbuilt combinations are a ConfigError naming the option.

Stop: with a step budget every node stops at the same step (with DyLU the fastest node's budget:
its wish rides with the sums); otherwise a node's wish rides in
the side sum of every operation it launches and every member stops at the apply of the first
one that carries it (up to h + τ steps late). At the stop every operation in flight is applied,
``final_sync=full`` folds the work since each fragment's last send into one last outer step,
θ_local ← θ_g on every node, buffers follow ``--buffers``, and a digest of θ_g is compared
(one model: ``identical_replicas = "end"``). A script whose loop just ends, without an agreed
stop, leaves every node with its own local model.

Views (``--on-failure continue``): every operation runs through
:class:`~p2psync.strategies.regroup.Regroup` keyed by its operation number. A failed one is
redone over the survivors with the same Δ's (error-feedback residuals it consumed are put back
first); the first operation of a new view compares operation numbers, and a member behind or a
joiner adopts the lowest-id leader's θ_g, outer momentum and counters (not its local model;
a joiner also its inner optimizer state with ``join_inner_state=copy``),
resets θ_local ← θ_g and takes part in the operation with Δ = 0 and weight 0 (its first send of
every fragment after that also weighs 0 with ``uniform``). Its loop moves to the leader's step.
The stop is re-formed the same way: the final full-model sync is an operation like the others,
and the closing checks after it (eager's exact mean, buffers, the digest of θ_g) run as one more
operation (:data:`CLOSE`). A member that missed an operation the others completed there (it
failed on it alone) adopts the leader's θ_g — with the final sync in it once the leader is in
the closing checks — and takes part in what the leader runs; a member that missed the agreed
stop learns it from the leader's counters. Eager updates re-form their rounds but not the
completion step of their stop: a view change there ends the run with an error.

Memory: θ_g and b (2n float32 on the host) persist; a fragment's send and merge read and write
only its own parameters (``Replica.get_params_range`` / ``set_params_range``), so the transient
copies are a fragment's size (the final full sync and an adoption touch the whole model).

Checkpoints (``state_dict``): θ_g, the outer momentum, the counters and the operation in flight
(its Δ and weight, and its result when it has arrived); a resumed run applies it at its step.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping

import numpy as np

from p2psync import clock
from p2psync.collectives import OpId, OpStats
from p2psync.compress import Codec, ErrorFeedback, get_codec
from p2psync.coordinator import View
from p2psync.errors import ConfigError, PeerFailure, ReplicaMismatch, TrainingEnded
from p2psync.strategies.base import StepReport, Strategy, StrategyContext, register
from p2psync.strategies.buffers import sync_buffers
from p2psync.model import LAYERED, MODEL_BUFFERS, PARAM_RANGES, Layer
from p2psync.strategies.diloco_state import (Counters, Cursor, Schedule, dylu_interval, eager_gradient, fragment_map,
                                             indices, map_digest, merge, others_mean, outer_step, pack_state,
                                             Ranges, state_size, unpack_state)
from p2psync.strategies.needs import Needs
from p2psync.strategies.options import StrategyOptions, option, positive, require
from p2psync.strategies.failure import FailurePolicy
from p2psync.strategies.regroup import Adopted, Regroup, exact_mean_input
from p2psync.tasks import cancel_all, gather_or_cancel

log = logging.getLogger("p2psync.diloco")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
#: the fragment number of the final full-model operation
FULL = -1
#: the counters' fragment of the stop's closing checks (after the final sync)
CLOSE = -2


@dataclass(frozen=True)
class DilocoOptions(StrategyOptions):
    """``--opt`` options of ``--strategy diloco`` (see the module docstring)."""

    inner_steps: int = option(100, "H: inner steps between two syncs of the same parameters")
    outer_lr: float = option(0.7, "outer learning rate (DiLoCo 0.7, Streaming 0.4)")
    outer_momentum: float = option(0.9, "outer momentum, 0 <= mu < 1")
    nesterov: bool = option(True, "Nesterov outer momentum (false: heavy ball)")
    fragments: int = option(1, "P: fragments synchronized in turn (Streaming DiLoCo)")
    fragment_by: Literal["blocks", "flat"] = option("blocks", "fragments of repeated blocks (+1 for the rest) "
                                                              "or contiguous ranges")
    fragment_pattern: Literal["strided", "sequential"] = option("strided", "which blocks go together")
    tau: int = option(0, "overlap: a fragment's average is merged tau inner steps after it was sent")
    alpha: float = option(0.5, "merge weight of the local parameters (tau > 0)")
    eager: bool = option(False, "eager updates: a round's sum is applied a whole round later, each node's own "
                                "contribution at once")
    eager_delay: int = option(1, "rounds of eager overlap (only 1 is built)")
    outer_codec: str = option("", "codec of the pseudo-gradient allreduce (empty: the run's --codec)")
    error_feedback: str = option("", "error feedback of the outer codec: true/false (empty: --error-feedback)")
    weighting: Literal["uniform", "samples"] = option("uniform", "weights of the nodes' pseudo-gradients")
    dylu: bool = option(False, "per-node inner steps proportional to the node's measured speed")
    dylu_min_steps: int = option(5, "with dylu: the fewest inner steps a node takes per cycle")
    final_sync: Literal["full", "outer"] = option("full", "at the stop: one last full outer step, or the outer "
                                                          "parameters as they are")
    join_inner_state: Literal["copy", "fresh"] = option("copy", "a joiner copies the leader's inner optimizer "
                                                                "state, or keeps its own (fresh)")
    init_sync: bool = option(True, "start every member from the lowest id's parameters")

    def __post_init__(self) -> None:
        require(self.inner_steps >= 1, self, "inner_steps", "must be a whole number >= 1")
        positive(self, "outer_lr")
        require(0.0 <= self.outer_momentum < 1.0, self, "outer_momentum", "must be in [0, 1)")
        require(self.fragments >= 1, self, "fragments", "must be a whole number >= 1")
        require(self.inner_steps % self.fragments == 0, self, "inner_steps",
                f"must be a multiple of fragments={self.fragments}")
        require(0 <= self.tau < self.inner_steps // self.fragments, self, "tau",
                f"must be 0 <= tau < inner_steps / fragments = {self.inner_steps // self.fragments} "
                "(at most one fragment in flight)")
        require(math.isfinite(self.alpha) and 0.0 <= self.alpha <= 1.0, self, "alpha", "must be in [0, 1]")
        require(not self.eager or self.fragments == 1, self, "eager", "only with fragments=1 (eager updates of "
                "streamed fragments are not built)")
        require(not self.eager or self.tau == 0, self, "eager", "only with tau=0 (the overlap is a whole round)")
        require(not self.eager or self.weighting == "uniform", self, "eager", "only with weighting=uniform")
        require(not self.eager or not self.outer_codec.startswith("topk"), self, "eager", "not with a topk outer_codec")
        require(self.eager_delay == 1, self, "eager_delay", "only 1 is built (2-outer-steps eager is not)")
        require(self.dylu_min_steps >= 1, self, "dylu_min_steps", "must be a whole number >= 1")
        require(self.dylu or self.dylu_min_steps == 5, self, "dylu_min_steps", "only with dylu=true")
        require(not (self.dylu and self.eager), self, "dylu", "not with eager")
        require(self.error_feedback.strip().lower() in ("", *_TRUE, *_FALSE), self, "error_feedback",
                "true or false (empty: the run's --error-feedback)")
        if self.outer_codec:
            try:
                get_codec(self.outer_codec)
            except ConfigError as exc:
                raise ConfigError(f"--opt outer_codec={self.outer_codec}: {exc}") from None

    @property
    def feedback(self) -> bool | None:
        """The error_feedback option: True, False, or None (the run's setting)."""
        v = self.error_feedback.strip().lower()
        return None if not v else v in _TRUE


@dataclass
class _Op:
    """One operation: a fragment's (or, ``f == FULL``, the whole model's) weighted
    pseudo-gradient sum, launched at ``counters``."""

    f: int
    payload: np.ndarray
    w: float
    stop: bool
    nonfinite: bool
    counters: Counters
    #: this node's inner steps per second when it launched the op (DyLU)
    speed: float = 0.0
    task: asyncio.Task[Any] | None = None
    #: the sums when they arrived before a checkpoint that this op was restored from
    result: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def k(self) -> int:
        return self.counters.op


@register
class DiLoCo(Strategy):
    """``--strategy diloco`` (see the module docstring)."""

    name = "diloco"
    requires = (PARAM_RANGES, LAYERED, MODEL_BUFFERS)
    Options = DilocoOptions
    opts: DilocoOptions
    failure: FailurePolicy
    needs = Needs(schedules="honoured: the user's optimizer takes every inner step (the outer lr is constant)",
                  clipping="clips each node's own gradient (inner steps are local)",
                  buffers="each node's own between syncs; the lowest member's (or the mean) at the end (--buffers)")
    identical_replicas = "end"

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.codec = self.opts.outer_codec or ctx.collectives.codec
        self.regroup = Regroup(ctx=ctx, name="diloco", snapshot=self._snapshot, restore=self._restore,
                               size=self._state_size)
        #: the failure policy (re-form or stop) the step driver applies, shared with the regroup
        self.failure = self.regroup.failure
        self.schedule: Schedule | None = None
        self.cursor: Cursor | None = None
        #: inner steps per second (EMA over compute time only) and the fastest member's (DyLU)
        self.speed = 0.0
        self.fastest = 0.0
        self._measured = 0
        #: each fragment's (lo, hi) ranges of the flat vector, and its positions there (in that order)
        self.ranges: list[Ranges] = []
        self.frags: list[np.ndarray] = []
        self.theta: np.ndarray | None = None
        self.bufs: list[np.ndarray | None] = []
        self.t = 0
        self.ops = 0
        self.applied = 0
        self.inflight: _Op | None = None
        self._relaunch: _Op | None = None
        self._launched = Counters(0, 0, 0, 0)
        self._adopted: tuple[np.ndarray, list[np.ndarray | None], Counters] | None = None
        #: the leader's inner optimizer state a joiner takes (``join_inner_state=copy``)
        self._inner: np.ndarray | None = None
        self._want_stop = False
        #: the leader's counters showed it at the stop (a member that missed the agreed stop)
        self._stopping = False
        #: θ_g holds the final sync already (adopted from a leader in the closing checks)
        self._final_done = False
        #: fragments this node has not trained a full interval on since it adopted a state
        self.fresh: set[int] = set()
        self.marks: list[int] = []
        self.digest = 0.0
        self.skipped = 0
        self.blocked = 0
        self.adoptions = 0

    def codecs(self) -> list[Codec]:
        return [get_codec(self.codec)]

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        fb = self.opts.feedback
        coll = self.ctx.collectives
        if fb is True and coll.feedback is None:
            coll.feedback = ErrorFeedback()
        elif fb is False:
            coll.feedback = None
        rep = self.ctx.replica
        layers: list[Layer] = []
        if self.opts.fragments > 1:
            try:
                layers = LAYERED.of(rep).layers()
            except ConfigError:
                if self.opts.fragment_by == "blocks":
                    raise
        ranges = fragment_map(layers, rep.numel, self.opts.fragments, by=self.opts.fragment_by,
                              pattern=self.opts.fragment_pattern)
        self.ranges = ranges
        self.frags = [indices(r) for r in ranges]
        self.digest = map_digest(ranges)
        self.schedule = Schedule(self.opts.inner_steps, len(self.frags), self.opts.tau)
        self.cursor = Cursor(parts=len(self.frags), interval=self.schedule.interval, delay=self.opts.tau)
        self.bufs = [None] * len(self.frags)
        self.marks = [rep.samples] * len(self.frags)
        codec = get_codec(self.codec)
        group = self.ctx.group
        if codec.lossy and codec.name != "topk" and len(group) > 2 and self.ctx.node_id == min(group):
            log.warning("diloco: the outer codec %s re-encodes partial sums at every hop of a reduce-scatter over %d "
                        "members (each contribution is not encoded just once and summed in float32 at the piece's "
                        "owner: that plan is not built); 4-bit outer gradients lose more than the paper's",
                        codec.spec, len(self.ctx.group))
        if self.ctx.joining:
            got = await self.regroup.join()  # (no op: the leader's state is stashed by _restore)
            if self._adopted is None:
                raise PeerFailure("diloco: joined but no member gave its state")
            self.start_step = self._adopted[2].step + 1
            log.info("node %d: joins at operation %d (step %d)", self.ctx.node_id, got, self.start_step)

    def on_peer_failure(self, peer: int) -> None:
        self.regroup.on_peer_failure(peer)

    def on_view(self, view: View) -> None:
        self.regroup.on_view(view)

    async def close(self) -> None:
        op, self.inflight = self.inflight, None
        if op is not None:
            await cancel_all([op.task])

    # -- the state a member behind adopts (Regroup) ----------------------------------------

    def _state_size(self) -> int:
        inner = self.ctx.replica.state_size() if self.opts.join_inner_state == "copy" else 0
        return state_size(self.ctx.replica.numel, len(self.frags)) + inner

    async def _snapshot(self) -> np.ndarray:
        """θ_g, b and the counters as of this node's latest launch (Regroup runs the sync of a
        new view inside that operation: θ_g changes only when it is applied); with
        ``join_inner_state=copy`` this node's model and optimizer state after them."""
        if self.theta is None:
            raise PeerFailure("diloco: asked for a state before it has one")
        vec = pack_state(self.theta, self.bufs, self.frags, self._launched)
        if self.opts.join_inner_state == "copy":
            vec = np.concatenate([vec, await self.ctx.replica.export_state()])
        return vec

    async def _restore(self, vec: np.ndarray) -> None:
        """Keep the leader's state; the step loop takes it over (:meth:`_take_adopted`)."""
        own = state_size(self.ctx.replica.numel, len(self.frags))
        self._adopted = unpack_state(vec[:own], self.ctx.replica.numel, self.frags)
        self._inner = np.array(vec[own:], np.float32, copy=True) if vec.size > own else None

    def state_dict(self) -> dict[str, Any]:
        """θ_g, the outer momentum, counters, the operation in flight (its Δ and weight; its
        sums when they have arrived) and the settings a resume must share (tensors and JSON
        values)."""
        import torch

        if self.theta is None:
            return {}
        mom = pack_state(self.theta, self.bufs, self.frags, Counters(0, 0, 0, 0))[self.theta.size:2 * self.theta.size]
        out: dict[str, Any] = {
            "theta_g": torch.from_numpy(self.theta.copy()), "momentum": torch.from_numpy(mom.copy()),
            "has_momentum": [b is not None for b in self.bufs], "t": self.t, "ops": self.ops,
            "applied": self.applied, "fresh": sorted(self.fresh), "settings": self._settings(),
            "speed": self.speed, "fastest": self.fastest}
        cur = self.cursor
        if cur is not None:
            out["cursor"] = [cur.interval, cur.delay, cur.since, cur.next_frag, -1 if cur.due is None else cur.due]
        op = self.inflight
        if op is not None:
            c = op.counters
            rec: dict[str, Any] = {"f": op.f, "w": op.w, "stop": op.stop, "nonfinite": op.nonfinite,
                                   "counters": [c.op, c.t, c.step, c.applied, c.frag], "speed": op.speed,
                                   "payload": torch.from_numpy(op.payload.copy())}
            res = op.result
            if res is None and op.task is not None and op.task.done() and not op.task.cancelled() \
                    and op.task.exception() is None and isinstance(op.task.result(), tuple):
                s, side, _ = op.task.result()
                res = (s, side)
            if res is not None:
                rec["result"] = [torch.from_numpy(np.array(res[0], np.float32)),
                                 torch.from_numpy(np.array(res[1], np.float32))]
            out["inflight"] = rec
        return out

    def _settings(self) -> list[float]:
        o = self.opts
        return [float(o.inner_steps), float(len(self.frags)), float(o.tau), o.outer_lr, o.outer_momentum,
                float(o.nesterov), self.digest]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume θ_g, the momentum, the counters and the operation in flight."""
        if not state:
            return
        if list(state.get("settings", [])) != self._settings():
            raise ConfigError("diloco: the checkpoint was taken with other settings (inner_steps, fragments, tau, "
                              "outer_lr, outer_momentum, nesterov or the model's fragments differ)")
        self.theta = np.asarray(state["theta_g"].numpy(), np.float32).copy()
        mom = np.asarray(state["momentum"].numpy(), np.float32)
        self.bufs = [np.array(mom[idx], copy=True) if have else None
                     for idx, have in zip(self.frags, state["has_momentum"])]
        self.t, self.ops, self.applied = int(state["t"]), int(state["ops"]), int(state["applied"])
        self.fresh = set(int(f) for f in state.get("fresh", []))
        self.speed, self.fastest = float(state.get("speed", 0.0)), float(state.get("fastest", 0.0))
        cur = state.get("cursor")
        if cur is not None and self.cursor is not None:
            h, d, since, nxt, due = (int(v) for v in cur)
            self.cursor = Cursor(parts=len(self.frags), interval=h, delay=d, since=since, next_frag=nxt,
                                 due=None if due < 0 else due)
        rec = state.get("inflight")
        if rec is not None:
            c = Counters(*(int(v) for v in rec["counters"]))
            op = _Op(f=int(rec["f"]), payload=np.asarray(rec["payload"].numpy(), np.float32).copy(),
                     w=float(rec["w"]), stop=bool(rec["stop"]), nonfinite=bool(rec["nonfinite"]), counters=c,
                     speed=float(rec.get("speed", 0.0)))
            if "result" in rec:
                op.result = (np.asarray(rec["result"][0].numpy(), np.float32).copy(),
                             np.asarray(rec["result"][1].numpy(), np.float32).copy())
                self.inflight = op
            else:
                self._relaunch = op
            self._launched = c

    # -- one step ------------------------------------------------------------------------

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        sched = self.schedule
        if sched is None:
            raise ConfigError("diloco: train_step before start")
        t0 = clock.now()
        extra: dict[str, Any] = {}
        if self.theta is None and self._adopted is None:
            await self._begin()
        if self._adopted is not None:  # a joiner's first step
            await self._take_adopted(extra)
        if self._relaunch is not None:
            op, self._relaunch = self._relaunch, None
            self._start(op)
        cur = self.cursor
        if cur is None:
            raise ConfigError("diloco: train_step before start")
        wait = clock.now() - t0
        tc = clock.now()
        try:
            loss, grad = await self.ctx.replica.compute_gradients()
        except TrainingEnded:
            await self.close()  # the peers whose loops go on redo it without this node
            raise
        await self.ctx.replica.apply_gradients(grad)  # the inner step: the user's optimizer
        t1 = clock.now()
        self._measure(t1 - tc)
        self.t += 1
        self._want_stop = self._want_stop or want_stop
        # a step budget stops every node at the same step, known in advance; with DyLU the
        # nodes' steps differ: the stop rides with the sums (the fastest node raises it)
        stop = not self.opts.dylu and self.ctx.max_steps is not None and step + 1 >= self.ctx.max_steps
        next_step: int | None = None
        f, apply = cur.step()
        if self.opts.eager:
            apply, got_eager = False, await self._eager_round(f, step, extra) if f is not None else False
            if isinstance(got_eager, Counters):
                next_step = got_eager.step + 1
                stop = self.ctx.max_steps is not None and next_step >= self.ctx.max_steps
            else:
                stop = stop or got_eager
        elif f is not None:
            await self._launch(f, step)
            apply = cur.apply_now()
        if apply and self.inflight is not None:
            got = await self._apply(extra)
            if isinstance(got, Counters):
                next_step = got.step + 1
                stop = not self.opts.dylu and self.ctx.max_steps is not None and next_step >= self.ctx.max_steps
            else:
                stop = stop or got
        stop = stop or self._stopping
        if stop:
            await self._flush(extra, step)
        wait += clock.now() - t1
        # comm_s: everything outside the inner step (reading and writing the model, the outer
        # steps, sums); wait_s: only the time blocked on a sum that had not arrived yet
        blocked = float(extra.get("wait_op_s", 0.0))
        return StepReport(loss=loss, stop=stop, comm_s=wait, wait_s=blocked, next_step=next_step, extra={
            **extra, "outer_steps": self.applied, "in_flight": int(self.inflight is not None),
            "blocked": self.blocked, "skipped_nonfinite": self.skipped, "members": len(self.ctx.group),
            "reforms": self.regroup.reformations, "adoptions": self.adoptions,
            **({"h_m": cur.interval, "speed": round(self.speed, 3)} if self.opts.dylu else {})})

    def _measure(self, seconds: float) -> None:
        """The inner-step speed (steps/s of compute, exchanges excluded), an EMA (0.9); the
        first step (warm-up: kernels load, caches fill) is not counted."""
        self._measured += 1
        if seconds <= 0 or self._measured <= 1:
            return
        v = 1.0 / seconds
        self.speed = v if self.speed == 0 else 0.9 * self.speed + 0.1 * v

    def _view(self) -> View:
        return self.failure.view()

    async def _begin(self) -> None:
        """First step of a fresh run: every member starts from the lowest id's parameters
        (``init_sync``) and checks that every member cut the same fragments."""
        rep, coll, view = self.ctx.replica, self.ctx.collectives, self._view()
        params = await rep.get_params()
        tag = OpId("diloco", "init", view.epoch).tag
        rows = await coll.allgather(np.array([self.digest, float(len(self.frags))], np.float32), view.members,
                                    tag=f"{tag}.map")
        if any(not np.array_equal(r, rows[0]) for r in rows):
            raise ConfigError("diloco: the members cut different fragments (different models, or different "
                              "--opt fragments / fragment_by / fragment_pattern)")
        if self.opts.init_sync and len(view.members) > 1:
            root = np.asarray(await coll.broadcast(params, min(view.members), view.members, tag=tag), np.float32)
            if root.tobytes() != params.tobytes():  # (a session's start gave every member the same already;
                await rep.set_params(root)          # replacing them would skip the iteration parked now)
            params = root
        self.theta = np.array(params, np.float32, copy=True)

    def _weight(self, f: int) -> float:
        rep = self.ctx.replica
        if self.opts.weighting == "samples":
            if f == FULL:
                w = (rep.samples - min(self.marks)) / self.opts.inner_steps
            else:
                w = (rep.samples - self.marks[f]) / self.opts.inner_steps
                self.marks[f] = rep.samples
            return float(w)
        if f == FULL:
            return 0.0 if len(self.fresh) == len(self.frags) else 1.0
        if f in self.fresh:
            self.fresh.discard(f)
            return 0.0
        return 1.0

    async def _launch(self, f: int, step: int, *, zero: bool = False, ref: np.ndarray | None = None) -> None:
        """Send fragment ``f`` (or the whole model, ``FULL``): Δ = θ_g − θ_local (``ref``
        instead of θ_g for the whole model), weighted, summed over the view in the background."""
        if self.theta is None:
            raise ConfigError("diloco: no global copy yet")
        idx = self.frags[f] if f != FULL else None
        g = self.theta[idx] if idx is not None else self.theta if ref is None else ref
        if zero:
            delta = np.zeros_like(g)
        else:  # (a fragment's own values only: no copy of the whole model)
            rep = self.ctx.replica
            local = (await PARAM_RANGES.of(rep).get_params_range(self.ranges[f]) if idx is not None
                     else await rep.get_params())
            delta = np.subtract(g, local, dtype=np.float32)
        nonfinite = not bool(np.isfinite(delta).all())
        if nonfinite:
            delta = np.zeros_like(g)
        if zero:  # this fragment's first send since adopting: its next one spans a full interval again
            w = 0.0
            if f != FULL:
                self.fresh.discard(f)
                self.marks[f] = self.ctx.replica.samples
        else:
            w = self._weight(f)
        payload = delta if w == 1.0 else np.multiply(delta, np.float32(w))
        c = Counters(op=self.ops, t=self.t, step=step, applied=self.applied, frag=f)
        self.ops += 1
        self._launched = c
        self._start(_Op(f=f, payload=payload, w=w, stop=self._want_stop, nonfinite=nonfinite, counters=c,
                        speed=float(np.float32(self.speed))))  # (as the side sum carries it)
        if f != FULL and self.cursor is not None:
            self.cursor.sent(f)

    def _start(self, op: _Op) -> None:
        op.task = asyncio.get_running_loop().create_task(self._run_op(op), name=f"p2psync-diloco.{op.k}")
        self.inflight = op

    async def _run_op(self, op: _Op) -> Any:
        return await self.regroup.run(op.k, lambda v: self._reduce(v, op))

    async def _reduce(self, view: View, op: _Op) -> tuple[np.ndarray, np.ndarray, OpStats]:
        """Σ w·Δ (outer codec) and Σ [w, stop, non-finite] (exact) over ``view``; the
        error-feedback residuals of this fragment are put back if the attempt fails, so a redo
        does not add the quantization error twice."""
        coll = self.ctx.collectives
        tag = OpId("diloco", op.k, view.epoch).tag
        part = "full" if op.f == FULL else f"f{op.f}"
        side = np.zeros(3 + (len(view.members) if self.opts.dylu else 0), np.float32)
        side[:3] = op.w, float(op.stop), float(op.nonfinite)
        if self.opts.dylu:
            side[3 + view.members.index(self.ctx.node_id)] = op.speed
        fb = coll.feedback
        family = ("diloco", part)  # the error-feedback key of this fragment's pseudo-gradient
        kept = {k: v for k, v in fb.residual.items() if isinstance(k, tuple) and family in k} if fb else {}
        try:
            (s, st), sums = await gather_or_cancel([
                coll.allreduce_with_stats(op.payload, view.members, op="sum", tag=f"{tag}.{part}", codec=self.codec,
                                          feedback=family),
                coll.allreduce(side, view.members, op="sum", tag=f"{tag}.side", codec="none")])
        except BaseException:
            if fb is not None:
                for k in [k for k in fb.residual if isinstance(k, tuple) and family in k]:
                    del fb.residual[k]
                fb.residual.update(kept)
            raise
        return np.asarray(s, np.float32), np.asarray(sums, np.float32), st

    async def _collect(self, extra: dict[str, Any], *, final: bool = False
                       ) -> tuple[_Op, np.ndarray, np.ndarray, OpStats | None] | Counters | None:
        """Await the operation in flight: (op, Σ w·Δ, the side sums, stats), or the counters of
        a leader's state this node adopted instead, or None when nothing is in flight."""
        op = self.inflight
        if op is None:
            return None
        st: OpStats | None = None
        if op.result is not None:
            s, side = op.result
        else:
            if op.task is None:
                raise ConfigError("diloco: an operation without a task")
            if not op.task.done() and not final:
                self.blocked += 1
            t0 = clock.now()
            got = await op.task
            extra["wait_op_s"] = round(float(extra.get("wait_op_s", 0.0)) + clock.now() - t0, 4)
            if isinstance(got, Adopted) or got is None:
                self.inflight = None
                if final and self.opts.eager:
                    raise PeerFailure("diloco: a view changed during the completion step of eager updates' stop "
                                      "(it is not re-formed)")
                return await self._take_adopted(extra)
            s, side, st = got
        self.inflight = None
        if self.cursor is not None:
            self.cursor.applied()
        if self.opts.dylu and side.size > 3:
            self.fastest = float(side[3:].max())
            if op.f == len(self.frags) - 1 and self.cursor is not None:  # a cycle's last: the next cycles' length
                # this node's speed as it published it in this op, against the fastest published there
                h = dylu_interval(op.speed, self.fastest, self.opts.inner_steps, len(self.frags),
                                  self.opts.dylu_min_steps)
                self.cursor.interval = h
                self.cursor.delay = min(self.opts.tau, h - 1)
        if st is not None:
            extra.update(compression=round(st.compression, 3), op_nic_bytes=st.nic_bytes)
        return op, s, side, st

    async def _apply(self, extra: dict[str, Any], *, final: bool = False) -> bool | Counters:
        """Await the operation in flight and apply it (outer step, merge). Returns whether the
        members agreed to stop, or the counters of a leader's state this node adopted instead."""
        got = await self._collect(extra, final=final)
        if got is None or isinstance(got, Counters):
            return False if got is None else got
        op, s, side, _ = got
        await self._outer(op, s, side, extra, merge_local=True)
        return bool(side[1] > 0)

    def _late_part(self, op: _Op, s: np.ndarray, side: np.ndarray, extra: dict[str, Any]) -> np.ndarray | None:
        """Eager: the others' contributions of a finished round (None when it is skipped)."""
        sw = float(side[0])
        if side[2] > 0 or not sw > 0:
            self.skipped += int(bool(side[2] > 0))
            return None
        extra.update(sum_w=sw)
        return others_mean(s, op.payload, sw)

    async def _eager_round(self, f: int, step: int, extra: dict[str, Any]) -> bool | Counters:
        """Eager updates (fragments=1): await the previous round's sum, launch this round's,
        then one outer step on this node's θ_g with its own fresh pseudo-gradient and the
        others' previous ones (:func:`~p2psync.strategies.diloco_state.eager_gradient`), and
        θ_local ← θ_g. Returns whether the previous round carried a stop, or adopted counters."""
        if self.theta is None or self.cursor is None:
            raise ConfigError("diloco: no global copy yet")
        got = await self._collect(extra)
        if isinstance(got, Counters):
            return got
        stop, others = False, None
        if got is not None:
            prev, s, side, _ = got
            stop = bool(side[1] > 0)
            others = self._late_part(prev, s, side, extra)
        await self._launch(f, step)
        self.cursor.applied()  # (the round's own sum is awaited at the next send)
        new = self.inflight
        if new is None:
            raise ConfigError("diloco: the round did not start")
        g = eager_gradient(new.payload, float(len(self._view().members)), others)
        extra.update(delta_norm=float(np.linalg.norm(g)))
        o = self.opts
        self.bufs[0] = outer_step(self.theta, self.bufs[0], g, lr=o.outer_lr, momentum=o.outer_momentum,
                                  nesterov=o.nesterov)
        self.applied += 1
        await self.ctx.replica.set_params(self.theta.copy())
        return stop

    async def _outer(self, op: _Op, s: np.ndarray, side: np.ndarray, extra: dict[str, Any], *,
                     merge_local: bool) -> None:
        """One outer step per fragment the operation covers, then θ_local of those fragments
        (``merge_local``: merged with α when τ > 0, else θ_g)."""
        if self.theta is None:
            raise ConfigError("diloco: no global copy yet")
        sw = float(side[0])
        frags = range(len(self.frags)) if op.f == FULL else [op.f]
        o = self.opts
        skip = bool(side[2] > 0) or not sw > 0
        if skip:
            self.skipped += int(bool(side[2] > 0))
            mean = None
        else:
            mean = np.divide(s, np.float32(sw), dtype=np.float32)
            extra.update(delta_norm=float(np.linalg.norm(mean)), sum_w=sw)
        for f in frags:
            idx = self.frags[f]
            if mean is not None:
                g = self.theta[idx]
                d = mean if op.f != FULL else mean[idx]
                self.bufs[f] = outer_step(g, self.bufs[f], d, lr=o.outer_lr, momentum=o.outer_momentum,
                                          nesterov=o.nesterov)
                self.theta[idx] = g
            self.applied += 1
        if merge_local:
            alpha = o.alpha if o.tau > 0 and not skip else 0.0
            for f in frags:
                g = self.theta[self.frags[f]]
                ranged = PARAM_RANGES.of(self.ctx.replica)
                local = g if alpha == 0.0 else await ranged.get_params_range(self.ranges[f])
                await ranged.set_params_range(self.ranges[f], merge(g, local, alpha))

    async def _take_adopted(self, extra: dict[str, Any]) -> Counters:
        """Take the leader's state (Regroup's sync of a new view): θ_g, b, counters;
        θ_local ← θ_g; then take part in the operation the leader is running with Δ = 0 and
        weight 0 (applied at once when τ = 0)."""
        if self._adopted is None or self.schedule is None:
            raise PeerFailure("diloco: no state to adopt")
        theta, bufs, c = self._adopted
        self._adopted = None
        if self.inflight is not None:
            await self.close()
        self.theta, self.bufs = theta, bufs
        self.t, self.ops, self.applied = c.t, c.op, c.applied
        inner, self._inner = self._inner, None
        if inner is not None and self.ctx.joining and self.adoptions == 0:  # a joiner: the leader's inner state
            await self.ctx.replica.import_state(inner)
        await self.ctx.replica.set_params(self.theta.copy())
        self.fresh = set(range(len(self.frags)))
        self.marks = [self.ctx.replica.samples] * len(self.frags)
        self.adoptions += 1
        cur = self.cursor
        if c.frag in (FULL, CLOSE) and not self.opts.eager:  # the leader is at the stop
            self._stopping = True
            log.warning("node %d: adopted the leader's DiLoCo state at its stop (operation %d, %s)", self.ctx.node_id,
                        c.op, "final sync" if c.frag == FULL else "closing checks")
            if c.frag == FULL:  # take part in the leader's final sync with Δ = 0
                await self._launch(FULL, c.step, zero=True)
            else:
                self._final_done = True
            return c
        if cur is None or not 0 <= c.frag < len(self.frags):
            raise PeerFailure(f"diloco: the leader's operation {c.op} names fragment {c.frag}")
        cur.since, cur.next_frag, cur.due = 0, c.frag, None
        await self._launch(c.frag, c.step, zero=True)
        if self.opts.eager:
            cur.applied()  # (awaited at the next send)
        elif cur.apply_now():
            got = await self._apply(extra)
            if isinstance(got, Counters):
                return got
        log.warning("node %d: adopted the leader's DiLoCo state at operation %d (step %d)", self.ctx.node_id,
                    c.op, c.step)
        return c

    async def _flush(self, extra: dict[str, Any], step: int) -> None:
        """The stop: apply the operation in flight, the final full sync (``final_sync=full``),
        then the closing checks (:meth:`_close_checks`) as one more operation. A member that
        adopts a leader's state on the way joins what the leader runs (the module docstring)."""
        if self.theta is None:
            raise ConfigError("diloco: no global copy yet")
        # the model's progress since the last send is measured from θ_g as it was then (eager's
        # completion step below moves θ_g without any local step behind it)
        since = self.theta.copy()
        if self.opts.eager:  # the completion step: the others' last contributions, no new own one
            last = await self._collect(extra, final=True)
            if isinstance(last, tuple):
                late = self._late_part(last[0], last[1], last[2], extra)
                if late is not None:
                    o = self.opts
                    self.bufs[0] = outer_step(self.theta, self.bufs[0], late, lr=o.outer_lr,
                                              momentum=o.outer_momentum, nesterov=o.nesterov)
        elif self.inflight is not None and self.inflight.f != FULL:
            await self._apply(extra, final=True)  # (an adoption here may launch the leader's final sync)
        if self.opts.final_sync == "full" and not self._final_done:
            if self.inflight is None or self.inflight.f != FULL:
                await self._launch(FULL, step, ref=since if self.opts.eager else None)
            got = await self._collect(extra, final=True)
            if isinstance(got, tuple):
                full, s, side, _ = got
                await self._outer(full, s, side, extra, merge_local=False)
            elif got is None or got.frag != CLOSE:
                raise PeerFailure("diloco: the final sync ended without a result")
        if self.theta is None:
            raise ConfigError("diloco: no global copy yet")
        self._launched = Counters(op=self.ops, t=self.t, step=step, applied=self.applied, frag=CLOSE)
        done = await self.regroup.run(self.ops, self._close_checks)
        if isinstance(done, Adopted):  # it missed the final sync: the leader's θ_g holds it
            await self._take_adopted(extra)
            if not self._final_done:
                raise PeerFailure("diloco: adopted a state that is not at the stop's closing checks")
            done = await self.regroup.run(self.ops, self._close_checks)
        if isinstance(done, Adopted):
            raise PeerFailure("diloco: the members did not agree on the stop's closing checks")

    async def _close_checks(self, view: View) -> None:
        """The stop's last operation over ``view``: eager's exact mean of θ_g and the momentum,
        θ_local ← θ_g, buffers as ``--buffers`` says, and a digest of θ_g compared over the
        members (a mismatch is a :class:`~p2psync.errors.ReplicaMismatch`)."""
        if self.theta is None:
            raise ConfigError("diloco: no global copy yet")
        coll = self.ctx.collectives
        op = OpId("diloco", self.ops, view.epoch).tag
        theta, mom = self.theta, self.bufs[0]
        if self.opts.eager:  # every node's own θ_g and momentum differ by its in-flight terms: one exact mean
            m = mom if mom is not None else np.zeros_like(theta)
            th, mo = await gather_or_cancel([
                coll.allreduce(exact_mean_input(theta), view.members, op="mean", codec="none", tag=f"{op}.mean"),
                coll.allreduce(exact_mean_input(m), view.members, op="mean", codec="none", tag=f"{op}.mean.b")])
            theta, mom = np.asarray(th, np.float32), np.asarray(mo, np.float32)
        await self.ctx.replica.set_params(theta.copy())
        await sync_buffers(MODEL_BUFFERS.of(self.ctx.replica), coll, self.ctx.buffers, tag=f"{op}.end",
                           group=view.members)
        mine = np.frombuffer(hashlib.blake2b(theta.tobytes(), digest_size=8).digest(), np.uint8).copy()
        rows = await coll.allgather(mine, view.members, tag=f"{op}.hash")
        differ = tuple(n for n, r in zip(view.members, rows) if not np.array_equal(r, rows[0]))
        if differ:
            raise ReplicaMismatch(f"diloco: the global copy differs on node(s) {list(differ)} from node "
                                  f"{view.members[0]}'s at the end", nodes=differ, tensor="theta_g")
        self.theta = theta  # (kept only once every member holds it: a redo starts from the same θ_g)
        if self.opts.eager:
            self.bufs[0] = mom

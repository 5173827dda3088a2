"""One DiLoCo operation and the node state it works on (IO): a fragment's (or the whole
model's) weighted pseudo-gradient sum launched in the background over the current view through
:class:`~p2psync.strategies.regroup.Regroup`, awaited, and applied as an outer step.

Send: Δ = θ_g[f] − θ_local[f]; ``w·Δ`` is summed over the view's members by the topology's
collectives with the outer codec (tag ``diloco.<op>.e<epoch>.f<f>``), next to an exact side sum
of ``[w, stop, non-finite]`` (``.side``; DyLU adds one speed slot per member). Apply: Δ̄ =
Σ w·Δ / Σ w, one outer step on θ_g[f] and b[f], then θ_local[f] ← θ_g[f] + α·(θ_local[f] −
θ_g[f]) (α = 0 when τ = 0). Every member applies the same bytes (a lossy codec's owner seals
decode(encode(sum))), so θ_g stays bitwise identical everywhere (except with ``eager``).

A failed attempt is redone over the next view with the same Δ's; the error-feedback residuals
it consumed are put back first, so the redo does not add the quantization error twice. When
this node adopts a leader's state instead (Regroup's sync of a new view), awaiting the
operation hands over to :meth:`Operations._take_adopted` (:mod:`.adoption`).
"""

from __future__ import annotations

import asyncio
import logging
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from p2psync import clock
from p2psync.collectives import OpId, OpStats
from p2psync.coordinator import View
from p2psync.errors import ConfigError
from p2psync.model import PARAM_RANGES
from p2psync.strategies.base import Strategy, StrategyContext
from p2psync.strategies.diloco.options import DilocoOptions
from p2psync.strategies.diloco.outer import late_part, merge, others_mean, outer_step
from p2psync.strategies.diloco.schedule import Cursor, Schedule, dylu_interval
from p2psync.strategies.diloco.fragments import Ranges
from p2psync.strategies.diloco.state import FULL, Counters
from p2psync.strategies.failure import FailurePolicy
from p2psync.strategies.regroup import Adopted, Regroup
from p2psync.tasks import cancel_all, gather_or_cancel

log = logging.getLogger("p2psync.diloco")


@dataclass
class Op:
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
    #: eager: the own fresh term of this round that θ_g holds (:func:`~.outer.own_term`):
    #: this node's, or the leader's when it adopted the leader's state in this round
    held: np.ndarray | None = None

    @property
    def k(self) -> int:
        return self.counters.op


class Operations(Strategy):
    """The node's DiLoCo state (θ_g, momentum, counters, the operation in flight) and its
    operations: launch, sum over a view, await, apply. The strategy (:mod:`.strategy`) builds on
    it through :class:`~p2psync.strategies.diloco.adoption.Adoption` and
    :class:`~p2psync.strategies.diloco.stop.Stopping`."""

    Options = DilocoOptions
    opts: DilocoOptions

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.codec = self.opts.outer_codec or ctx.collectives.codec
        self.regroup = Regroup(ctx=ctx, name="diloco", snapshot=self._snapshot, restore=self._restore,
                               size=self._state_size)
        #: the failure policy (re-form or stop) the step driver applies, shared with the regroup
        self.failure: FailurePolicy = self.regroup.failure
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
        self.inflight: Op | None = None
        self._relaunch: Op | None = None
        self._launched = Counters(0, 0, 0, 0)
        self._adopted: tuple[np.ndarray, list[np.ndarray | None], Counters, np.ndarray | None] | None = None
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

    async def close(self) -> None:
        op, self.inflight = self.inflight, None
        if op is not None:
            await cancel_all([op.task])

    @abstractmethod
    def _state_size(self) -> int:
        """Length of the state vector a member behind adopts (:mod:`.adoption`)."""

    @abstractmethod
    async def _snapshot(self) -> np.ndarray:
        """This node's state vector for a member behind (:mod:`.adoption`)."""

    @abstractmethod
    async def _restore(self, vec: np.ndarray) -> None:
        """Keep a leader's state vector for :meth:`_take_adopted` (:mod:`.adoption`)."""

    @abstractmethod
    async def _take_adopted(self, extra: dict[str, Any]) -> Counters:
        """Take the leader's state kept by :meth:`_restore`; returns its counters (:mod:`.adoption`)."""

    def _view(self) -> View:
        return self.failure.view()

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

    async def _launch(self, f: int, step: int, *, zero: bool = False, ref: np.ndarray | None = None,
                      at_stop: bool = False) -> None:
        """Send fragment ``f`` (or the whole model, ``FULL``): Δ = θ_g − θ_local (``ref``
        instead of θ_g for the whole model), weighted, summed over the view in the background.
        ``at_stop``: the members agreed to stop already (its counters say so to a member
        that adopts this node's state during it)."""
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
        c = Counters(op=self.ops, t=self.t, step=step, applied=self.applied, frag=f, at_stop=at_stop)
        self.ops += 1
        self._launched = c
        self._start(Op(f=f, payload=payload, w=w, stop=self._want_stop, nonfinite=nonfinite, counters=c,
                       speed=float(np.float32(self.speed))))  # (as the side sum carries it)
        if f != FULL and self.cursor is not None:
            self.cursor.sent(f)

    def _start(self, op: Op) -> None:
        op.task = asyncio.get_running_loop().create_task(self._run_op(op), name=f"p2psync-diloco.{op.k}")
        self.inflight = op

    async def _run_op(self, op: Op) -> Any:
        return await self.regroup.run(op.k, lambda v: self._reduce(v, op))

    async def _reduce(self, view: View, op: Op) -> tuple[np.ndarray, np.ndarray, OpStats]:
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
                       ) -> tuple[Op, np.ndarray, np.ndarray, OpStats | None] | Counters | None:
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

    def _late_part(self, op: Op, s: np.ndarray, side: np.ndarray, extra: dict[str, Any]) -> np.ndarray | None:
        """Eager: a finished round's mean less the own fresh term θ_g holds of it (``op.held``).
        A skipped round (a non-finite Δ somewhere, or no weight) adds nothing: its late part only
        takes the held term out again (None when there is none)."""
        sw = float(side[0])
        if side[2] > 0 or not sw > 0:
            self.skipped += int(bool(side[2] > 0))
            return None if op.held is None or not op.held.any() else np.negative(op.held)
        extra.update(sum_w=sw)
        if op.held is None:  # (a round restored from a checkpoint without its held term: over Σw)
            return others_mean(s, op.payload, sw)
        return late_part(s, sw, op.held)

    async def _outer(self, op: Op, s: np.ndarray, side: np.ndarray, extra: dict[str, Any], *,
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

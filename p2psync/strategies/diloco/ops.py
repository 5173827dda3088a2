"""One DiLoCo operation (IO), over the node's state (:mod:`.node`): a fragment's (or the whole
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
operation hands over to :meth:`Operations.adopt`: the node takes the leader's state
(:meth:`.adoption.Adoption.take`) and takes part in the leader's operation with Δ = 0.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from p2psync import clock
from p2psync.collectives import OpId, OpStats
from p2psync.coordinator import View
from p2psync.errors import ConfigError, PeerFailure
from p2psync.model import PARAM_RANGES
from p2psync.strategies.base import StrategyContext
from p2psync.strategies.diloco.adoption import Adoption
from p2psync.strategies.diloco.node import NodeState, Op
from p2psync.strategies.diloco.options import DilocoOptions
from p2psync.strategies.diloco.outer import late_part, merge, others_mean, outer_step
from p2psync.strategies.diloco.schedule import dylu_interval
from p2psync.strategies.diloco.state import CLOSE, FULL, Counters
from p2psync.strategies.regroup import Adopted, Regroup
from p2psync.tasks import gather_or_cancel

log = logging.getLogger("p2psync.diloco")


class Operations:
    """The node's operations over its :class:`~.node.NodeState`: launch, sum over a view
    (through ``regroup``, keyed by the operation number), await, apply; and, when an awaited
    operation was replaced by a leader's state, taking that state (``adoption``) and part in
    the leader's operation. ``codec`` is the outer codec the sums use, ``algo`` their
    collective plan (None: the run's)."""

    def __init__(self, ctx: StrategyContext, opts: DilocoOptions, state: NodeState, regroup: Regroup,
                 adoption: Adoption, codec: str, algo: str | None = None) -> None:
        self.ctx = ctx
        self.opts = opts
        self.state = state
        self.regroup = regroup
        self.adoption = adoption
        self.codec = codec
        self.algo = algo

    def _weight(self, f: int) -> float:
        st, rep = self.state, self.ctx.replica
        if self.opts.weighting == "samples":
            if f == FULL:
                w = (rep.samples - min(st.marks)) / self.opts.inner_steps
            else:
                w = (rep.samples - st.marks[f]) / self.opts.inner_steps
                st.marks[f] = rep.samples
            return float(w)
        if f == FULL:
            return 0.0 if len(st.fresh) == len(st.frags) else 1.0
        if f in st.fresh:
            st.fresh.discard(f)
            return 0.0
        return 1.0

    async def launch(self, f: int, step: int, *, zero: bool = False, ref: np.ndarray | None = None,
                     at_stop: bool = False) -> None:
        """Send fragment ``f`` (or the whole model, ``FULL``): Δ = θ_g − θ_local (``ref``
        instead of θ_g for the whole model), weighted, summed over the view in the background.
        ``at_stop``: the members agreed to stop already (its counters say so to a member
        that adopts this node's state during it)."""
        st = self.state
        if st.theta is None:
            raise ConfigError("diloco: no global copy yet")
        idx = st.frags[f] if f != FULL else None
        g = st.theta[idx] if idx is not None else st.theta if ref is None else ref
        if zero:
            delta = np.zeros_like(g)
        else:  # (a fragment's own values only: no copy of the whole model)
            rep = self.ctx.replica
            local = (await PARAM_RANGES.of(rep).get_params_range(st.ranges[f]) if idx is not None
                     else await rep.get_params())
            delta = np.subtract(g, local, dtype=np.float32)
        nonfinite = not bool(np.isfinite(delta).all())
        if nonfinite:
            delta = np.zeros_like(g)
        if zero:  # this fragment's first send since adopting: its next one spans a full interval again
            w = 0.0
            if f != FULL:
                st.fresh.discard(f)
                st.marks[f] = self.ctx.replica.samples
        else:
            w = self._weight(f)
        payload = delta if w == 1.0 else np.multiply(delta, np.float32(w))
        c = Counters(op=st.ops, t=st.t, step=step, applied=st.applied, frag=f, at_stop=at_stop)
        st.ops += 1
        st.launched = c
        self.start(Op(f=f, payload=payload, w=w, stop=st.want_stop, nonfinite=nonfinite, counters=c,
                      speed=float(np.float32(st.speed))))  # (as the side sum carries it)
        if f != FULL and st.cursor is not None:
            st.cursor.sent(f)

    def start(self, op: Op) -> None:
        """Run ``op`` in the background (through the regroup) as the operation in flight."""
        op.task = asyncio.get_running_loop().create_task(self._run(op), name=f"p2psync-diloco.{op.k}")
        self.state.inflight = op

    async def _run(self, op: Op) -> Any:
        return await self.regroup.run(op.k, lambda v: self.reduce(v, op))

    async def reduce(self, view: View, op: Op) -> tuple[np.ndarray, np.ndarray, OpStats]:
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
                                          algo=self.algo, feedback=family),
                coll.allreduce(side, view.members, op="sum", tag=f"{tag}.side", codec="none")])
        except BaseException:
            if fb is not None:
                for k in [k for k in fb.residual if isinstance(k, tuple) and family in k]:
                    del fb.residual[k]
                fb.residual.update(kept)
            raise
        return np.asarray(s, np.float32), np.asarray(sums, np.float32), st

    async def collect(self, extra: dict[str, Any], *, final: bool = False
                      ) -> tuple[Op, np.ndarray, np.ndarray, OpStats | None] | Counters | None:
        """Await the operation in flight: (op, Σ w·Δ, the side sums, stats), or the counters of
        a leader's state this node adopted instead (:meth:`adopt`), or None when nothing is in
        flight."""
        state = self.state
        op = state.inflight
        if op is None:
            return None
        st: OpStats | None = None
        if op.result is not None:
            s, side = op.result
        else:
            if op.task is None:
                raise ConfigError("diloco: an operation without a task")
            if not op.task.done() and not final:
                state.blocked += 1
            t0 = clock.now()
            got = await op.task
            extra["wait_op_s"] = round(float(extra.get("wait_op_s", 0.0)) + clock.now() - t0, 4)
            if isinstance(got, Adopted) or got is None:
                state.inflight = None
                return await self.adopt(extra)
            s, side, st = got
        state.inflight = None
        if state.cursor is not None:
            state.cursor.applied()
        if self.opts.dylu and side.size > 3:
            state.fastest = float(side[3:].max())
            if op.f == len(state.frags) - 1 and state.cursor is not None:  # a cycle's last: the next cycles' length
                # this node's speed as it published it in this op, against the fastest published there
                h = dylu_interval(op.speed, state.fastest, self.opts.inner_steps, len(state.frags),
                                  self.opts.dylu_min_steps)
                state.cursor.interval = h
                state.cursor.delay = min(self.opts.tau, h - 1)
        if st is not None:
            extra.update(compression=round(st.compression, 3), op_nic_bytes=st.nic_bytes, outer_algo=st.algo)
        return op, s, side, st

    async def apply(self, extra: dict[str, Any], *, final: bool = False) -> bool | Counters:
        """Await the operation in flight and apply it (outer step, merge). Returns whether the
        members agreed to stop, or the counters of a leader's state this node adopted instead."""
        got = await self.collect(extra, final=final)
        if got is None or isinstance(got, Counters):
            return False if got is None else got
        op, s, side, _ = got
        await self.outer(op, s, side, extra, merge_local=True)
        return bool(side[1] > 0)

    def late_part(self, op: Op, s: np.ndarray, side: np.ndarray, extra: dict[str, Any]) -> np.ndarray | None:
        """Eager: a finished round's mean less the own fresh term θ_g holds of it (``op.held``).
        A skipped round (a non-finite Δ somewhere, or no weight) adds nothing: its late part only
        takes the held term out again (None when there is none)."""
        sw = float(side[0])
        if side[2] > 0 or not sw > 0:
            self.state.skipped += int(bool(side[2] > 0))
            return None if op.held is None or not op.held.any() else np.negative(op.held)
        extra.update(sum_w=sw)
        if op.held is None:  # (a round restored from a checkpoint without its held term: over Σw)
            return others_mean(s, op.payload, sw)
        return late_part(s, sw, op.held)

    async def outer(self, op: Op, s: np.ndarray, side: np.ndarray, extra: dict[str, Any], *,
                    merge_local: bool) -> None:
        """One outer step per fragment the operation covers, then θ_local of those fragments
        (``merge_local``: merged with α when τ > 0, else θ_g)."""
        st = self.state
        if st.theta is None:
            raise ConfigError("diloco: no global copy yet")
        sw = float(side[0])
        frags = range(len(st.frags)) if op.f == FULL else [op.f]
        o = self.opts
        skip = bool(side[2] > 0) or not sw > 0
        if skip:
            st.skipped += int(bool(side[2] > 0))
            mean = None
        else:
            mean = np.divide(s, np.float32(sw), dtype=np.float32)
            extra.update(delta_norm=float(np.linalg.norm(mean)), sum_w=sw)
        for f in frags:
            idx = st.frags[f]
            if mean is not None:
                g = st.theta[idx]
                d = mean if op.f != FULL else mean[idx]
                st.bufs[f] = outer_step(g, st.bufs[f], d, lr=o.outer_lr, momentum=o.outer_momentum,
                                        nesterov=o.nesterov)
                st.theta[idx] = g
            st.applied += 1
        if merge_local:
            alpha = o.alpha if o.tau > 0 and not skip else 0.0
            for f in frags:
                g = st.theta[st.frags[f]]
                ranged = PARAM_RANGES.of(self.ctx.replica)
                local = g if alpha == 0.0 else await ranged.get_params_range(st.ranges[f])
                await ranged.set_params_range(st.ranges[f], merge(g, local, alpha))

    async def adopt(self, extra: dict[str, Any]) -> Counters:
        """Take the leader's state (Regroup's sync of a new view: :meth:`.adoption.Adoption.take`),
        then take part in the operation the leader is running with Δ = 0 and weight 0 (applied
        at once when τ = 0: when it carries the stop, this node stops with the members, as
        :attr:`~.node.NodeState.stopping`); returns the leader's counters. At the leader's stop:
        its final sync (taken part in), or its closing checks (θ_g holds the final sync already)."""
        c, held = await self.adoption.take()
        st = self.state
        cur = st.cursor
        if c.frag in (FULL, CLOSE):
            log.warning("node %d: adopted the leader's DiLoCo state at its stop (operation %d, %s)", self.ctx.node_id,
                        c.op, "final sync" if c.frag == FULL else "closing checks")
            if c.frag == FULL:  # take part in the leader's final sync with Δ = 0
                await self.launch(FULL, c.step, zero=True)
            else:
                st.final_done = True
            return c
        if cur is None or not 0 <= c.frag < len(st.frags):
            raise PeerFailure(f"diloco: the leader's operation {c.op} names fragment {c.frag}")
        cur.since, cur.next_frag, cur.due = 0, c.frag, None
        await self.launch(c.frag, c.step, zero=True, at_stop=c.at_stop)
        if self.opts.eager:  # θ_g holds the leader's step of this round, its own fresh term in it
            cur.applied()  # (awaited at the next send)
            st.applied += 1
            if st.inflight is not None:
                st.inflight.held = held
        elif cur.apply_now():
            got = await self.apply(extra)
            if isinstance(got, Counters):
                return got
            if got:  # the leader's operation carried the stop: this node stops with the members
                st.stopping = True
        log.warning("node %d: adopted the leader's DiLoCo state at operation %d (step %d%s)", self.ctx.node_id,
                    c.op, c.step, ", at its stop" if c.at_stop else "")
        return c

"""DiLoCo: local steps of the user's own optimizer, and every H steps an outer Nesterov step on a
global copy of the model from the averaged pseudo-gradient; Streaming DiLoCo's fragments, sent
in turn and merged τ steps later while training goes on.

Papers: DiLoCo (arXiv 2311.08105, Alg. 1), Streaming DiLoCo (arXiv 2501.18512, Alg. 2, §2.2-2.4);
the parts are listed in :mod:`p2psync.strategies.diloco`.

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
``eager``: :mod:`~p2psync.strategies.diloco.options`).

Views and the stop: every operation runs through :class:`~p2psync.strategies.regroup.Regroup`
(:mod:`~p2psync.strategies.diloco.ops`): a failed one is redone over the survivors, and a member
behind or a joiner adopts a leader's state (:mod:`~p2psync.strategies.diloco.adoption`). The
stop's protocol, re-formed the same way, is in :mod:`~p2psync.strategies.diloco.stop`.

Memory: θ_g and b (2n float32 on the host) persist; a fragment's send and merge read and write
only its own parameters (``Replica.get_params_range`` / ``set_params_range``), so the transient
copies are a fragment's size (the final full sync and an adoption touch the whole model).

Checkpoints (``state_dict``): θ_g, the outer momentum, the counters and the operation in flight
(its Δ and weight, and its result when it has arrived); a resumed run applies it at its step.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np

from p2psync import clock
from p2psync.collectives import OpId
from p2psync.compress import Codec, ErrorFeedback, get_codec
from p2psync.coordinator import View
from p2psync.errors import ConfigError, PeerFailure, TrainingEnded
from p2psync.model import LAYERED, MODEL_BUFFERS, PARAM_RANGES, Layer
from p2psync.strategies.base import StepReport, Strategy, StrategyContext, register
from p2psync.strategies.diloco.adoption import Adoption
from p2psync.strategies.diloco.fragments import fragment_map, indices, map_digest, part_count
from p2psync.strategies.diloco.node import NodeState, Op
from p2psync.strategies.diloco.ops import Operations
from p2psync.strategies.diloco.options import DilocoOptions
from p2psync.strategies.diloco.outer import eager_gradient, outer_step, own_term
from p2psync.strategies.diloco.schedule import Cursor, Schedule
from p2psync.strategies.diloco.state import Counters, pack_state
from p2psync.strategies.diloco.stop import Stop
from p2psync.strategies.failure import FailurePolicy
from p2psync.strategies.needs import Needs
from p2psync.strategies.regroup import Regroup

log = logging.getLogger("p2psync.diloco")


@register
class DiLoCo(Strategy):
    """``--strategy diloco`` (see the module docstring). It owns the node's parts, each built
    with what it needs: the state (:class:`~.node.NodeState`), the adoption
    (:class:`~.adoption.Adoption`, whose three the regroup is built with), the regroup, the
    operations (:class:`~.ops.Operations`) and the stop (:class:`~.stop.Stop`); it implements
    the strategy's hooks and the step loop over them."""

    name = "diloco"
    requires = (PARAM_RANGES, LAYERED, MODEL_BUFFERS)
    needs = Needs(schedules="honoured: the user's optimizer takes every inner step (the outer lr is constant)",
                  clipping="clips each node's own gradient (inner steps are local)",
                  buffers="each node's own between syncs; the lowest member's (or the mean) at the end (--buffers)")
    identical_replicas = "end"
    Options = DilocoOptions
    opts: DilocoOptions

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.state = NodeState()
        self.adoption = Adoption(ctx, self.opts, self.state)
        self.regroup = Regroup(ctx=ctx, name="diloco", snapshot=self.adoption.snapshot,
                               restore=self.adoption.restore, size=self.adoption.size)
        #: the failure policy (re-form or stop) the step driver applies, shared with the regroup
        self.failure: FailurePolicy = self.regroup.failure
        codec = self.opts.outer_codec or ctx.collectives.codec
        self.ops = Operations(ctx, self.opts, self.state, self.regroup, self.adoption, codec=codec,
                              algo=self.opts.outer_plan(codec, ctx.collectives.algo))
        self.stop = Stop(ctx, self.opts, self.state, self.ops, self.regroup)

    @classmethod
    def check_blocks(cls, opts: DilocoOptions, *, blocks: int, rest: bool) -> None:
        """The schedule's checks against the number of fragments such a model is cut into
        (:meth:`~.options.DilocoOptions.check_parts`)."""
        opts.check_parts(part_count(opts.fragments, by=opts.fragment_by, blocks=blocks, rest=rest))

    def codecs(self) -> list[Codec]:
        return [get_codec(self.ops.codec)]

    async def close(self) -> None:
        await self.state.drop_inflight()

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        st = self.state
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
        self.opts.check_parts(len(ranges))
        st.ranges = ranges
        st.frags = [indices(r) for r in ranges]
        st.digest = map_digest(ranges)
        st.schedule = Schedule(self.opts.inner_steps, len(st.frags), self.opts.tau)
        st.cursor = Cursor(parts=len(st.frags), interval=st.schedule.interval, delay=self.opts.tau)
        st.bufs = [None] * len(st.frags)
        st.marks = [rep.samples] * len(st.frags)
        if self.ctx.joining:
            got = await self.regroup.join()  # (no op: the leader's state is kept by the adoption's restore)
            kept = self.adoption.pending
            if kept is None:
                raise PeerFailure("diloco: joined but no member gave its state")
            self.start_step = kept.step + 1
            log.info("node %d: joins at operation %d (step %d)", self.ctx.node_id, got, self.start_step)

    def on_peer_failure(self, peer: int) -> None:
        self.regroup.on_peer_failure(peer)

    def on_view(self, view: View) -> None:
        self.regroup.on_view(view)

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """θ_g, the outer momentum, counters, the operation in flight (its Δ and weight; its
        sums when they have arrived) and the settings a resume must share (tensors and JSON
        values)."""
        import torch

        st = self.state
        if st.theta is None:
            return {}
        mom = pack_state(st.theta, st.bufs, st.frags, Counters(0, 0, 0, 0))[st.theta.size:2 * st.theta.size]
        out: dict[str, Any] = {
            "theta_g": torch.from_numpy(st.theta.copy()), "momentum": torch.from_numpy(mom.copy()),
            "has_momentum": [b is not None for b in st.bufs], "t": st.t, "ops": st.ops,
            "applied": st.applied, "fresh": sorted(st.fresh), "settings": self._settings(),
            "speed": st.speed, "fastest": st.fastest}
        cur = st.cursor
        if cur is not None:
            out["cursor"] = [cur.interval, cur.delay, cur.since, cur.next_frag, -1 if cur.due is None else cur.due]
        op = st.inflight
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
            if op.held is not None:
                rec["held"] = torch.from_numpy(op.held.copy())
            if res is not None:
                rec["result"] = [torch.from_numpy(np.array(res[0], np.float32)),
                                 torch.from_numpy(np.array(res[1], np.float32))]
            out["inflight"] = rec
        return out

    def _settings(self) -> list[float]:
        o = self.opts
        return [float(o.inner_steps), float(len(self.state.frags)), float(o.tau), o.outer_lr, o.outer_momentum,
                float(o.nesterov), self.state.digest]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume θ_g, the momentum, the counters and the operation in flight."""
        st = self.state
        if not state:
            return
        if list(state.get("settings", [])) != self._settings():
            raise ConfigError("diloco: the checkpoint was taken with other settings (inner_steps, fragments, tau, "
                              "outer_lr, outer_momentum, nesterov or the model's fragments differ)")
        st.theta = np.asarray(state["theta_g"].numpy(), np.float32).copy()
        mom = np.asarray(state["momentum"].numpy(), np.float32)
        st.bufs = [np.array(mom[idx], copy=True) if have else None
                   for idx, have in zip(st.frags, state["has_momentum"])]
        st.t, st.ops, st.applied = int(state["t"]), int(state["ops"]), int(state["applied"])
        st.fresh = set(int(f) for f in state.get("fresh", []))
        st.speed, st.fastest = float(state.get("speed", 0.0)), float(state.get("fastest", 0.0))
        cur = state.get("cursor")
        if cur is not None and st.cursor is not None:
            h, d, since, nxt, due = (int(v) for v in cur)
            st.cursor = Cursor(parts=len(st.frags), interval=h, delay=d, since=since, next_frag=nxt,
                               due=None if due < 0 else due)
        rec = state.get("inflight")
        if rec is not None:
            op_, t, at, applied, frag = (int(v) for v in rec["counters"])
            c = Counters(op=op_, t=t, step=at, applied=applied, frag=frag)
            op = Op(f=int(rec["f"]), payload=np.asarray(rec["payload"].numpy(), np.float32).copy(),
                    w=float(rec["w"]), stop=bool(rec["stop"]), nonfinite=bool(rec["nonfinite"]), counters=c,
                    speed=float(rec.get("speed", 0.0)))
            if "held" in rec:
                op.held = np.asarray(rec["held"].numpy(), np.float32).copy()
            if "result" in rec:
                op.result = (np.asarray(rec["result"][0].numpy(), np.float32).copy(),
                             np.asarray(rec["result"][1].numpy(), np.float32).copy())
                st.inflight = op
            else:
                st.relaunch = op
            st.launched = c

    # -- one step ------------------------------------------------------------------------

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        st = self.state
        sched = st.schedule
        if sched is None:
            raise ConfigError("diloco: train_step before start")
        t0 = clock.now()
        extra: dict[str, Any] = {}
        if st.theta is None and self.adoption.pending is None:
            await self._begin()
        if self.adoption.pending is not None:  # a joiner's first step
            c = await self.ops.adopt(extra)
            if st.stopping:  # the operation it adopted carried the members' stop: it stops with them,
                await self.stop.flush(extra, c.step)  # with no inner step of its own past their last
                return self._report(float("nan"), True, clock.now() - t0, extra, next_step=c.step + 1)
        if st.relaunch is not None:
            op, st.relaunch = st.relaunch, None
            self.ops.start(op)
        cur = st.cursor
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
        st.t += 1
        st.want_stop = st.want_stop or want_stop
        # a step budget stops every node at the same step, known in advance; with DyLU the
        # nodes' steps differ: the stop rides with the sums (the fastest node raises it)
        stop = not self.opts.dylu and self.ctx.max_steps is not None and step + 1 >= self.ctx.max_steps
        next_step: int | None = None
        f, apply = cur.step()
        if self.opts.eager:
            apply, got_eager = False, await self._eager_round(f, step, extra, stopping=stop) if f is not None else False
            if isinstance(got_eager, Counters):
                next_step = got_eager.step + 1
                stop = self.ctx.max_steps is not None and next_step >= self.ctx.max_steps
            else:
                stop = stop or got_eager
        elif f is not None:
            await self.ops.launch(f, step)
            apply = cur.apply_now()
        if apply and st.inflight is not None:
            got = await self.ops.apply(extra)
            if isinstance(got, Counters):
                next_step = got.step + 1
                stop = not self.opts.dylu and self.ctx.max_steps is not None and next_step >= self.ctx.max_steps
            else:
                stop = stop or got
        stop = stop or st.stopping
        if stop:
            await self.stop.flush(extra, step)
        wait += clock.now() - t1
        return self._report(loss, stop, wait, extra, next_step=next_step)

    def _report(self, loss: float, stop: bool, wait: float, extra: dict[str, Any], *,
                next_step: int | None) -> StepReport:
        """A step's report. comm_s (``wait``): everything outside the inner step (reading and
        writing the model, the outer steps, sums); wait_s: only the time blocked on a sum that
        had not arrived yet."""
        st, cur = self.state, self.state.cursor
        blocked = float(extra.get("wait_op_s", 0.0))
        return StepReport(loss=loss, stop=stop, comm_s=wait, wait_s=blocked, next_step=next_step, extra={
            **extra, "outer_steps": st.applied, "in_flight": int(st.inflight is not None),
            "blocked": st.blocked, "skipped_nonfinite": st.skipped, "members": len(self.ctx.group),
            "reforms": self.regroup.reformations, "adoptions": st.adoptions,
            **({"h_m": cur.interval, "speed": round(st.speed, 3)} if self.opts.dylu and cur is not None else {})})

    def _measure(self, seconds: float) -> None:
        """The inner-step speed (steps/s of compute, exchanges excluded), an EMA (0.9); the
        first step (warm-up: kernels load, caches fill) is not counted."""
        st = self.state
        st.measured += 1
        if seconds <= 0 or st.measured <= 1:
            return
        v = 1.0 / seconds
        st.speed = v if st.speed == 0 else 0.9 * st.speed + 0.1 * v

    async def _begin(self) -> None:
        """First step of a fresh run: every member starts from the lowest id's parameters
        (``init_sync``) and checks that every member cut the same fragments."""
        st = self.state
        rep, coll, view = self.ctx.replica, self.ctx.collectives, self.failure.view()
        params = await rep.get_params()
        tag = OpId("diloco", "init", view.epoch).tag
        rows = await coll.allgather(np.array([st.digest, float(len(st.frags))], np.float32), view.members,
                                    tag=f"{tag}.map")
        if any(not np.array_equal(r, rows[0]) for r in rows):
            raise ConfigError("diloco: the members cut different fragments (different models, or different "
                              "--opt fragments / fragment_by / fragment_pattern)")
        if self.opts.init_sync and len(view.members) > 1:
            root = np.asarray(await coll.broadcast(params, min(view.members), view.members, tag=tag), np.float32)
            if root.tobytes() != params.tobytes():  # (a session's start gave every member the same already;
                await rep.set_params(root)          # replacing them would skip the iteration parked now)
            params = root
        st.theta = np.array(params, np.float32, copy=True)

    async def _eager_round(self, f: int, step: int, extra: dict[str, Any], *, stopping: bool) -> bool | Counters:
        """Eager updates (fragments=1): await the previous round's sum, launch this round's,
        then one outer step on this node's θ_g with its own fresh pseudo-gradient and the
        others' previous ones (:func:`~p2psync.strategies.diloco.outer.eager_gradient`: the own
        fresh term is kept with the round, ``Op.held``, for its late part), and θ_local ← θ_g.
        Returns whether the previous round carried a stop, or adopted counters.
        ``stopping`` (the step budget ends here) or a stop carried by the previous round makes
        this round the one the stop's completion step awaits (launched ``at_stop``)."""
        st = self.state
        if st.theta is None or st.cursor is None:
            raise ConfigError("diloco: no global copy yet")
        got = await self.ops.collect(extra)
        if isinstance(got, Counters):
            return got
        stop, others = False, None
        if got is not None:
            prev, s, side, _ = got
            stop = bool(side[1] > 0)
            others = self.ops.late_part(prev, s, side, extra)
        await self.ops.launch(f, step, at_stop=stopping or stop)
        st.cursor.applied()  # (the round's own sum is awaited at the next send)
        new = st.inflight
        if new is None:
            raise ConfigError("diloco: the round did not start")
        expected = float(len(self.failure.view().members))
        g = eager_gradient(new.payload, expected, others)
        new.held = own_term(new.payload, expected)  # (the term g holds: its late part takes it out)
        extra.update(delta_norm=float(np.linalg.norm(g)))
        o = self.opts
        st.bufs[0] = outer_step(st.theta, st.bufs[0], g, lr=o.outer_lr, momentum=o.outer_momentum,
                                nesterov=o.nesterov)
        st.applied += 1
        await self.ctx.replica.set_params(st.theta.copy())
        return stop

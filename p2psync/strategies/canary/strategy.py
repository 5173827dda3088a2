"""Canary: colayers exchanged during backward over multi-NIC BCube, GEI bitmaps, staleness
bounding (Zhou et al., *Canary*, §4.3-§5).

What a node does per iteration ``t`` (spec §6.6):

1. Backward produces the colayers' gradients output layer first (§4.3.2; grouping:
   :mod:`~p2psync.strategies.canary.colayers`). As soon as the last parameter of colayer
   ``c^[z]`` has its gradient (``register_post_accumulate_grad_hook``, through the one training
   path's gradient-ready hook) its exchange starts, overlapping the rest of backward (and, in
   the built-in job, the emulated device time): pipelining, §4.3.2 advantage 2.
2. The exchange (:mod:`~p2psync.strategies.canary.exchange`) runs the §6.3 BCube schedule (α·β
   slots per colayer, one thread per level/NIC; a mesh scatter/gather on other topologies,
   Fig. 14), every payload through the gradient sketch by default (§4.3.1; what an encoding
   drops leaves with the next data, never lost; ``--codec sketch8p``: the sketch exactly as
   the paper gives it, spec §2), at **5 bits per value** (``--opt sketch_bits``; the paper
   sketches at 8 bits and allows "fewer and flexible bits (instead of the fixed 8 bits) ...
   according to the property of different layers", §4.3.1). Why 5: on ``bench.canary``
   (medians of 3 runs, 1 Gb/s NICs, README) 5 bits move 0.21 / 0.26 of BSP's bytes per
   iteration on BCube(2,2) / (3,2) against 8 bits' 0.33 / 0.42, reach the target as soon
   (1.74x / 1.70x sooner than BSP, 8 bits 1.91x / 1.72x, within the runs' spread) and end
   as accurate; 70 % below BSP's traffic (the paper reports 56 %) is out
   of 8 bits' reach on BCube(3,2), whose schedule moves 1.125x a ring's bytes. ``--opt
   sketch_bits=0`` chooses the width per piece: the fewest bits (2-8) whose sketch keeps the
   piece's relative L2 error within ``sketch_tol`` (0.1: at most 1 % of its energy waits for
   the next round; ``sketch8:auto``; 0.22 / 0.27 of BSP's bytes, README). In ``native`` mode
   nobody waits for anyone's computation: a peer answers every push at once, with an empty
   packet when it has nothing for this node (§4.4.2), and data a slow node could not take
   part in leaves with its next exchange.
3. The GEI row of ``t`` records whose contributions each colayer's aggregate holds (the AND of
   its slots' masks; :mod:`~p2psync.strategies.canary.gei`). ``ζ`` (the newest iteration any
   worker reported) and the node at ζ (the lowest id of those seen there: neither depends on
   the order messages arrive in) ride in every message header, so ζ spreads to every worker
   hop by hop (§4.3).
4. The end-of-iteration decision (§5.4): within ``s`` of ζ, or beyond it with at least ``p``
   complete colayers: apply the aggregate through the user's optimizer step; else *overtime*:
   drop the iteration's gradients, pull the model (parameters) of the fastest worker (the node
   at ζ, reached hop by hop; else the freshest one heard from) and go on at that model's
   iteration (see *Overtime* below).

Choices where the paper is silent or wrong (the spec's resolutions unless said):

* **Divisor** (``divisor=members``, default; a departure from the spec): the aggregate is
  divided by the number of members ``n`` of the view. The spec (§5.4, §9 item 13) divides by
  the number of contributors, ``popcount(r^[z])`` (the mean of what arrived), and offers ``n``
  as the option; here that reading is ``divisor=contributors``, which divides each slot by the
  number of contributions it summed (equal to the popcount when every worker's gradient is in
  once). Why ``n`` by default: in native mode every contribution reaches every node once, but
  not in the same iteration: a slow node's round sums several iterations of its fast peers.
  Dividing by the contributions would make a slow node's replica move less per second than a
  fast one's, and the replicas drift apart; dividing by n applies every gradient with weight
  1/n on every replica. With plain SGD and no codec the replicas then differ only by what is
  still in flight; a lossy codec's residue is delivered later (bounded, not a random walk),
  and data lost with a failed peer, dropped as stale at some nodes only, or overwritten by an
  overtime pull makes them differ more (the stop's final average ends the run with one
  model). In bsp mode every colayer is complete, so both divisors give the mean.
* **Staleness**: a contribution whose iteration is older than ``ζ − s`` is dropped where it is
  (the sender's own gradient is not sent at all), so a node that falls more than ``s``
  iterations behind has incomplete colayers (its own bit is missing) and is reset by branch C.
  Canary's bounding never blocks the fast workers (spec §5.5). The own GEI bit: a node keeps
  its own gradient in its result for every slot (owned or not; an owner's total leaves the
  sender's own contribution out, so nobody gets its own gradient back), so the bit is set in
  every slot as soon as the colayer's round adds the gradient, just before its first piece
  leaves (spec §4.4 item 4), unless it was already stale. Branch C drops the aggregate;
  pieces of the node's own gradient still waiting in outboxes leave anyway (the others may
  use them).
* **Overtime** (branch C; a departure from the spec's ``t ← ζ``): the node goes on at
  ``max(t + 1, i)``, ``i`` being the iteration of the model it took (the lender's own
  iteration when it served it), or at ``t + 1`` with its own model when no peer gave one. When
  the node at ζ lends its model, ``i`` is ζ (or newer: it moved on meanwhile); when it cannot
  and a slower peer does, adopting ζ would give the node an iteration its parameters do not
  have, and the next decisions would count it as up to date when it is not. ``t + 1`` at
  least: a node's iterations only go up (rows and bsp rounds are keyed by them).
* **Replies** (``replies``, native mode): §4.4.2 says a worker sends "an empty packet when it
  is still under computation or has exchanged current gradient in prior communication"; the
  spec (§6.5) reads that as "empty when it holds nothing for the pusher", so by default
  (``held``) a computing node's reply carries what it relays for the pusher. ``round`` reads it
  literally: outside its own round of that colayer (computing, or done exchanging it) a node's
  replies are empty and what it relays leaves with its own next push, summed into one
  message. Measured (``bench.canary``'s two rows, README): ``round`` sends the schedule's
  bytes per iteration (Canary fp32 1.02x BSP's on
  BCube(2,2), against 1.25x), but a slow node now relays its fast peers' gradients at its own
  pace, and time to target grows (BCube(2,2) fp32, two seeds: 12.7 / 15.3 s against 11.0 /
  11.0 s), so ``held`` stays the default.
* ``mode=bsp`` (§5.3): every exchange waits for every member's data of the same iteration (no
  empty packets), every colayer is complete every iteration: synchronous SGD on Canary's
  schedule (equal to ``ssgd`` with the sketch off).
* **Stop**: a node that has stopped (``--steps``, ``--time``, ``request_stop``) says so in
  every message it sends and every node stops at the end of the iteration in which it learns
  it (native: the first node at its budget ends the run); in bsp mode the flag rides in the
  contributions of the last round (with ``--steps`` known in advance) and every node stops
  after the same round; the members then average their whole state once (exact), so the
  run ends with one model (as P-Reduce and DTS do). A member that is re-synchronizing when
  another stops learns it in that averaging and stops too.
* **Views**: a failed peer's pending answers are aborted at once (native: empty packets; bsp:
  the round is abandoned); at the next step the members of the new view average their state
  (exact, :meth:`~p2psync.strategies.regroup.Regroup.average_state`) and the exchange is
  re-planned over them (the BCube layout needs the whole BCube; any other group uses the mesh
  layout, relaying over direct links). Data in flight at that moment is dropped. A joiner
  takes a live member's state and joins that average.
* **Pipelining** sends the gradients backward produced. Several backward passes per step
  (gradient accumulation) is a clear error with ``pipeline=true`` (the first pass's colayers
  are already on their way; ``pipeline=false`` sends them at the step); a ``.grad`` changed
  after backward (clipping, ``GradScaler.unscale_``) is warned about once: the peers got the
  unchanged gradient (use ``pipeline=false`` to send what the step sees). A colayer whose
  parameters did not all get a gradient in backward (an unused branch) is sent at the step.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
from typing import Any, Literal, Mapping

import numpy as np

from p2psync import clock
from p2psync.strategies.canary.plan import layout_for
from p2psync.compress import Codec, Sketch8, get_codec
from p2psync.coordinator import View
from p2psync.errors import ConfigError, P2PSyncError, PeerFailure, ProtocolError
from p2psync.model import LAYERED, MODEL_BUFFERS
from p2psync.strategies.needs import Needs
from p2psync.strategies.options import StrategyOptions, option, require
from p2psync.strategies.base import StepReport, Strategy, StrategyContext, register
from p2psync.strategies.canary.colayers import Colayer, group, parse_counts
from p2psync.strategies.canary.exchange import CanaryMode, Exchange, Progress, ReplyPolicy, RoundResult
from p2psync.strategies.canary.gei import Branch, GEIMatrix, decide, members_mask, node_bit, validate
from p2psync.strategies.canary.wire import Header
from p2psync.strategies.failure import FailurePolicy
from p2psync.strategies.regroup import Regroup
from p2psync.tasks import cancel_all
from p2psync.transport.forward import Forwarder

log = logging.getLogger("p2psync.canary")

Divisor = Literal["members", "contributors"]
ProportionMask = Literal["full", "own"]


@dataclasses.dataclass(frozen=True)
class CanaryOptions(StrategyOptions):
    """``--opt`` options of ``--strategy canary`` (see the module docstring)."""

    mode: CanaryMode = option("native", "native (asynchronous, empty packets) or bsp (every colayer complete "
                              "every iteration)")
    replies: ReplyPolicy = option("held", "native: a reply carries the data held for the pusher at any time (held) "
                                  "or only during this node's own round of that colayer (round: fewer bytes, "
                                  "later data)")
    s: float = option(18.0, "staleness threshold: iterations behind the fastest worker (inf: never stale)")
    p: int = option(-1, "colayers that must be complete once s is exceeded (-1: 60 % of them, the paper's 6 of 10)")
    colayers: int = option(0, "number of colayers of nearly equal size (0: the automatic rule)")
    colayer_layers: str = option("", "layers per colayer, output to input (e.g. 3,4,4,8)")
    colayer_kib: int = option(4096, "automatic rule: largest colayer, KiB")
    sketch: bool = option(True, "without --codec: payloads through the sketch (sketch8:sketch_bits), else none")
    sketch_bits: int = option(5, "the sketch's bits per value: 1-8 (2**bits buckets; the paper's 8 bits: "
                              "sketch_bits=8), or 0: per piece, the fewest within sketch_tol (§4.3.1 'fewer "
                              "and flexible bits')")
    sketch_tol: float = option(Sketch8.AUTO_TOL, "sketch_bits=0: relative L2 error allowed per piece (what it drops "
                               "leaves with the next round)")
    sketch_fraction: float = option(1.0, "sketch while step/--steps is below this (Fig. 22a)")
    divisor: Divisor = option("members", "members (sum / n) or contributors")
    proportion_mask: ProportionMask = option("full", "a colayer is complete with every member's bit (full) or its "
                                                     "own (own)")
    pipeline: bool = option(True, "send each colayer as soon as backward produced it")

    def __post_init__(self) -> None:
        require(self.s >= 0, self, "s", "must be >= 0")
        require(0.0 <= self.sketch_fraction <= 1.0, self, "sketch_fraction", "must be in [0, 1]")
        require(self.colayer_kib >= 1, self, "colayer_kib", "must be >= 1")
        require(0 <= self.sketch_bits <= 8, self, "sketch_bits", "must be between 1 and 8, or 0 (automatic)")
        require(0.0 < self.sketch_tol < 1.0, self, "sketch_tol", "must be between 0 and 1")
        require(self.sketch_bits == 0 or self.sketch_tol == Sketch8.AUTO_TOL, self, "sketch_tol",
                "applies to sketch_bits=0 only (the width chosen per piece)")
        require(self.colayers >= 0, self, "colayers", "must be >= 0 (0: the automatic rule)")
        require(self.mode == "native" or self.replies == "held", self, "replies",
                "applies to mode=native only (mode=bsp sends no replies)")
        parse_counts(self.colayer_layers)


def sketch_codec(o: CanaryOptions) -> Codec:
    """The sketch ``--opt sketch_bits`` / ``sketch_tol`` ask for: ``sketch8:BITS`` (5 by
    default), or ``sketch8:auto`` at that tolerance for ``sketch_bits=0``."""
    return Sketch8(tol=o.sketch_tol) if o.sketch_bits == 0 else Sketch8(bits=o.sketch_bits)


@register
class Canary(Strategy):
    """``--strategy canary``: colayers exchanged during backward, GEI bitmaps, staleness
    bounding (see the module docstring)."""

    name = "canary"
    requires = (LAYERED, MODEL_BUFFERS)
    identical_replicas = "end"
    needs = Needs(clipping="not applied to what is sent: colayers leave during backward (a changed .grad is "
                           "warned about; --opt pipeline=false sends what the step sees)",
                  buffers="each node's own; re-syncs and the final average take the lowest member's (--buffers)")
    grad_ready = True
    Options = CanaryOptions
    opts: CanaryOptions
    failure: FailurePolicy

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        o = self.opts
        self.layer_counts = parse_counts(o.colayer_layers)
        run_codec = ctx.collectives.codec
        self.codec: Codec = (get_codec(run_codec) if run_codec != "none" else sketch_codec(o) if o.sketch
                             else get_codec("none"))
        self.plain = get_codec("none")
        self.regroup = Regroup(ctx=ctx, name="canary")
        #: the failure policy (re-form or stop) the step driver applies, shared with the regroup
        self.failure = self.regroup.failure
        self.fwd = Forwarder(transport=ctx.transport, name="canary", timeout=ctx.peer_timeout,
                             accept=lambda to, tag: to in ctx.topology.ids and tag.startswith("canary."))
        self.exchange: Exchange | None = None
        self.colayers: tuple[Colayer, ...] = ()
        self.t = 0  # this node's iteration (Canary's ⟨t⟩)
        self.last_iter: dict[int, int] = {}  # the newest iteration each peer told us
        self.stopping = False
        self.next_step = 0  # the loop step the next rounds belong to
        self.resyncs = 0
        self._resync_due = False
        self._rounds: dict[int, tuple[asyncio.Task[RoundResult], np.ndarray]] = {}
        self._pending: dict[int, dict[int, np.ndarray]] = {}
        self._double = False
        self._warned_grad = False
        self._pulls = 0
        self.counts = {b.value: 0 for b in Branch}
        #: (iteration, colayer, clock.now() when its exchange started) of the last rounds
        self.timeline: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=256)

    # -- lifecycle -----------------------------------------------------------------------

    def codecs(self) -> list[Codec]:
        """The sketch (or ``--codec``) it exchanges with: warmed by the runtime before start."""
        return [self.codec]

    async def start(self) -> None:
        layers = LAYERED.of(self.ctx.replica).layers()
        self.colayers = group(layers, count=self.opts.colayers, layers_per_colayer=self.layer_counts,
                              max_bytes=self.opts.colayer_kib << 10)
        self.param_colayer = {p: c.index for c in self.colayers for p in c.params}
        self.p = self.opts.p if self.opts.p >= 0 else math.ceil(0.6 * len(self.colayers))
        try:
            validate(s=self.opts.s, p=self.p, colayers=len(self.colayers))
        except ValueError as exc:
            raise ConfigError(f"canary: {exc}") from None
        self.gei = GEIMatrix(len(self.colayers), me=self.ctx.node_id)
        self.fwd.start()
        self.ctx.rpc_server.register("canary.model", self._serve_model)
        self.t = self.next_step = self.start_step
        self.gei.see(self.t)
        if self.ctx.joining:
            self.resyncs = await self.regroup.join()
            self._resync_due = True
        self._plan(self.ctx.view)

    def _plan(self, view: View) -> None:
        self.exchange = Exchange(
            transport=self.ctx.transport, fwd=self.fwd, layout=layout_for(self.ctx.topology, view.members),
            sizes=[c.hi - c.lo for c in self.colayers], codec=self.codec, mode=self.opts.mode,
            staleness=self.opts.s, timeout=self.ctx.peer_timeout, epoch=view.epoch, plan=self.resyncs,
            piece=max(1, self.ctx.collectives.piece_bytes // 4), replies=self.opts.replies,
            progress=Progress(iteration=lambda: self.t, zeta=lambda: (self.gei.zeta, self.gei.zeta_node),
                              stopping=lambda: self.stopping, on_header=self._header,
                              last=self._stop_flag if self.opts.mode == "bsp" else None))
        self.exchange.start()

    async def close(self) -> None:
        await self._cancel_rounds()
        if self.exchange is not None:
            await self.exchange.close()
        await self.fwd.close()

    def on_peer_failure(self, peer: int) -> None:
        self.regroup.on_peer_failure(peer)
        if self.exchange is not None:
            self.exchange.abort_waits(PeerFailure(f"canary: peer {peer} failed", peers=(peer,)), peer)

    def on_view(self, view: View) -> None:
        self.regroup.on_view(view)
        if self.exchange is not None and view.epoch != self.exchange.epoch:
            self._resync_due = True
            self.exchange.retire(PeerFailure(f"canary: view {view.epoch} replaced view {self.exchange.epoch}"))

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "resyncs": self.resyncs}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A resumed run: the nodes' checkpoints hold different replicas (asynchronous), so the
        members average their state first."""
        if isinstance(state.get("t"), int):
            self.t = state["t"]
        self._resync_due = True

    # -- colayers launched during backward ------------------------------------------------

    def on_grad_ready(self, index: int, offset: int, grad: np.ndarray) -> None:
        if not self.opts.pipeline or self.exchange is None or self._resync_due or not self.colayers:
            return
        z = self.param_colayer[index]
        buf = self._pending.setdefault(z, {})
        if index in buf or z in self._rounds:
            self._double = True  # a second backward pass before the step
            return
        buf[index] = grad
        if len(buf) == len(self.colayers[z].params):
            del self._pending[z]
            self._launch(z, np.concatenate([buf[i] for i in sorted(buf)]).astype(np.float32, copy=False))

    def _launch(self, z: int, vec: np.ndarray) -> None:
        if self.exchange is None:
            raise ConfigError("canary: not started")
        task = asyncio.get_running_loop().create_task(self.exchange.round(z, self.t, vec), name=f"canary-c{z}")
        self._rounds[z] = (task, vec)

    async def _cancel_rounds(self) -> None:
        rounds, self._rounds = self._rounds, {}
        self._pending.clear()
        self._double = False
        await cancel_all(task for task, _ in rounds.values())

    def _launch_all(self, grad: np.ndarray) -> None:
        """Every colayer backward did not launch goes now; a launched one must be what the step
        sees (see the module docstring)."""
        if self._double:
            raise ConfigError("canary: several backward passes per optimizer.step() (gradient accumulation): "
                              "colayers leave during the first one; use --opt pipeline=false")
        for c in self.colayers:
            got = self._rounds.get(c.index)
            if got is None:
                self._launch(c.index, grad[c.lo:c.hi].copy())
            elif not self._warned_grad and not np.array_equal(got[1], grad[c.lo:c.hi]):
                self._warned_grad = True
                log.warning("node %d: canary: the gradient changed after backward (clipping, scaling?): the "
                            "peers got backward's gradient; --opt pipeline=false sends the one optimizer.step() "
                            "sees", self.ctx.node_id)
        self._pending.clear()

    # -- one iteration -------------------------------------------------------------------

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        self.next_step = step
        stop_now = False
        if self._resync_due:
            stop_now = await self._resync()
        loss, grad = await self.ctx.replica.compute_gradients()
        t0 = clock.now()
        if stop_now:  # a member stopped during the re-synchronization: nothing more to send
            await self._cancel_rounds()
            return StepReport(loss=loss, stop=True, extra=self._metrics())
        self._use_codec(step)
        rounds: dict[int, tuple[asyncio.Task[RoundResult], np.ndarray]] = {}
        try:
            self._launch_all(grad)
            rounds, self._rounds = self._rounds, {}
            t = self.t
            extra: dict[str, Any] = {}
            try:
                results = [await rounds[c.index][0] for c in self.colayers]
            except PeerFailure as exc:  # bsp: a member failed, or an answer never came: nothing applied
                log.warning("node %d: canary round of iteration %d abandoned: %s", self.ctx.node_id, t, exc)
                self._resync_due = True
                extra["abandoned"] = True
                results = []
            if results:
                extra.update(await self._decide(t, grad, results))
        finally:
            await cancel_all(task for task, _ in rounds.values())
            self._double = False
        # bsp: stop where any contribution of this round asked to (every node saw all of them);
        # native: as soon as this node wants to or heard of it
        seen = any(r.stop for r in results)
        stop = seen if self.opts.mode == "bsp" else self.stopping or want_stop or seen
        self.stopping = self.stopping or want_stop or seen
        self.next_step = step + 1
        if stop:
            await self._finish()
        wait = clock.now() - t0
        return StepReport(loss=loss, stop=stop, comm_s=wait, wait_s=wait, extra={**extra, **self._metrics()})

    async def _decide(self, t: int, grad: np.ndarray, results: list[RoundResult]) -> dict[str, Any]:
        members = self.exchange.layout.group if self.exchange is not None else (self.ctx.node_id,)
        for c, r in zip(self.colayers, results):
            self.gei.record(t, c.index, r.mask)
            self.timeline.append((t, c.index, r.started))
        need = members_mask(members) if self.opts.proportion_mask == "full" else node_bit(self.ctx.node_id)
        zeta = self.gei.zeta  # at the decision (headers arriving during a pull may raise it)
        d = decide(zeta=zeta, t=t, row=self.gei.row(t), mask=need, s=self.opts.s, p=self.p)
        if self.opts.mode == "bsp":
            d = dataclasses.replace(d, branch=Branch.APPLY)  # every colayer is complete by construction
        self.counts[d.branch.value] += 1
        row = list(self.gei.row(t))
        if d.branch is Branch.OVERTIME:
            got = await self._pull_fastest(members)
            self.t = max(t + 1, got) if got is not None else t + 1
        else:
            vec = np.empty_like(grad)
            for c, r in zip(self.colayers, results):
                if self.opts.divisor == "members":
                    vec[c.lo:c.hi] = r.sums / np.float32(len(members))
                else:
                    vec[c.lo:c.hi] = np.divide(r.sums, r.counts, out=np.zeros_like(r.sums), where=r.counts > 0)
            await self.ctx.replica.apply_gradients(vec)
            self.t = t + 1
        self.gei.see(self.t)
        self.gei.forget_before(self.t)  # only the current row decides
        return {"t": t, "zeta": zeta, "staleness": d.staleness, "branch": d.branch.value,
                "complete": d.complete, "gei": row[:16] if len(members) <= 62 else [],
                "round_s": round(max(r.seconds for r in results), 5)}

    def _use_codec(self, step: int) -> None:
        frac, total = self.opts.sketch_fraction, self.ctx.max_steps
        sketching = frac >= 1.0 or (total is not None and step < frac * total)
        if self.exchange is not None:
            self.exchange.codec = self.codec if sketching else self.plain

    def _stop_flag(self) -> bool:
        """bsp: what this node's contributions say: it stops, or the run's step budget ends
        with the step the next rounds belong to (every node then stops after that round)."""
        last = self.ctx.max_steps is not None and self.next_step + 1 >= self.ctx.max_steps
        return self.stopping or last

    def _header(self, h: Header) -> None:
        if h.it > self.last_iter.get(h.origin, -1):
            self.last_iter[h.origin] = h.it
        self.gei.heard(h.origin, h.it, h.zeta, h.zeta_node)
        if h.stop and not self.stopping:
            self.stopping = True

    def _metrics(self) -> dict[str, Any]:
        st = self.exchange.stats if self.exchange is not None else None
        out: dict[str, Any] = {"branches": dict(self.counts), "resyncs": self.resyncs,
                               "colayers": len(self.colayers)}
        if st is not None:
            out.update(empties_sent=st.empties_sent, empties_recv=st.empties_recv, stale=st.stale, lost=st.lost,
                       moved=st.moved, held=st.held, malformed=st.malformed, wire_bytes=st.wire_bytes,
                       raw_bytes=st.raw_bytes,
                       level_bytes={str(k): v for k, v in sorted(st.by_level.items())})
        return out

    # -- overtime: the fastest worker's model ---------------------------------------------

    async def _pull_fastest(self, members: tuple[int, ...]) -> int | None:
        """Branch C: copy the parameters of the fastest worker (the node that reported ζ, then
        the freshest peers heard from). Returns the iteration of the model taken, or None when
        no peer gave one (the node then goes on with its own)."""
        me = self.ctx.node_id
        heard = sorted((n for n in self.last_iter if n in members and n != me), key=lambda n: (-self.last_iter[n], n))
        fastest = self.gei.zeta_node
        first = [fastest] if fastest in members and fastest != me else []
        for n in dict.fromkeys([*first, *heard]):
            self._pulls += 1
            tag = f"canary.m.{me}.{self.ctx.transport.incarnation}.{self._pulls}"
            try:
                rep = await self.ctx.rpc.call(n, "canary.model", {"tag": tag}, timeout=self.ctx.peer_timeout)
                msg = await self.ctx.transport.recv(tag, timeout=self.ctx.peer_timeout)
                vec = msg.arrays[0] if len(msg.arrays) == 1 else None
                it = rep.get("it") if isinstance(rep, dict) else None
                if vec is None or vec.dtype != np.float32 or vec.size != self.ctx.replica.numel \
                        or type(it) is not int or not np.all(np.isfinite(vec)):
                    raise ProtocolError("canary", f"node {n} sent a malformed model")
            except P2PSyncError as exc:
                log.warning("node %d: canary overtime: no model from node %d: %s", me, n, exc)
                continue
            finally:
                self.ctx.transport.retire(tag)
            await self.ctx.replica.set_params(np.array(vec, copy=True))
            self.gei.see(it, n)
            log.info("node %d: canary overtime at iteration %d (ζ %d): took node %d's model (its iteration %d)",
                     me, self.t, self.gei.zeta, n, it)
            return int(it)
        return None

    async def _serve_model(self, caller: int, args: Mapping[str, Any], _: Any) -> Any:
        tag = args.get("tag")
        if not isinstance(tag, str) or not tag.startswith(f"canary.m.{caller}."):
            raise ProtocolError("canary", f"bad model request from node {caller}")
        it = self.t
        vec = await asyncio.wait_for(self.ctx.replica.get_params(), self.ctx.peer_timeout)
        await self.fwd.send(caller, tag, [vec], {"it": it})
        return {"it": it}

    # -- views and the end -----------------------------------------------------------------

    async def _resync(self) -> bool:
        """The members of the current view average their state (every member goes on at the
        newest member's iteration: bsp rounds are keyed by it) and the exchange is re-planned
        over them. True when a member stopped in that averaging."""
        await self._cancel_rounds()
        if self.exchange is not None:
            await self.exchange.close()
            self.exchange = None
        self.resyncs, go_on, stopped = await self.regroup.average_state(self.resyncs, self.t, self.stopping)
        self.t = go_on - 1
        self.gei.see(self.t)
        self._resync_due = False
        if stopped:
            self.stopping = True
            return True
        self._plan(self.ctx.view)
        return False

    async def _finish(self) -> None:
        """Stop: every member averages its whole state once, so the run ends with one model."""
        await self._cancel_rounds()
        self.resyncs, _, _ = await self.regroup.average_state(self.resyncs, self.t, True)

"""``--strategy diloco-async``: asynchronous Local-SGD with Delayed Nesterov (c = 0) and Dynamic
Local Updates (Async Local-SGD, arXiv 2401.09135, Alg. 3 and Eq. 6), without a server.

Each node takes H_m inner steps with the user's own optimizer (any class, untouched: its state is
never reset nor synchronized), then sends its pseudo-gradient g = θ_start − θ_local (θ_start: the
θ_g it started the phase from) and restarts from θ_g. The paper's server applies each g on
arrival (:mod:`~p2psync.strategies.diloco.dn`: θ ← θ − ε·g/N every time, and every N-th update
the momentum step). Here every node keeps a replica of that server's state (θ_g, m, the buffer's
sum, the counters) and applies the same stream of updates:

* **One total order.** A finished phase asks the coordinator's sequencer
  (:mod:`p2psync.coordinator.sequencer`, one RPC of a few bytes) for the next number of the
  current view's stream; every node applies the updates strictly in number order (one waiting
  for a missing number is held), so θ_g is bitwise identical on every node that applied the
  same prefix (numpy float32, one fixed operation order). A sequencer rather than a
  deterministic rule: a rule that needs no agreement (round robin over the members, say) makes
  each update wait for the slower members' earlier turns, which is the synchronous DiLoCo the
  asynchronous one exists to avoid; arrival order differs between nodes, so it cannot be used.
* **Encoded once.** The origin encodes g once with the outer codec (``outer_codec``, error
  feedback per ``error_feedback``), applies the *decoded* values itself like everyone else, and
  floods the bytes down a BFS tree of the live members (:mod:`~p2psync.strategies.flood`, shared
  with ASGD); relays forward them unchanged.
* **Grace.** After sending, a node waits until every update up to and including its own is
  applied (at most ``grace_s``), then for the rest of the buffer that holds its own (its
  momentum step; at most ``merge_s``, by default a quarter of the phase it just ended), then
  restarts from θ_g as it stands (what was not applied by then comes later; its next g is
  measured from the θ_g it restarted from, as the paper's workers do). The second wait is the
  paper's grace period (Alg. 2: a worker that finishes shortly after another is merged before
  both restart from the same server model): nodes that finish together restart from one θ_g,
  and with one update per node per buffer the run is synchronous DiLoCo's, outer step for
  outer step, while a node far from finishing holds nobody longer than the merge window.
  Waiting only for the numbers below its own (the spec's reading, §3.9.2) let the first node
  of a buffer restart from θ_g with its own update alone, without the others' nor the
  momentum step: measured on lm-tiny, ring-4, H = 20, 200 steps, val_bpb 4.32 against
  synchronous DiLoCo's 3.74. With DyLU every node's phase lasts about as long, so nobody
  waits a phase.
* **DyLU.** Every update carries its sender's measured inner-step speed (EMA of compute
  seconds per step); at each phase start a node takes
  H_m = max(dylu_min_steps, ⌊v_m / max v · H⌋) inner steps.

Failures and views (``--on-failure continue``): the numbers belong to one view (its epoch and
coordinator). At a new view the members re-form through
:class:`~p2psync.strategies.regroup.Regroup`: they freeze their streams, exchange how many
updates each applied, and every member behind adopts the state (θ_g, m, buffer, counters, the
stop) of the lowest-id member that applied the most, then numbering restarts at 0 over the new
view. Updates of the old view not in that state are dropped, like the paper's late updates
(a node's own local work is kept: its next g still measures it from its θ_start). A joiner
adopts the same state, starts from θ_g and continues at the leader's loop step (the state it
adopts carries it: :data:`STEP_SLOTS`), so a step budget (``--steps``) is the run's, not a fresh
one; a member behind keeps its own step. A number handed out but never delivered (its sender
died after asking, or a send was dropped) holds up the numbers after it; after ``hole_s``
(default the peer timeout) the node that waits asks the coordinator for a new epoch over the
same members (``request_redo``), and the re-form above resolves it. With ``--on-failure stop``
(or without a membership service) such a hole ends the run with PeerFailure.

Stop: a node that reaches its step budget (``--steps``: the fastest node's steps, as with
diloco's dylu) or whose loop asks to stop sends its last (partial-phase) pseudo-gradient marked
``stop``; the stream ends at that update on every node (later numbers are dropped, as is the
other nodes' unsent local work). Every node then checks, over the members, that its θ_g hashes
the same as the others' (a mismatch is ReplicaMismatch: a bug), sets θ_local ← θ_g, and stops:
one identical model everywhere, which the replica audit checks (``identical_replicas="end"``).
In exact arithmetic no final average is needed: the stream's order already makes θ_g bitwise
equal. An incomplete last buffer's momentum step is not applied (its plain parts are).

Deviations from the spec's design (§3.9.2): updates are applied in number order, not "on
arrival in any order" (float additions do not commute bitwise); the final identity is a hash
check instead of an exact average or broadcast (the replicas are already equal bitwise; a
member behind at the stop adopts the leader's state through the re-form). Module buffers
(BatchNorm statistics) stay each node's own.

Memory: θ_g, m, the buffer sum and θ_start (4n float32 on the host), plus the updates received
ahead of a missing number.

Checkpoints (``state_dict``): the packed DN state (θ_g, m, the buffer, the counters), θ_start,
the phase's position and H_m; a resumed node logs the restored state's digests and re-forms at
its first step (a member whose checkpoint applied fewer updates adopts the leader's state;
updates in flight when it was taken are dropped). A resume needs every node's checkpoint of one
step (replicas differ between the updates, so :mod:`p2psync.api.start` refuses mixed steps), and
nodes stop wherever the stop finds them: after a finished run their latest checkpoints may be of
different steps. A resumed run is not bitwise equal to the uninterrupted one: the order of the
updates is the sequencer's, a race, and no two runs are bitwise equal
(tests/e2e/test_diloco_async_cli.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from p2psync import clock
from p2psync.collectives import OpId
from p2psync.compress import Codec, ErrorFeedback, get_codec
from p2psync.coordinator import RpcServer, View
from p2psync.coordinator.sequencer import SequencerService
from p2psync.errors import (ConfigError, Diverged, P2PSyncError, PeerFailure, ProtocolError, ReplicaMismatch,
                            TrainingEnded, TransportError)
from p2psync.strategies.base import StepReport, Strategy, StrategyContext, register
from p2psync.strategies.diloco.async_options import DilocoAsyncOptions
from p2psync.strategies.diloco.dn import (DNState, apply_update, dylu_steps, int_slots, pack, slot_ints, state_size,
                                          unpack)
from p2psync.strategies.diloco.identity import differing, digest
from p2psync.strategies.failure import FailurePolicy, Reform
from p2psync.strategies.flood import Flood
from p2psync.strategies.needs import Needs
from p2psync.strategies.regroup import Adopted, Regroup
from p2psync.tasks import TaskSet
from p2psync.topology import Topology
from p2psync.wire import Message

log = logging.getLogger("p2psync.diloco_async")

#: the flooded pseudo-gradients (outside the ``dlasync.`` prefix of the regroup's operations)
TAG = "dlasync-g"
NAME = "diloco-async"
#: θ_g hashes kept per node after completed buffers (tests and metrics)
KEEP_HASHES = 256
#: float32 slots after the packed DN state in what a member behind adopts: the giver's loop step
STEP_SLOTS = 2


@dataclass
class Update:
    """One numbered pseudo-gradient (decoded) waiting for its turn."""

    origin: int
    g: np.ndarray
    stop: bool


@register
class DilocoAsync(Strategy):
    """``--strategy diloco-async`` (see the module docstring)."""

    name = NAME
    needs = Needs(schedules="honoured: the user's optimizer takes every inner step (the outer lr is constant)",
                  clipping="clips each node's own gradient (inner steps are local)",
                  buffers="each node's own (not synchronized)")
    identical_replicas = "end"
    Options = DilocoAsyncOptions
    opts: DilocoAsyncOptions

    @classmethod
    def coordinator_services(cls, server: RpcServer, topology: Topology, options: Mapping[str, Any]) -> None:
        SequencerService(server, name=NAME)

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.regroup = Regroup(ctx=ctx, name="dlasync", snapshot=self._snapshot, restore=self._restore,
                               size=lambda: state_size(ctx.replica.numel) + STEP_SLOTS)
        self.failure: FailurePolicy = self.regroup.failure
        self.codec = get_codec(self.opts.outer_codec or ctx.collectives.codec)
        fb = self.opts.feedback
        wants = (ctx.collectives.feedback is not None if fb is None else fb) or self.codec.always_feedback
        self.feedback = ErrorFeedback() if wants and self.codec.lossy else None
        self.flood = Flood(ctx, TAG, name="dlasync", send_timeout=self.opts.send_timeout)
        self._rx = TaskSet("dlasync-receive")
        self.dn: DNState | None = None
        #: θ_g when this node's phase began (its pseudo-gradient is measured from it)
        self.theta_start: np.ndarray | None = None
        #: the stream applied now, (view epoch, its coordinator); None: frozen (re-forming)
        self.stream: tuple[int, int] | None = None
        #: the oldest epoch whose updates are kept
        self.floor = -1
        #: dn.count when the stream began (update k of the stream is update base + k)
        self.base = 0
        self.n_buffer = 1
        self.pending: dict[tuple[int, int], dict[int, Update]] = {}
        self._applied = asyncio.Event()
        #: this node's update waiting to be applied: (stream, number)
        self.own: tuple[tuple[int, int], int] | None = None
        #: buffers completed before this node's latest update was applied (None: not applied yet)
        self.own_buffers: int | None = None
        self.requests = 0
        #: since when a missing number has held up later ones; the epoch a redo was asked for
        self.hole_since: float | None = None
        self.redo_asked = -1
        #: this node's inner steps in the phase, when it began, the phase's length, speeds (steps/s)
        self.phase = 0
        self.phase_t0 = clock.now()
        self.h_m = self.opts.inner_steps
        self.speed = 0.0
        self.measured = 0
        self.speeds: dict[int, float] = {}
        self.stop_sent = False
        self.started = False
        #: the loop's step this node is at (the one running, or the next): what a joiner continues at
        self.step = 0
        #: the step of the member whose state this node adopted last (None: it adopted none)
        self.adopted_step: int | None = None
        #: the loss of this node's latest inner step (what a step that only stops reports)
        self.last_loss = float("nan")
        #: counts for the step reports
        self.buffers = 0
        self.stale = 0
        self.duplicates = 0
        self.malformed = 0
        self.late = 0
        self.dropped_own = 0
        self.adoptions = 0
        self.grace_wait_s = 0.0
        #: the longest single grace wait (seconds)
        self.max_grace_s = 0.0
        #: pseudo-gradients this node sent
        self.sent = 0
        #: θ_g's hash after each completed buffer, by dn.count (the newest KEEP_HASHES)
        self.hashes: OrderedDict[int, int] = OrderedDict()

    def codecs(self) -> list[Codec]:
        return [self.codec]

    # -- the state a member behind adopts -----------------------------------------------

    async def _snapshot(self) -> np.ndarray:
        """:func:`~.dn.pack` of the DN state, then this node's loop step (a float64 in
        :data:`STEP_SLOTS` float32 slots, exact): a joiner continues at it."""
        if self.dn is None:
            raise ConfigError("diloco-async: no state yet")
        return np.concatenate([pack(self.dn), int_slots([self.step])])

    async def _restore(self, vec: np.ndarray) -> None:
        n = state_size(self.ctx.replica.numel)
        self.dn = unpack(vec[:n], self.ctx.replica.numel)
        self.adopted_step = slot_ints(vec[n:n + STEP_SLOTS])[0]
        self.adoptions += 1

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        rep = self.ctx.replica
        self.dn = DNState.start(np.asarray(await rep.get_params(), np.float32))
        self.theta_start = self.dn.theta.copy()
        self.flood.alive = set(self.failure.view().members) | {self.ctx.node_id}
        self._rx.spawn(self._receive())
        if self.ctx.joining:
            await self.regroup.join()
            if self.adopted_step is None:
                raise PeerFailure("diloco-async: joined but no member gave its state")
            # the leader's position: its budget (--steps) is the others', not a fresh one
            self.start_step = self.step = self.adopted_step
            await self._restart_phase()
            self._open_stream()
            self.started = True
            log.info("node %d: joins diloco-async at update %d, step %d", self.ctx.node_id, self.dn.count,
                     self.start_step)

    async def close(self) -> None:
        await self._rx.close()
        await self.flood.close(min(1.0, self.opts.send_timeout))

    def on_peer_failure(self, peer: int) -> None:
        self.regroup.on_peer_failure(peer)
        self.flood.alive.discard(peer)
        self._wake()

    def on_view(self, view: View) -> None:
        self.regroup.on_view(view)
        self.flood.alive = set(view.members) | {self.ctx.node_id}
        self._wake()

    def _wake(self) -> None:
        ev, self._applied = self._applied, asyncio.Event()
        ev.set()

    # -- the stream ----------------------------------------------------------------------

    def _reforming(self) -> bool:
        return isinstance(self.failure, Reform)

    def _key(self, view: View) -> tuple[int, int]:
        return (view.epoch, view.coordinator if self._reforming() else -1)

    def _open_stream(self) -> None:
        """Begin applying the current view's stream at this node's (agreed) state."""
        if self.dn is None:
            raise ConfigError("diloco-async: no state yet")
        view = self.failure.view()
        key = self._key(view)
        self.stream, self.floor, self.base = key, view.epoch, self.dn.count
        self.n_buffer = self.opts.dn_buffer or len(view.members)
        for k in [k for k in self.pending if k[0] < view.epoch or (k[0] == view.epoch and k != key)]:
            del self.pending[k]
        if self.own is not None and self.own[0] != key:
            self.own = None
            self.dropped_own += 1
        self.hole_since = None
        self._drain()

    def _in_sync(self) -> bool:
        if self.stream is None:
            return False
        return not self._reforming() or (self.regroup.synced == self.ctx.epoch
                                         and self.stream == self._key(self.ctx.view))

    async def _sync(self) -> None:
        """At a new view: freeze the stream, re-form (a member behind adopts the leader's
        state), and open the new view's stream."""
        if self._in_sync() or self.dn is None:
            return
        self.stream = None
        got = await self.regroup.run(self.dn.count, None)
        if isinstance(got, Adopted):
            log.warning("node %d: adopted the diloco-async state at update %d", self.ctx.node_id, got.step)
        self._open_stream()

    async def _receive(self) -> None:
        while True:
            try:
                msg = await self.ctx.transport.listen(TAG)
            except TransportError:  # closed
                return
            self._take(msg)
            while (m := self.ctx.transport.recv_nowait(TAG)) is not None:
                self._take(m)
            del msg
            self._drain()

    def _take(self, msg: Message) -> None:
        """Keep (and forward, once) one flooded update; drop a stale one or a copy."""
        meta = msg.meta
        origin, epoch, coord, k = meta.get("origin"), meta.get("epoch"), meta.get("coord"), msg.header.step
        try:
            if type(origin) is not int or origin not in self.ctx.topology.ids or type(epoch) is not int \
                    or type(coord) is not int or not isinstance(meta.get("stop"), bool):
                raise ProtocolError("diloco-async", "bad update header")
            if any(f.codec != self.codec.name for f in msg.header.frames):
                raise ProtocolError("codec", f"expected codec {self.codec.name}")
            key = (epoch, coord)
            if epoch < self.floor:
                self.stale += 1
                return
            box = self.pending.setdefault(key, {})
            if k in box or (key == self.stream and self.dn is not None and k < self.dn.count - self.base):
                self.duplicates += 1
                return
            g = self.codec.decode(msg.arrays, self.ctx.replica.numel)
        except ProtocolError as exc:
            if not self.malformed:
                log.warning("node %d: malformed update from node %d ignored: %s", self.ctx.node_id, msg.src, exc)
            self.malformed += 1
            return
        box[k] = Update(origin, np.asarray(g, np.float32), bool(meta["stop"]))
        speed = meta.get("speed")
        if isinstance(speed, float):
            self.speeds[origin] = speed
        self.flood.forward(origin, list(msg.arrays), step=k, meta=meta, codec=self.codec.name)

    def _drain(self) -> None:
        """Apply the current stream's updates that are next in number order."""
        dn, key = self.dn, self.stream
        if dn is None or key is None or dn.stop:
            return
        box = self.pending.get(key, {})
        moved = False
        o = self.opts
        while (k := dn.count - self.base) in box:
            u = box.pop(k)
            if self.own is not None and self.own == (key, k):
                self.own_buffers = self.buffers  # its buffer is complete once a buffer completes from here on
            if apply_update(dn, u.g, lr=o.outer_lr, momentum=o.outer_momentum, buffer=self.n_buffer):
                self.buffers += 1
                self.hashes[dn.count] = digest(dn.theta)
                while len(self.hashes) > KEEP_HASHES:
                    self.hashes.popitem(last=False)
            moved = True
            if u.stop:
                dn.stop = True
                break
        if box and not dn.stop:
            self.hole_since = self.hole_since if self.hole_since is not None and not moved else clock.now()
        else:
            self.hole_since = None
        if moved:
            self._wake()

    def _check_hole(self) -> None:
        """A number missing for more than ``hole_s`` while later ones wait: ask for a new
        epoch (re-forming), or end the run (the stop policy)."""
        if self.hole_since is None or self.dn is None or self.stream is None:
            return
        limit = self.opts.hole_s or self.ctx.peer_timeout
        if clock.now() - self.hole_since < limit:
            return
        missing = self.dn.count - self.base
        if not self.failure.recovers(PeerFailure("hole")):
            raise PeerFailure(f"diloco-async: update {missing} of the stream never arrived within {limit:g}s")
        if self.redo_asked != self.stream[0]:
            self.redo_asked = self.stream[0]
            log.warning("node %d: diloco-async update %d missing for %.1fs: asking for a new epoch",
                        self.ctx.node_id, missing, limit)
            self.ctx.membership.request_redo(self.stream[0], ())

    # -- one step ------------------------------------------------------------------------

    async def _begin(self) -> None:
        """First step: re-form (a fresh run: every member at 0) and start every member from
        the lowest id's parameters."""
        dn = self.dn
        if dn is None:
            raise ConfigError("diloco-async: train_step before start")
        params = dn.theta

        async def init(view: View) -> np.ndarray:
            if len(view.members) < 2:
                return params
            tag = OpId("dlasync", "init", view.epoch).tag
            return np.asarray(await self.ctx.collectives.broadcast(params, min(view.members), view.members, tag=tag),
                              np.float32)

        got = await self.regroup.run(dn.count, init)
        if isinstance(got, np.ndarray) and self.dn is not None and self.dn.count == 0:
            self.dn.theta = np.array(got, np.float32, copy=True)
        await self._restart_phase()
        self._open_stream()
        self.started = True

    async def _restart_phase(self) -> None:
        """θ_local ← θ_g; the next phase is measured from there, H_m by DyLU."""
        dn = self.dn
        if dn is None:
            raise ConfigError("diloco-async: no state yet")
        self.theta_start = dn.theta.copy()
        params = await self.ctx.replica.get_params()
        if params.tobytes() != self.theta_start.tobytes():
            await self.ctx.replica.set_params(self.theta_start.copy())
        self.phase = 0
        self.phase_t0 = clock.now()
        if self.opts.dylu:
            members = set(self.failure.view().members)
            self.h_m = dylu_steps(self.speed, [v for n, v in self.speeds.items() if n in members],
                                  inner_steps=self.opts.inner_steps, min_steps=self.opts.dylu_min_steps)

    def _measure(self, seconds: float) -> None:
        """The inner-step speed (steps/s of compute), an EMA (0.9); the first step not counted."""
        self.measured += 1
        if seconds <= 0 or self.measured <= 1:
            return
        v = 1.0 / seconds
        self.speed = v if self.speed == 0 else 0.9 * self.speed + 0.1 * v

    async def _send(self, stop: bool) -> None:
        """Number, encode once and flood this node's pseudo-gradient; it joins the node's own
        pending updates (decoded, as everyone applies it)."""
        if self.theta_start is None or self.stream is None:
            return
        key = self.stream
        params = np.asarray(await self.ctx.replica.get_params(), np.float32)
        g = np.subtract(self.theta_start, params, dtype=np.float32)
        if not np.isfinite(g).all():
            raise Diverged(f"node {self.ctx.node_id}: its pseudo-gradient holds NaN or infinity")
        self.requests += 1
        args: dict[str, Any] = {"epoch": key[0], "req": self.requests}
        if self._reforming():
            args["coord"] = key[1]
        call = asyncio.ensure_future(self.ctx.membership.call_coordinator(f"{NAME}.seq", args,
                                                                          timeout=self.ctx.peer_timeout))
        try:
            rep = await call
        except P2PSyncError as exc:  # no coordinator answered: a view change follows, the update is dropped
            log.warning("node %d: no number for its update (%s); dropped", self.ctx.node_id, exc)
            self.dropped_own += 1
            return
        k = rep.get("seq") if isinstance(rep, dict) else None
        if type(k) is not int or key != self.stream:
            self.dropped_own += 1  # stale (a newer view): the re-form drops it
            return
        if self.feedback is not None:
            x = self.feedback.compensate("diloco-async", g)
            enc = self.codec.encode(x)
            dec = np.asarray(self.codec.decode(enc, x.size), np.float32)
            self.feedback.record("diloco-async", x, dec)
        else:
            enc = self.codec.encode(g)
            dec = np.asarray(self.codec.decode(enc, g.size), np.float32)
        me = self.ctx.node_id
        self.pending.setdefault(key, {})[k] = Update(me, dec, stop)
        self.own = (key, k)
        self.own_buffers = None
        meta = {"origin": me, "epoch": key[0], "coord": key[1], "stop": stop, "speed": float(self.speed)}
        self.flood.forward(me, enc, step=k, meta=meta, codec=self.codec.name)
        self.sent += 1
        self._drain()

    def _own_done(self) -> bool:
        dn, own = self.dn, self.own
        if dn is None or dn.stop or own is None:
            return True
        if own[0] != self.stream:
            return True  # dropped by a re-form
        return dn.count - self.base > own[1]

    def _merged(self) -> bool:
        """This node's own update is applied and so is the rest of its buffer (the momentum
        step that completes it), or the stream ended or re-formed: what a phase restarts
        after, within the grace."""
        if not self._own_done():
            return False
        dn, own = self.dn, self.own
        if dn is None or dn.stop or own is None or own[0] != self.stream or self.own_buffers is None:
            return True
        return self.buffers > self.own_buffers

    async def _wait_applied(self, seconds: float, *, merged: bool = False) -> bool:
        """Wait until this node's own update is applied (``merged``: and the rest of its buffer,
        :meth:`_merged`), or the stream ended, or a newer view came, at most ``seconds``;
        whether it is done."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        done = self._merged if merged else self._own_done
        while not done():
            if not self._in_sync():
                return False
            self._check_hole()
            left = deadline - loop.time()
            if left <= 0:
                return False
            ev = self._applied
            try:
                await asyncio.wait_for(ev.wait(), min(left, 0.5))
            except asyncio.TimeoutError:
                pass
        return True

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        t0 = clock.now()
        self.step = step
        if not self.started:
            await self._begin()
        await self._sync()
        self._check_hole()
        dn = self.dn
        if dn is None:
            raise ConfigError("diloco-async: train_step before start")
        if dn.stop:  # (the stream ended at another node's stop: this node's local work is dropped)
            return await self._finish(self.last_loss, t0, clock.now() - t0, 0.0)
        wait = clock.now() - t0
        tc = clock.now()
        try:
            loss, grad = await self.ctx.replica.compute_gradients()
        except TrainingEnded:
            await self.close()
            raise
        await self.ctx.replica.apply_gradients(grad)  # the inner step: the user's optimizer
        t1 = clock.now()
        self._measure(t1 - tc)
        self.last_loss = loss
        self.phase += 1
        stop = want_stop or (self.ctx.max_steps is not None and step + 1 >= self.ctx.max_steps)
        waited = 0.0  # this step's grace wait
        if not dn.stop and (stop or self.phase >= self.h_m):
            await self._send(stop)
            self.stop_sent = self.stop_sent or stop
            tg = clock.now()
            merge = self.opts.merge_s or 0.25 * (tg - self.phase_t0)  # (tg: the phase's end)
            if not await self._wait_applied(self.opts.grace_s):
                self.late += 1
            else:
                await self._wait_applied(merge, merged=True)
            waited = clock.now() - tg
            self.grace_wait_s += waited
            self.max_grace_s = max(self.max_grace_s, waited)
            if stop:
                await self._await_stop()
            if self.dn is not None and not self.dn.stop:
                await self._restart_phase()
        if self.dn is not None and self.dn.stop:
            return await self._finish(loss, t0, wait + clock.now() - t1, waited)
        return self._report(loss, False, wait + clock.now() - t1, waited)

    async def _await_stop(self) -> None:
        """This node sent the stop: wait until the stream ends (its update, or another's stop
        before it, is applied); across a re-form it sends it again. Bounded."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.regroup.bound + (self.opts.hole_s or self.ctx.peer_timeout)
        while self.dn is not None and not self.dn.stop:
            if loop.time() > deadline:
                raise PeerFailure("diloco-async: the stop was never applied")
            if not self._in_sync():
                await self._sync()
            if self.own is None and self.dn is not None and not self.dn.stop:
                await self._send(True)
            await self._wait_applied(1.0)
            self._check_hole()

    async def _finish(self, loss: float, t0: float, wait: float, grace: float) -> StepReport:
        """The stream ended: check that every member holds the same θ_g, θ_local ← θ_g, stop
        (``wait``, ``grace``: this step's, as :meth:`_report`)."""
        while True:
            dn = self.dn
            if dn is None:
                raise ConfigError("diloco-async: no state")
            count, h = dn.count, digest(dn.theta)

            async def check(view: View) -> None:
                tag = OpId("dlasync", count, view.epoch).tag + ".final"
                bad, rows = await differing(self.ctx.collectives, np.array([h, count], np.int64), view.members, tag=tag)
                if bad:
                    raise ReplicaMismatch(f"diloco-async: θ_g differs at the stop on nodes {list(bad)} "
                                          f"({[(int(r[0]), int(r[1])) for r in rows]})", nodes=bad)

            got = await self.regroup.run(count, check)
            if not isinstance(got, Adopted):
                break
            self._open_stream()  # a member behind took the leader's (stopped) state: check again
            if self.dn is not None and not self.dn.stop:
                raise PeerFailure("diloco-async: re-formed at the stop over members that had not stopped")
        if self.dn is None:
            raise ConfigError("diloco-async: no state")
        await self.ctx.replica.set_params(self.dn.theta.copy())
        self.theta_start = self.dn.theta.copy()
        return self._report(loss, True, wait, grace)

    def _report(self, loss: float, stop: bool, wait: float, grace: float) -> StepReport:
        """This step's report: ``wait``, its seconds outside the inner step (``comm_s``);
        ``grace``, its seconds waiting for its own update to be applied (``wait_s``: per step,
        as the driver sums them; the total is ``grace_wait_s``)."""
        dn = self.dn
        return StepReport(loss=loss, stop=stop, comm_s=wait, wait_s=grace, extra={
            "applied": 0 if dn is None else dn.count, "buffers": self.buffers, "h_m": self.h_m,
            "speed": round(self.speed, 3), "sent": self.sent, "late": self.late,
            "max_grace_s": round(self.max_grace_s, 4), "grace_wait_s": round(self.grace_wait_s, 4), "stale": self.stale, "duplicates": self.duplicates,
            "dropped_own": self.dropped_own, "dropped_sends": self.flood.dropped, "adoptions": self.adoptions,
            "reforms": self.regroup.reformations, "members": len(self.ctx.group)})

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """θ_g, the momentum, the buffer and the counters (one vector), θ_start; the stream's
        updates not applied yet are not kept (a resumed run re-forms and drops them)."""
        import torch

        if self.dn is None or self.theta_start is None:
            return {}
        return {"dn": torch.from_numpy(pack(self.dn).copy()), "theta_start": torch.from_numpy(self.theta_start.copy()),
                "phase": self.phase, "h_m": self.h_m, "settings": self._settings()}

    def _settings(self) -> list[float]:
        o = self.opts
        return [o.outer_lr, o.outer_momentum, float(o.dn_buffer)]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        if list(state.get("settings", [])) != self._settings():
            raise ConfigError("diloco-async: the checkpoint was taken with other settings (outer_lr, outer_momentum "
                              "or dn_buffer differ)")
        vec = np.asarray(state["dn"].numpy(), np.float32)
        self.dn = unpack(vec, self.ctx.replica.numel)
        self.theta_start = np.asarray(state["theta_start"].numpy(), np.float32).copy()
        self.phase, self.h_m = int(state["phase"]), int(state["h_m"])
        self.started = True
        self.stream = None  # re-form at the next step (under the stop policy: open it there)
        log.warning("node %d: diloco-async state restored at update %d (state %016x, theta_start %016x)",
                    self.ctx.node_id, self.dn.count, digest(pack(self.dn)), digest(self.theta_start))


__all__ = ["DilocoAsync", "DilocoAsyncOptions", "digest"]

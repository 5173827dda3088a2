"""Canary's colayer exchange over the transport: pushes, immediate replies, empty packets.

Paper: Zhou et al., *Canary*, §4.4.2 ("each worker independently operates gradient exchange
without a synchronized barrier … a worker will send an empty packet when it is still under
computation or has exchanged current gradient in prior communication"), built as a push /
immediate-reply protocol.

One :class:`Exchange` per node and *plan* (a view's members, re-planned after every
re-synchronization): a :class:`~p2psync.strategies.canary.flow.Flow` per colayer (results
and outboxes, routed as :mod:`~p2psync.strategies.canary.plan` says), and the wire protocol
of a *round* (one colayer of one iteration): the node adds its own gradient, then each thread
(one per BCube level, so one per NIC) walks its steps; at a step it sends each peer of that
step its outbox for that peer and awaits the peer's answer. Messages:
:mod:`~p2psync.strategies.canary.wire`.

* ``native`` mode (Canary's asynchronous exchange): the answer is the peer's *reply*, sent at
  once by the peer's receive task with whatever the peer's outbox holds for this node at that
  step: its data, or an empty packet when it has nothing (still computing, or it sent it
  before). Nobody waits for anyone's computation; data a slow node could not take part in
  stays in an outbox and leaves with its next exchange (exactly once, see plan.py). A
  peer that does not answer within the timeout, or answers from another plan, counts as an
  empty packet (its data in that exchange is lost, counted in ``lost`` / ``moved``).
* ``bsp`` mode (§5.3's BSP restriction: every ``r^[z] = 2^n − 1``): the answer is the peer's
  own push for the same iteration, colayer, thread and step (exact tags, no empty packets), so
  every node ends every round with every member's contribution (the exact sum without a
  lossy codec). A missing, late or malformed answer abandons the round (PeerFailure).

Every message carries the sender's iteration and the newest iteration it knows of (ζ spreads
hop by hop), and whether the sender stops. Data whose newest contribution is older than
``ζ − s`` is dropped on receipt and not sent (spec §6.5; counted in ``stale``). Payloads go
through the codec (the sketch by default), re-encoded at every hop after summing in float32
(spec §2.2: partial sums are re-sketched); what an encoding drops stays in the outbox and
leaves with the next data for that peer and step (error feedback inside the flow: a lossy
codec delays part of a contribution, it never loses it, so replicas do not drift apart by
quantization noise).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Literal, Mapping, Sequence, get_args

import numpy as np

from p2psync import clock
from p2psync.strategies.canary.flow import Datum, Flow
from p2psync.strategies.canary.plan import Layout
from p2psync.compress import Codec, get_codec
from p2psync.errors import P2PSyncError, PeerFailure, PeerTimeout, ProtocolError, TransportError
from p2psync.strategies.canary.gei import node_bit
from p2psync.strategies.canary.wire import Header, pack, parse_header, unpack
from p2psync.tasks import TaskSet, gather_or_cancel
from p2psync.transport import Transport
from p2psync.transport.forward import Forwarder
from p2psync.wire import Message

log = logging.getLogger("p2psync.canary")

#: native: asynchronous, empty packets; bsp: every colayer complete every iteration
CanaryMode = Literal["native", "bsp"]
MODES: tuple[str, ...] = get_args(CanaryMode)
#: native mode, what a reply carries: ``held`` (default): whatever the outbox holds for the
#: pusher, at any time (the spec's §6.5 reading); ``round``: data only while this node's own
#: round of that colayer runs (it has finished computing that gradient and has not finished
#: exchanging it), an empty packet otherwise (§4.4.2 read literally: "an empty packet when it
#: is still under computation or has exchanged current gradient in prior communication"): what
#: a computing node relays waits for its next push, one message instead of several, later
ReplyPolicy = Literal["held", "round"]
REPLIES: tuple[str, ...] = get_args(ReplyPolicy)
#: node-local numbers of exchanges (reply tags of a closed exchange are never reused)
_UIDS = itertools.count(1)


@dataclass
class RoundResult:
    """What one round of one colayer gave: the sum per element, how many contributions each
    slot summed (``counts``, per element), the colayer's GEI mask (AND over its slots)."""

    sums: np.ndarray
    counts: np.ndarray
    mask: int
    seconds: float
    #: ``clock.now()`` when the round started (its first push leaves right after)
    started: float = 0.0
    #: a contributor to what this round summed asked to stop
    stop: bool = False


@dataclass
class ExchangeStats:
    pushes: int = 0
    empties_sent: int = 0
    empties_recv: int = 0
    stale: int = 0
    lost: int = 0
    malformed: int = 0
    moved: int = 0  # answers from, or pushes for, another plan
    #: replies sent empty by the ``round`` policy while data for the pusher was waiting (stale
    #: data included: it is dropped when its push comes)
    held: int = 0
    wire_bytes: int = 0
    raw_bytes: int = 0
    #: payload bytes, and messages that carried data, sent per level (NIC)
    by_level: dict[int, int] = field(default_factory=dict)
    msgs_by_level: dict[int, int] = field(default_factory=dict)


@dataclass
class Progress:
    """What the strategy tells the exchange, read at every send."""

    iteration: Callable[[], int]
    zeta: Callable[[], tuple[int, int]]  # ζ and the node that reported it
    stopping: Callable[[], bool]  # in every header: this node has stopped
    on_header: Callable[[Header], None]
    #: in this node's own contributions: the run stops after this round (bsp: every node
    #: sees every contribution of a round, so all stop after the same one); default: stopping
    last: Callable[[], bool] | None = None


class Exchange:
    """The colayer exchanges of one node over one plan."""

    def __init__(self, *, transport: Transport, fwd: Forwarder, layout: Layout, sizes: Sequence[int],
                 codec: Codec, mode: CanaryMode, staleness: float, timeout: float, epoch: int, plan: int,
                 progress: Progress, name: str = "canary", piece: int = 1 << 18,
                 replies: ReplyPolicy = "held") -> None:
        if mode not in MODES:
            raise ValueError(f"canary mode {mode!r}: choose from {', '.join(MODES)}")
        if replies not in REPLIES:
            raise ValueError(f"canary replies {replies!r}: choose from {', '.join(REPLIES)}")
        self.replies = replies
        #: colayers whose round (this node's own exchange of its gradient) is in progress
        self._in_round: dict[int, int] = {}
        self.tr, self.fwd, self.layout, self.mode = transport, fwd, layout, mode
        self.me = transport.node_id
        self.s, self.timeout, self.epoch, self.plan, self.name = staleness, timeout, epoch, plan, name
        self.progress = progress
        self.codec = codec  # what this node sends with (the strategy may switch it, sketch_fraction)
        self.codecs: Mapping[str, Codec] = {codec.spec: codec, "none": get_codec("none")}
        self.flows = [Flow(layout, self.me, layout.slots(n, max(piece, -(-n // max(1, layout.levels * layout.alpha * 8)))))
                      for n in sizes]
        self.sizes = list(sizes)
        self.stats = ExchangeStats()
        self.uid = next(_UIDS)
        self._seq = itertools.count(1)
        #: the push listener (native mode) and the replies being sent; a reply fails alone (the
        #: pusher counts it as an empty packet), and so does the listener, logged
        self._tasks = TaskSet(f"{name}-exchange", isolated=True)
        self._listening = False
        self.push_tag = f"{name}.p"
        self._reply_prefix = f"{name}.r.{self.me}.{transport.incarnation}.{self.uid}."
        self._bsp_prefix = f"{name}.b.{epoch}.{plan}."
        #: the answers to this exchange's pushes (native) and its rounds' pieces (bsp)
        self._scopes = (transport.scope(self._reply_prefix), transport.scope(self._bsp_prefix))
        #: a newer view replaced this exchange's: rounds in progress end at once (no new waits)
        self.retired = False

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self.mode == "native" and not self._listening:
            self._listening = True
            self._tasks.spawn(self._serve(), name=f"{self.name}-rx-{self.me}")

    async def close(self) -> None:
        self.retired = True
        await self._tasks.close()
        for sc in self._scopes:
            sc.retire()

    def retire(self, exc: P2PSyncError) -> None:
        """A newer view: pending answers fail with ``exc`` and the rounds in progress take no
        further step (the members re-synchronize and re-plan; waiting here would only keep
        them waiting)."""
        self.retired = True
        self.abort_waits(exc)

    def abort_waits(self, exc: P2PSyncError, peer: int | None = None) -> None:
        """Fail the pending answers (of ``peer``, or all): native rounds take them as empty
        packets, bsp rounds are abandoned."""
        for sc in self._scopes:
            sc.abort(exc, peer=peer)

    # -- one round -------------------------------------------------------------------------

    async def round(self, z: int, t: int, grad: np.ndarray) -> RoundResult:
        """Exchange colayer ``z`` of iteration ``t`` (``grad``: its flat gradient)."""
        t0 = clock.now()
        self._in_round[z] = self._in_round.get(z, 0) + 1
        try:
            self.contribute(z, t, grad)
            await gather_or_cancel(self._thread(z, th, t) for th in range(self.layout.levels))
        finally:
            self._in_round[z] -= 1
        sums, counts, mask, stop = self.collect(z)
        return RoundResult(sums, counts, mask, clock.now() - t0, t0, stop)

    def contribute(self, z: int, t: int, grad: np.ndarray) -> None:
        """This node's own gradient of colayer ``z`` at iteration ``t`` into every slot (its own
        GEI bit with it, spec §4.4 item 4); nothing when ``t`` is already older than ``ζ − s``."""
        flow = self.flows[z]
        if grad.size != self.sizes[z]:
            raise ValueError(f"colayer {z} has {self.sizes[z]} elements, got {grad.size}")
        if self._is_stale(t):
            self.stats.stale += 1
            return
        bit = node_bit(self.me)
        g = np.asarray(grad, dtype=np.float32)
        stop = (self.progress.last or self.progress.stopping)()
        for s in flow.slots:
            flow.add(s, 0, Datum(g[s.lo:s.hi].copy(), 1, bit, t, t, stop))

    def collect(self, z: int) -> tuple[np.ndarray, np.ndarray, int, bool]:
        """Take what colayer ``z``'s slots hold: the sums, the contributions summed per element,
        the GEI mask (the AND over the slots of their contributors: spec §4.4 item 3; 0 when a
        slot holds nothing) and whether a contributor asked to stop."""
        sums = np.zeros(self.sizes[z], np.float32)
        counts = np.zeros(self.sizes[z], np.float32)
        mask, stop = -1, False
        for s in self.flows[z].slots:
            d = self.flows[z].take_result(s)
            if d is None:
                mask = 0
                continue
            sums[s.lo:s.hi] = d.vec
            counts[s.lo:s.hi] = d.count
            mask &= d.mask
            stop = stop or d.stop
        return sums, counts, max(mask, 0), stop

    async def _thread(self, z: int, th: int, t: int) -> None:
        for k in range(self.layout.steps):
            peers = self.layout.peers(self.me, th, k)
            await gather_or_cancel(self._step(z, th, k, y, t) for y in peers)

    async def _step(self, z: int, th: int, k: int, y: int, t: int) -> None:
        if self.mode == "bsp":
            await self._bsp_step(z, th, k, y, t)
            return
        if self.retired:
            return
        rq = f"{self._reply_prefix}{next(self._seq)}.p{y}"
        try:
            await self._send(y, self.push_tag, z, th, k, reply_to=rq)
            if self.retired:  # replaced while the push was on its way out
                return
            msg = await self.tr.recv(rq, timeout=self.timeout, peer=y)
            self._ingest(msg, z, th, k, y)
        except ProtocolError as exc:  # native: a malformed answer counts as an empty packet
            self._malformed(exc)
        except (PeerFailure, PeerTimeout) as exc:  # native: a silent peer is an empty packet
            self.stats.lost += 1
            log.info("node %d: canary exchange with node %d (colayer %d, step %d) got no answer: %s",
                     self.me, y, z, k, exc)
        finally:
            self.tr.retire(rq)

    async def _bsp_step(self, z: int, th: int, k: int, y: int, t: int) -> None:
        def abandoned(why: str) -> PeerFailure:
            return PeerFailure(f"{self.name}: round of iteration {t} abandoned at step {k} with node {y}: {why}",
                               peers=(y,))
        if self.retired:
            raise abandoned(f"view {self.epoch} was replaced")
        tag = f"{self._bsp_prefix}{t}.{z}.{th}.{k}."
        try:
            await self._send(y, f"{tag}{self.me}", z, th, k, reply_to=None)
            if self.retired:
                raise abandoned(f"view {self.epoch} was replaced")
            msg = await self.tr.recv(f"{tag}{y}", timeout=self.timeout, peer=y)
            self._ingest(msg, z, th, k, y)
        except (PeerTimeout, ProtocolError) as exc:  # the round cannot complete: abandoned
            raise abandoned(str(exc)) from exc

    # -- messages ----------------------------------------------------------------------------

    def _is_stale(self, newest: int) -> bool:
        return newest < self.progress.zeta()[0] - self.s

    async def _send(self, y: int, tag: str, z: int, th: int, k: int, reply_to: str | None,
                    moved: bool = False, hold: bool = False) -> None:
        """Send ``y`` this node's outbox for step ``k`` (nothing when ``moved``: an empty
        packet saying this node is on another plan; nothing when ``hold``: an empty packet, the
        outbox waits)."""
        items = []
        flow = None if moved else self.flows[z]
        if flow is not None and not hold:
            for s in flow.send_slots(th, k, y):
                d = flow.take_outbox(k, y, s)
                if d is None:
                    continue
                if self._is_stale(d.newest):
                    self.stats.stale += 1
                    continue
                items.append((s, d))
        codec = self.codec
        entries, arrays, residuals = pack(items, codec)
        for (s, d), (_, r) in zip(items, residuals):  # error feedback: the residue goes with the next data
            if flow is not None:
                flow.put_back(k, y, s, Datum(r, 0, 0, d.newest, d.oldest))
        zeta, zn = self.progress.zeta()
        meta = Header(self.me, self.epoch, self.plan, z, th, k, self.progress.iteration(), zeta, zn,
                      self.progress.stopping(), codec.spec).meta()
        meta["d"] = entries
        if reply_to is not None:
            meta["rq"] = reply_to
        if moved:
            meta["mv"] = True
        nbytes = sum(a.nbytes for a in arrays)
        self.stats.pushes += 1
        self.stats.raw_bytes += sum(s.size * 4 for s, _ in items)
        self.stats.wire_bytes += nbytes
        if flow is not None:
            level = self.layout.level(th, k)
            self.stats.by_level[level] = self.stats.by_level.get(level, 0) + nbytes
            if entries:
                self.stats.msgs_by_level[level] = self.stats.msgs_by_level.get(level, 0) + 1
        if not entries:
            self.stats.empties_sent += 1
        await self.fwd.send(y, tag, arrays, meta, timeout=self.timeout)

    def _ingest(self, msg: Message, z: int, th: int, k: int, y: int) -> None:
        """Take the data of an answer (or a push) from ``y`` for step ``k`` of thread ``th``."""
        h = parse_header(msg.meta, msg.src)
        if h.origin != y or (h.z, h.th, h.k) != (z, th, k):
            raise ProtocolError("canary", f"node {msg.src}: answer for another exchange "
                                          f"(node {h.origin}, colayer {h.z}, thread {h.th}, step {h.k})")
        self.progress.on_header(h)
        if msg.meta.get("mv") or (h.epoch, h.plan) != (self.epoch, self.plan):
            self.stats.moved += 1
            return
        codec = self.codecs.get(h.codec)
        if codec is None:
            raise ProtocolError("canary", f"node {y}: codec {h.codec!r} (this exchange: {self.codec.spec!r})")
        flow = self.flows[z]
        allowed = {s.index: s for s in flow.recv_slots(th, k, y)}
        items = unpack(msg.meta.get("d"), msg.arrays, allowed, codec, y)
        if not items:
            self.stats.empties_recv += 1
        for slot, d in items:
            if self._is_stale(d.newest):
                self.stats.stale += 1
                continue
            flow.add(slot, k + 1, d, y)

    # -- the receive task (native) -------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            try:
                msg = await self.tr.listen(self.push_tag)
            except TransportError:
                return
            except P2PSyncError as exc:  # e.g. a piece refused at ingest (non-finite): go on
                self._malformed(exc)
                continue
            try:
                self._answer(msg)
            except ProtocolError as exc:
                self._malformed(exc)

    def _malformed(self, exc: P2PSyncError) -> None:
        if not self.stats.malformed:
            log.warning("node %d: malformed canary message ignored: %s", self.me, exc)
        self.stats.malformed += 1

    def _answer(self, msg: Message) -> None:
        h = parse_header(msg.meta, msg.src)
        rq, y = msg.meta.get("rq"), h.origin
        if not (isinstance(rq, str) and rq.startswith(f"{self.name}.r.{y}.") and rq.endswith(f".p{self.me}")):
            raise ProtocolError("canary", f"node {msg.src}: malformed push")
        if msg.src != y and self.tr.topology.routes(self.me, y):  # a neighbour's push comes directly
            raise ProtocolError("canary", f"node {msg.src} pushed as node {y}")
        if (h.epoch, h.plan) != (self.epoch, self.plan):  # another plan: nothing of it routes here
            self.stats.moved += 1
            self.progress.on_header(h)
            self._spawn(lambda: self._send(y, rq, h.z, h.th, h.k, reply_to=None, moved=True))
            return
        if not (h.z < len(self.flows) and h.th < self.layout.levels and h.k < self.layout.steps
                and y in self.layout.peers(self.me, h.th, h.k)):
            raise ProtocolError("canary", f"node {y}: push for colayer {h.z}, thread {h.th}, step {h.k} "
                                          "is not one of its exchanges with this node")
        self._ingest(msg, h.z, h.th, h.k, y)
        hold = self.replies == "round" and not self._in_round.get(h.z) and not self.progress.stopping()
        if hold and self.flows[h.z].holds(h.k, y, self.flows[h.z].send_slots(h.th, h.k, y)):
            self.stats.held += 1
        self._spawn(lambda: self._send(y, rq, h.z, h.th, h.k, reply_to=None, hold=hold))

    def _spawn(self, make: Callable[[], Awaitable[None]]) -> None:
        """Send a reply in an owned task. The coroutine is made inside the task: a task cancelled
        before its first step (the exchange closing) never runs its body, and a coroutine made
        here would then be left un-awaited. After close the task set cancels what it is given, so
        the reply is not sent."""
        self._tasks.spawn(self._guard(make))

    async def _guard(self, make: Callable[[], Awaitable[None]]) -> None:
        try:
            await make()
        except P2PSyncError as exc:  # the pusher counts a missing reply as an empty packet
            log.info("node %d: canary reply lost: %s", self.me, exc)


__all__ = ["CanaryMode", "Exchange", "ExchangeStats", "MODES", "Progress", "REPLIES", "ReplyPolicy", "RoundResult"]

"""Canary's colayer exchange over the transport: pushes, immediate replies, empty packets.

Paper ../shared/papers/canary.md §4.4.2 ("each worker independently operates gradient exchange
without a synchronized barrier … a worker will send an empty packet when it is still under
computation or has exchanged current gradient in prior communication"); reading notes
../shared/specs/canary.md §6.5 (the push / immediate-reply protocol) and §6.6.

One :class:`Exchange` per node and view: a :class:`~p2psync.collectives.canary_flow.Flow` per
colayer (results and outboxes, routed as :mod:`~p2psync.collectives.canary_plan` says), and the
wire protocol of a *round* (one colayer of one iteration): the node adds its own gradient,
then each thread (one per BCube level, so one per NIC) walks its steps; at a step it sends each
peer of that step its outbox for that peer and awaits the peer's answer.

* ``native`` mode (Canary's asynchronous exchange): the answer is the peer's *reply*, sent at
  once by the peer's receive task with whatever the peer's outbox holds for this node at that
  step: its data, or an empty packet when it has nothing (still computing, or it sent it
  before). Nobody waits for anyone's computation; data a slow node could not take part in
  stays in an outbox and leaves with its next exchange (exactly once, see canary_plan). A
  peer that fails to answer within the timeout counts as an empty packet (its data in that
  exchange is lost, counted in ``lost``).
* ``bsp`` mode (§5.3's BSP restriction: every ``r^[z] = 2^n − 1``): the answer is the peer's
  own push for the same iteration, colayer, thread and step (exact tags, no empty packets), so
  every node ends every round with the exact sum over all members: the synchronous schedule.

Every message carries the sender's iteration (it raises the receiver's ``ζ``) and whether the
sender has stopped. Data whose newest contribution is older than ``ζ − s`` is dropped on receipt
and not sent (spec §6.5; counted in ``stale``). Payloads go through the codec (the sketch by
default), re-encoded at every hop after summing in float32 (spec §2.2: partial sums are
re-sketched). Masks ride as little-endian bytes (any number of nodes).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from p2psync.collectives.canary_flow import Datum, Flow
from p2psync.collectives.canary_plan import Layout
from p2psync.compress import Codec
from p2psync.errors import P2PSyncError, PeerFailure, PeerTimeout, ProtocolError, TransportError
from p2psync.strategies.canary_gei import node_bit
from p2psync.transport import Transport
from p2psync.transport.forward import Forwarder
from p2psync.wire import Message

log = logging.getLogger("p2psync.canary")

MODES = ("native", "bsp")


@dataclass
class RoundResult:
    """What one round of one colayer gave: the sum per element, how many contributions each
    slot summed (``counts``, per element), the colayer's GEI mask (AND over its slots)."""

    sums: np.ndarray
    counts: np.ndarray
    mask: int
    seconds: float
    #: ``time.perf_counter()`` when the round started (its first push leaves right after)
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
    moved: int = 0  # messages of another view
    wire_bytes: int = 0
    raw_bytes: int = 0
    #: payload bytes, and messages that carried data, sent per level (NIC)
    by_level: dict[int, int] = field(default_factory=dict)
    msgs_by_level: dict[int, int] = field(default_factory=dict)


class Exchange:
    """The colayer exchanges of one node over one view."""

    def __init__(self, *, transport: Transport, fwd: Forwarder, layout: Layout, sizes: Sequence[int],
                 codec: Codec, mode: str, staleness: float, timeout: float, epoch: int, name: str = "canary",
                 piece: int = 1 << 18, iteration: Callable[[], int], zeta: Callable[[], int],
                 stopping: Callable[[], bool], on_header: Callable[[int, int, bool], None]) -> None:
        if mode not in MODES:
            raise ValueError(f"canary mode {mode!r}: choose from {', '.join(MODES)}")
        self.tr, self.fwd, self.layout, self.codec, self.mode = transport, fwd, layout, codec, mode
        self.me = transport.node_id
        self.s, self.timeout, self.epoch, self.name = staleness, timeout, epoch, name
        self.iteration, self.zeta, self.stopping, self.on_header = iteration, zeta, stopping, on_header
        self.flows = [Flow(layout, self.me, layout.slots(n, max(piece, -(-n // max(1, layout.levels * layout.alpha * 8)))))
                      for n in sizes]
        self.sizes = list(sizes)
        self.stats = ExchangeStats()
        self._seq = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self._rx: asyncio.Task[None] | None = None
        self.push_tag = f"{name}.p"
        #: a newer view replaced this exchange's: rounds in progress end at once (no new waits)
        self.retired = False

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self.mode == "native" and self._rx is None:
            self._rx = asyncio.get_running_loop().create_task(self._serve(), name=f"{self.name}-rx-{self.me}")

    async def close(self) -> None:
        tasks = [t for t in (self._rx, *self._tasks) if t is not None]
        self._rx = None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.tr.mailbox.retire(f"{self.name}.r.{self.me}.")
        self.tr.mailbox.retire(f"{self.name}.b.{self.epoch}.")

    def retire(self, exc: P2PSyncError) -> None:
        """A newer view: pending answers fail with ``exc`` and the rounds in progress take no
        further step (the members re-synchronize and re-plan; waiting here would only keep
        them waiting)."""
        self.retired = True
        self.abort_waits(exc)

    def abort_waits(self, exc: P2PSyncError) -> None:
        """Fail the pending answers (a peer failed or the view changed): native rounds take
        them as empty packets, bsp rounds raise."""
        self.tr.mailbox.abort(exc, match=lambda tag: tag.startswith((f"{self.name}.r.{self.me}.",
                                                                     f"{self.name}.b.{self.epoch}.")))

    # -- one round -------------------------------------------------------------------------

    async def round(self, z: int, t: int, grad: np.ndarray) -> RoundResult:
        """Exchange colayer ``z`` of iteration ``t`` (``grad``: its flat gradient)."""
        t0 = time.perf_counter()
        flow = self.flows[z]
        if grad.size != self.sizes[z]:
            raise ValueError(f"colayer {z} has {self.sizes[z]} elements, got {grad.size}")
        if not self._is_stale(t):
            bit = node_bit(self.me)
            g = np.asarray(grad, dtype=np.float32)
            stop = self.stopping()
            for s in flow.slots:
                flow.add(s, 0, Datum(g[s.lo:s.hi].copy(), 1, bit, t, t, stop))
        else:
            self.stats.stale += 1
        await _all(self._thread(z, th, t) for th in range(self.layout.levels))
        sums = np.zeros(self.sizes[z], np.float32)
        counts = np.zeros(self.sizes[z], np.float32)
        mask, stop = -1, False
        for s in flow.slots:
            d = flow.take_result(s)
            if d is None:
                mask = 0
                continue
            sums[s.lo:s.hi] = d.vec
            counts[s.lo:s.hi] = d.count
            mask &= d.mask
            stop = stop or d.stop
        return RoundResult(sums, counts, max(mask, 0), time.perf_counter() - t0, t0, stop)

    async def _thread(self, z: int, th: int, t: int) -> None:
        for k in range(self.layout.steps):
            peers = self.layout.peers(self.me, th, k)
            await _all(self._step(z, th, k, y, t) for y in peers)

    async def _step(self, z: int, th: int, k: int, y: int, t: int) -> None:
        flow = self.flows[z]
        if self.retired:
            if self.mode == "bsp":
                raise PeerFailure(f"{self.name}: view {self.epoch} was replaced during the round")
            return
        if self.mode == "bsp":
            await self._send(y, self._bsp_tag(t, z, th, k, self.me), z, th, k, flow, t, reply_to=None)
            msg = await self.tr.recv(self._bsp_tag(t, z, th, k, y), timeout=self.timeout)
            self._ingest(msg, z, th, k, y)
            return
        rq = f"{self.name}.r.{self.me}.{self.tr.incarnation}.{next(self._seq)}"
        try:
            await self._send(y, self.push_tag, z, th, k, flow, t, reply_to=rq)
            msg = await self.tr.recv(rq, timeout=self.timeout)
            self._ingest(msg, z, th, k, y)
        except ProtocolError as exc:  # native: a malformed answer counts as an empty packet
            self._malformed(exc)
        except (PeerFailure, PeerTimeout) as exc:  # native: a silent peer is an empty packet
            self.stats.lost += 1
            log.info("node %d: canary exchange with node %d (colayer %d, step %d) got no answer: %s",
                     self.me, y, z, k, exc)
        finally:
            self.tr.mailbox.retire(rq, exact=True)

    def _bsp_tag(self, t: int, z: int, th: int, k: int, src: int) -> str:
        return f"{self.name}.b.{self.epoch}.{t}.{z}.{th}.{k}.{src}"

    # -- messages ----------------------------------------------------------------------------

    def _is_stale(self, newest: int) -> bool:
        return newest < self.zeta() - self.s

    def _outgoing(self, flow: Flow, th: int, k: int, y: int) -> tuple[list[list[Any]], list[np.ndarray]]:
        """Take this node's outbox for ``y`` at step ``k``: (entries, arrays)."""
        entries: list[list[Any]] = []
        arrays: list[np.ndarray] = []
        for s in flow.send_slots(th, k, y):
            d = flow.take_outbox(k, y, s)
            if d is None:
                continue
            if self._is_stale(d.newest):
                self.stats.stale += 1
                continue
            enc = self.codec.encode(np.ascontiguousarray(d.vec, dtype=np.float32))
            entries.append([s.index, d.count, _mask_bytes(d.mask), d.newest, d.oldest, d.stop, len(enc)])
            arrays += enc
            self.stats.raw_bytes += s.size * 4
            self.stats.wire_bytes += sum(a.nbytes for a in enc)
        return entries, arrays

    async def _send(self, y: int, tag: str, z: int, th: int, k: int, flow: Flow, t: int,
                    reply_to: str | None) -> None:
        entries, arrays = self._outgoing(flow, th, k, y)
        meta: dict[str, Any] = {"o": self.me, "e": self.epoch, "z": z, "th": th, "k": k, "it": t,
                                "st": self.stopping(), "d": entries}
        if reply_to is not None:
            meta["rq"] = reply_to
        self.stats.pushes += 1
        if not entries:
            self.stats.empties_sent += 1
        level = self.layout.level(th, k)
        self.stats.by_level[level] = self.stats.by_level.get(level, 0) + sum(a.nbytes for a in arrays)
        if entries:
            self.stats.msgs_by_level[level] = self.stats.msgs_by_level.get(level, 0) + 1
        await self.fwd.send(y, tag, arrays, meta, timeout=self.timeout)

    def _ingest(self, msg: Message, z: int, th: int, k: int, y: int) -> None:
        """Take the data of an answer (or a push) from ``y`` for step ``k`` of thread ``th``."""
        meta = msg.meta
        entries = meta.get("d")
        it, stop = meta.get("it"), meta.get("st")
        if type(it) is not int or not isinstance(stop, bool) or not isinstance(entries, list):
            raise ProtocolError("canary", f"node {y}: malformed header {sorted(meta)!r}"[:120])
        self.on_header(y, it, stop)
        if not entries:
            self.stats.empties_recv += 1
            return
        flow = self.flows[z]
        allowed = {s.index: s for s in flow.recv_slots(th, k, y)}
        pos = 0
        for e in entries:
            if not (isinstance(e, list) and len(e) == 7 and all(type(v) is int for v in (*e[:2], *e[3:5], e[6]))
                    and isinstance(e[2], bytes) and isinstance(e[5], bool)):
                raise ProtocolError("canary", f"node {y}: malformed slot entry")
            idx, count, mask_b, newest, oldest, stop_flag, narr = e
            slot = allowed.get(idx)
            if slot is None or count < 1 or narr < 1 or pos + narr > len(msg.arrays):
                raise ProtocolError("canary", f"node {y}: slot {idx} is not one it sends this node at step {k}")
            vec = self.codec.decode(msg.arrays[pos:pos + narr], slot.size)
            pos += narr
            if not np.all(np.isfinite(vec)):
                raise ProtocolError("canary", f"node {y}: non-finite values in slot {idx}")
            if self._is_stale(newest):
                self.stats.stale += 1
                continue
            flow.add(slot, k + 1, Datum(np.array(vec, dtype=np.float32, copy=True), count,
                                        int.from_bytes(mask_b, "little"), newest, oldest, stop_flag))
        if pos != len(msg.arrays):
            raise ProtocolError("canary", f"node {y}: {len(msg.arrays) - pos} arrays too many")

    # -- the receive task (native) -------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            try:
                msg = await self.tr.listen(self.push_tag)
            except TransportError:
                return
            try:
                self._answer(msg)
            except ProtocolError as exc:
                self._malformed(exc)

    def _malformed(self, exc: ProtocolError) -> None:
        if not self.stats.malformed:
            log.warning("node %d: malformed canary message ignored: %s", self.me, exc)
        self.stats.malformed += 1

    def _answer(self, msg: Message) -> None:
        meta = msg.meta
        y, e, z, th, k, rq = (meta.get(f) for f in ("o", "e", "z", "th", "k", "rq"))
        if not (type(y) is int and type(e) is int and type(z) is int and type(th) is int and type(k) is int
                and isinstance(rq, str) and rq.startswith(f"{self.name}.r.{y}.")):
            raise ProtocolError("canary", f"node {msg.src}: malformed push")
        if msg.src != y and self.tr.topology.routes(self.me, y):  # a neighbour's push comes directly
            raise ProtocolError("canary", f"node {msg.src} pushed as node {y}")
        if e != self.epoch:  # another view's layout: nothing of it can be routed here
            self.stats.moved += 1
            return
        if not (0 <= z < len(self.flows) and 0 <= th < self.layout.levels and 0 <= k < self.layout.steps
                and y in self.layout.peers(self.me, th, k)):
            raise ProtocolError("canary", f"node {y}: push for colayer {z}, thread {th}, step {k} "
                                          "is not one of its exchanges with this node")
        self._ingest(msg, z, th, k, y)
        flow = self.flows[z]
        self._spawn(self._send(y, rq, z, th, k, flow, self.iteration(), reply_to=None))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(self._guard(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guard(self, coro: Any) -> None:
        try:
            await coro
        except P2PSyncError as exc:  # the pusher counts a missing reply as an empty packet
            log.info("node %d: canary reply lost: %s", self.me, exc)


async def _all(coros: Any) -> list[Any]:
    """Await every coroutine; when one fails, cancel the others (no orphan waits)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _mask_bytes(mask: int) -> bytes:
    return mask.to_bytes(max(1, (mask.bit_length() + 7) // 8), "little")


__all__ = ["Exchange", "ExchangeStats", "MODES", "RoundResult"]

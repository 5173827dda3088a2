"""One collective operation on one node, piece by piece (:class:`Run`), and what it reports
(:class:`OpStats`): the execution half of :mod:`p2psync.collectives.executor`, whose module
docstring describes the pipeline, the zero-copy sends, the codecs and the tags."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Hashable, cast

import numpy as np

from p2psync.collectives.piece_machine import Apply, Check, Exchange, Hold, Payload, PieceMachine, Seal, Verdict
from p2psync.collectives.schedule import Schedule
from p2psync.compress import Codec
from p2psync.errors import ConfigError, Diverged, PeerFailure, PeerTimeout, ProtocolError
from p2psync.transport import all_finite, diverged, sum_diverged
from p2psync.wire import Fill, Message

if TYPE_CHECKING:
    from p2psync.collectives.executor import Collectives

#: ``check(lo, hi, piece, src)``: validates a received piece (buffer elements ``lo:hi``) that
#: neighbour ``src`` delivered, before it is used or passed on; raises to reject it
PieceCheck = Callable[[int, int, np.ndarray, int], None]

# the members the loop compares with, read once (an Enum class's attributes go through its
# metaclass's __getattr__ hook on every read, Python 3.11)
_OWN_FILL, _SUM_FILL, _CACHED = Payload.OWN_FILL, Payload.SUM_FILL, Payload.CACHED
_YES, _SCAN = Check.YES, Check.SCAN
_VERDICT_SCAN = Verdict.SCAN


@dataclass
class OpStats:
    """What one collective operation cost: its kind, plan algorithm, codec and tag, seconds,
    payload bytes before and after the codec, and bytes sent per NIC. Returned by
    :meth:`Collectives.allreduce_with_stats`; strategies log it, e.g. ssgd.py:
    ``extra={"compression": round(st.compression, 3), "op_nic_bytes": st.nic_bytes, ...}``."""

    op: str
    algo: str
    codec: str
    tag: str = ""
    seconds: float = 0.0
    raw_bytes: int = 0  # what the pieces would have cost uncompressed
    wire_bytes: int = 0  # what was actually sent (payload)
    nic_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def compression(self) -> float:
        """Raw bytes over wire bytes (1.0 when nothing was sent)."""
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0


async def _all(aws: list[Awaitable[Any]]) -> list[Any]:
    """Await them all as tasks; if one fails, cancel the others and wait for them to end
    before raising, so none goes on alone (a send still to compute its Fill from a piece
    about to be given back, a piece coroutine of an operation that has returned)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _divergence(me: int, tag: str, result: np.ndarray, base: np.ndarray | None) -> Diverged:
    """The error of a sum of finite received values and ``base`` (this node's values; None:
    no longer known) that is not finite: this node's own divergence when ``base`` is not
    finite or the result holds NaN (finite values only overflow to infinity), else the
    group's (:class:`~p2psync.errors.SumDiverged`: the coordinator ends the run)."""
    if (base is not None and not all_finite(base)) or bool(np.isnan(result).any()):
        return diverged(me, tag)
    return sum_diverged(me, tag)


class Run:
    """State of one collective on one node: the working buffer and the encoded-piece cache."""

    def __init__(self, owner: Collectives, sched: Schedule, buf: np.ndarray, bounds: np.ndarray,
                 codec: Codec, tag: str, stats: OpStats, sig: int, check: PieceCheck | None = None,
                 src: np.ndarray | None = None, feedback: Hashable | None = None) -> None:
        """``sched``: this node's steps of the plan (:func:`~p2psync.collectives.schedule.schedule`,
        computed with ``fused=Run.fuses(codec, check)``). ``feedback``: the caller's key of the
        error-feedback state of this tensor (None: no residual is applied or kept)."""
        self.owner = owner
        self.me = owner.transport.node_id
        self.sched = sched
        self.buf = buf
        self.bounds = bounds
        self.codec = codec
        self.tag = tag
        self.stats = stats
        self.sig = sig
        self.meta = {"sig": sig}
        self.cache: dict[int, list[np.ndarray]] = {}
        self.fb = owner.feedback if codec.lossy and feedback is not None else None
        self.fbkey = feedback
        self.check = check
        #: the arrival check of lossless pieces happens here, fused with their use (_apply)
        self.fused_check = self.fuses(codec, check)
        if src is not None and codec.lossy:
            raise ConfigError("a lossy codec encodes from the working buffer: it needs it filled")
        #: this node's own values (the caller's tensor, read only); ``fresh``: each piece's
        #: values are only there at first, not in ``buf`` yet (not so without ``src``: ``buf`` has them)
        self.src = buf if src is None else src
        self.fresh = src is not None
        #: whether this node's own values were finite (a lossy codec's working buffer holds
        #: partial sums once pieces arrive: :meth:`_encode` then tells the two divergences apart)
        self.own_finite = all_finite(buf) if codec.lossy else True

    def piece(self, k: int) -> np.ndarray:
        return self.buf[self.bounds[k]:self.bounds[k + 1]]

    def mine(self, k: int) -> np.ndarray:
        """Piece ``k`` of ``src``: this node's own values (read only)."""
        return self.src[self.bounds[k]:self.bounds[k + 1]]

    def _encode(self, k: int, key: tuple[Any, ...]) -> list[np.ndarray]:
        """Piece ``k`` as sent: the working buffer's view (lossless), or its encoding, after
        error-feedback compensation. A lossy piece that is not finite is not encoded: it is
        this node's own divergence when its own values are not finite, else the sum's
        (:class:`~p2psync.errors.SumDiverged`: a partial sum of finite values, or of finite
        pieces decoded, that overflowed here; the transport checked the encoded pieces that
        arrived, and a lossless codec's receiver would have found it on arrival)."""
        x = self.piece(k)
        if not self.codec.lossy:
            return [x]  # zero-copy view of the working buffer (see the module docstring)
        if self.fb is not None:
            x = self.fb.compensate(key, x)
        if not all_finite(x):  # (a decoded piece near float32's limit may overflow to NaN too)
            raise diverged(self.me, self.tag) if not self.own_finite else sum_diverged(self.me, self.tag)
        enc = self.codec.encode(x)
        if self.fb is not None:
            self.fb.record(key, x, self.codec.decode(enc, x.size))
        return enc

    def _own_fill(self, k: int, tag: str) -> Fill:
        """Piece ``k``'s own values, sent before anything arrived for it: copied from the
        caller's tensor straight into the place they are sent from (a shared-memory ring), or
        into ``buf`` first (:class:`~p2psync.wire.fill.Fill`): a frame never views the caller's
        tensor, which may change once a failed operation returns."""
        mine, me = self.mine(k), self.me

        def fill(out: np.ndarray) -> None:
            np.copyto(out, mine)
            if not all_finite(out):
                raise diverged(me, tag)
        return Fill(self.piece(k), fill)

    def _sum_fill(self, k: int, msg: Message, vals: np.ndarray, tag: str, base_mine: bool) -> Fill:
        """Piece ``k``'s partial sum with the received ``vals``, computed where it is sent from
        (:func:`~p2psync.collectives.schedule.deferrable`) and checked there as :meth:`_apply`
        would: a NaN / infinity in ``vals`` is the sender's offence, else the sum overflowed here.
        ``base_mine``: ``vals`` are added to this node's own values (``src``), else to ``buf``'s."""
        base = self.mine(k) if base_mine else self.piece(k)
        tr, me = self.owner.transport, self.me

        def fill(out: np.ndarray) -> None:
            np.add(base, vals, out=out)
            if not all_finite(out):
                tr.check_finite(msg.src, vals, f"piece {msg.tag!r}")
                raise _divergence(me, tag, out, base)
        return Fill(self.piece(k), fill)

    @staticmethod
    def fuses(codec: Codec, check: PieceCheck | None) -> bool:
        """Whether a Run checks the pieces it receives itself, fused with their use (``_apply``,
        ``_sum_fill``): lossless codecs without an extra ``check``. Only then may a received
        partial sum be sent straight on (:func:`~p2psync.collectives.schedule.deferrable`)."""
        return not codec.lossy and check is None

    def seal(self, k: int) -> None:
        """The owner quantizes a fully reduced piece once; those bytes are what everyone gets."""
        enc = self._encode(k, ("own", self.fbkey, self.buf.size, k))
        self.cache[k] = enc
        self.piece(k)[...] = self.codec.decode(enc, self.piece(k).size)

    def _decode(self, msg: Message, k: int) -> np.ndarray:
        if msg.meta.get("sig") != self.sig:
            raise ProtocolError("collective_mismatch",
                                f"{self.tag}: node {msg.src} runs a different operation under this tag "
                                f"(signature {msg.meta.get('sig')!r} != {self.sig})")
        n = int(self.bounds[k + 1] - self.bounds[k])
        if not self.codec.lossy:
            a = msg.arrays[0] if len(msg.arrays) == 1 else None
            if a is None or a.dtype != self.buf.dtype or a.size != n:
                raise ProtocolError("piece", f"{self.tag}: piece {k} from node {msg.src} has the wrong size or type")
            return a
        if any(f.codec != self.codec.name for f in msg.header.frames):
            raise ProtocolError("codec", f"{self.tag}: piece {k} from node {msg.src} is not {self.codec.name}")
        return self.codec.decode(msg.arrays, n)

    async def _recv(self, src: int, tag: str) -> Message:
        try:
            return await self.owner.transport.recv(tag, timeout=self.owner.timeout)
        except PeerTimeout:
            raise PeerFailure(f"{self.tag}: no piece from node {src} within {self.owner.timeout:g}s",
                              peers=(src,)) from None

    def _apply(self, k: int, vals: np.ndarray, msg: Message, a: Apply, m: PieceMachine) -> None:
        """Add ``vals`` into piece ``k`` or copy them over it, as ``a`` says. With the fused
        check (``Verdict.SCAN``) the transport has not scanned ``vals``: the piece is checked
        right after, while hot, and a non-finite result is blamed on the sender when ``vals``
        holds the NaN / infinity (else the sum overflowed here, and sending it raises Diverged
        as usual). The first value a piece gets is added to the caller's tensor's values
        (``a.base_mine``) into the working buffer."""
        piece = self.piece(k)
        if a.reduce:
            np.add(self.mine(k) if a.base_mine else piece, vals, out=piece)
        else:
            piece[...] = vals
        if a.cache:
            self.cache[k] = list(msg.arrays)
        if a.verdict is _VERDICT_SCAN:
            finite = all_finite(piece)
            m.applied(finite)
            if not finite:
                self.owner.transport.check_finite(msg.src, vals, f"piece {msg.tag!r}")
                if a.reduce:  # finite received values: this node's own, or the sum, diverged
                    raise _divergence(self.me, msg.tag, piece, self.mine(k) if a.base_mine else None)

    async def execute(self, seal: bool) -> None:
        """Run every piece's steps. ``seal``: a lossy codec's owner quantizes its fully reduced
        pieces before the allgather (:meth:`seal`)."""
        owned = self.sched.owned
        # lossless pieces: the finiteness check of what arrives is fused with the add / copy
        # into the working buffer (one read of the piece instead of two; see _apply)
        # and pieces that came through shared memory are added / copied straight from the
        # sender's ring (borrowed, released once used: _piece), not copied out first
        tr = self.owner.transport
        defer = tr.defer_finite(f"{self.tag}.") if self.fused_check else contextlib.nullcontext()
        lend = tr.lend(f"{self.tag}.", 3) if self.fused_check else contextlib.nullcontext()
        lossy, fused, fresh = self.codec.lossy, self.fused_check, self.fresh
        with defer, lend:  # (open first: a piece that arrives before its scope is copied out)
            machines = [PieceMachine(steps, lossy=lossy, fused=fused, fresh=fresh, seal=seal and k in owned)
                        for k, steps in enumerate(self.sched.pieces)]
            if len(machines) == 1:  # one piece (a small tensor): no task, no gather
                await self._piece(0, machines[0])
            else:
                await _all([self._piece(k, m) for k, m in enumerate(machines)])
        for k, m in enumerate(machines):  # never sent nor received here (an allreduce receives every piece)
            if m.fresh:
                self.piece(k)[...] = self.mine(k)

    async def _piece(self, k: int, m: PieceMachine) -> None:
        """Perform piece ``k``'s actions as its machine ``m`` decides them (see
        :mod:`~p2psync.collectives.piece_machine`)."""
        #: a received partial sum not added yet: added straight into the next send (_sum_fill)
        held: tuple[Message, np.ndarray] | None = None
        try:
            while (act := m.next()) is not None:
                if isinstance(act, Seal):
                    self.seal(k)
                    continue
                fill, sends, recvs = self._exchange(k, act, m, held)
                if act.single:  # e.g. every step of a ring: no task, no gather
                    one = await (sends or recvs)[0]
                    msgs = [] if sends else [cast(Message, one)]
                else:
                    results = await _all([*sends, *recvs])  # sends return None
                    msgs = cast("list[Message]", results[len(sends):])
                if m.exchanged(fill is not None and fill.owned) is not None and held is not None:
                    held[0].release()
                    held = None
                for e, msg in zip(act.expects, msgs, strict=True):
                    keep = False
                    try:
                        vals = self._decode(msg, k)
                        if self.check is not None:
                            self.check(int(self.bounds[k]), int(self.bounds[k + 1]), vals, msg.src)
                        use = m.arrived(e)
                        if isinstance(use, Hold):
                            held, keep = (msg, vals), True
                        else:
                            self._apply(k, vals, msg, use, m)
                    finally:  # a borrowed piece views the sender's ring: read no more from here
                        if not keep:
                            msg.release()
        finally:
            if held is not None:
                held[0].release()

    def _exchange(self, k: int, ex: Exchange, m: PieceMachine, held: tuple[Message, np.ndarray] | None
                  ) -> tuple[Fill | None, list[Awaitable[None]], list[Awaitable[Message]]]:
        """Start one step's sends and receives of piece ``k``: returns the step's fill (one,
        whatever the number of sends), the sends and the receives (in ``ex.expects`` order) to
        await. A plain function, not a coroutine: one frame less per step."""
        tag = self.tag + ex.send_suffix
        fill: Fill | None = None
        if ex.fill is _SUM_FILL:
            fill = self._sum_fill(k, *cast("tuple[Message, np.ndarray]", held), tag, ex.base_mine)
        elif ex.fill is _OWN_FILL:
            fill = self._own_fill(k, tag)
        scan: bool | None = None  # the piece's values scanned once for the step's Check.SCAN sends
        sends: list[Awaitable[None]] = []
        stats, send, raw = self.stats, self.owner.transport.send, self.piece(k).nbytes if ex.sends else 0
        for s in ex.sends:
            if fill is not None:
                arrays: list[Any] = [fill]
            elif s.payload is _CACHED:
                arrays = self.cache[k]
            else:
                arrays = self._encode(k, ("rs", self.fbkey, self.buf.size, k))
            check = s.check
            if check is _SCAN and scan is None:  # sent as is: check once, here, while hot
                scan = all_finite(arrays[0])  # (if not finite, the transport's scan raises Diverged)
                m.scanned(scan)
            # the piece's bytes: raw, on the wire, per NIC
            nbytes = 0
            for a in arrays:
                nbytes += a.nbytes
            t = s.transfer
            stats.wire_bytes += nbytes
            stats.raw_bytes += raw
            stats.nic_bytes[t.nic] = stats.nic_bytes.get(t.nic, 0) + nbytes
            sends.append(send(t.dst, tag, arrays, codecs=[self.codec.name] * len(arrays),
                              nic=None if t.via else t.nic, meta=self.meta, timeout=self.owner.timeout,
                              checked=bool(scan) if check is _SCAN else check is _YES, unordered=True,
                              relay=bool(t.via)))
        recvs: list[Awaitable[Message]] = []
        for e in ex.expects:
            recvs.append(self._recv(e.src, self.tag + e.suffix))
        return fill, sends, recvs


__all__ = ["OpStats", "PieceCheck", "Run"]

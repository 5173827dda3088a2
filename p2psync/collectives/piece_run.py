"""One collective operation on one node, piece by piece (:class:`Run`), and what it reports
(:class:`OpStats`): the execution half of :mod:`p2psync.collectives.executor`, whose module
docstring describes the pipeline, the zero-copy sends, the codecs and the tags."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Hashable, cast

import numpy as np

from p2psync.collectives.schedule import Schedule, Step
from p2psync.compress import Codec
from p2psync.errors import ConfigError, PeerFailure, PeerTimeout, ProtocolError
from p2psync.transport import all_finite, diverged
from p2psync.wire import Fill, Message

if TYPE_CHECKING:
    from p2psync.collectives.executor import Collectives

#: ``check(lo, hi, piece, src)``: validates a received piece (buffer elements ``lo:hi``) that
#: neighbour ``src`` delivered, before it is used or passed on; raises to reject it
PieceCheck = Callable[[int, int, np.ndarray, int], None]


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
        #: pieces whose current values are known finite: copied from a received piece (the
        #: transport rejects non-finite ones on arrival) or checked here since the last add;
        #: their sends skip the transport's own scan (``checked=True``)
        self.clean: set[int] = set()
        #: the arrival check of lossless pieces happens here, fused with their use (_use)
        self.fused_check = self.fuses(codec, check)
        if src is not None and codec.lossy:
            raise ConfigError("a lossy codec encodes from the working buffer: it needs it filled")
        #: this node's own values (the caller's tensor, read only), and the pieces whose values
        #: are still only there, not in ``buf`` yet (none without ``src``: ``buf`` has them)
        self.src = buf if src is None else src
        self.fresh: set[int] = set(range(len(bounds) - 1)) if src is not None else set()

    def piece(self, k: int) -> np.ndarray:
        return self.buf[self.bounds[k]:self.bounds[k + 1]]

    def mine(self, k: int) -> np.ndarray:
        """Piece ``k`` of ``src``: this node's own values (read only)."""
        return self.src[self.bounds[k]:self.bounds[k + 1]]

    def _encode(self, k: int, key: tuple[Any, ...]) -> list[np.ndarray]:
        x = self.piece(k)
        if not self.codec.lossy:
            return [x]  # zero-copy view of the working buffer (see the module docstring)
        if self.fb is not None:
            x = self.fb.compensate(key, x)
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

    def _sum_fill(self, k: int, msg: Message, vals: np.ndarray, tag: str) -> Fill:
        """Piece ``k``'s partial sum with the received ``vals``, computed where it is sent from
        (:func:`~p2psync.collectives.schedule.deferrable`) and checked there as :meth:`_use`
        would: a NaN / infinity in ``vals`` is the sender's offence, else the sum overflowed here."""
        base = self.mine(k) if k in self.fresh else self.piece(k)
        tr, me = self.owner.transport, self.me

        def fill(out: np.ndarray) -> None:
            np.add(base, vals, out=out)
            if not all_finite(out):
                tr.check_finite(msg.src, vals, f"piece {msg.tag!r}")
                raise diverged(me, tag)
        return Fill(self.piece(k), fill)

    @staticmethod
    def fuses(codec: Codec, check: PieceCheck | None) -> bool:
        """Whether a Run checks the pieces it receives itself, fused with their use (``_use``,
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

    def _use(self, k: int, vals: np.ndarray, msg: Message, reduce: bool) -> None:
        """Add ``vals`` into piece ``k`` (``reduce``) or replace it. With the fused check the
        transport has not scanned ``vals``: the piece is checked right after, while hot, and a
        non-finite result is blamed on the sender when ``vals`` holds the NaN / infinity (else
        the sum overflowed here, and sending it raises Diverged as usual). The first value a
        piece gets is written into the working buffer from the caller's tensor (``fresh``)."""
        piece = base = self.piece(k)
        if k in self.fresh:  # the first value for it: from the caller's tensor into ``buf``
            self.fresh.discard(k)
            base = self.mine(k)
        if reduce:
            np.add(base, vals, out=piece)
        else:
            piece[...] = vals
            if self.codec.lossy:
                self.cache[k] = list(msg.arrays)
        if not self.fused_check:
            if reduce:
                self.clean.discard(k)
            else:
                self.clean.add(k)  # the transport checked it on arrival
        elif all_finite(piece):
            self.clean.add(k)
        else:
            self.clean.discard(k)
            self.owner.transport.check_finite(msg.src, vals, f"piece {msg.tag!r}")

    async def execute(self, seal: bool) -> None:
        """Run every piece's steps. ``seal``: a lossy codec's owner quantizes its fully reduced
        pieces before the allgather (:meth:`seal`)."""
        owned = self.sched.owned
        # lossless pieces: the finiteness check of what arrives is fused with the add / copy
        # into the working buffer (one read of the piece instead of two; see _use)
        # and pieces that came through shared memory are added / copied straight from the
        # sender's ring (borrowed, released once used: _piece), not copied out first
        tr = self.owner.transport
        defer = tr.defer_finite(f"{self.tag}.") if self.fused_check else contextlib.nullcontext()
        lend = tr.lend(f"{self.tag}.", 3) if self.fused_check else contextlib.nullcontext()
        with defer, lend:
            await _all([self._piece(k, steps, seal and k in owned) for k, steps in enumerate(self.sched.pieces)])
        for k in self.fresh:  # never sent nor received here (an allreduce receives every piece)
            self.piece(k)[...] = self.mine(k)
        self.fresh.clear()

    async def _piece(self, k: int, steps: tuple[Step, ...], seal: bool) -> None:
        #: a received partial sum not added yet: added straight into the next send (_sum_fill)
        held: tuple[Message, np.ndarray] | None = None
        try:
            for step in steps:
                if seal and step.phase.startswith("ag"):
                    self.seal(k)
                    seal = False
                sends = []
                fill: Fill | None = None  # one per step, whatever the number of sends
                tag = self.tag + step.send_suffix
                for t in step.sends:
                    if held is not None or k in self.fresh:  # lossless, computed where it is sent from
                        if fill is None:
                            fill = self._sum_fill(k, *held, tag) if held is not None else self._own_fill(k, tag)
                        arrays: list[Any] = [fill]
                    elif not t.reduce and k in self.cache:
                        arrays = self.cache[k]
                    else:
                        arrays = self._encode(k, ("rs", self.fbkey, self.buf.size, k))
                    nbytes = sum(a.nbytes for a in arrays)
                    self.stats.wire_bytes += nbytes
                    self.stats.raw_bytes += self.piece(k).nbytes
                    self.stats.nic_bytes[t.nic] = self.stats.nic_bytes.get(t.nic, 0) + nbytes
                    checked = fill is not None  # a Fill checks what it computes
                    if not self.codec.lossy and not checked:  # sent as is: check once, here, while hot
                        checked = k in self.clean or all_finite(arrays[0])
                        if checked:  # (if not, the transport's scan raises Diverged)
                            self.clean.add(k)
                    sends.append(self.owner.transport.send(t.dst, tag, arrays,
                                                           codecs=[self.codec.name] * len(arrays),
                                                           nic=None if t.via else t.nic,
                                                           meta=self.meta, timeout=self.owner.timeout,
                                                           checked=checked, unordered=True, relay=bool(t.via)))
                incoming = step.incoming
                recvs = [self._recv(src, self.tag + sfx) for (src, _), sfx in zip(incoming, step.recv_suffixes)]
                if len(sends) + len(recvs) == 1:  # e.g. every step of a ring: no task, no gather
                    one = await (sends or recvs)[0]
                    msgs = [] if sends else [cast(Message, one)]
                else:
                    results = await _all([*sends, *recvs])  # sends return None
                    msgs = cast("list[Message]", results[len(sends):])
                if fill is not None:  # it went: its values are in ``buf`` only if it was owned there
                    if fill.owned:  # (and checked)
                        self.clean.add(k)
                        self.fresh.discard(k)
                    if held is not None:  # a partial sum that nothing reads any more (Step.defer)
                        held[0].release()
                        held = None
                        self.fresh.discard(k)
                defer = step.defer
                for (_src, reduce), msg in zip(incoming, msgs, strict=True):
                    keep = False
                    try:
                        vals = self._decode(msg, k)
                        if self.check is not None:
                            self.check(int(self.bounds[k]), int(self.bounds[k + 1]), vals, msg.src)
                        if defer:
                            held, keep = (msg, vals), True
                        else:
                            self._use(k, vals, msg, reduce)
                    finally:  # a borrowed piece views the sender's ring: read no more from here
                        if not keep:
                            msg.release()
        finally:
            if held is not None:
                held[0].release()
        if seal:  # owner with no allgather step for this piece (e.g. a plan without one)
            self.seal(k)


__all__ = ["OpStats", "PieceCheck", "Run"]

"""Runs collective :mod:`plans <p2psync.collectives.plan>` over the transport, piece by piece.

Pieces are independent (every operation is elementwise), so each node runs one coroutine per
piece, and each walks that piece's own steps through the plan's rounds: send the piece where
the round says, await the pieces that come in for it (each receive with a timeout), apply them
in sender order (sums do not depend on arrival order), go on to the next round. A piece moves
on as soon as its own inputs are in, so the plan runs pipelined — while one piece is still in
round r another is already in round r+1 — with many pieces in flight on every NIC and no
barrier, global or per round.

Outgoing pieces are sent zero-copy from the working buffer. During the operation that is safe
because every plan is causal: this node only ever overwrites or adds into a piece after
receiving a value that already includes what it sent of that piece, so the send has been
delivered by then. After the operation the last pieces may still be queued inside ZeroMQ (a
send returns once the message is queued, not transmitted). A queued zero-copy frame holds a
reference to the working buffer until ZeroMQ lets go of it, so the buffer itself becomes the
result once nothing but the operation references it any more (counted against the count right
after the buffer was made); a large buffer waits for its last sends at most as long as copying
it would take, then it is copied (:mod:`p2psync.collectives.buffers`): the result never shares
memory with a send in flight. Handing the buffer over spares a copy of the whole tensor into
fresh (page-faulting) memory per operation.

Codecs apply per piece, except ``topk``: its allreduce sparsifies each node's whole contribution
once and allgathers the sparse parts (:mod:`p2psync.collectives.sparse`, always with error
feedback; a dense exact allreduce where sparse would not save traffic); its reduce-scatter is a
ConfigError. For any other lossy codec the result is kept identical on every node: the
owner of a fully reduced piece replaces its own copy by decode(encode(piece)) and the encoded
bytes are then forwarded unchanged during the allgather, so everyone decodes the same bytes.
With error feedback the part of a contribution a codec failed to send is added to this node's
next contribution to the same piece (reduce-scatter sends and owner quantization alike).

All work happens on a copy; the caller's tensor is only replaced when the collective completes.
A peer that does not deliver within the timeout, or one the membership service declares dead,
aborts the collective with :class:`~p2psync.errors.PeerFailure` naming it.

**Tags.** Every operation takes an explicit ``tag`` naming it the same way on every member
(e.g. ``"ssgd.12"``). Matching operations by call order instead (a per-group sequence number)
silently pairs the wrong tensors when two operations are issued in different orders on
different nodes, so there is no default. Piece messages are tagged
``<tag>.<phase><round>.<src>.<piece>`` (short for any group size) and carry a 32-bit signature
of the operation (kind, group, size, dtype, codec, plan): a member that runs a different
operation under the same tag is rejected with :class:`~p2psync.errors.ProtocolError` instead
of being summed.

**Dtypes.** The result has the input's dtype for every operation.

=========================  ==============================  ==================
input dtype                sum                             mean, weighted
=========================  ==============================  ==================
float32, float64           in that dtype                   in that dtype
float16 (bfloat16 torch)   accumulated in float32, cast    same
                           back once at the end
int8 ... uint64            in that dtype (wraps as numpy)  ConfigError
bool                       logical or                      ConfigError
=========================  ==============================  ==================

16-bit floats travel as float32 partial sums, so four nodes summing 30000 get 120000 (inf only
if the final sum itself exceeds float16's range) and a mean of large values is exact. Mean and
weighted sums of integers are rejected: truncating weights or returning another dtype would
be silent surprises; convert to float first.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence, cast, get_args

import numpy as np

from p2psync.collectives.buffers import refs, sends_done, to_numpy
from p2psync.collectives.kernels import add_checked, copy_checked, fits
from p2psync.collectives.plan import Plan, Transfer, make_plan, plan_tree
from p2psync.collectives.sparse import sparse_allreduce
from p2psync.compress import Codec, ErrorFeedback, TopK, get_codec
from p2psync.errors import ConfigError, PeerFailure, PeerTimeout, ProtocolError
from p2psync.transport import Transport, all_finite
from p2psync.wire import Message
from p2psync.wire.schema import valid_tag

#: ``check(lo, hi, piece, src)``: validates a received piece (buffer elements ``lo:hi``) that
#: neighbour ``src`` delivered, before it is used or passed on; raises to reject it
PieceCheck = Callable[[int, int, np.ndarray, int], None]

#: longest caller tag: piece suffixes (".rs12.1023.4095") must still fit the wire's 128 chars
MAX_TAG = 96
_STEP_PART = re.compile(r"\.e?[0-9]+(?=\.|$)")  # step numbers and view epochs (".e3")
#: the reductions an allreduce performs (``weighted``: a weighted sum, weights per member)
ReduceOp = Literal["sum", "mean", "weighted"]


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


def _check_tag(tag: str) -> None:
    if not valid_tag(tag) or len(tag) > MAX_TAG:
        raise ConfigError(f"collective tag {tag!r}: 1-{MAX_TAG} characters from A-Z a-z 0-9 _ . : / @ # -")


def feedback_family(tag: str) -> str:
    """The tensor a tag names, without its step numbers and view epochs (``"ssgd.12.e3"`` ->
    ``"ssgd"``): error feedback residuals carry over between steps of the same tensor (also
    across view changes, where a piece that changed shape starts afresh), never between
    tensors."""
    return _STEP_PART.sub("", tag) or tag


class Collectives:
    """Piece-level allreduce, allgather and broadcast over a group of nodes, run over one
    node's transport with the run's codec, error feedback and plan algorithm.

    One per node, built by ``NodeRuntime`` (api/runtime.py: ``Collectives(self.transport,
    piece_bytes=..., codec=cfg.codec, ...)``); strategies use ``ctx.collectives``, e.g.
    base.py's ``mean_and_agree``: ``coll.allreduce_with_stats(vec, group, op="mean", tag=tag)``.
    Every member of ``group`` must call the same operation with the same ``tag``.
    """

    def __init__(self, transport: Transport, *, piece_bytes: int = 1 << 20, timeout: float = 30.0,
                 codec: str = "none", error_feedback: bool = False, algo: str = "auto") -> None:
        if piece_bytes < 4:
            raise ConfigError("piece size must be at least 4 bytes")
        self.transport = transport
        self.topo = transport.topology
        self.piece_bytes = piece_bytes
        self.timeout = timeout
        self.codec = codec
        self.algo = algo
        get_codec(codec)  # validate
        self.feedback = ErrorFeedback() if error_feedback else None
        #: residuals of the ``topk`` allreduce: always kept (see p2psync.collectives.sparse)
        self.sparse_feedback = ErrorFeedback()
        self._plans: dict[tuple[Any, ...], Plan] = {}
        self.history: deque[OpStats] = deque(maxlen=64)

    # -- public operations ---------------------------------------------------------------

    async def allreduce(self, tensor: Any, group: Sequence[int] | None = None, *, tag: str,
                        op: ReduceOp = "sum", weights: Mapping[int, float] | None = None,
                        algo: str | None = None, codec: str | None = None) -> Any:
        """Sum, mean or weighted sum of ``tensor`` over ``group`` (default: every node). With
        codec ``topk[:F]`` this is the sparse allreduce of :mod:`p2psync.collectives.sparse`.
        :meth:`allreduce_with_stats` also returns the operation's :class:`OpStats`."""
        result, _ = await self.allreduce_with_stats(tensor, group, tag=tag, op=op, weights=weights, algo=algo,
                                                    codec=codec)
        return result

    async def allreduce_with_stats(self, tensor: Any, group: Sequence[int] | None = None, *, tag: str,
                                   op: ReduceOp = "sum", weights: Mapping[int, float] | None = None,
                                   algo: str | None = None, codec: str | None = None) -> tuple[Any, OpStats]:
        """:meth:`allreduce` and the stats of this very operation (bytes per NIC, compression,
        seconds), without looking them up in :attr:`history` by tag."""
        if op not in get_args(ReduceOp):
            raise ConfigError(f"unknown reduction {op!r}")
        g = self._group(group)
        buf, back = to_numpy(tensor)
        alone = refs(buf)  # no view of the working buffer exists yet
        if op != "sum" and buf.dtype.kind not in "f":
            raise ConfigError(f"allreduce op={op!r} needs a floating-point tensor, got {np.dtype(buf.dtype)} "
                              "(use op='sum', or convert to float)")
        if op == "weighted":
            if weights is None or set(weights) != set(g):
                raise ConfigError("weighted allreduce needs one weight per group member")
            buf *= buf.dtype.type(weights[self.transport.node_id])
        c = get_codec(codec or self.codec)
        if isinstance(c, TopK):
            _check_tag(tag)
            stats = OpStats(f"allreduce:{op}", "topk", c.spec, tag)
            out = await sparse_allreduce(self, buf, g, c, stats=stats, family=feedback_family(tag), algo=algo)
            return back(out / out.dtype.type(len(g)) if op == "mean" else out), stats
        plan = self._plan(g, buf, algo)
        stats = await self._execute(f"allreduce:{op}", plan, buf, tag, codec, phases=("rs", "ag"))
        if not await sends_done(lambda: refs(buf) == alone, buf.nbytes):
            # ZeroMQ may still be reading the last pieces: never touch ``buf``
            return back(buf / buf.dtype.type(len(g)) if op == "mean" else buf.copy()), stats
        if op == "mean":
            buf /= buf.dtype.type(len(g))
        return back(buf), stats

    async def reduce_scatter(self, tensor: Any, group: Sequence[int] | None = None, *, tag: str,
                             algo: str | None = None,
                             codec: str | None = None) -> dict[tuple[int, int], np.ndarray]:
        """Sum over ``group``; returns this node's fully reduced element ranges {(lo, hi): values}
        (numpy, in the input's dtype)."""
        g = self._group(group)
        if isinstance(get_codec(codec or self.codec), TopK):
            raise ConfigError("codec topk supports allreduce only (a reduce-scatter would re-sparsify partial "
                              "sums at every hop); pass codec='none' or another codec to reduce_scatter")
        dtype = np.dtype(tensor.dtype) if isinstance(tensor, np.ndarray) else None
        buf, _ = to_numpy(tensor)
        plan = self._plan(g, buf, algo)
        await self._execute("reduce_scatter", plan, buf, tag, codec, phases=("rs",))
        bounds = self._bounds(buf, len(g))
        return {(int(bounds[lo]), int(bounds[hi])): buf[bounds[lo]:bounds[hi]].astype(dtype or buf.dtype)
                for lo, hi in plan.owner[self.transport.node_id]}

    async def allgather(self, tensor: Any, group: Sequence[int] | None = None, *,
                        tag: str) -> list[np.ndarray]:
        """Every member's ``tensor`` (same shape everywhere), in group order."""
        rows, _ = await self._gather(tensor, self._group(group), tag)
        return rows

    async def _gather(self, tensor: Any, g: tuple[int, ...], tag: str, *, record: bool = True,
                      check: PieceCheck | None = None) -> tuple[list[np.ndarray], OpStats]:
        """:meth:`allgather` and its stats (kept in the history only with ``record``). Each
        piece lies within one member's slot; ``check`` validates every piece at every hop."""
        mine = np.array(tensor, copy=True).reshape(-1) if isinstance(tensor, np.ndarray) else to_numpy(tensor)[0]
        m = mine.size
        ppn = max(1, -(-m * mine.itemsize // self.piece_bytes))  # pieces per member
        plan = self._slot_plan(g, ppn)
        order = self._slot_order(plan, g)
        buf = np.zeros(m * len(g), dtype=mine.dtype)
        slot = order.index(self.transport.node_id)
        buf[slot * m:(slot + 1) * m] = mine
        bounds = np.concatenate([np.linspace(s * m, (s + 1) * m, ppn + 1).astype(np.int64)[:-1]
                                 for s in range(len(g))] + [np.array([m * len(g)])])
        phases = ("ag",) if plan.algo in ("ring", "mesh") else ("rs", "ag")
        stats = await self._execute("allgather", plan, buf, tag, "none", phases=phases, bounds=bounds,
                                    record=record, check=check)
        shape = np.shape(tensor)
        return [buf[order.index(n) * m:(order.index(n) + 1) * m].reshape(shape).copy() for n in g], stats

    async def broadcast(self, tensor: Any, root: int, group: Sequence[int] | None = None, *,
                        tag: str) -> Any:
        """``root``'s tensor on every member (pass a tensor of the same shape everywhere)."""
        g = self._group(group)
        if root not in g:
            raise ConfigError(f"broadcast root {root} is not in the group")
        buf, back = to_numpy(tensor)
        alone = refs(buf)
        plan = plan_tree(self.topo, g, self._pieces(buf, len(g)), root=root)
        await self._execute("broadcast", plan, buf, tag, "none", phases=("ag",))
        free = await sends_done(lambda: refs(buf) == alone, buf.nbytes)
        return back(buf if free else buf.copy())  # sends may still be reading ``buf``

    def stats_for(self, tag: str) -> OpStats:
        """The stats of the most recent operation with this tag."""
        for st in reversed(self.history):
            if st.tag == tag:
                return st
        raise KeyError(f"no collective with tag {tag!r} in the recent history")

    # -- planning ------------------------------------------------------------------------

    def _group(self, group: Sequence[int] | None) -> tuple[int, ...]:
        g = tuple(sorted(self.topo.ids if group is None else group))
        if self.transport.node_id not in g:
            raise ConfigError(f"node {self.transport.node_id} is not in the group {list(g)}")
        return g

    def _per_piece(self, buf: np.ndarray, members: int) -> int:
        """Elements per piece: about ``piece_bytes``, but at most size / members, so that even a
        small tensor is spread over every member (balanced traffic, pipelined rounds)."""
        return max(1, min(self.piece_bytes // buf.itemsize, -(-buf.size // max(1, members))))

    def _pieces(self, buf: np.ndarray, members: int) -> int:
        return -(-buf.size // self._per_piece(buf, members))

    def _bounds(self, buf: np.ndarray, members: int) -> np.ndarray:
        per = self._per_piece(buf, members)
        return np.minimum(np.arange(self._pieces(buf, members) + 1, dtype=np.int64) * per, buf.size)

    def _plan(self, g: tuple[int, ...], buf: np.ndarray, algo: str | None) -> Plan:
        key = (g, self._pieces(buf, len(g)), algo or self.algo)
        if key not in self._plans:
            self._plans[key] = make_plan(self.topo, g, key[1], key[2])
        return self._plans[key]

    def _slot_plan(self, g: tuple[int, ...], ppn: int) -> Plan:
        key = ("slots", g, ppn)
        if key not in self._plans:
            plan = make_plan(self.topo, g, ppn * len(g), self.algo)
            if plan.algo not in ("ring", "mesh"):
                plan = make_plan(self.topo, g, ppn * len(g), "tree")
            self._plans[key] = plan
        return self._plans[key]

    @staticmethod
    def _slot_order(plan: Plan, g: tuple[int, ...]) -> list[int]:
        """Which member's data sits in slot s: the owner of chunk s (ring/mesh), else group order."""
        if plan.algo not in ("ring", "mesh"):
            return list(g)
        return [n for _, n in sorted((plan.owner[n][0][0], n) for n in g)]

    # -- execution -----------------------------------------------------------------------

    async def _execute(self, op: str, plan: Plan, buf: np.ndarray, tag: str, codec: str | None,
                       *, phases: tuple[str, ...], bounds: np.ndarray | None = None,
                       record: bool = True, check: PieceCheck | None = None) -> OpStats:
        _check_tag(tag)
        c = get_codec(codec or self.codec)
        if c.lossy and buf.dtype != np.float32:
            raise ConfigError(f"codec {c.name} works on float32 (or 16-bit float) tensors, got {buf.dtype}")
        stats = OpStats(op, plan.algo, c.name, tag)
        t0 = time.perf_counter()
        if len(plan.group) > 1:
            if bounds is None:
                bounds = self._bounds(buf, len(plan.group))
            sig = zlib.crc32(repr((op, plan.group, plan.algo, buf.size, buf.dtype.str, c.name, phases,
                                   len(bounds))).encode())
            run = _Run(self, plan, buf, bounds, c, tag, stats, sig, check)
            await run.execute(phases)
        stats.seconds = time.perf_counter() - t0
        if record:
            self.history.append(stats)
        return stats


class _Run:
    """State of one collective on one node: the working buffer and the encoded-piece cache."""

    def __init__(self, owner: Collectives, plan: Plan, buf: np.ndarray, bounds: np.ndarray,
                 codec: Codec, tag: str, stats: OpStats, sig: int, check: PieceCheck | None = None) -> None:
        self.owner = owner
        self.me = owner.transport.node_id
        self.plan = plan
        self.buf = buf
        self.bounds = bounds
        self.codec = codec
        self.tag = tag
        self.stats = stats
        self.sig = sig
        self.meta = {"sig": sig}
        self.family = feedback_family(tag)
        self.cache: dict[int, list[np.ndarray]] = {}
        self.fb = owner.feedback if codec.lossy else None
        self.check = check
        #: pieces whose current values are known finite: copied from a received piece (the
        #: transport rejects non-finite ones on arrival) or checked here since the last add;
        #: their sends skip the transport's own scan (``checked=True``)
        self.clean: set[int] = set()
        #: the arrival check of lossless pieces happens here, fused with their use (_use)
        self.fused_check = not codec.lossy and check is None

    def piece(self, k: int) -> np.ndarray:
        return self.buf[self.bounds[k]:self.bounds[k + 1]]

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

    def seal(self, k: int) -> None:
        """The owner quantizes a fully reduced piece once; those bytes are what everyone gets."""
        enc = self._encode(k, ("own", self.family, self.buf.size, k))
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
        transport has not scanned ``vals``: the piece is checked in the same pass (float32:
        :mod:`p2psync.collectives.kernels`) or right after, while hot, and a non-finite result is blamed on the sender when ``vals`` holds the NaN / infinity (else
        the sum overflowed here, and sending it raises Diverged as usual)."""
        piece = self.piece(k)
        if self.fused_check and fits(piece, vals):  # add / copy and check in one pass
            if (add_checked if reduce else copy_checked)(piece, vals):
                self.clean.add(k)
                return
        elif reduce:
            np.add(piece, vals, out=piece)
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

    async def execute(self, phases: tuple[str, ...]) -> None:
        rounds = [(f"{ph}{r}", [t for t in rnd if self.me in (t.src, t.dst)])
                  for ph in ("rs", "ag") if ph in phases
                  for r, rnd in enumerate(self.plan.rs if ph == "rs" else self.plan.ag)]
        owned = {k for lo, hi in self.plan.owner[self.me] for k in range(lo, hi)}
        seal = self.codec.lossy and "ag" in phases
        # lossless pieces: the finiteness check of what arrives is fused with the add / copy
        # into the working buffer (one read of the piece instead of two; see _use)
        # and pieces that came through shared memory are added / copied straight from the
        # sender's ring (borrowed, released once used: _piece), not copied out first
        tr = self.owner.transport
        defer = tr.defer_finite(f"{self.tag}.") if self.fused_check else contextlib.nullcontext()
        lend = tr.lend(f"{self.tag}.", 3) if self.fused_check else contextlib.nullcontext()
        with defer, lend:
            tasks = [asyncio.ensure_future(self._piece(k, rounds, seal and k in owned))
                     for k in range(len(self.bounds) - 1)]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    async def _piece(self, k: int, rounds: list[tuple[str, list[Transfer]]], seal: bool) -> None:
        for phase, transfers in rounds:
            mine = [t for t in transfers if t.lo <= k < t.hi]
            if not mine:
                continue
            if seal and phase.startswith("ag"):
                self.seal(k)
                seal = False
            sends = []
            for t in mine:
                if t.src != self.me:
                    continue
                if not t.reduce and k in self.cache:
                    arrays = self.cache[k]
                else:
                    arrays = self._encode(k, ("rs", self.family, self.buf.size, k))
                nbytes = sum(a.nbytes for a in arrays)
                self.stats.wire_bytes += nbytes
                self.stats.raw_bytes += self.piece(k).nbytes
                self.stats.nic_bytes[t.nic] = self.stats.nic_bytes.get(t.nic, 0) + nbytes
                checked = False
                if not self.codec.lossy:  # sent as is: check once, here, while the piece is hot
                    checked = k in self.clean or all_finite(arrays[0])
                    if checked:  # (if not, the transport's scan raises Diverged)
                        self.clean.add(k)
                sends.append(self.owner.transport.send(t.dst, f"{self.tag}.{phase}.{self.me}.{k}", arrays,
                                                       codecs=[self.codec.name] * len(arrays), nic=t.nic,
                                                       meta=self.meta, timeout=self.owner.timeout,
                                                       checked=checked))
            incoming = sorted((t.src, t.reduce) for t in mine if t.dst == self.me)
            recvs = [self._recv(src, f"{self.tag}.{phase}.{src}.{k}") for src, _ in incoming]
            if len(sends) + len(recvs) == 1:  # e.g. every step of a ring: no task, no gather
                one = await (sends or recvs)[0]
                msgs = [] if sends else [cast(Message, one)]
            else:
                results = await asyncio.gather(*sends, *recvs)  # sends return None
                msgs = cast("list[Message]", results[len(sends):])
            for (_src, reduce), msg in zip(incoming, msgs, strict=True):
                try:
                    vals = self._decode(msg, k)
                    if self.check is not None:
                        self.check(int(self.bounds[k]), int(self.bounds[k + 1]), vals, msg.src)
                    self._use(k, vals, msg, reduce)
                finally:  # a borrowed piece views the sender's ring: read no more from here
                    msg.release()
        if seal:  # owner with no allgather step for this piece (e.g. a plan without one)
            self.seal(k)

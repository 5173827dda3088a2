"""Runs collective :mod:`plans <p2psync.collectives.plan>` over the transport, piece by piece.

Pieces are independent (every operation is elementwise), so each node runs one coroutine per
piece, and each walks that piece's own steps through the plan's rounds: send the piece where
the round says, await the pieces that come in for it (each receive with a timeout), apply them
in sender order (sums do not depend on arrival order), go on to the next round. A piece moves
on as soon as its own inputs are in, so the plan runs pipelined — while one piece is still in
round r another is already in round r+1 — with many pieces in flight on every NIC and no
barrier, global or per round. What a piece's coroutine does at each step is decided without
IO by its :class:`~p2psync.collectives.piece_machine.PieceMachine` (which frames each send
takes, whether its values are known finite, whether an arrived piece is added, copied or held
for the next send, when the owner seals); the coroutine (:mod:`p2psync.collectives.piece_run`)
performs those actions over the transport and counts the bytes.

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
fresh (page-faulting) memory per operation. Two kinds of lossless sends are not written into
the working buffer first but computed where they are sent from (a :class:`~p2psync.wire.fill.Fill`:
into the sender's shared-memory ring, else into the buffer and sent from there): a partial sum
that nothing on this node reads but the send (the ring's and BCube's reduce-scatter:
``schedule.deferrable``; the received piece is given back once the send has gone), and a piece's
first send from the caller's tensor (below).

Codecs apply per piece, except ``topk``: its allreduce sparsifies each node's whole contribution
once and allgathers the sparse parts (:mod:`p2psync.collectives.sparse`, always with error
feedback; a dense exact allreduce where sparse would not save traffic); its reduce-scatter is a
ConfigError. For any other lossy codec the result is kept identical on every node: the
owner of a fully reduced piece replaces its own copy by decode(encode(piece)) and the encoded
bytes are then forwarded unchanged during the allgather, so everyone decodes the same bytes.
With error feedback the part of a contribution a codec failed to send is added to this node's
next contribution to the same piece (reduce-scatter sends and owner quantization alike). The
caller names the tensor whose residuals these are: ``feedback=`` a key that is the same on
every operation that sends the same tensor (``("ssgd", "grad")``), whatever its tags; an
operation without a key applies and keeps no residual.

The caller's tensor is never written: the result is a new tensor (except for an allreduce of a
*donated* tensor, below). Most operations work on a copy of it. A lossless allreduce sum or
mean of a host tensor that needs no conversion (numpy or CPU torch, contiguous, not 16-bit)
reads it where it stands instead: the working buffer starts empty, and each piece gets its
first value when the first piece that arrives for it is added to this node's own values (or
replaces them), straight into the buffer — one pass less over the whole tensor per operation.
The tensor must therefore not change until the call returns (as with torch.distributed's
asynchronous operations). A piece this node sends before anything arrives for it is copied from
there as it is sent (a Fill), so a frame ZeroMQ still holds after a failed operation never
views the caller's memory.
An allreduce may instead be handed the tensor (``donate=True``: a host float array the caller
owns, needs no conversion and never touches again, not even after a failure): it is the working
buffer itself, reduced in place, and becomes the result once ZeroMQ let go of it, as above (else
the result is a fresh copy) — no second buffer of the tensor's size, and the result can be donated
again by the next operation.
A peer that does not deliver within the timeout, or one the membership service declares dead,
aborts the collective with :class:`~p2psync.errors.PeerFailure` naming it.

**Groups that need relays.** When a group's own links do not join it, its plan passes pieces
through other nodes (:mod:`p2psync.collectives.plan`): those sends ask the transport to relay
(``relay=True``; hop by hop over live nodes, never as datagrams), and before every such
operation the live nodes must still join the group, else it fails at once with
:class:`~p2psync.errors.GroupCutOff` (a PeerFailure naming the dead nodes that would have
joined it) instead of waiting out its timeout; an operation that fails with a PeerFailure
meanwhile says the same when the nodes marked dead by then cut the group apart. A plan over
direct links sends exactly as before.

**Tags.** Every operation takes an explicit ``tag`` naming it the same way on every member
(e.g. ``"ssgd.12"``). Matching operations by call order instead (a per-group sequence number)
silently pairs the wrong tensors when two operations are issued in different orders on
different nodes, so there is no default. Piece messages are tagged
``<tag>.<phase><round>.<src>.<piece>`` (short for any group size) and carry a 32-bit signature
of the operation (kind, group, size, dtype, codec, plan): a member that runs a different
operation under the same tag is rejected with :class:`~p2psync.errors.ProtocolError` instead
of being summed. Each piece tag is used once, so pieces are sent *unordered*
(``Transport.send(..., unordered=True)``: as datagrams to peers on this host, which may overtake
other messages): a tag must not be reused while an earlier operation under it may still run.

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

import weakref
import zlib
from collections import deque
from typing import Any, Hashable, Literal, Mapping, Sequence, get_args

import numpy as np

from p2psync import clock
from p2psync.collectives.buffers import host_flat, own, refs, sends_done, to_numpy
from p2psync.collectives.piece_run import OpStats, PieceCheck, Run
from p2psync.collectives.plan import Plan, check_live, make_plan, plan_tree
from p2psync.collectives.schedule import Schedule, schedule
from p2psync.collectives.sparse import sparse_allreduce
from p2psync.compress import ErrorFeedback, TopK, get_codec
from p2psync.errors import ConfigError, GroupCutOff, PeerFailure
from p2psync.topology import Topology
from p2psync.transport import Transport
from p2psync.wire.schema import valid_tag

#: the smallest piece the simulator cuts a tensor into to spread it over the members (bytes;
#: ``Collectives(spread_floor_bytes=...)``)
SPREAD_FLOOR_BYTES = 4096
#: largest allgather (all the rows together, bytes) done as a sum allreduce of the rows' bytes
#: (see ``Collectives.allgather``)
GATHER_BY_SUM_BYTES = 64 << 10
#: longest caller tag: piece suffixes (".rs12.1023.4095") must still fit the wire's 128 chars
MAX_TAG = 96
#: the plans whose owners hold one chunk each in member order, so an allgather of slots is
#: their allgather phase alone
_SLOT_ALGOS = ("ring", "mesh", "direct")
#: the reductions an allreduce performs (``weighted``: a weighted sum, weights per member)
ReduceOp = Literal["sum", "mean", "weighted"]


#: every plan made over a topology, by its inputs, shared by every :class:`Collectives` over
#: that very topology object (a plan is a pure function of the topology and the key, and never
#: changed once made): one copy per process, however many nodes it simulates. Kept as long as
#: the topology is.
_SHARED_PLANS: weakref.WeakKeyDictionary[Topology, dict[tuple[Any, ...], Plan]] = weakref.WeakKeyDictionary()


def shared_plans(topo: Topology) -> dict[tuple[Any, ...], Plan]:
    """The plans made over ``topo`` so far, by their inputs (see ``_SHARED_PLANS``): the
    ``Collectives`` of every node over ``topo`` in this process read and add to this one dict."""
    plans = _SHARED_PLANS.get(topo)
    if plans is None:
        plans = _SHARED_PLANS.setdefault(topo, {})
    return plans


def _check_tag(tag: str) -> None:
    if not valid_tag(tag) or len(tag) > MAX_TAG:
        raise ConfigError(f"collective tag {tag!r}: 1-{MAX_TAG} characters from A-Z a-z 0-9 _ . : / @ # -")


class Collectives:
    """Piece-level allreduce, allgather and broadcast over a group of nodes, run over one
    node's transport with the run's codec, error feedback and plan algorithm.

    One per node, built by ``NodeRuntime`` (api/runtime.py: ``Collectives(self.transport,
    piece_bytes=..., codec=cfg.codec, ...)``); strategies use ``ctx.collectives``, e.g.
    base.py's ``mean_and_agree``: ``coll.allreduce_with_stats(vec, group, op="mean", tag=tag)``.
    Every member of ``group`` must call the same operation with the same ``tag``.
    """

    def __init__(self, transport: Transport, *, piece_bytes: int = 1 << 20, timeout: float = 30.0,
                 codec: str = "none", error_feedback: bool = False, algo: str = "auto",
                 spread_floor_bytes: int = 0) -> None:
        """``spread_floor_bytes``: the smallest piece a tensor is cut into to spread it over the
        members (0: down to one element; see :meth:`_per_piece`)."""
        if piece_bytes < 4:
            raise ConfigError("piece size must be at least 4 bytes")
        if spread_floor_bytes < 0:
            raise ConfigError("spread floor must be >= 0 bytes")
        self.transport = transport
        self.topo = transport.topology
        self.piece_bytes = piece_bytes
        self.spread_floor_bytes = spread_floor_bytes
        self.timeout = timeout
        self.codec = codec
        self.algo = algo
        get_codec(codec)  # validate
        self.feedback = ErrorFeedback() if error_feedback else None
        #: residuals of the ``topk`` allreduce: always kept (see p2psync.collectives.sparse)
        self.sparse_feedback = ErrorFeedback()
        #: plans by their inputs (topology aside), shared with every node over this topology
        self._plans = shared_plans(self.topo)
        self._schedules: dict[tuple[Any, ...], tuple[Plan, Schedule]] = {}
        self._sigs: dict[tuple[Any, ...], tuple[Plan, int]] = {}
        self.history: deque[OpStats] = deque(maxlen=64)

    # -- public operations ---------------------------------------------------------------

    async def allreduce(self, tensor: Any, group: Sequence[int] | None = None, *, tag: str,
                        op: ReduceOp = "sum", weights: Mapping[int, float] | None = None,
                        algo: str | None = None, codec: str | None = None,
                        feedback: Hashable | None = None, donate: bool = False) -> Any:
        """Sum, mean or weighted sum of ``tensor`` over ``group`` (default: every node). With
        codec ``topk[:F]`` this is the sparse allreduce of :mod:`p2psync.collectives.sparse`.
        ``feedback``: the key of this tensor's error-feedback state under a lossy codec (see the
        module docstring; None: none is applied or kept).
        :meth:`allreduce_with_stats` also returns the operation's :class:`OpStats`.
        ``tensor`` is not written, and must not change until this returns (a lossless sum or
        mean reads it as the operation goes; see the module docstring). ``donate``: the caller
        hands ``tensor`` over instead: the operation reduces in it and may return that very
        memory; the caller must not read or write it afterwards, whatever the outcome (a host
        tensor that needs a conversion is copied as usual)."""
        result, _ = await self.allreduce_with_stats(tensor, group, tag=tag, op=op, weights=weights, algo=algo,
                                                    codec=codec, feedback=feedback, donate=donate)
        return result

    async def allreduce_with_stats(self, tensor: Any, group: Sequence[int] | None = None, *, tag: str,
                                   op: ReduceOp = "sum", weights: Mapping[int, float] | None = None,
                                   algo: str | None = None, codec: str | None = None,
                                   feedback: Hashable | None = None, donate: bool = False) -> tuple[Any, OpStats]:
        """:meth:`allreduce` and the stats of this very operation (bytes per NIC, compression,
        seconds), without looking them up in :attr:`history` by tag."""
        if op not in get_args(ReduceOp):
            raise ConfigError(f"unknown reduction {op!r}")
        g = self._group(group)
        flat, back, view = host_flat(tensor)
        if op != "sum" and flat.dtype.kind not in "f":
            raise ConfigError(f"allreduce op={op!r} needs a floating-point tensor, got {np.dtype(flat.dtype)} "
                              "(use op='sum', or convert to float)")
        c = get_codec(codec or self.codec)
        # a lossless sum or mean reads the caller's tensor where it stands: each piece goes
        # into the working buffer with the first piece added to it (see the module docstring);
        # a donated tensor is the working buffer itself (not for topk: its residual keeps the buffer)
        donated = donate and not isinstance(c, TopK)
        src = flat if view and not donated and op != "weighted" and not c.lossy and len(g) > 1 else None
        buf = np.empty_like(flat) if src is not None else flat.copy() if view and not donated else own(flat)
        alone = refs(buf)  # no view of the working buffer exists yet
        if op == "weighted":
            if weights is None or set(weights) != set(g):
                raise ConfigError("weighted allreduce needs one weight per group member")
            buf *= buf.dtype.type(weights[self.transport.node_id])
        if isinstance(c, TopK):
            _check_tag(tag)
            stats = OpStats(f"allreduce:{op}", "topk", c.spec, tag)
            out = await sparse_allreduce(self, buf, g, c, stats=stats, feedback=feedback, algo=algo)
            return back(out / out.dtype.type(len(g)) if op == "mean" else out), stats
        plan = self._plan(g, buf, algo)
        stats = await self._execute(f"allreduce:{op}", plan, buf, tag, codec, phases=("rs", "ag"), src=src,
                                    feedback=feedback)
        if not await sends_done(lambda: refs(buf) == alone, buf.nbytes):
            # ZeroMQ may still be reading the last pieces: never touch ``buf``
            return back(buf / buf.dtype.type(len(g)) if op == "mean" else buf.copy()), stats
        if op == "mean":
            buf /= buf.dtype.type(len(g))
        return back(buf), stats

    async def reduce_scatter(self, tensor: Any, group: Sequence[int] | None = None, *, tag: str,
                             algo: str | None = None, codec: str | None = None,
                             feedback: Hashable | None = None) -> dict[tuple[int, int], np.ndarray]:
        """Sum over ``group``; returns this node's fully reduced element ranges {(lo, hi): values}
        (numpy, in the input's dtype). ``feedback``: as for :meth:`allreduce`."""
        g = self._group(group)
        if isinstance(get_codec(codec or self.codec), TopK):
            raise ConfigError("codec topk supports allreduce only (a reduce-scatter would re-sparsify partial "
                              "sums at every hop); pass codec='none' or another codec to reduce_scatter")
        dtype = np.dtype(tensor.dtype) if isinstance(tensor, np.ndarray) else None
        buf, _ = to_numpy(tensor)
        plan = self._plan(g, buf, algo)
        await self._execute("reduce_scatter", plan, buf, tag, codec, phases=("rs",), feedback=feedback)
        bounds = self._bounds(buf, len(g))
        return {(int(bounds[lo]), int(bounds[hi])): buf[bounds[lo]:bounds[hi]].astype(dtype or buf.dtype)
                for lo, hi in plan.owner[self.transport.node_id]}

    async def allgather(self, tensor: Any, group: Sequence[int] | None = None, *,
                        tag: str) -> list[np.ndarray]:
        """Every member's ``tensor`` (same shape everywhere), in group order, bit for bit.

        When all the rows together are small (:data:`GATHER_BY_SUM_BYTES` at most) this is a
        sum allreduce of their bytes, each member's row in its own slot of a zeroed vector: the
        sum of one row and zeros is that row, exactly, and the operation costs the allreduce's
        O(N) messages on a ring instead of the slot allgather's N (N - 1). Every member takes
        the same way: it depends only on the row's size and the group."""
        g = self._group(group)
        mine = np.array(tensor, copy=True) if isinstance(tensor, np.ndarray) else to_numpy(tensor)[0]
        if len(g) > 1 and mine.nbytes * len(g) <= GATHER_BY_SUM_BYTES:
            return await self._gather_by_sum(mine, g, tag)
        rows, _ = await self._gather(tensor, g, tag)
        return rows

    async def _gather_by_sum(self, mine: np.ndarray, g: tuple[int, ...], tag: str) -> list[np.ndarray]:
        """:meth:`allgather` of small rows as a sum allreduce of their bytes (see there), in
        pieces of :data:`SPREAD_FLOOR_BYTES` at least (bytes: no sum can overflow)."""
        row = np.ascontiguousarray(mine).reshape(-1).view(np.uint8)
        nb = row.size
        buf = np.zeros(nb * len(g), np.uint8)
        slot = g.index(self.transport.node_id)
        buf[slot * nb:(slot + 1) * nb] = row
        per = self._per_piece(buf, len(g), SPREAD_FLOOR_BYTES)  # bytes a piece
        pieces = -(-buf.size // per)
        bounds = np.minimum(np.arange(pieces + 1, dtype=np.int64) * per, buf.size)
        await self._execute("allgather", self._plan_of(g, pieces, None), buf, tag, "none", phases=("rs", "ag"),
                            bounds=bounds)
        return [buf[i * nb:(i + 1) * nb].copy().view(mine.dtype).reshape(mine.shape) for i in range(len(g))]

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
        phases = ("ag",) if plan.algo in _SLOT_ALGOS else ("rs", "ag")
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
        key = ("tree", g, self._pieces(buf, len(g)), root)  # kept, as every plan (and its schedules)
        plan = self._plans.get(key) or self._plans.setdefault(key, plan_tree(self.topo, g, key[2], root=root))
        check_live(plan, self.topo, self.transport.dead)
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

    def _per_piece(self, buf: np.ndarray, members: int, floor: int | None = None) -> int:
        """Elements per piece: about ``piece_bytes``, but at most size / members, so that even a
        small tensor is spread over every member (balanced traffic, pipelined rounds), but not
        in pieces smaller than ``spread_floor_bytes`` (or ``piece_bytes`` when that is
        smaller): where a message costs its overhead, not its bytes, more pieces only add
        messages (a 64-byte vector over 1024 members would be 16 one-element pieces, each
        crossing the whole ring; the simulator uses :data:`SPREAD_FLOOR_BYTES`). Real runs
        spread down to one element: a sum that overflows is then seen by every owner of a
        piece at once (with one piece only its owner sees it, and the others learn it when
        that node leaves)."""
        cap = self.piece_bytes // buf.itemsize
        floor = self.spread_floor_bytes if floor is None else floor
        spread = max(-(-buf.size // max(1, members)), floor // buf.itemsize)
        return max(1, min(cap, spread))

    def _pieces(self, buf: np.ndarray, members: int) -> int:
        return -(-buf.size // self._per_piece(buf, members))

    def _bounds(self, buf: np.ndarray, members: int) -> np.ndarray:
        per = self._per_piece(buf, members)
        return np.minimum(np.arange(self._pieces(buf, members) + 1, dtype=np.int64) * per, buf.size)

    def _plan(self, g: tuple[int, ...], buf: np.ndarray, algo: str | None) -> Plan:
        return self._plan_of(g, self._pieces(buf, len(g)), algo)

    def _plan_of(self, g: tuple[int, ...], pieces: int, algo: str | None) -> Plan:
        key = (g, pieces, algo or self.algo)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make_plan(self.topo, g, key[1], key[2])
        check_live(plan, self.topo, self.transport.dead)
        return plan

    def _slot_plan(self, g: tuple[int, ...], ppn: int) -> Plan:
        key = ("slots", g, ppn, self.algo)
        if key not in self._plans:
            plan = make_plan(self.topo, g, ppn * len(g), self.algo)
            if plan.algo not in _SLOT_ALGOS:
                plan = make_plan(self.topo, g, ppn * len(g), "tree")
            self._plans[key] = plan
        plan = self._plans[key]
        check_live(plan, self.topo, self.transport.dead)
        return plan

    @staticmethod
    def _slot_order(plan: Plan, g: tuple[int, ...]) -> list[int]:
        """Which member's data sits in slot s: the owner of chunk s (ring/mesh), else group order."""
        if plan.algo not in _SLOT_ALGOS:
            return list(g)
        return [n for _, n in sorted((plan.owner[n][0][0], n) for n in g)]

    def _schedule(self, plan: Plan, phases: tuple[str, ...], pieces: int, fused: bool) -> Schedule:
        """This node's steps of ``plan`` (:mod:`p2psync.collectives.schedule`), computed once and
        kept as long as the plan is (every plan is, in ``_plans``); the plan is kept with them,
        so a key by ``id`` never outlives it."""
        key = (id(plan), phases, pieces, fused)
        hit = self._schedules.get(key)
        if hit is None or hit[0] is not plan:
            hit = self._schedules[key] = (plan, schedule(plan, self.transport.node_id, pieces, phases, fused))
        return hit[1]

    def _signature(self, plan: Plan, what: tuple[Any, ...]) -> int:
        """The CRC of ``repr(what)`` (an operation's identity, the same on every member), kept
        per plan and operation: the group in it makes it O(N) to compute."""
        key = (id(plan), what[0], *what[2:])
        hit = self._sigs.get(key)
        if hit is None or hit[0] is not plan:
            if len(self._sigs) >= 4 * len(self._schedules) + 64:
                self._sigs.clear()
            hit = self._sigs[key] = (plan, zlib.crc32(repr(what).encode()))
        return hit[1]

    # -- execution -----------------------------------------------------------------------

    async def _execute(self, op: str, plan: Plan, buf: np.ndarray, tag: str, codec: str | None,
                       *, phases: tuple[str, ...], bounds: np.ndarray | None = None,
                       record: bool = True, check: PieceCheck | None = None,
                       src: np.ndarray | None = None, feedback: Hashable | None = None) -> OpStats:
        """Run ``plan`` on ``buf``. ``src``: ``buf`` is not filled yet, this node's values are
        there (read only; lossless codecs): each piece is read from it until the first piece
        that arrives for it is added to it (or replaces it) into ``buf``, or until this node
        sends it (copied as it is sent, into ``buf`` unless shared memory takes it), and copied
        at the end if it never reached ``buf`` (:class:`Run`; a group of more than one)."""
        _check_tag(tag)
        c = get_codec(codec or self.codec)
        if c.lossy and buf.dtype != np.float32:
            raise ConfigError(f"codec {c.name} works on float32 (or 16-bit float) tensors, got {buf.dtype}")
        stats = OpStats(op, plan.algo, c.name, tag)
        t0 = clock.now()
        if len(plan.group) > 1:
            if bounds is None:
                bounds = self._bounds(buf, len(plan.group))
            sig = self._signature(plan, (op, plan.group, plan.algo, buf.size, buf.dtype.str, c.name, phases,
                                         len(bounds)))
            sched = self._schedule(plan, phases, len(bounds) - 1, Run.fuses(c, check))
            run = Run(self, sched, buf, bounds, c, tag, stats, sig, check, src, feedback)
            try:
                await run.execute(c.lossy and "ag" in phases)
            except PeerFailure as exc:  # relays that died meanwhile may have cut the group apart
                if plan.relays and not isinstance(exc, GroupCutOff):
                    try:
                        check_live(plan, self.topo, self.transport.dead)
                    except GroupCutOff as cut:
                        raise cut from exc
                raise
        stats.seconds = clock.now() - t0
        if record:
            self.history.append(stats)
        return stats


__all__ = ["Collectives", "OpStats", "PieceCheck", "ReduceOp"]

"""The allreduce of the ``topk`` codec: every node sparsifies once, the group allgathers the
sparse vectors, and every node sums them in the same order.

Why not the piece executor: a ring (or BCube, or tree) reduce-scatter sums partial results hop
by hop, and a top-k codec would have to re-sparsify every partial sum, dropping a little more
at each hop and sending a different selection on every link. Deep Gradient Compression instead
sparsifies each node's own contribution once and exchanges the sparse vectors; this module
does that:

1. x = this node's contribution (already multiplied by its weight for ``op="weighted"``) plus
   its error-feedback residual for the tensor (keyed by the caller's ``feedback`` key and the
   tensor's size, so the steps of one tensor share one residual and two tensors never do;
   without a key, what is not sent is dropped);
2. keep its k = ceil(f * n) largest-magnitude entries (:func:`~p2psync.compress.topk.select_topk`;
   k is the same on every node since n and f are); the rest, x - sparse(x), becomes the new
   residual. ``topk`` uses error feedback whenever the caller gives a key, whatever
   ``error_feedback`` says;
3. allgather (indices, values) with :meth:`Collectives.allgather <p2psync.collectives.Collectives.allgather>`
   (exact, over the topology's plans): k * 8 bytes per node (int32 indices + float32 values;
   int64 indices for n >= 2**31), packed into one array of 32-bit words (:func:`pack`: the
   indices, then the values' bits) so it is one message per piece;
4. check every node's part (:func:`~p2psync.compress.topk.check_sparse`: a malformed one is a
   :class:`~p2psync.errors.ProtocolError`, never an out-of-bounds write) and add the parts into
   a dense float32 zero vector in group order. Every node adds the same float32 values in the
   same order, so the result is bitwise identical everywhere, and a sum of finite parts that
   overflowed is :class:`~p2psync.errors.SumDiverged` on every node alike (the coordinator
   ends the run). ``op="mean"`` divides by the
   group size afterwards, as the dense path does.

**Untrusted rows.** A ring (or tree) allgather passes other members' rows on hop by hop, as
words the transport's check of float frames cannot see. So every piece is checked at every hop
as it arrives (:func:`row_check`, the allgather's ``check``): values must be finite and 32-bit
indices below n, and a piece that is not is blamed on the neighbour that delivered it (a
:class:`~p2psync.errors.NonFinitePiece` naming it, counted as its offence and reported), never
on the row's origin, which a malicious relay could otherwise get excluded. This node's own
contribution is checked before it is sent: NaN or infinity in it is
:class:`~p2psync.errors.Diverged`.

The residual is committed only when the exchange succeeds: an aborted allreduce (a peer failed,
the strategy drops the step) leaves the previous residual in place.

**Dense fallback.** Each node receives N * k * 8 bytes (N = group size). When that is more than
the dense vector itself (N * k * 8 > n * 4, i.e. f > about 0.5 / N) sparsification saves little
or nothing (on a ring or mesh sparse traffic is N * k * 8 per node against 8 * n * (N-1) / N for
the dense allreduce; BCube and tree allgathers move up to about twice the ring's bytes), so the
operation runs as an exact dense allreduce (codec ``none``) of x, and the residual is flushed
into it (set to zero). A group of one node is exact too, as for every codec. Whether to fall
back depends only on n, k and N, so every member decides the same way.

**Stats.** The operation's :class:`~p2psync.collectives.OpStats` has ``raw_bytes`` = what this
node would have sent in the dense allreduce plan for this tensor, and ``wire_bytes`` /
``nic_bytes`` = what the sparse allgather actually sent, so ``compression`` is the saving over
the dense allreduce. A dense fallback records the dense operation's stats (codec ``none``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Hashable

import numpy as np

from p2psync import clock
from p2psync.compress import TopK
from p2psync.compress.topk import check_sparse, index_dtype
from p2psync.errors import ConfigError, Diverged, ProtocolError
from p2psync.transport import all_finite, sum_diverged

if TYPE_CHECKING:
    from p2psync.collectives.executor import Collectives, OpStats, PieceCheck

#: vectors at least this long are sparsified in a worker thread (numpy releases the GIL), so a
#: large selection does not stall the event loop (heartbeats, other transfers)
THREAD_MIN = 1 << 20


def use_sparse(n: int, k: int, members: int) -> bool:
    """Whether the sparse exchange is used: a non-empty vector, more than one member, and the
    gathered sparse parts (members * k * (index + value bytes)) no larger than the dense vector
    (n * 4)."""
    return n > 0 and members > 1 and members * k * (index_dtype(n).itemsize + 4) <= n * 4


def pack(idx: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """(indices, values) as one array of little-endian 32-bit words: the indices (one word
    each, two for int64), then the values' float32 bits."""
    iw = idx.astype(idx.dtype.newbyteorder("<"), copy=False).view("<u4")
    vw = vals.astype("<f4", copy=False).view("<u4")
    return np.concatenate([iw, vw])


def _cut(n: int, k: int) -> int:
    """Words of indices in a packed row of k entries of an n-vector."""
    return k * index_dtype(n).itemsize // 4


def unpack(row: np.ndarray, n: int, k: int, who: str) -> tuple[np.ndarray, np.ndarray]:
    """The (indices, values) in a packed row, checked (ProtocolError if malformed)."""
    dt = index_dtype(n)
    cut = _cut(n, k)
    if row.dtype != np.uint32 or row.size != cut + k:
        raise ProtocolError("sparse", f"{who}: expected {cut + k} 32-bit words, got {row.size} of {row.dtype}")
    idx = np.ascontiguousarray(row[:cut]).view(dt.newbyteorder("<")).astype(dt, copy=False)
    vals = np.ascontiguousarray(row[cut:]).view("<f4").astype(np.float32, copy=False)
    check_sparse(idx, vals, n, k, who)
    return idx, vals


def row_check(coll: Collectives, n: int, k: int, tag: str) -> PieceCheck:
    """The allgather's per-hop check of packed rows (see the module docstring): a piece holds
    the words ``lo:hi`` of the gathered buffer, within one row of ``cut + k`` words."""
    cut, m = _cut(n, k), _cut(n, k) + k
    small = index_dtype(n).itemsize == 4

    def check(lo: int, hi: int, piece: np.ndarray, src: int) -> None:
        start = lo - lo % m  # the row's first word
        r_lo, r_hi = lo - start, hi - start
        if r_hi > cut:
            coll.transport.check_finite(src, piece[max(0, cut - r_lo):].view("<f4"),
                                f"{tag}: sparse values delivered by node {src}")
        if small and r_lo < cut:
            words = piece[:min(cut, r_hi) - r_lo]
            if words.size and int(words.max()) >= n:
                raise ProtocolError("sparse", f"{tag}: node {src} delivered indices out of range (n = {n})")
    return check


def _split(codec: TopK, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kept (indices, values); ``x`` (this node's private copy) becomes the residual."""
    idx, vals = codec.sparsify(x)  # vals is a copy (fancy indexing)
    x[idx] = 0
    return idx, vals


async def gather_sum(coll: Collectives, idx: np.ndarray, vals: np.ndarray, g: tuple[int, ...], n: int,
                     tag: str) -> tuple[np.ndarray, OpStats]:
    """Allgather every member's k-of-n sparse vector and sum them densely in group order;
    returns the float32 sum and the allgather's stats (not recorded in the history)."""
    k = idx.size
    rows, stats = await coll._gather(pack(idx, vals), g, tag, record=False, check=row_check(coll, n, k, tag))
    out = np.zeros(n, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # (an overflow is found right after)
        for src, row in zip(g, rows, strict=True):
            i, v = unpack(row, n, k, f"{tag}: sparse part of node {src}")
            out[i] += v  # indices are unique within a part: no lost updates
    if not all_finite(out):  # every part was finite (checked on arrival): their sum overflowed
        raise sum_diverged(coll.transport.node_id, tag)
    return out, stats


async def sparse_allreduce(coll: Collectives, buf: np.ndarray, g: tuple[int, ...], codec: TopK, *,
                           stats: OpStats, feedback: Hashable | None, algo: str | None) -> np.ndarray:
    """The sum over ``g`` of every member's sparsified ``buf`` (error-feedback compensated),
    as a fresh float32 array; see the module docstring. ``buf`` is this node's private copy."""
    if buf.dtype != np.float32:
        raise ConfigError(f"codec {codec.spec} works on float32 (or 16-bit float) tensors, got {buf.dtype}")
    t0 = clock.now()
    n = buf.size
    k = codec.k(n)
    key = ("topk", feedback, n)
    r = coll.sparse_feedback.residual.get(key) if feedback is not None else None
    x = buf + r if r is not None and r.shape == buf.shape else buf
    if not all_finite(x):  # packed as words, the transport's own check would not see it
        raise Diverged(f"node {coll.transport.node_id}'s contribution to {stats.tag!r} holds NaN or infinity (not sent)")
    if not use_sparse(n, k, len(g)):
        dense = await coll._execute(stats.op, coll._plan(g, x, algo), x, stats.tag, "none", phases=("rs", "ag"))
        vars(stats).update(vars(dense))  # the caller's stats describe what ran (a dense allreduce)
        coll.sparse_feedback.residual.pop(key, None)  # sent in full
        return x.copy()  # never hand out ``x``: ZeroMQ may still be reading the last pieces
    if n >= THREAD_MIN:
        idx, vals = await asyncio.to_thread(_split, codec, x)
    else:
        idx, vals = _split(codec, x)
    out, gst = await gather_sum(coll, idx, vals, g, n, stats.tag)
    if feedback is not None:
        coll.sparse_feedback.residual[key] = x  # committed only now that the exchange succeeded
    stats.algo = f"topk/{gst.algo}"
    stats.wire_bytes = gst.wire_bytes
    stats.nic_bytes = dict(gst.nic_bytes)
    stats.raw_bytes = dense_bytes(coll, g, buf, algo)
    stats.seconds = clock.now() - t0
    coll.history.append(stats)
    return out


def dense_bytes(coll: Collectives, g: tuple[int, ...], buf: np.ndarray, algo: str | None) -> int:
    """What this node sends in the dense allreduce plan for ``buf`` (the sparse op's raw bytes)."""
    plan = coll._plan(g, buf, algo)
    b = coll._bounds(buf, len(g))
    me = coll.transport.node_id
    return sum(int(b[t.hi] - b[t.lo]) * buf.itemsize for rnd in (*plan.rs, *plan.ag) for t in rnd if t.src == me)

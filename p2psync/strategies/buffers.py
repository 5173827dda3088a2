"""Module buffers (BatchNorm's running statistics and batch counts) across a group.

Parameters are what the strategies exchange; buffers change in every forward pass on each
node's own batches, so without this each replica's buffers drift apart even when its
parameters are bitwise equal. ``--buffers`` chooses what a synchronizing step does with them:

* ``broadcast`` (default, as torch's DDP): every member takes the buffers of the group's
  lowest id, bitwise (all buffers, whatever their dtype);
* ``average``: the floating-point buffers become the group's mean (exact allreduce, codec
  ``none``), the others (batch counts) are the lowest id's;
* ``local``: buffers are left alone (replicas then differ in them; the replica audit reports
  it).

Tags: ``<tag>.buf`` (the broadcast) and ``<tag>.bufmean`` (the mean).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Sequence, TypeVar

import numpy as np

from p2psync.collectives import Collectives
from p2psync.model import Buffers, ModelBuffers
from p2psync.tasks import gather_or_cancel
from p2psync.vocab import BufferMode

T = TypeVar("T")


async def exchange_buffers(coll: Collectives, mine: Buffers, mode: BufferMode, *, tag: str,
                           group: Sequence[int]) -> Buffers | None:
    """The buffers every member of ``group`` takes (the same on every member), or None when
    there is nothing to do (``local``, or a model without buffers)."""
    if mode == "local" or mine.empty:
        return None
    root = min(group)
    if mode == "broadcast" or mine.floats is None or mine.floats.size == 0:
        raw = await coll.broadcast(mine.raw, root, group, tag=f"{tag}.buf")
        return Buffers(raw=np.asarray(raw, np.uint8))
    raw, mean = await gather_or_cancel([
        coll.broadcast(mine.raw, root, group, tag=f"{tag}.buf"),
        coll.allreduce(mine.floats, group, op="mean", codec="none", tag=f"{tag}.bufmean")])
    return Buffers(raw=np.asarray(raw, np.uint8), floats=np.asarray(mean, np.float32))


async def own_buffers(replica: ModelBuffers, mode: BufferMode) -> Buffers | None:
    """``replica``'s buffers as ``mode`` exchanges them (None: nothing to exchange)."""
    if mode == "local" or replica.buffer_bytes == 0:
        return None
    return await replica.get_buffers(floats=mode == "average")


async def alongside(op: Awaitable[T], coll: Collectives, mine: Buffers | None, mode: BufferMode, *, tag: str,
                    group: Sequence[int]) -> tuple[T, Buffers | None]:
    """``op``'s result and the group's buffers (:func:`exchange_buffers` of ``mine``), run
    together: when one fails the other is cancelled."""
    if mine is None:
        return await op, None
    res = asyncio.ensure_future(op)
    bufs = asyncio.ensure_future(exchange_buffers(coll, mine, mode, tag=tag, group=group))
    await gather_or_cancel([res, bufs])
    return res.result(), bufs.result()


async def sync_buffers(replica: ModelBuffers, coll: Collectives, mode: BufferMode, *, tag: str,
                       group: Sequence[int]) -> None:
    """Read ``replica``'s buffers, take the group's (:func:`exchange_buffers`) and write them
    back: what a strategy's "one model" ending adds to its averaged parameters."""
    mine = await own_buffers(replica, mode)
    got = await exchange_buffers(coll, mine, mode, tag=tag, group=group) if mine is not None else None
    if got is not None:
        await replica.set_buffers(got)


__all__ = ["alongside", "exchange_buffers", "own_buffers", "sync_buffers"]

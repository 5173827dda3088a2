"""Working buffers of the collectives: the host copy an operation works on, and when that copy
may become the result (see :mod:`p2psync.collectives.executor`: a zero-copy frame that ZeroMQ
still holds keeps a reference to it). Pure, no transport."""

from __future__ import annotations

import asyncio
import sys
from typing import Any, Callable

import numpy as np

from p2psync import clock

_WIDE = {np.dtype(np.float16): np.dtype(np.float32)}  # accumulate 16-bit floats in float32


def to_numpy(tensor: Any) -> tuple[np.ndarray, Any]:
    """A flat host copy of ``tensor`` (16-bit floats widened to float32) and a function that
    turns a flat result back into the tensor's type, shape and dtype."""
    arr, back, view = host_flat(tensor)
    return (arr.copy() if view else arr), back


def host_flat(tensor: Any) -> tuple[np.ndarray, Any, bool]:
    """``tensor`` as a flat host array (16-bit floats widened to float32), the function that
    turns a flat result back into the tensor's type, shape and dtype, and whether the array
    views the caller's own memory (then it must not be written; else it is a fresh copy: a
    staged CUDA tensor, a widened or non-contiguous one)."""
    if isinstance(tensor, np.ndarray):
        shape, dtype = tensor.shape, tensor.dtype
        work = _WIDE.get(dtype, dtype)
        if type(tensor) is np.ndarray and work == dtype and tensor.flags.c_contiguous:  # (no subclass)
            return tensor.reshape(-1), lambda flat: flat.reshape(shape), True
        return (np.array(tensor, dtype=work, copy=True).reshape(-1),
                lambda flat: flat.astype(dtype, copy=False).reshape(shape), False)
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"collectives take numpy arrays or torch tensors, not {type(tensor).__name__}")
    t = tensor.detach()
    view = t.device.type == "cpu" and t.is_contiguous() and t.dtype not in (torch.float16, torch.bfloat16)
    if t.device.type == "cuda":  # stage through pinned host memory
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t)
        t = host
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.to(torch.float32)
    arr = t.contiguous().numpy().reshape(-1)
    dev, shape, tdtype = tensor.device, tensor.shape, tensor.dtype
    return arr, lambda flat: torch.from_numpy(np.ascontiguousarray(flat).reshape(shape)).to(dev, tdtype), view


def own(arr: np.ndarray) -> np.ndarray:
    """A new array object over ``arr``'s memory (1-D, contiguous) that owns its views: :func:`refs`
    of it, and of every view taken from it, counts the references to this object alone, not
    the caller's references to ``arr``, which other code may drop at any moment (the loop that
    delivered ``arr`` from a thread, a finished future still queued): a count taken before an
    operation then changes only with the views the operation itself made."""
    return np.frombuffer(memoryview(arr.data).cast("B"), dtype=arr.dtype)


def refs(buf: np.ndarray) -> int:
    """References to the array that owns ``buf``'s memory (numpy files every view under that
    owner, not under the view it was taken from). Compare only counts taken by the same call
    site on the same local: each view of the buffer (a piece inside a zero-copy frame ZeroMQ
    still holds) adds one until it is gone."""
    owner: Any = buf
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    return sys.getrefcount(owner)


#: how fast a fresh copy of a finished operation's buffer is made (bytes/s, page faults
#: included): a result waits for its last sends at most as long as copying it would take
COPY_RATE = 2e9
POLL = 0.001  # s between looks
#: a buffer that copies faster than this never waits: a look costs a whole loop timer tick (1 ms,
#: more on a loaded machine), and 4 MB operations measured 0.7 ms slower on average with waits
_MIN_WAIT = 4 * POLL


def wait_budget(nbytes: int) -> float:
    """How long (s) a finished operation may wait for its last sends before copying its
    ``nbytes`` buffer instead: as long as the copy would take, or 0 under 4 ms (about 8 MB).
    The rule of :func:`sends_done`, also kept by the benchmark floor (``bench/_floor.py``)."""
    budget = nbytes / COPY_RATE
    return budget if budget >= _MIN_WAIT else 0.0


async def sends_done(free: Callable[[], bool], nbytes: int) -> bool:
    """Has ZeroMQ let go of every zero-copy send of the working buffer (``free``)? Waits for
    it, looking every millisecond (the loop's idle wait lets pyzmq release the frames), at most
    as long as copying the ``nbytes`` buffer would take: what not waiting would cost. A
    buffer that copies in under 4 ms (up to about 8 MB) does not wait."""
    if free():
        return True
    # clock.now(), not loop.time(): uvloop's loop.time() is cached per iteration in whole milliseconds
    end = clock.now() + wait_budget(nbytes)
    while end - clock.now() >= POLL:
        await asyncio.sleep(POLL)
        if free():
            return True
    return False

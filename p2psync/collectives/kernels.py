"""The collectives' fused piece kernels: add a received piece into the working buffer (or copy
it there) and check the result for NaN / infinity in the same pass (numba, cached on disk).

A lossless piece that arrives is used once and must be checked once (the executor's fused
arrival check, :meth:`~p2psync.collectives.executor._Run._use`): numpy needs two passes for it,
``np.add(piece, vals, out=piece)`` and a scan of ``piece`` (``all_finite``: a BLAS dot), 46 µs
for 1 MiB of float32 on this project's 2-core machine; these kernels read each value once,
23-25 µs. The check is on the bits (exponent all ones: infinity or NaN), so no floating-point
flag of the compiler can remove it. float32 only, contiguous; the executor takes numpy's path
for everything else. Each kernel has a numpy twin (``*_np``) that gives the same answer.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_EXP = np.uint32(0x7F800000)  # float32's exponent bits: all set for infinity and NaN


@njit(cache=True, nogil=True)
def add_checked(out: np.ndarray, vals: np.ndarray) -> bool:
    """``out += vals`` (float32, same length); whether every result is finite."""
    bits = out.view(np.uint32)
    bad = np.uint32(0)
    for i in range(out.shape[0]):
        out[i] = out[i] + vals[i]
        bad |= np.uint32((bits[i] & _EXP) == _EXP)
    return bool(bad == 0)


@njit(cache=True, nogil=True)
def copy_checked(out: np.ndarray, vals: np.ndarray) -> bool:
    """``out[:] = vals`` (float32, same length); whether every value is finite."""
    bits = out.view(np.uint32)
    bad = np.uint32(0)
    for i in range(out.shape[0]):
        out[i] = vals[i]
        bad |= np.uint32((bits[i] & _EXP) == _EXP)
    return bool(bad == 0)


def add_checked_np(out: np.ndarray, vals: np.ndarray) -> bool:
    np.add(out, vals, out=out)
    return bool(np.isfinite(out).all())


def copy_checked_np(out: np.ndarray, vals: np.ndarray) -> bool:
    out[...] = vals
    return bool(np.isfinite(out).all())


def fits(out: np.ndarray, vals: np.ndarray) -> bool:
    """Whether the kernels take this pair (float32, one-dimensional, contiguous, same size)."""
    return (out.dtype == np.float32 and vals.dtype == np.float32 and out.ndim == 1 and vals.ndim == 1
            and out.shape == vals.shape and out.flags.c_contiguous and vals.flags.c_contiguous)


def warm() -> None:
    """Load (or compile) both kernels for what arrives: a writeable piece and a read-only one
    (the wire's frames, and shared-memory views, are read-only; numba types them apart)."""
    out, vals = np.zeros(8, np.float32), np.ones(8, np.float32)
    wire = vals.copy()
    wire.flags.writeable = False
    for v in (vals, wire):
        add_checked(out, v)
        copy_checked(out, v)


__all__ = ["add_checked", "add_checked_np", "copy_checked", "copy_checked_np", "fits", "warm"]

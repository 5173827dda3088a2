"""The NaN / infinity scan of tensor pieces (:func:`all_finite`): every piece a node sends is
scanned (``Diverged`` instead of sending), and every one it receives (an offence of the sender).
Pure numpy."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from p2psync.errors import Diverged, SumDiverged
from p2psync.wire.fill import Fill

_DOT_MIN = 4096  # below this np.isfinite(a).all() is as fast


def all_finite(a: Any) -> bool:
    """True unless ``a`` (a numpy array, CPU torch tensor or :class:`~p2psync.wire.fill.Fill`)
    is floating-point and holds NaN or infinity.

    A large float32/float64 vector is checked as ``dot(a, a)`` (BLAS, one read of ``a``, no
    temporary): a NaN or an infinity makes the sum of squares NaN or infinite, and only when it
    is not finite (that, or finite values whose squares overflow) does ``np.isfinite`` decide.
    For 1 MiB of float32 (best of 400): 22 µs, against 28-30 µs for the earlier
    ``dot(a, zeros) == 0`` (it streamed a second array) and 27-28 µs for
    ``np.isfinite(a).all()`` (it also writes and re-reads a boolean array). Other inputs take
    that exact path."""
    if type(a) is Fill:  # its values are what it computes
        a = a.own()
    if not isinstance(a, np.ndarray):
        detach = getattr(a, "detach", None)
        a = np.asarray(detach() if detach is not None else a)
    if a.dtype.kind != "f" or not a.size:
        return True
    if a.size >= _DOT_MIN and a.ndim == 1 and a.dtype.char in "fd" and a.flags.c_contiguous:
        with np.errstate(invalid="ignore", over="ignore"):
            if math.isfinite(np.dot(a, a)):
                return True
    return bool(np.isfinite(a).all())


def diverged(node: int, tag: str) -> Diverged:
    """The error of a node about to send a tensor piece that holds NaN or infinity."""
    return Diverged(f"node {node} was about to send a tensor piece {tag!r} holding NaN or infinity (not sent; "
                    "nobody else is blamed)")


def sum_diverged(node: int, tag: str) -> SumDiverged:
    """The error of a node whose sum of finite tensor pieces overflowed (:class:`SumDiverged`)."""
    return SumDiverged(f"node {node}'s sum of finite tensor pieces {tag!r} overflowed to NaN or infinity (not "
                       "sent; the run ends on every member)")


__all__ = ["all_finite", "diverged", "sum_diverged"]

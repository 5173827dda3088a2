"""``topk[:FRACTION]``: keep the largest-magnitude fraction of the entries (Deep Gradient
Compression, the 1 % sparsification behind the DTS paper's headline numbers). Pure.

A vector of n entries is sent as its k = ceil(FRACTION * n) largest-magnitude entries: their
indices (int32, int64 for n >= 2**31) in increasing order, and their values (float32), so
k * 8 bytes instead of n * 4. ``topk`` alone means ``topk:0.01`` (:data:`DEFAULT_FRACTION`).
k is computed from the fraction as written (``0.07`` is exactly 7/100, so 100 entries keep 7,
not ceil(7.000000000000001) = 8) and is at least 1 for a non-empty vector.

**Error feedback is always on.** Dropping 99 % of a gradient every step without carrying the
dropped part over does not train; with it (residual = x - sparse(x), added to the next
contribution of the same tensor) the sum of what was sent tracks the sum of the inputs to
within one residual. ``topk`` therefore uses error feedback whether or not ``error_feedback``
/ ``--error-feedback`` is set.

**Selection** is O(n): ``np.partition`` finds the k-th largest magnitude t (the same
introselect as ``np.argpartition``, without its n int64 indices), then every entry above t is
taken, and of the entries equal to t the lowest-index ones until there are k. Ties are thus
broken deterministically. NaN counts as the largest magnitude, above inf (it is sent, as a
dense allreduce would send it).

**Where it runs.** Sparse vectors cannot be summed piece by piece along a ring without
re-sparsifying the partial sums at every hop, so a collective allreduce with this codec does
not use the piece executor: :mod:`p2psync.collectives.sparse` allgathers every node's
(indices, values) and sums them in group order. ASGD sends the encoded arrays as they are.
A peer's arrays are checked before use (:func:`check_sparse`): wrong dtypes or sizes, indices
out of range, repeated or unsorted indices are a :class:`~p2psync.errors.ProtocolError`.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import ClassVar, Sequence

import numpy as np

from p2psync.compress.base import Codec, expect_arrays
from p2psync.errors import ConfigError, ProtocolError

DEFAULT_FRACTION = 0.01
INT32_MAX = (1 << 31) - 1


def parse_fraction(text: str) -> float:
    """The fraction in ``topk:TEXT``: a number with 0 < f <= 1, else ConfigError naming it."""
    try:
        f = float(text)
    except ValueError:
        f = math.nan
    if not 0 < f <= 1:  # also false for NaN
        raise ConfigError(f"codec 'topk:{text}': the fraction must be a number with 0 < f <= 1, got {text!r}")
    return f


def topk_count(n: int, fraction: float) -> int:
    """k = ceil(fraction * n) (fraction as written in decimal), between 1 and n (0 for n = 0)."""
    if n <= 0:
        return 0
    return min(n, max(1, math.ceil(Fraction(repr(float(fraction))) * n)))


def index_dtype(n: int) -> np.dtype:
    """int32 indices while they fit, int64 beyond."""
    return np.dtype(np.int32) if n - 1 <= INT32_MAX else np.dtype(np.int64)


def select_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices (increasing, :func:`index_dtype`) of the ``k`` largest ``|x|``; ties go to the
    lowest indices, NaN counts as the largest magnitude. O(n)."""
    n = x.size
    dt = index_dtype(n)
    if k >= n:
        return np.arange(n, dtype=dt)
    if k <= 0:
        return np.empty(0, dt)
    a = np.abs(x)
    while True:
        t = np.partition(a, n - k)[n - k]  # the k-th largest magnitude
        above = np.flatnonzero(a > t)  # fewer than k
        ties = np.flatnonzero(a == t)[:k - above.size]
        if above.size + ties.size == k:
            break
        # short only if there are NaNs (every comparison with them is false): rank them above
        # everything (nan_to_num: NaN -> inf, inf -> the largest float) and select again
        a = np.nan_to_num(a, nan=np.inf, copy=False)
    return np.sort(np.concatenate([above, ties])).astype(dt, copy=False)


def check_sparse(idx: np.ndarray, vals: np.ndarray, n: int, k: int, who: str) -> None:
    """ProtocolError unless (``idx``, ``vals``) is a valid k-of-n sparse vector: k indices of
    :func:`index_dtype`, strictly increasing, in [0, n); k float32 values."""
    if idx.dtype != index_dtype(n) or idx.shape != (k,) or vals.dtype != np.float32 or vals.shape != (k,):
        raise ProtocolError("sparse", f"{who}: expected {k} {index_dtype(n)} indices and {k} float32 values, "
                                      f"got {idx.size} {idx.dtype} and {vals.size} {vals.dtype}")
    if k and (int(idx[0]) < 0 or int(idx[-1]) >= n):
        raise ProtocolError("sparse", f"{who}: index out of range for {n} entries "
                                      f"(first {int(idx[0])}, last {int(idx[-1])})")
    if k > 1 and not bool((np.diff(idx) > 0).all()):
        raise ProtocolError("sparse", f"{who}: indices are not strictly increasing")


class TopK(Codec):
    """The ``k`` largest-magnitude entries as (indices, values); see the module docstring."""

    name = "topk"
    usage: ClassVar[str] = "topk[:FRACTION]"
    always_feedback: ClassVar[bool] = True

    def __init__(self, *, fraction: float = DEFAULT_FRACTION) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ConfigError(f"codec topk: the fraction must be a number with 0 < f <= 1, got {fraction!r}")
        self.fraction = float(fraction)

    @classmethod
    def with_param(cls, param: str) -> TopK:
        return cls(fraction=parse_fraction(param))

    @property
    def spec(self) -> str:
        return f"topk:{self.fraction!r}"

    def k(self, n: int) -> int:
        return topk_count(n, self.fraction)

    def sparsify(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(indices, values) of the kept entries of a 1-D float32 vector."""
        idx = select_topk(x, self.k(x.size))
        return idx, x[idx].astype(np.float32, copy=False)

    def encode(self, x: np.ndarray) -> list[np.ndarray]:
        idx, vals = self.sparsify(x)
        return [idx, vals]

    def decode(self, arrays: Sequence[np.ndarray], n: int) -> np.ndarray:
        k = self.k(n)
        expect_arrays(arrays, [(index_dtype(n), k), (np.dtype(np.float32), k)], self.spec)
        check_sparse(arrays[0], arrays[1], n, k, self.spec)
        out = np.zeros(n, np.float32)
        out[arrays[0]] = arrays[1]
        return out

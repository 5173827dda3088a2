"""numba kernels for the codecs' hot loops (compiled once, cached on disk).

Each kernel has a plain-numpy twin (``*_np``) that gives the same answer; tests compare them.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def minmax(x: np.ndarray) -> tuple[float, float]:
    lo = np.inf
    hi = -np.inf
    for v in x:
        if v < lo:
            lo = v
        if v > hi:
            hi = v
    return lo, hi


@njit(cache=True, nogil=True)
def bucketize(x: np.ndarray, bounds: np.ndarray, out: np.ndarray, sums: np.ndarray,
              counts: np.ndarray) -> None:
    """out[i] = number of the 255 sorted inner ``bounds`` that are <= x[i] (0..255), and
    per-bucket sums and counts of the values (for mean representatives).

    ``bounds`` has 256 entries, the last +inf, so the search is exactly 8 halvings with no
    data-dependent loop exit; the compare-and-add compiles to conditional moves.
    """
    for i in range(x.shape[0]):
        v = x[i]
        p = 0
        p += 128 * (bounds[p + 127] <= v)
        p += 64 * (bounds[p + 63] <= v)
        p += 32 * (bounds[p + 31] <= v)
        p += 16 * (bounds[p + 15] <= v)
        p += 8 * (bounds[p + 7] <= v)
        p += 4 * (bounds[p + 3] <= v)
        p += 2 * (bounds[p + 1] <= v)
        p += 1 * (bounds[p] <= v)
        out[i] = p
        sums[p] += v
        counts[p] += 1


def bucketize_np(x: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    codes = np.searchsorted(bounds[:255], x, side="right").astype(np.uint8)
    counts = np.bincount(codes, minlength=256).astype(np.int64)
    sums = np.bincount(codes, weights=x.astype(np.float64), minlength=256)
    return codes, sums, counts


@njit(cache=True, nogil=True)
def quantize_uniform(x: np.ndarray, lo: float, inv_scale: float, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        q = (x[i] - lo) * inv_scale + 0.5
        if q < 0.0:
            q = 0.0
        elif q > 255.0:
            q = 255.0
        out[i] = np.uint8(q)


def quantize_uniform_np(x: np.ndarray, lo: float, inv_scale: float) -> np.ndarray:
    return np.clip((x - lo) * inv_scale + 0.5, 0, 255).astype(np.uint8)


@njit(cache=True, nogil=True)
def lookup(codes: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
    for i in range(codes.shape[0]):
        out[i] = table[codes[i]]


def lookup_np(codes: np.ndarray, table: np.ndarray) -> np.ndarray:
    out: np.ndarray = table[codes]
    return out


@njit(cache=True, nogil=True)
def pack_bits(codes: np.ndarray, bits: int, out: np.ndarray) -> None:
    """``codes`` (each < 2**bits) into ``out`` (zeroed, ceil(n*bits/8) bytes), little-endian."""
    pos = 0
    for i in range(codes.shape[0]):
        c = np.uint32(codes[i])
        byte = pos >> 3
        shift = pos & 7
        out[byte] |= np.uint8((c << shift) & 0xFF)
        if shift + bits > 8:
            out[byte + 1] |= np.uint8(c >> (8 - shift))
        pos += bits


@njit(cache=True, nogil=True)
def unpack_lookup(packed: np.ndarray, bits: int, table: np.ndarray, out: np.ndarray) -> None:
    """Decode :func:`pack_bits` output straight through ``table`` into ``out``."""
    mask = (1 << bits) - 1
    pos = 0
    for i in range(out.shape[0]):
        byte = pos >> 3
        shift = pos & 7
        v = np.uint32(packed[byte]) >> shift
        if shift + bits > 8:
            v |= np.uint32(packed[byte + 1]) << (8 - shift)
        out[i] = table[v & mask]
        pos += bits


#: bucketize_keyed: a table cell covers 2**KEY_SHIFT consecutive float32 bit patterns (the
#: sign, the exponent and 9 mantissa bits: cells 1/512 of a value wide, in every binade)
KEY_SHIFT = 14


@njit(cache=True, nogil=True, inline="always")
def _key(bits: int) -> int:
    """float32 bit pattern (as int32) -> key in float order: 2**31 + the magnitude's bits, negated
    for negative values (branchless), so -0.0 and +0.0 share a key as they compare equal; NaN
    lies beyond +-inf."""
    j = np.int64(bits)
    neg = j >> 63  # 0 or -1
    return int(0x80000000 + (((j & 0x7FFFFFFF) ^ neg) - neg))


@njit(cache=True, nogil=True)
def bucketize_keyed(x: np.ndarray, bounds: np.ndarray, lo: float, hi: float, out: np.ndarray,
                    sums: np.ndarray, counts: np.ndarray) -> None:
    """Exactly :func:`bucketize` (same codes, same sums in the same order), about 3.4x faster.

    ``bounds``: 256 sorted values (the last +inf, never compared, as in :func:`bucketize`);
    ``lo``/``hi``: the min and max of ``x``. Every float32 in [lo, hi] falls into a cell of
    2**KEY_SHIFT consecutive keys (bit patterns in float order); a table built per call from the
    bounds' own cells gives, per cell, how many bounds lie in cells below it (``first``) and in
    it or below (``last``). A value's code is ``first`` of its cell unless the cell holds bounds
    (a few values in a hundred on gradients), where a binary search over those few bounds decides: no
    data-dependent 8-step search per value. NaN gets code 0, as in :func:`bucketize`.
    """
    n = x.shape[0]
    if n == 0:
        return
    if not (lo <= hi):  # no finite value: the plain search
        bucketize(x, bounds, out, sums, counts)
        return
    xi = x.view(np.int32)
    lb = np.zeros(2, np.float32)
    lb[0] = lo
    lb[1] = hi
    lbi = lb.view(np.int32)
    klo = _key(lbi[0]) >> KEY_SHIFT
    ncell = (_key(lbi[1]) >> KEY_SHIFT) - klo + 1
    first = np.empty(ncell, np.uint8)  # bytes: the table stays in L2
    last = np.empty(ncell, np.uint8)
    bi = bounds.view(np.int32)
    prev = -1  # cell of bound j - 1 (relative to klo; -1: below the table)
    for j in range(255):
        cj = (_key(bi[j]) >> KEY_SHIFT) - klo
        cj = min(max(cj, -1), ncell)
        # cells in (prev, cj] have exactly j bounds in cells below them; [prev, cj) have j in or below
        for c in range(max(prev + 1, 0), min(cj, ncell - 1) + 1):
            first[c] = j
        for c in range(max(prev, 0), min(cj, ncell)):
            last[c] = j
        prev = cj
    for c in range(max(prev + 1, 0), ncell):
        first[c] = 255
    for c in range(max(prev, 0), ncell):
        last[c] = 255
    for i in range(n):
        v = x[i]
        c = (_key(xi[i]) >> KEY_SHIFT) - klo
        if c < 0 or c >= ncell:  # outside [lo, hi]: NaN (its key lies beyond +-inf, and the
            p = 0                  # search's comparisons are all false: 0, as bucketize's)
            e = 255
        else:
            p = int(first[c])
            e = int(last[c])
        if e != p:  # the cell holds bounds
            while p < e:
                mid = (p + e) >> 1
                if bounds[mid] <= v:
                    p = mid + 1
                else:
                    e = mid
        out[i] = p
        sums[p] += v
        counts[p] += 1

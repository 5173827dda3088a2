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

"""numba kernels for the codecs' hot loops (compiled once, cached on disk).

Each kernel has a plain-numpy twin (``*_np``) that gives the same answer; tests compare them.
"""

from __future__ import annotations

import math

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


def minmax_fast(x: np.ndarray) -> tuple[float, float]:
    """:func:`minmax` (the least and greatest value, NaN ignored; ``(inf, -inf)`` when there is
    no other value) through numpy's vectorized reductions, about 2.4x faster than the scalar
    loop: numpy's answer is NaN when ``x`` holds a NaN, and only then the loop decides.
    ``-0.0`` and ``0.0`` compare equal, so either may stand for a zero extreme."""
    lo, hi = float(x.min()), float(x.max())
    if lo != lo or hi != hi:  # a NaN somewhere: the loop that skips it
        return minmax(x)
    return lo, hi


#: below this many values :func:`sorted_sample_np` (numpy's sort) beats the radix sort's fixed cost
RADIX_MIN = 512


@njit(cache=True, nogil=True)
def sorted_sample(x: np.ndarray, stride: int, out: np.ndarray) -> None:
    """``out`` = ``numpy.sort(x[::stride])`` for float32 ``x`` (contiguous): an LSD radix sort
    of the values' bit patterns in three passes (11, 11 and 10 bits), about 3x numpy's
    quicksort on this machine's 16 K-value samples. A pattern is made order-preserving as
    an unsigned key (sign bit set for the non-negative, every bit flipped for the negative);
    every NaN gets the greatest key, so NaNs end the result as with numpy (each as the NaN
    ``0x7FFFFFFF``: sign and payload are not kept). ``-0.0`` sorts before ``0.0`` (numpy
    leaves their order open; they compare equal). ``out`` holds ceil(len(x) / stride) values."""
    n = out.shape[0]
    if stride < 1 or n != (x.shape[0] + stride - 1) // stride:
        raise ValueError("sorted_sample: out must hold ceil(len(x) / stride) values, stride >= 1")
    xu = x.view(np.uint32)
    a = np.empty(n, np.uint32)
    b = np.empty(n, np.uint32)
    h0 = np.zeros(2048, np.int64)
    h1 = np.zeros(2048, np.int64)
    h2 = np.zeros(1024, np.int64)
    for i in range(n):
        u = xu[i * stride]
        if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN
            k = np.uint32(0xFFFFFFFF)
        elif u & np.uint32(0x80000000):
            k = ~u
        else:
            k = u | np.uint32(0x80000000)
        a[i] = k
        h0[k & np.uint32(0x7FF)] += 1
        h1[(k >> np.uint32(11)) & np.uint32(0x7FF)] += 1
        h2[k >> np.uint32(22)] += 1
    s0 = 0
    s1 = 0
    for j in range(2048):  # counts to first positions
        c = h0[j]
        h0[j] = s0
        s0 += c
        c = h1[j]
        h1[j] = s1
        s1 += c
    s2 = 0
    for j in range(1024):
        c = h2[j]
        h2[j] = s2
        s2 += c
    for i in range(n):
        k = a[i]
        d = k & np.uint32(0x7FF)
        b[h0[d]] = k
        h0[d] += 1
    for i in range(n):
        k = b[i]
        d = (k >> np.uint32(11)) & np.uint32(0x7FF)
        a[h1[d]] = k
        h1[d] += 1
    ou = out.view(np.uint32)
    for i in range(n):
        k = a[i]
        d = k >> np.uint32(22)
        ou[h2[d]] = np.uint32(k & np.uint32(0x7FFFFFFF)) if k & np.uint32(0x80000000) else np.uint32(~k)
        h2[d] += 1


def sorted_sample_np(x: np.ndarray, stride: int) -> np.ndarray:
    """:func:`sorted_sample` in numpy."""
    out: np.ndarray = np.sort(x[::stride])
    return out


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
    """``codes`` (each < 2**bits) into ``out`` (zeroed, ceil(n*bits/8) bytes), little-endian:
    code i at bits [i*bits, (i+1)*bits) of the byte string. Eight codes fill exactly ``bits``
    bytes, so whole groups of eight go through one 64-bit word; the tail bit by bit."""
    n = codes.shape[0]
    groups = n // 8
    nb = np.uint64(bits)
    o = 0
    for g in range(groups):
        acc = np.uint64(0)
        for j in range(8):
            acc |= np.uint64(codes[g * 8 + j]) << (np.uint64(j) * nb)
        for b in range(bits):
            out[o + b] = np.uint8(acc & np.uint64(0xFF))
            acc >>= np.uint64(8)
        o += bits
    pos = groups * 8 * bits
    for i in range(groups * 8, n):
        c = np.uint32(codes[i])
        byte = pos >> 3
        shift = pos & 7
        out[byte] |= np.uint8((c << shift) & 0xFF)
        if shift + bits > 8:
            out[byte + 1] |= np.uint8(c >> (8 - shift))
        pos += bits


def pack_bits_np(codes: np.ndarray, bits: int) -> np.ndarray:
    """:func:`pack_bits` in numpy: each code's ``bits`` low bits, little-endian, in order."""
    b = (codes.astype(np.uint8)[:, None] >> np.arange(bits, dtype=np.uint8)) & 1
    out: np.ndarray = np.packbits(b.reshape(-1), bitorder="little")
    return out


@njit(cache=True, nogil=True)
def unpack_lookup(packed: np.ndarray, bits: int, table: np.ndarray, out: np.ndarray) -> None:
    """Decode :func:`pack_bits` output straight through ``table`` into ``out`` (whole groups
    of eight codes from one 64-bit word, the tail bit by bit)."""
    n = out.shape[0]
    groups = n // 8
    nb = np.uint64(bits)
    wmask = np.uint64((1 << bits) - 1)
    o = 0
    for g in range(groups):
        acc = np.uint64(0)
        for b in range(bits):
            acc |= np.uint64(packed[o + b]) << np.uint64(8 * b)
        for j in range(8):
            out[g * 8 + j] = table[(acc >> (np.uint64(j) * nb)) & wmask]
        o += bits
    mask = (1 << bits) - 1
    pos = groups * 8 * bits
    for i in range(groups * 8, n):
        byte = pos >> 3
        shift = pos & 7
        v = np.uint32(packed[byte]) >> shift
        if shift + bits > 8:
            v |= np.uint32(packed[byte + 1]) << (8 - shift)
        out[i] = table[v & mask]
        pos += bits


def unpack_lookup_np(packed: np.ndarray, bits: int, table: np.ndarray, n: int) -> np.ndarray:
    """:func:`unpack_lookup` in numpy."""
    b = np.unpackbits(packed, bitorder="little")[:n * bits].reshape(n, bits).astype(np.intp)
    out: np.ndarray = table[(b << np.arange(bits)).sum(axis=1)]
    return out


#: bucketize_keyed: a table cell holds 2**CELL_SHIFT consecutive float32 bit patterns (the sign,
#: the exponent and 9 mantissa bits: cells 1/512 of a value wide, in every binade); the table
#: has a cell for every bit pattern's top bits, indexed by them directly
CELL_SHIFT = 14
_CELLS = 1 << (32 - CELL_SHIFT)
_NEG = _CELLS >> 1  # first cell of the negative values (sign bit set)
_INF_CELL = 0x7F800000 >> CELL_SHIFT  # +inf's cell (its other patterns are NaN), then NaN only
_SEARCH_ALL = 255 << 8  # table entry "search every bound": NaN ends at code 0, inf at 255


@njit(cache=True, nogil=True, inline="always")
def _count_le(bounds: np.ndarray, v: float, j: int) -> int:
    """From ``j``: the number of the 255 inner ``bounds`` that are <= ``v`` (a merge step)."""
    while j < 255 and bounds[j] <= v:
        j += 1
    return j


@njit(cache=True, nogil=True, inline="always")
def _fill(bounds: np.ndarray, tab: np.ndarray, cell: int, pat: np.ndarray, val: np.ndarray, least: int,
          greatest: int, p: int, e: int) -> tuple[int, int]:
    """One merge step of :func:`_cell_table`: ``tab[cell]`` for the cell whose least and greatest
    values have the bit patterns ``least`` and ``greatest`` (``pat``/``val``: one scratch buffer
    seen as uint32 and float32); ``p``/``e`` of the previous cell in value order."""
    pat[0] = np.uint32(least)
    pat[1] = np.uint32(greatest)
    p = _count_le(bounds, val[0], p)
    e = _count_le(bounds, val[1], max(e, p))
    tab[cell] = p | (e << 8)
    return p, e


@njit(cache=True, nogil=True)
def _cell_table(bounds: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Per cell of the values in [lo, hi]: ``p | e << 8``, p = how many inner bounds are <= the
    cell's least value, e = how many are <= its greatest (p == e: every value of the cell has
    code p). Cells no finite value of [lo, hi] reaches are left unset, except the cells of
    +-inf and NaN, which say "search every bound".

    Built by a merge in value order that visits only the cells holding a bound (at most 255)
    and the cell after each: every cell between two such cells has the same entry (no bound
    inside, p == e), so runs of cells are filled at once. A cell-by-cell merge made the table
    cost about 0.5 ms per call whatever the input's size (some 120 000 cells for a gradient's
    range), which dominated the encode of the small pieces a collective sends.
    """
    tab = np.empty(_CELLS, np.uint16)
    tab[_INF_CELL:_NEG] = _SEARCH_ALL
    tab[_NEG + _INF_CELL:] = _SEARCH_ALL
    pat = np.zeros(2, np.uint32)
    val = pat.view(np.float32)
    val[0] = max(hi, 0.0)
    val[1] = -min(lo, 0.0)
    top = min(int(np.int64(pat[0])) >> CELL_SHIFT, _INF_CELL - 1)  # non-negative cells 0..top
    bottom = min(int(np.int64(pat[1])) >> CELL_SHIFT, _INF_CELL - 1)  # negative cells by magnitude 0..bottom
    low = (1 << CELL_SHIFT) - 1  # the low pattern bits a cell spans
    bpat = bounds.view(np.uint32)
    p = e = 0
    m = bottom
    while m >= 0:  # negative values, ascending: magnitudes descending
        sign_m = 0x80000000 | (m << CELL_SHIFT)
        p, e = _fill(bounds, tab, _NEG + m, pat, val, sign_m | low, sign_m, p, e)
        # the next bound above this cell: the cells before its cell all read e
        nxt = -1 if e == 255 or not bounds[e] <= 0.0 else (int(np.int64(bpat[e])) & 0x7FFFFFFF) >> CELL_SHIFT
        if nxt < m - 1:
            tab[_NEG + nxt + 1:_NEG + m] = e | (e << 8)
            m = nxt
        else:
            m -= 1
    p = e = 0
    c = 0
    while c <= top:  # non-negative values, ascending
        p, e = _fill(bounds, tab, c, pat, val, c << CELL_SHIFT, (c << CELL_SHIFT) | low, p, e)
        nxt = top + 1 if e == 255 else min(int(np.int64(bpat[e])) >> CELL_SHIFT, top + 1)
        if nxt > c + 1:
            tab[c + 1:nxt] = e | (e << 8)
            c = nxt
        else:
            c += 1
    return tab


@njit(cache=True, nogil=True)
def bucketize_keyed(x: np.ndarray, bounds: np.ndarray, lo: float, hi: float, out: np.ndarray,
                    sums: np.ndarray, counts: np.ndarray) -> None:
    """Exactly :func:`bucketize` (same codes, same sums in the same order), about 4x faster.

    ``bounds``: 256 sorted values (the last +inf, never compared, as in :func:`bucketize`);
    ``lo``/``hi``: the least and greatest non-NaN value of ``x`` (:func:`minmax`). A table built
    per call (:func:`_cell_table`) gives, for the cell a value's top bit-pattern bits select,
    the range of codes its values can have: one code for nearly every cell (2 % of the values
    of a gradient fall in a cell that holds a bound), else a binary search over those few
    bounds decides. No data-dependent 8-step search per value, no key arithmetic: the top
    bits index the table directly. NaN gets code 0, as in :func:`bucketize`.
    """
    n = x.shape[0]
    if n == 0:
        return
    if not (lo <= hi):  # no value but NaN: the plain search
        bucketize(x, bounds, out, sums, counts)
        return
    tab = _cell_table(bounds, lo, hi)
    xu = x.view(np.uint32)
    for i in range(n):
        v = x[i]
        t = np.int64(tab[xu[i] >> CELL_SHIFT])
        p = t & 0xFF
        e = t >> 8
        if e != p:  # the cell holds bounds (or is +-inf / NaN's)
            while p < e:
                mid = (p + e) >> 1
                if bounds[mid] <= v:
                    p = mid + 1
                else:
                    e = mid
        out[i] = p
        sums[p] += v
        counts[p] += 1


@njit(cache=True, nogil=True, inline="always")
def sketch_bounds(s: np.ndarray, lo: float, hi: float, bits: int, hybrid: bool, out: np.ndarray) -> None:
    """``out[:2**bits + 1]``: the boundaries ``Sketch8`` sketches with at ``bits`` bits, from
    the sorted sample ``s`` and the piece's ``lo``/``hi``: equal-mass quantiles of ``s``, and
    with ``hybrid`` (and at least 4 buckets) half of them merged with evenly spaced levels (the
    float32 values of ``numpy.linspace``)."""
    b = 1 << bits
    m = s.shape[0]
    out[0] = lo
    out[b] = hi
    if not hybrid or b < 4:
        for k in range(1, b):
            out[k] = s[(k * m) // b]
        return
    half = b // 2
    step = (hi - lo) / (half + 1)
    i = 1  # next quantile, 1..half-1
    j = 1  # next level, 1..half
    for k in range(1, b):
        level = np.float32(j * step + lo) if j <= half else np.float32(np.inf)
        if i < half and s[(i * m) // half] <= level:
            out[k] = s[(i * m) // half]
            i += 1
        else:
            out[k] = level
            j += 1


@njit(cache=True, nogil=True, inline="always")
def sketch_error(e: np.ndarray, q: np.ndarray, bits: int, mid: bool) -> float:
    """Relative L2 error of sketching the sorted values ``e`` with the ``2**bits + 1``
    boundaries ``q``: bucket k holds q_k <= v < q_(k+1) (the last one closed), sent as the mean
    of its values (or, with ``mid``, its boundaries' midpoint)."""
    last = (1 << bits) - 1
    k = 0
    n = 0
    s1 = 0.0
    s2 = 0.0
    sse = 0.0
    energy = 0.0
    for idx in range(e.shape[0] + 1):
        end = idx == e.shape[0]
        v = 0.0 if end else float(e[idx])
        if end or (k < last and q[k + 1] <= v):  # bucket k is complete
            if n > 0:
                if mid:
                    r = (float(q[k]) + float(q[k + 1])) * 0.5
                    sse += s2 - 2.0 * r * s1 + n * r * r
                else:
                    sse += s2 - s1 * s1 / n
            if end:
                break
            while k < last and q[k + 1] <= v:
                k += 1
            n = 0
            s1 = 0.0
            s2 = 0.0
        n += 1
        s1 += v
        s2 += v * v
        energy += v * v
    if energy <= 0.0:
        return 0.0
    return float(np.sqrt(max(sse, 0.0) / energy))


@njit(cache=True, nogil=True)
def auto_bits(s: np.ndarray, lo: float, hi: float, hybrid: bool, mid: bool, tol: float, least: int,
              most: int) -> int:
    """The fewest bits in [least, most] whose sketch of the sorted sample ``s`` (boundaries
    from ``s``, ``lo`` and ``hi``) has a relative error of at most ``tol`` (``most`` when none
    has), every width tried from ``least`` up (the hybrid boundaries of two widths do not nest,
    so the error need not fall with every added bit)."""
    q = np.empty((1 << most) + 1, np.float32)
    for w in range(least, most):
        sketch_bounds(s, lo, hi, w, hybrid, q)
        if sketch_error(s, q, w, mid) <= tol:
            return w
    return most


def sketch_bounds_np(s: np.ndarray, lo: float, hi: float, bits: int, hybrid: bool) -> np.ndarray:
    """:func:`sketch_bounds` in numpy (what ``Sketch8`` encodes with)."""
    b = 1 << bits
    if not hybrid or b < 4:
        inner = s[(np.arange(1, b) * s.size) // b]
    else:
        half = b // 2
        q = s[(np.arange(1, half) * s.size) // half]
        inner = np.sort(np.concatenate([q, np.linspace(lo, hi, half + 2, dtype=np.float32)[1:-1]]))
    out: np.ndarray = np.concatenate([[lo], inner, [hi]]).astype(np.float32)
    return out


def sketch_error_np(e: np.ndarray, q: np.ndarray, mid: bool) -> float:
    """:func:`sketch_error` in numpy: per bucket, sum (v - r)^2 = S2 - 2 r S1 + n r^2 from
    prefix sums of the values and their squares."""
    v = e.astype(np.float64)
    p1 = np.concatenate([[0.0], np.cumsum(v)])
    p2 = np.concatenate([[0.0], np.cumsum(v * v)])
    if p2[-1] <= 0:
        return 0.0
    edge = np.concatenate([[0], np.searchsorted(e, q[1:-1], side="left"), [e.size]])
    n = np.diff(edge).astype(np.float64)
    s1, s2 = np.diff(p1[edge]), np.diff(p2[edge])
    if mid:
        r = (q[:-1].astype(np.float64) + q[1:]) * 0.5
        sse = s2 - 2 * r * s1 + n * r * r
    else:
        sse = s2 - s1 * s1 / np.maximum(n, 1.0)
    return math.sqrt(float(np.maximum(sse, 0.0).sum()) / float(p2[-1]))


def auto_bits_np(s: np.ndarray, lo: float, hi: float, hybrid: bool, mid: bool, tol: float, least: int,
                 most: int) -> int:
    """:func:`auto_bits` in numpy."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN / inf: no width fits, the widest
        for w in range(least, most):
            if sketch_error_np(s, sketch_bounds_np(s, lo, hi, w, hybrid), mid) <= tol:
                return w
    return most


# -- e3m0: 4-bit floats (sign, 3 exponent bits, no mantissa) with one scale per block ------------

@njit(cache=True, nogil=True)
def _block_scale(x: np.ndarray, lo: int, hi: int) -> np.float32:
    """An e3m0 block's scale: the largest magnitude of ``x[lo:hi]`` (float32), or -1 when the
    block holds NaN or infinity."""
    s = np.float32(0.0)
    for i in range(lo, hi):
        a = abs(x[i])
        if not a <= np.float32(np.inf) or a == np.float32(np.inf):  # NaN or infinity
            return np.float32(-1.0)
        if a > s:
            s = a
    return s


@njit(cache=True, nogil=True)
def e3m0_encode(x: np.ndarray, block: int, codes: np.ndarray, scales: np.ndarray) -> bool:
    """Codes (two per byte, element 2j in the low nibble) and block scales (the block's largest
    magnitude) of float32 ``x``; ``codes`` zeroed, ceil(n/2) bytes; ``scales`` ceil(n/block).
    Round to nearest level, ties toward the smaller magnitude (thresholds in float32: s/128,
    then 1.5 times each level s/64 .. s/2). False when ``x`` holds NaN or infinity (outputs
    then undefined)."""
    n = x.shape[0]
    nb = scales.shape[0]
    t = np.empty(7, np.float32)
    for b in range(nb):
        lo = b * block
        hi = min(n, lo + block)
        s = _block_scale(x, lo, hi)
        if s < 0:  # NaN or infinity
            return False
        scales[b] = s
        if s == 0:
            continue
        t[0] = s * np.float32(0.0078125)  # s / 128: the midpoint of 0 and s / 64
        level = s * np.float32(0.015625)  # s / 64
        for e in range(1, 7):
            t[e] = level * np.float32(1.5)
            level = level * np.float32(2.0)
        for i in range(lo, hi):
            v = x[i]
            a = abs(v)
            e = 0
            for k in range(7):
                e += a > t[k]
            c = e | (8 if (v < 0 and e > 0) else 0)
            if i & 1:
                codes[i >> 1] |= np.uint8(c << 4)
            else:
                codes[i >> 1] |= np.uint8(c)
    return True


@njit(cache=True, nogil=True)
def e3m0_decode(codes: np.ndarray, scales: np.ndarray, block: int, out: np.ndarray) -> None:
    """Values of :func:`e3m0_encode`'s codes: 0 for exponent 0, else +-scale * 2**(e - 7)."""
    n = out.shape[0]
    table = np.empty(16, np.float32)
    for b in range(scales.shape[0]):
        s = scales[b]
        table[0] = 0.0
        table[8] = 0.0
        p = np.float32(0.015625)
        for e in range(1, 8):
            table[e] = s * p
            table[8 + e] = -(s * p)
            p = p * np.float32(2.0)
        lo = b * block
        hi = min(n, lo + block)
        for i in range(lo, hi):
            byte = np.int64(codes[i >> 1])
            c = (byte >> 4) if i & 1 else (byte & 15)
            out[i] = table[c]


def e3m0_encode_np(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`e3m0_encode` in numpy: (codes, scales), or None for a non-finite input."""
    n = x.size
    if not np.isfinite(x).all():
        return None
    nb = -(-n // block)
    a = np.abs(x.astype(np.float32))
    pad = np.zeros(nb * block, np.float32)
    pad[:n] = a
    s = pad.reshape(nb, block).max(axis=1) if nb else np.zeros(0, np.float32)
    levels = s[:, None] * (np.float32(2.0) ** np.arange(-6, 0, dtype=np.float32))[None, :]  # s/64 .. s/2
    t = np.concatenate([(s * np.float32(0.0078125))[:, None], (levels * np.float32(1.5)).astype(np.float32)], axis=1)
    e = (pad.reshape(nb, block)[:, :, None] > t[:, None, :]).sum(axis=2).reshape(-1)[:n].astype(np.uint8)
    c = e | np.where((x < 0) & (e > 0), 8, 0).astype(np.uint8)
    if n & 1:
        c = np.concatenate([c, np.zeros(1, np.uint8)])
    codes = (c[0::2] | (c[1::2] << 4)).astype(np.uint8)
    return codes, s.astype(np.float32)


def e3m0_decode_np(codes: np.ndarray, scales: np.ndarray, block: int, n: int) -> np.ndarray:
    """:func:`e3m0_decode` in numpy."""
    c = np.empty(2 * codes.size, np.uint8)
    c[0::2] = codes & 15
    c[1::2] = codes >> 4
    c = c[:n]
    e = (c & 7).astype(np.int32)
    mag = np.repeat(scales, block)[:n] * np.where(e > 0, np.ldexp(np.float32(1.0), e - 7), 0).astype(np.float32)
    out: np.ndarray = np.where(((c & 8) > 0) & (e > 0), -mag, mag).astype(np.float32)
    return out


# -- e3m0 with stochastic rounding (``e3m0:sr``): a counter-based random draw per value ---------

#: splitmix64's increment (2**64 / the golden ratio) and its finalizer's two multipliers
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_LOW24 = np.uint64(0xFFFFFF)
#: e3m0's magnitudes in units of s/64, code 0..7: the lower level of a value whose scaled
#: magnitude t = 64 |x| / s has ``code`` levels 1, 2, 4, ..., 64 at or below it ...
_SR_LOW = np.array([0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0], np.float32)
#: ... and 1 / the gap from that level to the next one up (code 7, t = 64: any, t - 64 = 0)
_SR_INV_GAP = np.array([1.0, 1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625], np.float32)
#: 2**24: a 24-bit draw r rounds up when r < p * 2**24 (u = r / 2**24 uniform on [0, 1))
_TWO24 = np.float32(16777216.0)


@njit(inline="always")
def _mix64(z: np.uint64) -> np.uint64:
    """splitmix64's finalizer (a bijection of 64-bit words; wraps mod 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True)
def e3m0_encode_sr(x: np.ndarray, block: int, salt: np.uint64, codes: np.ndarray, scales: np.ndarray) -> bool:
    """:func:`e3m0_encode` with stochastic rounding: between the adjacent levels L_lo <= |x| <=
    L_hi (L_lo = 0 below s/64) the code of L_hi with probability (|x| - L_lo) / (L_hi - L_lo).

    The draws: the piece's digest h = sum over pairs j of mix(w[2j] | w[2j+1] << 32 + j * G)
    (w: the float32 bit patterns, an odd count's last pair w[n-1] alone; mix: splitmix64's
    finalizer; G: its increment; sums mod 2**64), its seed = mix(h ^ mix(n + salt * G)), and
    pair j's 64-bit word m_j = mix(seed + (j + 1) * G) (splitmix64's j-th output from that
    seed): element 2j draws r = bits 8..31 of m_j, element 2j+1 bits 40..63. With the scaled
    magnitude t = (|x| / s) * 64 in float32 (t <= 64: exactly the codes' levels 0, 1, 2, 4, ..,
    64), e the number of those levels 1..64 at or below t and p = (t - level_e) / gap_e
    (exact: a power-of-two gap), the code is e + (r < p * 2**24). False for NaN or infinity."""
    n = x.shape[0]
    nb = scales.shape[0]
    for b in range(nb):
        lo = b * block
        hi = min(n, lo + block)
        s = _block_scale(x, lo, hi)
        if s < 0:  # NaN or infinity
            return False
        scales[b] = s
    w = x.view(np.uint32)
    half = n >> 1
    h = np.uint64(0)
    for j in range(half):
        key = np.uint64(w[2 * j]) | (np.uint64(w[2 * j + 1]) << np.uint64(32))
        h += _mix64(key + np.uint64(j) * _GOLDEN)
    if n & 1:
        h += _mix64(np.uint64(w[n - 1]) + np.uint64(half) * _GOLDEN)
    seed = _mix64(h ^ _mix64(np.uint64(n) + salt * _GOLDEN))
    m = np.uint64(0)
    for b in range(nb):
        s = scales[b]
        if s == 0:
            continue
        lo = b * block
        hi = min(n, lo + block)
        for i in range(lo, hi):
            if (i & 1) == 0 or i == lo:
                m = _mix64(seed + np.uint64((i >> 1) + 1) * _GOLDEN)
            r = (m >> np.uint64(40)) if i & 1 else ((m >> np.uint64(8)) & _LOW24)
            v = x[i]
            t = (abs(v) / s) * np.float32(64.0)
            e = 0
            for k in range(1, 8):
                e += t >= _SR_LOW[k]
            p = (t - _SR_LOW[e]) * _SR_INV_GAP[e]
            e += np.float32(r) < p * _TWO24
            c = e | (8 if (v < 0 and e > 0) else 0)
            if i & 1:
                codes[i >> 1] |= np.uint8(c << 4)
            else:
                codes[i >> 1] |= np.uint8(c)
    return True


def _mix64_np(z: np.ndarray) -> np.ndarray:
    """:func:`_mix64` of each uint64 (array arithmetic wraps mod 2**64 without a warning)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    out: np.ndarray = z ^ (z >> np.uint64(31))
    return out


def e3m0_encode_sr_np(x: np.ndarray, block: int, salt: int) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`e3m0_encode_sr` in numpy: (codes, scales), or None for a non-finite input."""
    x = np.ascontiguousarray(x, np.float32)
    n = x.size
    if not np.isfinite(x).all():
        return None
    nb = -(-n // block)
    a = np.abs(x)
    pad = np.zeros(nb * block, np.float32)
    pad[:n] = a
    scales = pad.reshape(nb, block).max(axis=1) if nb else np.zeros(0, np.float32)
    w = x.view(np.uint32).astype(np.uint64)
    half, pairs = n >> 1, (n + 1) >> 1
    key = np.zeros(pairs, np.uint64)
    key[:half] = w[0:2 * half:2] | (w[1:2 * half:2] << np.uint64(32))
    if n & 1:
        key[half] = w[n - 1]
    j = np.arange(pairs, dtype=np.uint64)
    h = _mix64_np(key + j * _GOLDEN).sum(dtype=np.uint64, keepdims=True)
    seed = _mix64_np(h ^ _mix64_np(np.array([n], np.uint64) + np.array([salt], np.uint64) * _GOLDEN))
    m = _mix64_np(seed + (j + np.uint64(1)) * _GOLDEN)
    r = np.empty(2 * pairs, np.uint64)
    r[0::2] = (m >> np.uint64(8)) & _LOW24
    r[1::2] = m >> np.uint64(40)
    s = np.repeat(scales, block)[:n]
    t = (a / np.where(s > 0, s, np.float32(1.0))) * np.float32(64.0)
    e = np.zeros(n, np.int64)
    for level in _SR_LOW[1:]:
        e += t >= level
    p = (t - _SR_LOW[e]) * _SR_INV_GAP[e]
    e += r[:n].astype(np.float32) < p * _TWO24
    e = np.where(s > 0, e, 0).astype(np.uint8)
    c = e | np.where((x < 0) & (e > 0), 8, 0).astype(np.uint8)
    if n & 1:
        c = np.concatenate([c, np.zeros(1, np.uint8)])
    codes = (c[0::2] | (c[1::2] << 4)).astype(np.uint8)
    return codes, scales.astype(np.float32)

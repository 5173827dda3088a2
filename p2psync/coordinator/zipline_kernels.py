"""numba kernels for the barrier searchers (``zipline.py``); each has a pure-Python twin there.

All take the merged timeline as three parallel arrays sorted by time: ``t`` (timestamps),
``w`` (worker of each element), ``k`` (its future-iteration index), plus ``n`` workers.
They return (best_d, best_right_position, z) where z[p] is worker p's chosen index.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _keep_best(d: float, j: int, best_d: float, best_pos: int, best_z: np.ndarray, k: np.ndarray,
               latest: np.ndarray) -> tuple[float, int]:
    """The better of the best so far (``best_d``, ``best_pos``) and Z's spread ``d`` after the
    element at position ``j``: a smaller ``d`` wins, and then every worker's current index
    (``k[latest]``) is taken into ``best_z``. Both scans end each step with
    ``best_d, best_pos = _keep_best(d, j, best_d, best_pos, best_z, k, latest)``."""
    if d < best_d:
        for q in range(best_z.shape[0]):
            best_z[q] = k[latest[q]]
        return d, j
    return best_d, best_pos


@njit(cache=True, nogil=True)
def zipline_scan(t: np.ndarray, w: np.ndarray, k: np.ndarray, n: int) -> tuple[float, int, np.ndarray]:
    """Algorithm 4 as written: Z holds the latest element of every worker; after each new
    element d_Z = newest - min(Z), the minimum found by a linear pass over Z (O(n))."""
    latest = np.full(n, -1, np.int64)  # position in t of each worker's current element
    seen = 0
    best_d = np.inf
    best_pos = -1
    best_z = np.zeros(n, np.int64)
    for j in range(t.shape[0]):
        p = w[j]
        if latest[p] < 0:
            seen += 1
        latest[p] = j
        if seen < n:
            continue
        lo = np.inf
        for q in range(n):
            if t[latest[q]] < lo:
                lo = t[latest[q]]
        best_d, best_pos = _keep_best(t[j] - lo, j, best_d, best_pos, best_z, k, latest)
    return best_d, best_pos, best_z


@njit(cache=True, nogil=True)
def zipline_opt_scan(t: np.ndarray, w: np.ndarray, k: np.ndarray, n: int,
                     binary: bool) -> tuple[float, int, np.ndarray]:
    """ZipLineOpt / ZipLineOptBS. Z is kept as an array in arrival (= time) order. A new element
    of worker p replaces p's previous element: if that was the oldest (case i) the new minimum
    is the next live element and d is recomputed; otherwise (case ii) d cannot improve
    (Theorem 7) and is not computed. Finding p's previous element in the array: ZipLineOpt
    traverses it from the oldest element (O(n)); ZipLineOptBS takes the element's position from
    its auxiliary table. Removal leaves a tombstone that the head skips, so the array never
    shifts and the slot is the position itself (the thesis' binary search over a compacted
    array becomes an O(1) lookup)."""
    m = t.shape[0]
    order = np.empty(m, np.int64)  # the array: positions into t, in arrival order
    alive = np.zeros(m, np.bool_)
    size = 0
    head = 0
    latest = np.full(n, -1, np.int64)  # auxiliary table: worker -> its element's position in t
    seen = 0
    best_d = np.inf
    best_pos = -1
    best_z = np.zeros(n, np.int64)
    for j in range(m):
        p = w[j]
        prev = latest[p]
        oldest_replaced = False
        if prev >= 0:
            if binary:  # the auxiliary table holds the element's slot
                slot = prev
            else:  # traverse the array
                slot = head
                while order[slot] != prev:
                    slot += 1
            alive[slot] = False
            while head < size and not alive[head]:
                head += 1
            oldest_replaced = slot < head
        else:
            seen += 1
        order[size] = j
        alive[size] = True
        size += 1
        latest[p] = j
        if seen < n:
            continue
        if prev >= 0 and not oldest_replaced and best_pos >= 0:
            continue  # Theorem 7: d_Z' >= d_Z, no need to compute it
        best_d, best_pos = _keep_best(t[j] - t[order[head]], j, best_d, best_pos, best_z, k, latest)
    return best_d, best_pos, best_z


@njit(cache=True, nogil=True)
def grid_scan_rows(M: np.ndarray, rows: np.ndarray) -> tuple[float, np.ndarray]:
    """Algorithm 3 for every designated row in ``rows`` (GridScan: one row; FullGridScan: all).
    Among equal d the earlier barrier (smaller max) wins (Corollary 3.1); nearest points
    prefer the lower index."""
    n, R = M.shape
    best_d = np.inf
    best_t = np.inf
    best_z = np.zeros(n, np.int64)
    z = np.zeros(n, np.int64)
    for r in rows:
        for i in range(R):
            e = M[r, i]
            lo = e
            hi = e
            for p in range(n):
                if p == r:
                    z[p] = i
                    continue
                bi = 0
                bd = abs(M[p, 0] - e)
                for c in range(1, R):
                    dd = abs(M[p, c] - e)
                    if dd < bd:
                        bd = dd
                        bi = c
                z[p] = bi
                v = M[p, bi]
                if v < lo:
                    lo = v
                if v > hi:
                    hi = v
            d = hi - lo
            if d < best_d or (d == best_d and hi < best_t):
                best_d = d
                best_t = hi
                best_z[:] = z
    return best_d, best_z

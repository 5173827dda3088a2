"""ElasticBSP barrier search: predict every worker's next R iteration end times and find the set
Z* (one predicted end time per worker) with the smallest spread d_Z = max(Z) - min(Z); the
barrier goes at t_sync = max(Z*). Pure, no I/O.

Reference: the thesis *Elastic Synchronization for Efficient and Effective Distributed Deep
Learning*, chapter 6:

* prediction (§6.3, §6.4, Fig. 6.4): from a worker's last two push timestamps, its interval
  gamma = t_last - t_prev and its future end times t_last + i * gamma, i = 1..R;
* Problem 1 (§6.4.1) and the tie-break (§6.4.2, Theorem 3, Corollary 3.1): among equal
  minimum d_Z the earliest solution (smallest t_sync) is preferred;
* the searchers of §6.5: naive search (R^n, a test oracle), GridScan (Alg. 3, heuristic),
  FullGridScan (Alg. 3 over every designated row), ZipLine (Alg. 4), ZipLineOpt (pruning by
  Theorem 7) and ZipLineOptBS (auxiliary n x R table + binary search).

Every searcher returns a :class:`BarrierChoice`. The hot loops are numba kernels
(``zipline_kernels.py``); ``use_numba=False`` runs the same algorithms in plain Python/numpy
and gives the same answers.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from p2psync.coordinator import zipline_kernels as K
from p2psync.errors import ConfigError


@dataclass(frozen=True)
class BarrierChoice:
    #: z[p] = index i (0-based: the (i+1)-th future iteration) chosen for worker p
    z: tuple[int, ...]
    #: spread max(Z) - min(Z): the fastest worker's wait at the barrier
    d: float
    #: barrier time max(Z)
    t_sync: float


def _check_matrix(M: np.ndarray) -> np.ndarray:
    M = np.asarray(M, dtype=np.float64)
    if M.ndim != 2 or M.shape[0] < 1 or M.shape[1] < 1:
        raise ConfigError(f"prediction matrix must be n x R with n, R >= 1, got shape {M.shape}")
    if not np.isfinite(M).all():
        raise ConfigError("prediction matrix has non-finite timestamps")
    return M


def predict(pushes: Sequence[Sequence[float]], R: int) -> np.ndarray:
    """n x R matrix of predicted end times from each worker's push timestamps (>= 2 each;
    the last two are used: the monitoring phase of §6.3)."""
    if R < 1:
        raise ConfigError("R must be >= 1")
    if len(pushes) < 1:
        raise ConfigError("need at least one worker")
    rows = []
    for p, ts in enumerate(pushes):
        ts = [float(x) for x in ts]
        if len(ts) < 2:
            raise ConfigError(f"worker {p}: need at least two push timestamps, got {len(ts)}")
        if not all(math.isfinite(x) for x in ts[-2:]):
            raise ConfigError(f"worker {p}: non-finite timestamp")
        gamma = ts[-1] - ts[-2]
        if gamma < 0:
            raise ConfigError(f"worker {p}: push timestamps go back in time")
        rows.append(ts[-1] + gamma * np.arange(1, R + 1))
    return np.array(rows, dtype=np.float64)


def _choice(M: np.ndarray, z: Sequence[int] | np.ndarray) -> BarrierChoice:
    vals = M[np.arange(M.shape[0]), np.asarray(z)]
    return BarrierChoice(tuple(int(i) for i in z), float(vals.max() - vals.min()), float(vals.max()))


# -- exhaustive and grid searches ------------------------------------------------------


def naive_search(M: np.ndarray, *, max_candidates: int = 2_000_000) -> BarrierChoice:
    """Every one of the R^n candidates; the earliest among those with minimum d. Test oracle."""
    M = _check_matrix(M)
    n, R = M.shape
    if R**n > max_candidates:
        raise ConfigError(f"naive search over {R}^{n} candidates is too large")
    best: tuple[float, float] | None = None
    best_z: tuple[int, ...] = ()
    for z in itertools.product(range(R), repeat=n):
        vals = M[np.arange(n), z]
        key = (float(vals.max() - vals.min()), float(vals.max()))
        if best is None or key < best:
            best, best_z = key, z
    return _choice(M, best_z)


def _grid(M: np.ndarray, rows: np.ndarray, use_numba: bool) -> BarrierChoice:
    if use_numba:
        _, z = K.grid_scan_rows(M, rows)
        return _choice(M, z)
    n, R = M.shape
    best, best_z = (np.inf, np.inf), np.zeros(n, np.int64)
    for r in rows:
        for i in range(R):
            e = M[r, i]
            z = np.abs(M - e).argmin(axis=1)
            z[r] = i
            vals = M[np.arange(n), z]
            key = (vals.max() - vals.min(), vals.max())
            if key < best:
                best, best_z = key, z
    return _choice(M, best_z)


def grid_scan(M: np.ndarray, *, use_numba: bool = True) -> BarrierChoice:
    """Algorithm 3: the designated row is the worker with the earliest first end time; for each
    of its R points, the nearest point of every other worker. Heuristic: may miss Z*."""
    M = _check_matrix(M)
    return _grid(M, np.array([int(np.argmin(M[:, 0]))], dtype=np.int64), use_numba)


def full_grid_scan(M: np.ndarray, *, use_numba: bool = True) -> BarrierChoice:
    """GridScan with every worker in turn as the designated row (Rn candidates)."""
    M = _check_matrix(M)
    return _grid(M, np.arange(M.shape[0], dtype=np.int64), use_numba)


# -- ZipLine family ------------------------------------------------------------------------


def timeline(M: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Omega: all predicted points merged and sorted by time (ties: worker, then index).

    A quicksort is 3x faster than a stable sort here; the tie order matters only when two
    timestamps are exactly equal, and then the stable sort (row-major: worker, then index)
    is used instead."""
    n, R = M.shape
    flat = M.reshape(-1)
    order = np.argsort(flat)
    t = flat[order]
    if t.size > 1 and np.any(t[1:] == t[:-1]):
        order = np.argsort(flat, kind="stable")
        t = flat[order]
    return t, (order // R).astype(np.int64), (order % R).astype(np.int64)


def _zipline_py(t: np.ndarray, w: np.ndarray, k: np.ndarray, n: int, variant: str) -> tuple[int, np.ndarray]:
    """Pure-Python twin of the kernels: returns (best right position, z)."""
    latest = [-1] * n
    arr: list[int] = []  # positions in arrival order (ZipLineOpt's array)
    seen, best_d, best_pos, best_z = 0, math.inf, -1, np.zeros(n, np.int64)
    for j in range(t.size):
        p = int(w[j])
        prev = latest[p]
        oldest = False
        if prev >= 0:
            oldest = arr[0] == prev
            arr.remove(prev)
        else:
            seen += 1
        arr.append(j)
        latest[p] = j
        if seen < n:
            continue
        if variant != "zipline" and prev >= 0 and not oldest and best_pos >= 0:
            continue  # Theorem 7
        lo = min(t[q] for q in latest) if variant == "zipline" else t[arr[0]]
        d = t[j] - lo
        if d < best_d:
            best_d, best_pos = d, j
            best_z = np.array([k[q] for q in latest], dtype=np.int64)
    return best_pos, best_z


def _zipline(M: np.ndarray, variant: str, use_numba: bool) -> BarrierChoice:
    M = _check_matrix(M)
    n = M.shape[0]
    t, w, k = timeline(M)
    if not use_numba:
        _, z = _zipline_py(t, w, k, n, variant)
    elif variant == "zipline":
        _, _, z = K.zipline_scan(t, w, k, n)
    else:
        _, _, z = K.zipline_opt_scan(t, w, k, n, variant == "zipline_opt_bs")
    return _choice(M, z)


def zipline(M: np.ndarray, *, use_numba: bool = True) -> BarrierChoice:
    """Algorithm 4: one pass over the merged timeline; exact, O(Rn^2) after the merge."""
    return _zipline(M, "zipline", use_numba)


def zipline_opt(M: np.ndarray, *, use_numba: bool = True) -> BarrierChoice:
    """ZipLine with the search-space pruning of Theorem 7 (ZipLineOpt); exact."""
    return _zipline(M, "zipline_opt", use_numba)


def zipline_opt_bs(M: np.ndarray, *, use_numba: bool = True) -> BarrierChoice:
    """ZipLineOpt with the auxiliary n x R table and binary search (ZipLineOptBS); exact."""
    return _zipline(M, "zipline_opt_bs", use_numba)


SEARCHERS: dict[str, Callable[..., BarrierChoice]] = {
    "naive": naive_search, "gridscan": grid_scan, "fullgridscan": full_grid_scan,
    "zipline": zipline, "zipline_opt": zipline_opt, "zipline_opt_bs": zipline_opt_bs,
}


# -- Dynamic SSP controller (chapter 5, Algorithm 2) ------------------------------------------


def slowest_worker(table: Sequence[Sequence[float]]) -> int:
    """The worker with the longest latest iteration interval (table[i] = [latest, second latest])."""
    if not table:
        raise ConfigError("empty push table")
    return int(np.argmax([float(a) - float(b) for a, b in table]))


def dssp_controller(fast: Sequence[float], slow: Sequence[float], r_max: int) -> int:
    """r* in [0, r_max]: the extra iterations worker p (``fast`` = its [latest, second latest]
    push timestamps) should run so its simulated finish is closest to one of the slowest
    worker's simulated finishes (Alg. 2 lines 4-10). 0 = wait now. Ties: the smaller r."""
    if r_max < 0:
        raise ConfigError("r_max must be >= 0")
    vals = [float(x) for x in (*fast, *slow)]
    if len(fast) != 2 or len(slow) != 2 or not all(math.isfinite(v) for v in vals):
        raise ConfigError("fast and slow each need two finite timestamps [latest, second latest]")
    i_p = fast[0] - fast[1]
    i_s = slow[0] - slow[1]
    if i_p < 0 or i_s < 0:
        raise ConfigError("latest timestamp must not precede the second latest")
    r = np.arange(r_max + 1)
    sim_p = fast[0] + r * i_p  # Sim_p[0] = A[p][0]
    sim_s = slow[0] + i_s + r * i_s  # Sim_slowest[0] = A[slowest][0] + I_slowest
    gap = np.abs(sim_s[None, :] - sim_p[:, None]).min(axis=1)
    return int(np.argmin(gap))  # first minimum: the smallest r

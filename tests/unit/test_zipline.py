"""ElasticBSP barrier search (thesis ch. 6) and the DSSP controller (ch. 5, Alg. 2)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2psync.coordinator.zipline import (SEARCHERS, dssp_controller, full_grid_scan, grid_scan,
                                         naive_search, predict, slowest_worker, zipline,
                                         zipline_opt, zipline_opt_bs)
from p2psync.errors import ConfigError

EXACT = [zipline, zipline_opt, zipline_opt_bs]


@st.composite
def matrices(draw):
    n = draw(st.integers(1, 4))
    R = draw(st.integers(1, 5))
    if draw(st.booleans()):  # small integer grid: many ties and identical intervals
        rows = [sorted(draw(st.lists(st.integers(0, 8), min_size=R, max_size=R))) for _ in range(n)]
        return np.array(rows, dtype=float)
    pushes = [[draw(st.integers(0, 500)), 0] for _ in range(n)]
    for p in pushes:
        p[1] = p[0] + draw(st.sampled_from([1000, 1100, 1250, draw(st.integers(1000, 1500))]))
    return predict(pushes, R)


@settings(max_examples=400, deadline=None)
@given(matrices())
def test_zipline_family_is_exact_and_earliest(M):
    ref = naive_search(M)
    for search in EXACT:
        for use_numba in (True, False):
            got = search(M, use_numba=use_numba)
            assert got.d == ref.d, (search.__name__, use_numba)
            assert got.t_sync == ref.t_sync  # the earliest among optimal solutions
            vals = M[np.arange(M.shape[0]), list(got.z)]
            assert vals.max() - vals.min() == got.d and vals.max() == got.t_sync


@settings(max_examples=300, deadline=None)
@given(matrices())
def test_grid_scans_never_beat_the_optimum(M):
    ref = naive_search(M)
    for search in (grid_scan, full_grid_scan):
        a, b = search(M, use_numba=True), search(M, use_numba=False)
        assert a == b
        assert a.d >= ref.d


def test_full_grid_scan_can_miss_the_optimum():
    # nearest points chosen row by row need not form the tightest set (found by property search)
    M = np.array([[0.0, 3.0], [1.0, 9.0], [0.0, 6.0], [6.0, 9.0]])
    assert naive_search(M).d == 5.0 and zipline(M).d == 5.0
    assert full_grid_scan(M).d == 6.0


def test_gridscan_is_sometimes_worse_on_the_thesis_setting():
    # Table 6.3 setting: intervals uniform in 1000-1500 ms; GridScan succeeded in 30 % there
    rng = np.random.default_rng(0)
    worse = 0
    for _ in range(40):
        n, R = 50, 15
        M = predict([[s, s + g] for s, g in zip(rng.uniform(0, 1500, n), rng.uniform(1000, 1500, n))], R)
        opt = zipline_opt_bs(M)
        g = grid_scan(M)
        assert g.d >= opt.d
        worse += g.d > opt.d
    assert 0 < worse < 40


def test_tie_prefers_earliest_barrier():
    # two workers with identical intervals: every aligned pair has d = 0; the first one wins
    M = predict([[0, 1000], [0, 1000]], 5)
    for search in (*EXACT, full_grid_scan, grid_scan):
        got = search(M)
        assert got.d == 0 and got.t_sync == 2000 and got.z == (0, 0)


def test_thesis_figure_6_7_style_example():
    # d_6 == d_10 in Fig. 6.7: the chronologically first optimal set is chosen
    M = np.array([[1.0, 5.0, 9.0], [2.0, 6.0, 10.0]])
    got = zipline(M)
    assert got.d == 1.0 and got.t_sync == 2.0 and got.z == (0, 0)


def test_predict_from_pushes():
    M = predict([[10, 20, 35], [0, 40]], 3)
    np.testing.assert_array_equal(M, [[50, 65, 80], [80, 120, 160]])
    with pytest.raises(ConfigError, match="two push"):
        predict([[1]], 3)
    with pytest.raises(ConfigError, match="back in time"):
        predict([[5, 1]], 3)
    with pytest.raises(ConfigError):
        predict([[0, 1]], 0)


@pytest.mark.parametrize("bad", [np.zeros((0, 3)), np.zeros((2, 0)), np.array([[0.0, np.nan]]),
                                 np.zeros(3)])
def test_searchers_validate_input(bad):
    for name, search in SEARCHERS.items():
        with pytest.raises(ConfigError):
            search(bad)


def test_dssp_controller_hand_made():
    # fast worker: interval 10, last push at 100; slowest: interval 35, last push at 90
    # Sim_p = 100, 110, 120, ...; Sim_slowest = 125, 160, 195, ...
    assert dssp_controller([100, 90], [90, 55], r_max=5) == 2  # 120 vs 125 (gap 5)
    assert dssp_controller([100, 90], [90, 55], r_max=1) == 1  # 110 vs 125 beats 100
    # the slowest will finish right after the fast worker's current push: wait now
    assert dssp_controller([100, 90], [99, 98], r_max=4) == 0  # Sim_s = 100, 101, ...
    # exact alignment two iterations ahead
    assert dssp_controller([0, -10], [0, -20], r_max=3) == 2  # Sim_p 0,10,20 ; Sim_s 20,40
    with pytest.raises(ConfigError):
        dssp_controller([1, 2], [3, 1], 2)  # latest before second latest
    with pytest.raises(ConfigError):
        dssp_controller([1, 0], [3, 1], -1)


def test_slowest_worker():
    assert slowest_worker([[100, 90], [100, 50], [100, 80]]) == 1

"""all_finite: the transport's NaN / infinity check, on both of its paths (BLAS dot and isfinite)."""

import numpy as np
import pytest

from p2psync.transport import all_finite


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 100, 5000, 300_000])
def test_finds_every_non_finite_value(dtype, n):
    a = np.random.default_rng(n).standard_normal(n).astype(dtype)
    assert all_finite(a)
    for bad in (np.nan, np.inf, -np.inf):
        for i in (0, n // 2, n - 1):
            b = a.copy()
            b[i] = bad
            assert not all_finite(b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_huge_finite_values_are_finite(dtype):
    big = np.full(100_000, np.finfo(dtype).max, dtype)  # their sum would overflow
    assert all_finite(big) and all_finite(-big)


def test_strided_2d_integer_and_empty_inputs():
    a = np.ones((300, 300), np.float32)
    a[7, 9] = np.nan
    assert not all_finite(a) and not all_finite(a[:, 1::2][:, 4:5].T.reshape(-1))
    assert all_finite(np.arange(10)) and all_finite(np.zeros(0, np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_overflowing_squares_still_find_a_nan(dtype):
    """Huge finite values overflow the sum of squares: the exact check decides, and still finds
    the one NaN or infinity among them."""
    big = np.full(100_000, np.finfo(dtype).max / 4, dtype)
    for bad in (np.nan, np.inf):
        b = big.copy()
        b[77_777] = bad
        assert not all_finite(b)

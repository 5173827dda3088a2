"""bucketize_keyed (the table-driven bucket search of sketch8) gives exactly bucketize's codes,
sums and counts, edge cases included."""

import numpy as np
import pytest

from p2psync.compress import Sketch8
from p2psync.compress import kernels as K

rng = np.random.default_rng(0)
CASES = {
    "student-t": (rng.standard_t(2, 1 << 18) * 1e-3).astype(np.float32),
    "normal": rng.standard_normal(100_000).astype(np.float32),
    "constant": np.full(5000, 3.0, np.float32),
    "signed zeros": np.r_[np.zeros(1000), -np.zeros(1000), np.ones(10)].astype(np.float32),
    "infinities": np.r_[rng.standard_normal(5000), [np.inf, -np.inf]].astype(np.float32),
    "nan": np.r_[rng.standard_normal(5000), [np.nan, -np.nan, np.inf]].astype(np.float32),
    "integers": rng.integers(-5, 5, 100_000).astype(np.float32),
    "denormals": (rng.standard_normal(10_000) * 1e-40).astype(np.float32),
    "negative only": -np.abs(rng.standard_t(2, 50_000)).astype(np.float32),
    "positive only": np.abs(rng.standard_normal(50_000) * 1e-6).astype(np.float32),
    "near float max": (np.clip(rng.standard_normal(10_000), -1, 1) * 3.4e38).astype(np.float32),
    "many exact zeros": np.r_[np.zeros(40_000), rng.standard_normal(10_000) * 1e-3].astype(np.float32),
}


@pytest.mark.parametrize("bits", [8, 6, 3, 1])
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_codes_sums_and_counts_as_the_eight_step_search(case, bits):
    x = CASES[case]
    s = Sketch8(bits=bits)
    with np.errstate(all="ignore"):
        q = s.quantiles(x)
    b = s.buckets
    r = 256 // b
    bounds = np.full(256, np.inf, np.float32)
    bounds[:(b - 1) * r] = np.repeat(q[1:-1], r)
    want = (np.empty(x.size, np.uint8), np.zeros(256), np.zeros(256, np.int64))
    got = (np.empty(x.size, np.uint8), np.zeros(256), np.zeros(256, np.int64))
    K.bucketize(x, bounds, *want)
    K.bucketize_keyed(x, bounds, float(q[0]), float(q[-1]), *got)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])


@pytest.mark.parametrize("case", sorted(CASES) + ["all nan"])
def test_minmax_fast_equals_the_loop_nan_ignored(case):
    x = CASES.get(case, np.full(10, np.nan, np.float32))
    want = K.minmax(x)
    got = K.minmax_fast(x)
    assert got == want  # (inf, -inf) for all-NaN; -0.0 == 0.0
    assert not np.isnan(got).any()


def _cell_edges(lo: float, hi: float) -> np.ndarray:
    """The least and greatest float32 of every cell (2**CELL_SHIFT bit patterns) in [lo, hi]."""
    low = (1 << K.CELL_SHIFT) - 1
    top = int(np.float32(max(hi, 0.0)).view(np.uint32)) >> K.CELL_SHIFT
    bottom = int(np.float32(-min(lo, 0.0)).view(np.uint32)) >> K.CELL_SHIFT
    pos = np.arange(top + 1, dtype=np.uint32) << K.CELL_SHIFT
    neg = (np.arange(bottom + 1, dtype=np.uint32) << K.CELL_SHIFT) | np.uint32(0x80000000)
    pats = np.concatenate([pos, pos | low, neg, neg | low]).view(np.float32)
    return pats[(pats >= lo) & (pats <= hi)]


@pytest.mark.parametrize("case", ["student-t", "normal", "integers", "signed zeros", "positive only",
                                  "negative only", "many exact zeros", "constant"])
def test_every_cell_of_the_table_agrees_with_the_search(case):
    """The table is built by skipping runs of cells without a bound: the extreme values of every
    cell in [lo, hi] (not only those the data hits) get the 8-step search's code."""
    x = CASES[case]
    s = Sketch8()
    q = s.quantiles(x)
    bounds = np.r_[q[1:-1], np.inf].astype(np.float32)
    lo, hi = float(q[0]), float(q[-1])
    edges = np.r_[_cell_edges(lo, hi), q].astype(np.float32)  # the bounds themselves too
    want = (np.empty(edges.size, np.uint8), np.zeros(256), np.zeros(256, np.int64))
    got = (np.empty(edges.size, np.uint8), np.zeros(256), np.zeros(256, np.int64))
    K.bucketize(edges, bounds, *want)
    K.bucketize_keyed(edges, bounds, lo, hi, *got)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[2], want[2])


@pytest.mark.parametrize("stride", [1, 3, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_radix_sorted_sample_is_numpys_sort(case, stride):
    """sorted_sample (the sketch's sample sort) returns numpy's sorted strided sample, edge
    cases included: NaNs last, infinities, signed zeros (equal), denormals, float max."""
    x = CASES[case]
    want = K.sorted_sample_np(x, stride)
    got = np.empty(want.size, np.float32)
    K.sorted_sample(x, stride, got)
    np.testing.assert_array_equal(got, want)  # NaN == NaN, -0.0 == 0.0 here
    nan = np.isnan(got)
    assert not nan.any() or nan[-int(nan.sum()):].all()


def test_the_sketch_samples_through_the_radix_sort_only_where_it_applies(monkeypatch):
    """Sketch8's numba path takes the radix sort for a float32 sample of at least RADIX_MIN
    values and numpy's sort otherwise; both give the same encoding."""
    x = CASES["student-t"][:40_000]
    radix = []
    real = K.sorted_sample

    def spy(*args):
        radix.append(args[2].size)
        return real(*args)

    monkeypatch.setattr(K, "sorted_sample", spy)
    for n in (K.RADIX_MIN - 1, K.RADIX_MIN, 40_000):
        a, b = Sketch8(use_numba=True), Sketch8(use_numba=False)
        for u, v in zip(a._sample(x[:n]), b._sample(x[:n])):
            np.testing.assert_array_equal(u, v)
    assert radix == [K.RADIX_MIN, 40_000 // 3 + 1]  # 40 000 values: every 3rd sampled (16 384 at most)
    Sketch8(use_numba=True)._sample(x[:2000].astype(np.float64))  # not float32: numpy's sort
    Sketch8(use_numba=True)._sample(x[:4000:2])  # not contiguous: numpy's sort
    assert len(radix) == 2
    with pytest.raises(ValueError, match="ceil"):
        real(x[:100], 1, np.empty(101, np.float32))

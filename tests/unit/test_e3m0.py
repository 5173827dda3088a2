"""The ``e3m0`` codec: a worked vector (block of 8), the error bound, zero blocks, odd lengths,
non-finite input, the decode table, numba == numpy, error feedback; ``e3m0:sr`` (stochastic
rounding): numba == numpy bitwise, adjacent levels, unbiasedness, repeatability, specs."""

from __future__ import annotations

import numpy as np
import pytest

from p2psync.compress import E3M0, ErrorFeedback, codec_usage, get_codec
from p2psync.errors import ConfigError, Diverged, ProtocolError


def test_the_worked_vector_block_8():
    x = np.array([0.9, -0.35, 0.06, 0.0, -1.6, 0.13, 0.011, -0.004], np.float32)
    for numba in (True, False):
        codes, scales = E3M0(block=8, use_numba=numba).encode(x)
        assert codes.tobytes() == bytes([0xD6, 0x02, 0x3F, 0x00])
        assert scales.tolist() == [np.float32(1.6)]
        got = E3M0(block=8, use_numba=numba).decode([codes, scales], 8)
        want = np.array([0.8, -0.4, 0.05, 0, -1.6, 0.1, 0, 0], np.float32) * np.float32(1.0)
        s = np.float32(1.6)
        exact = np.array([s / 2, -s / 4, s / 32, 0, -s, s / 16, 0, 0], np.float32)  # powers of two of s
        assert got.tobytes() == exact.tobytes()
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert sum(a.nbytes for a in E3M0(block=8).encode(x)) == 8  # 4 + 4 bytes for 8 values


@pytest.mark.parametrize("block", [1, 3, 32, 128, 256])
def test_error_bound_numba_equals_numpy_and_sizes(block):
    rng = np.random.default_rng(block)
    x = (rng.standard_t(3, 4001) * 1e-3).astype(np.float32)  # odd length
    a, b = E3M0(block=block), E3M0(block=block, use_numba=False)
    ea, eb = a.encode(x), b.encode(x)
    assert ea[0].tobytes() == eb[0].tobytes() and ea[1].tobytes() == eb[1].tobytes()
    assert ea[0].size == 2001 and ea[1].size == -(-4001 // block)
    y = a.decode(ea, x.size)
    assert y.tobytes() == b.decode(ea, x.size).tobytes()
    s = np.repeat(ea[1], block)[:x.size]
    bound = np.maximum(np.abs(x) / 3, s / 128) * (1 + 1e-6)
    assert (np.abs(x - y) <= bound).all()
    assert E3M0(block=block).roundtrip(np.zeros(0, np.float32)).size == 0


def test_zero_block_odd_count_and_negative_zero_code():
    x = np.zeros(5, np.float32)
    codes, scales = E3M0(block=4).encode(x)
    assert codes.tolist() == [0, 0, 0] and scales.tolist() == [0.0, 0.0]
    # code 0x8 (sign, exponent 0) decodes to +0.0
    got = E3M0(block=2).decode([np.array([0x88], np.uint8), np.array([3.0], np.float32)], 2)
    assert got.tobytes() == np.zeros(2, np.float32).tobytes()
    assert E3M0(block=2, use_numba=False).decode([np.array([0x88], np.uint8), np.array([3.0], np.float32)],
                                                 2).tobytes() == np.zeros(2, np.float32).tobytes()


def test_every_code_decodes_to_its_power_of_two_of_the_scale():
    s = np.float32(3.0)
    codes = np.array([(2 * j + 1) << 4 | 2 * j for j in range(8)], np.uint8)  # codes 0..15 in order
    got = E3M0(block=16).decode([codes, np.array([s], np.float32)], 16)
    want = [0.0] + [float(s) * 2.0 ** (e - 7) for e in range(1, 8)] + [0.0] + [-float(s) * 2.0 ** (e - 7)
                                                                                for e in range(1, 8)]
    assert got.tolist() == want


def test_non_finite_input_raises_and_bad_payloads_are_protocol_errors():
    for bad in (np.nan, np.inf, -np.inf):
        for numba in (True, False):
            with pytest.raises(Diverged, match="e3m0"):
                E3M0(use_numba=numba).encode(np.array([1.0, bad, 2.0], np.float32))
    c = E3M0(block=4)
    with pytest.raises(ProtocolError):
        c.decode([np.zeros(2, np.uint8), np.array([1.0], np.float32)], 5)  # needs 3 code bytes, 2 scales
    with pytest.raises(ProtocolError, match="scale"):
        c.decode([np.zeros(2, np.uint8), np.array([-1.0], np.float32)], 4)
    with pytest.raises(ProtocolError, match="scale"):
        c.decode([np.zeros(2, np.uint8), np.array([np.nan], np.float32)], 4)


def test_registry_parameters_and_usage():
    assert isinstance(get_codec("e3m0"), E3M0) and get_codec("e3m0").block == 128
    c = get_codec("e3m0:32")
    assert c.block == 32 and c.spec == "e3m0:32" and get_codec("e3m0").spec == "e3m0"
    assert "e3m0[:BLOCK]" in codec_usage()
    for bad in ("e3m0:x", "e3m0:0", "e3m0:-4"):
        with pytest.raises(ConfigError, match="e3m0"):
            get_codec(bad)


def test_error_feedback_tracks_the_sum_within_one_quantization_error():
    """R rounds of a constant Δ: what was decoded sums to R·Δ minus the last residual."""
    c, fb = E3M0(block=16), ErrorFeedback()
    d = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    total = np.zeros_like(d)
    for _ in range(20):
        x = fb.compensate("f", d)
        y = c.roundtrip(x)
        fb.record("f", x, y)
        total += y
    np.testing.assert_allclose(total + fb.residual["f"], 20 * d, rtol=1e-4, atol=1e-4)
    # the residual stays bounded by one quantization step of the compensated input
    assert np.abs(fb.residual["f"]).max() <= np.abs(fb.compensate("f", d)).max()


# -- e3m0:sr: stochastic rounding -------------------------------------------------------------

def _levels(x: np.ndarray, scales: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Each |x|'s adjacent levels (the largest at or below it, the smallest at or above it)
    among its block's 0, s/64, ..., s, as the decoder computes them (float32)."""
    s = np.repeat(scales, block)[:x.size]
    table = np.concatenate([np.zeros((s.size, 1), np.float32),
                            s[:, None] * (np.float32(2.0) ** np.arange(-6, 1, dtype=np.float32))[None, :]], axis=1)
    a = np.abs(x)[:, None]
    lo = np.where(table <= a, table, -np.inf).max(axis=1).astype(np.float32)
    hi = np.where(table >= a, table, np.inf).min(axis=1).astype(np.float32)
    return lo, hi


def _awkward(n: int, seed: int) -> np.ndarray:
    """Student-t values with exact levels, zeros of both signs, subnormals and huge values."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_t(3, n) * 1e-3).astype(np.float32)
    x[::17] = 0.0
    x[5::19] = -0.0
    x[3::23] = np.float32(1e-40) * rng.choice([-1, 1], x[3::23].size)  # subnormal
    x[7::29] = np.float32(3e38) * rng.choice([-1, 1], x[7::29].size)
    x[11::31] = np.float32(2.0) ** rng.integers(-9, -3, x[11::31].size)  # often exactly a level
    return x


@pytest.mark.parametrize("block", [1, 3, 32, 128, 256])
@pytest.mark.parametrize("n", [0, 1, 2, 4001, 4096])
def test_sr_numba_kernel_equals_the_numpy_twin_bitwise(block, n):
    for salt in (0, 1, 2 ** 64 - 1):
        x = _awkward(n, block * 7 + n)
        a = E3M0(block=block, sr=True, salt=salt).encode(x)
        b = E3M0(block=block, sr=True, salt=salt, use_numba=False).encode(x)
        assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()
        assert a[0].size == (n + 1) // 2 and a[1].size == -(-n // block)


@pytest.mark.parametrize("block", [1, 3, 128])
def test_sr_every_value_decodes_to_one_of_its_two_adjacent_levels_within_their_gap(block):
    x = _awkward(20001, block)
    c = E3M0(block=block, sr=True)
    enc = c.encode(x)
    q = c.decode(enc, x.size)
    lo, hi = _levels(x, enc[1], block)
    normal = np.repeat(enc[1], block)[:x.size] * np.float32(2.0 ** -6) >= np.finfo(np.float32).tiny
    assert ((np.abs(q) == lo) | (np.abs(q) == hi))[normal].all()  # (levels below float32's normal range round)
    assert ((q == 0) | (np.sign(q) == np.sign(x))).all()
    assert (np.abs(q - x) <= (hi - lo))[normal].all()
    exact = normal & (lo == hi)  # a value exactly on a level (zero, the block's scale, s * 2**-k) is kept
    assert exact.sum() > 1000 and (np.abs(q) == np.abs(x))[exact].all()


def test_sr_is_unbiased_where_round_to_nearest_is_not():
    """The mean of R independent encodings (salts 0..R-1) of a fixed vector is within a few
    standard errors of it, per value and summed; round to nearest's error, the same every time,
    is biased toward the smaller magnitude (a density that falls off between levels)."""
    x = np.abs(np.random.default_rng(11).standard_normal(2048)).astype(np.float32)
    R = 2000
    acc = np.zeros(x.size)
    for salt in range(R):
        acc += E3M0(block=128, sr=True, salt=salt).roundtrip(x)
    mean = acc / R
    enc = E3M0(block=128).encode(x)
    lo, hi = _levels(x, enc[1], 128)
    var = (hi.astype(np.float64) - x) * (x - lo.astype(np.float64))  # one draw's: Bernoulli between the levels
    se = np.sqrt(var / R)
    assert (np.abs(mean - x) <= 6 * se + 3 * (hi - lo) / R + 1e-6 * x).all()
    total_se = np.sqrt(var.sum() / R)
    z_sr = (mean - x).sum() / total_se
    z_rtn = (E3M0(block=128).roundtrip(x) - x).sum() / total_se
    assert abs(z_sr) < 4 and z_rtn < -40, (z_sr, z_rtn)  # measured: -2.4 and -206
    assert abs((mean - x).mean()) < 0.05 * abs((E3M0(block=128).roundtrip(x) - x).mean())


def test_sr_the_specs_worked_example_in_one_encoding():
    """Spec §5.5: 0.9 in a block of scale 1.6 decodes to 0.8 with probability 0.875, to 1.6
    with 0.125 (mean 0.9): the draws of one piece's values are independent of each other."""
    x = np.full(1 << 16, 0.9, np.float32)
    x[::8] = 1.6
    for numba in (True, False):
        q = E3M0(block=8, sr=True, use_numba=numba).roundtrip(x)[x == np.float32(0.9)]
        assert set(q.tolist()) == {np.float32(0.8), np.float32(1.6)}
        up = (q == np.float32(1.6)).mean()
        assert abs(up - 0.125) < 5 * np.sqrt(0.125 * 0.875 / q.size), up


def test_sr_repeats_for_the_same_piece_and_draws_afresh_for_another():
    x = np.random.default_rng(5).standard_normal(10000).astype(np.float32)
    a = get_codec("e3m0:sr").encode(x)
    b = get_codec("e3m0:sr").encode(x.copy())
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()
    assert a[0].tobytes() == E3M0(sr=True, use_numba=False).encode(x)[0].tobytes()
    y = x.copy()
    y[-1] = np.nextafter(y[-1], np.float32(np.inf))  # one bit of the last value: every draw changes
    c = get_codec("e3m0:sr").encode(y)
    changed = (a[0][:4000] != c[0][:4000]).mean()
    rtn = get_codec("e3m0")
    assert changed > 0.2, changed  # (a value whose draw changes its code: about half of those between levels)
    d = E3M0(sr=True, salt=1).encode(x)
    assert (a[0] != d[0]).mean() > 0.2
    # round to nearest is untouched
    assert rtn.encode(x)[0].tobytes() == E3M0(use_numba=False).encode(x)[0].tobytes()


def test_sr_is_decoded_by_any_e3m0_receiver_and_sends_under_its_name():
    """Decoding does not depend on how the sender rounded: ``e3m0`` and ``e3m0:sr`` read the
    same bytes identically, and both go on the wire as codec ``e3m0``."""
    x = np.random.default_rng(6).standard_normal(1001).astype(np.float32)
    enc = get_codec("e3m0:sr").encode(x)
    for spec in ("e3m0", "e3m0:sr"):
        assert get_codec(spec).name == "e3m0"
        assert get_codec(spec).decode(enc, x.size).tobytes() == get_codec("e3m0:sr").decode(enc, x.size).tobytes()
    for bad in (np.nan, np.inf):
        for numba in (True, False):
            with pytest.raises(Diverged, match="e3m0"):
                E3M0(sr=True, use_numba=numba).encode(np.array([1.0, bad], np.float32))


def test_sr_specs_parse_round_trip_and_bad_forms_name_the_spec():
    for spec, block, sr in (("e3m0", 128, False), ("e3m0:32", 32, False), ("e3m0:sr", 128, True),
                            ("e3m0:32:sr", 32, True), ("e3m0:1:sr", 1, True)):
        c = get_codec(spec)
        assert isinstance(c, E3M0) and (c.block, c.sr, c.spec, c.salt) == (block, sr, spec, 0)
        assert get_codec(c.spec).spec == spec
    assert get_codec("e3m0:128:sr").spec == "e3m0:sr"
    assert "e3m0[:BLOCK][:sr]" in codec_usage()
    for bad in ("e3m0:sr:32", "e3m0:32:sr:sr", "e3m0:sr:sr", "e3m0:32:", "e3m0::sr", "e3m0:", "e3m0:SR",
                "e3m0:x:sr", "e3m0:0:sr", "e3m0:-4:sr", "e3m0:sr=1", "e3m0:stochastic", "e3m0:1_28",
                f"e3m0:{(1 << 20) + 1}:sr"):
        with pytest.raises(ConfigError, match=f"codec {bad}"):
            get_codec(bad)
    for kw in ({"sr": 1}, {"salt": -1}, {"salt": 1 << 64}, {"salt": True}):
        with pytest.raises(ConfigError, match="e3m0"):
            E3M0(**kw)

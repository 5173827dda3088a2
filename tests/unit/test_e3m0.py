"""The ``e3m0`` codec: a worked vector (block of 8), the error bound, zero blocks, odd lengths,
non-finite input, the decode table, numba == numpy, error feedback."""

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

"""Codecs: round-trip bounds, numba == numpy, the sketch's buckets, error feedback."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from p2psync.compress import kernels as K
from p2psync.compress.base import WARM_VALUES
from p2psync.compress import ErrorFeedback, Fp16, Int8Uniform, NoCodec, Sketch8, Sketch8Paper, codec_usage, get_codec
from p2psync.errors import ConfigError, ProtocolError
from p2psync.topology import mesh
from tests.helpers import gated, make_trainer

floats = hnp.arrays(np.float32, st.integers(0, 3000),
                    elements=st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False))


@settings(max_examples=80, deadline=None)
@given(floats)
def test_roundtrip_bounds(x):
    assert np.array_equal(NoCodec().roundtrip(x), x)
    if x.size == 0:
        for c in (Fp16(), Int8Uniform(), Sketch8()):
            assert c.roundtrip(x).size == 0
        return
    lo, hi = float(x.min()), float(x.max())
    np.testing.assert_allclose(Fp16().roundtrip(x), x, rtol=1e-3, atol=1e-3)
    # int8: within half a level
    step = (hi - lo) / 255
    assert np.abs(Int8Uniform().roundtrip(x) - x).max() <= step / 2 + 1e-3 * max(1, abs(hi), abs(lo))
    # sketch8: every value is decoded to a representative inside [min, max]
    y = Sketch8().roundtrip(x)
    assert y.min() >= lo - 1e-3 * max(1, abs(lo)) and y.max() <= hi + 1e-3 * max(1, abs(hi))
    # constant pieces are exact
    c = np.full(17, x[0], dtype=np.float32)
    for codec in (Int8Uniform(), Sketch8()):
        np.testing.assert_allclose(codec.roundtrip(c), c, rtol=1e-6)


@pytest.mark.parametrize("codec", [Int8Uniform, Sketch8, Sketch8Paper])
def test_numba_and_numpy_paths_agree(codec):
    x = (np.random.default_rng(0).standard_t(2, 50_001) * 1e-3).astype(np.float32)
    a = codec(use_numba=True).encode(x)
    b = codec(use_numba=False).encode(x)
    for u, v in zip(a, b):
        np.testing.assert_allclose(u.astype(np.float64), v.astype(np.float64), rtol=1e-5, atol=1e-9)
    np.testing.assert_array_equal(codec(use_numba=True).decode(a, x.size), codec(use_numba=False).decode(a, x.size))


def test_sketch_paper_mode_equal_mass_and_midpoints():
    x = np.random.default_rng(1).standard_normal(200_000).astype(np.float32)
    c = Sketch8(boundaries="quantile", representative="mid")
    codes, reps = c.encode(x)
    counts = np.bincount(codes, minlength=256)
    # Step 1: nearly equal mass (sampled quantiles: within a few sigma of n/256)
    assert counts.min() > 0.6 * x.size / 256 and counts.max() < 1.4 * x.size / 256
    # Step 2: the representative is the mean of the bucket's start and end quantiles
    q = c.quantiles(x)
    np.testing.assert_allclose(reps, (q[:-1] + q[1:]) / 2, rtol=1e-6)
    assert codes.dtype == np.uint8  # Step 3: one byte per value


@pytest.mark.parametrize("use_numba", [True, False])
def test_the_specs_worked_sketch_example(use_numba):
    """Spec §2.4 / C13 with the paper's sketch: g = [0.5, −2, 0.1, 3, −0.3, 0, 1.2, −0.8], B = 4
    (2 bits): q = [−2, −0.3, 0.1, 1.2, 3], codes [2, 0, 2, 3, 1, 1, 3, 0] (equi-depth: 2 per
    bucket), representatives the midpoints [−1.15, −0.1, 0.65, 2.1], largest error 0.9 (half
    the last bucket)."""
    g = np.array([0.5, -2.0, 0.1, 3.0, -0.3, 0.0, 1.2, -0.8], np.float32)
    c = Sketch8Paper(bits=2, use_numba=use_numba)
    np.testing.assert_allclose(c.quantiles(g), [-2.0, -0.3, 0.1, 1.2, 3.0])
    packed, reps = c.encode(g)
    assert packed.nbytes == 2  # 8 codes x 2 bits
    codes = c.decode([packed, np.arange(4, dtype=np.float32)], g.size)  # the table 0..3 reads the codes
    assert codes.tolist() == [2, 0, 2, 3, 1, 1, 3, 0]
    assert np.bincount(codes.astype(int), minlength=4).tolist() == [2, 2, 2, 2]
    np.testing.assert_allclose(reps, [-1.15, -0.1, 0.65, 2.1], rtol=1e-6)
    out = c.decode([packed, reps], g.size)
    np.testing.assert_allclose(out, [0.65, -1.15, 0.65, 2.1, -0.1, -0.1, 2.1, -1.15], rtol=1e-6)
    assert float(np.abs(out - g).max()) == pytest.approx(0.9, rel=1e-6)


def test_the_paper_sketch_is_a_codec_of_its_own():
    """``sketch8p[:BITS]`` selects the paper-exact variant (spec §2: the paper's sketch vs
    p2psync's default ``sketch8``) wherever a codec is named (``--codec``)."""
    c = get_codec("sketch8p")
    assert isinstance(c, Sketch8Paper) and c.spec == "sketch8p" and c.bits == 8
    assert (c.boundaries, c.representative) == ("quantile", "mid")
    six = get_codec("sketch8p:6")
    assert isinstance(six, Sketch8Paper) and six.spec == "sketch8p:6" and six.bits == 6
    assert six.representative == "mid"
    default = get_codec("sketch8")
    assert not isinstance(default, Sketch8Paper) and (default.boundaries, default.representative) == ("hybrid", "mean")
    assert "sketch8p[:BITS|:auto[=TOL]]" in codec_usage()
    x = np.random.default_rng(4).standard_t(3, 5000).astype(np.float32)
    assert np.array_equal(c.roundtrip(x), Sketch8(boundaries="quantile", representative="mid").roundtrip(x))
    for bad in ("sketch8p:9", "sketch8p:x"):
        with pytest.raises(ConfigError, match="sketch8p"):
            get_codec(bad)


def _real_gradients():
    out = []
    for model in ("mlp", "cnn"):
        async def go(model=model):
            grads = []
            async with gated([make_trainer(mesh(1), 0, model=model)]) as (tr,):
                for k in range(12):
                    _, g = await tr.compute_gradients()
                    await tr.apply_gradients(g)
                    grads.append(g)
            return grads

        out += asyncio.run(go())[::4]
    return out


def _rel(x, y):
    x = x.astype(np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(x))


def test_sketch8_beats_int8_on_heavy_tailed_data():
    rng = np.random.default_rng(2)
    samples = _real_gradients() + [(rng.standard_t(2, 200_000) * 1e-3).astype(np.float32)]
    for g in samples:
        assert _rel(g, Sketch8().roundtrip(g)) < _rel(g, Int8Uniform().roundtrip(g))


def test_error_feedback_accumulated_sum_converges():
    rng = np.random.default_rng(3)
    codec = Sketch8()
    fb = ErrorFeedback()
    true_sum = np.zeros(5000)
    with_fb = np.zeros(5000)
    without = np.zeros(5000)
    errs = []
    for t in range(200):
        x = (rng.standard_t(2, 5000) * 1e-2).astype(np.float32) + 1e-3  # biased, heavy-tailed
        true_sum += x
        without += codec.roundtrip(x)
        comp = fb.compensate("k", x)
        dec = codec.decode(codec.encode(comp), comp.size)
        fb.record("k", comp, dec)
        with_fb += dec
        errs.append(np.abs(with_fb - true_sum).max())
    # with feedback the error of the running sum stays bounded by one step's residual
    assert np.abs(with_fb - true_sum).max() <= np.abs(fb.residual["k"]).max() + 1e-4
    assert np.linalg.norm(with_fb - true_sum) < 0.2 * np.linalg.norm(without - true_sum)


def test_warm_runs_encode_and_both_decodes_the_wire_can_give():
    """Codec.warm (what the runtime and Canary call before the first step) encodes one float32
    piece and decodes the payload as it is and read-only, as it arrives from the wire: numba
    compiles those two separately, so a warmed codec loads nothing in its first exchange."""
    calls = []

    class Recording(Sketch8):
        def encode(self, x):
            calls.append(("encode", x.dtype, x.size, x.flags.writeable))
            return super().encode(x)

        def decode(self, arrays, n):
            calls.append(("decode", n, tuple(a.flags.writeable for a in arrays)))
            return super().decode(arrays, n)

    Recording(bits=5).warm()
    n = WARM_VALUES
    assert n >= K.RADIX_MIN
    assert calls == [("encode", np.dtype(np.float32), n, True), ("decode", n, (True, True)),
                     ("decode", n, (False, False))]
    widths = []

    class Widths(Sketch8):
        def encode(self, x):
            enc = super().encode(x)
            widths.append(enc[1].size)
            return enc

    Widths(tol=Sketch8.AUTO_TOL).warm()
    assert widths[0] < 256 and widths[1] == 256  # auto: the piece's narrow code, then the widest


def test_decode_rejects_wrong_payloads_and_bad_names():
    with pytest.raises(ProtocolError):
        Sketch8().decode([np.zeros(3, np.uint8)], 3)
    with pytest.raises(ProtocolError):
        Int8Uniform().decode([np.zeros(3, np.uint8), np.zeros(2, np.float64)], 3)
    with pytest.raises(ConfigError):
        get_codec("zip")
    with pytest.raises(ConfigError):
        Sketch8(sample=10)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_sketch_with_fewer_bits(bits):
    """Canary §4.3.1's "fewer and flexible bits": 2**bits buckets, codes packed into bits bits,
    order-preserving, every value decoded to its bucket's representative within [min, max]."""
    rng = np.random.default_rng(bits)
    x = rng.standard_t(3, 1001).astype(np.float32)
    c = get_codec(f"sketch8:{bits}")
    enc = c.encode(x)
    assert enc[0].nbytes == (x.size * bits + 7) // 8 and enc[1].size == 2 ** bits
    y = c.decode(enc, x.size)
    assert y.min() >= x.min() and y.max() <= x.max()
    order = np.argsort(x, kind="stable")
    assert (np.diff(y[order]) >= 0).all()  # order-preserving
    assert len(np.unique(y)) <= 2 ** bits
    assert c.spec == ("sketch8" if bits == 8 else f"sketch8:{bits}")
    if bits == 8:
        assert np.array_equal(y, Sketch8().roundtrip(x))


def test_sketch_bit_widths_are_checked():
    for bad in ("0", "9", "x", "4.5"):
        with pytest.raises(ConfigError, match="bit width"):
            get_codec(f"sketch8:{bad}")
    with pytest.raises(ProtocolError):
        get_codec("sketch8:4").decode([np.zeros(3, np.uint8), np.zeros(16, np.float32)], 10)  # 10 x 4 bits = 5 bytes


@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6, 8])
def test_the_error_estimate_is_the_sketch_error_of_the_sample(bits, hybrid):
    """kernels.sketch_error (numba) and its numpy twin give the relative L2 error of sketching
    the sample itself (a piece no larger than the sample is its own sample), for both
    representatives; kernels.sketch_bounds is exactly the encoder's boundaries."""
    x = np.random.default_rng(bits).standard_t(3, 4000).astype(np.float32)
    x[:50] = 0.0  # ties across bucket boundaries
    for rep in ("mean", "mid"):
        c = Sketch8(bits=bits, representative=rep, boundaries="hybrid" if hybrid else "quantile", use_numba=False)
        lo, hi, s = c._sample(x)
        assert s.size == x.size
        q = K.sketch_bounds_np(s, lo, hi, bits, hybrid)
        qk = np.empty(2 ** bits + 1, np.float32)
        K.sketch_bounds(s, lo, hi, bits, hybrid, qk)
        assert np.array_equal(q, qk) and np.array_equal(q, c.quantiles(x))
        fast = Sketch8(bits=bits, representative=rep, boundaries=c.boundaries, use_numba=True)
        assert np.array_equal(q, fast.quantiles(x))  # the numba path: radix-sorted sample, kernel bounds
        want = _rel(x, c.roundtrip(x))
        assert K.sketch_error_np(s, q, rep == "mid") == pytest.approx(want, rel=1e-5)
        assert K.sketch_error(s, q, bits, rep == "mid") == pytest.approx(want, rel=1e-5)


def test_auto_width_takes_the_fewest_bits_within_the_tolerance():
    """sketch8:auto (§4.3.1 "fewer and flexible bits ... according to the property of different
    layers"): a Gaussian piece gets fewer bits than a heavy-tailed one, each the fewest whose
    sketch of the sample is within TOL; on a piece no larger than the sample (its own sample)
    the real error is then within TOL, on a larger one close to it; a zero piece gets the
    narrowest width."""
    rng = np.random.default_rng(7)
    pieces = {"normal": rng.standard_normal(50_000).astype(np.float32),
              "t2": rng.standard_t(2, 50_000).astype(np.float32),
              "t1 small": rng.standard_t(1, 16_000).astype(np.float32),
              "outliers": np.where(rng.random(262_144) < 0.002, 100.0, 1.0).astype(np.float32)
              * rng.standard_normal(262_144).astype(np.float32)}
    for tol in (0.05, 0.1, 0.2):
        c = get_codec(f"sketch8:auto={tol}")
        assert isinstance(c, Sketch8) and c.tol == tol
        for name, x in pieces.items():
            enc = c.encode(x)
            bits = int(np.log2(enc[1].size))
            assert enc[0].nbytes == (x.size * bits + 7) // 8
            lo, hi, s = c._sample(x)

            def err(w):
                return K.sketch_error_np(s, K.sketch_bounds_np(s, lo, hi, w, True), False)

            assert bits == K.auto_bits_np(s, lo, hi, True, False, tol, Sketch8.AUTO_MIN_BITS, 8), name
            assert all(err(w) > tol for w in range(Sketch8.AUTO_MIN_BITS, bits)), name  # none narrower fits
            real = _rel(x, c.decode(enc, x.size))
            if err(bits) > tol:
                assert bits == 8, name  # nothing was within: the widest
            elif x.size <= c.sample:
                assert real <= tol * (1 + 1e-5), (name, real)
            else:
                assert real <= tol * 1.25, (name, real)
    auto = get_codec("sketch8:auto")
    widths = {k: int(np.log2(auto.encode(x)[1].size)) for k, x in pieces.items()}
    assert widths["normal"] < widths["t2"] <= 8
    assert auto.encode(np.zeros(1000, np.float32))[1].size == 2 ** Sketch8.AUTO_MIN_BITS
    assert auto.encode(np.zeros(0, np.float32))[1].size == 2 ** Sketch8.AUTO_MIN_BITS
    assert auto.roundtrip(np.zeros(0, np.float32)).size == 0


@settings(max_examples=60, deadline=None)
@given(floats)
def test_auto_width_roundtrips_any_piece(x):
    """Empty, tiny, constant or wide pieces: the width is 2-8 bits, both paths agree, and every
    value decodes to a representative within [min, max], order kept."""
    a, b = Sketch8(tol=0.1), Sketch8(tol=0.1, use_numba=False)
    enc_a, enc_b = a.encode(x), b.encode(x)
    assert all(np.array_equal(p, q) for p, q in zip(enc_a, enc_b))
    assert enc_a[1].size in (4, 8, 16, 32, 64, 128, 256)
    y = a.decode(enc_a, x.size)
    assert y.size == x.size
    if x.size:
        assert y.min() >= x.min() and y.max() <= x.max()
        order = np.argsort(x, kind="stable")
        assert (np.diff(y[order]) >= 0).all()


def test_auto_width_is_read_from_the_payload():
    """A receiver decodes any width from the table's size, whatever its own tolerance; a table
    that is not a power of two, wider than 8 bits, or codes of the wrong length are refused."""
    x = np.random.default_rng(3).standard_normal(3001).astype(np.float32)
    sender, receiver = get_codec("sketch8:auto=0.3"), get_codec("sketch8:auto")
    enc = sender.encode(x)
    assert enc[1].size < 256
    assert np.array_equal(receiver.decode(enc, x.size), sender.decode(enc, x.size))
    for bits in range(1, 9):  # fixed widths decode through auto too
        enc = get_codec(f"sketch8:{bits}").encode(x)
        assert np.array_equal(receiver.decode(enc, x.size), get_codec(f"sketch8:{bits}").decode(enc, x.size))
    for bad in ([np.zeros(1501, np.uint8), np.zeros(12, np.float32)],      # 12 is no power of two
                [np.zeros(3001, np.uint8), np.zeros(512, np.float32)],     # 9 bits
                [np.zeros(1500, np.uint8), np.zeros(16, np.float32)],      # 3001 x 4 bits = 1501 bytes
                [np.zeros(5, np.uint8), np.zeros(0, np.float32)],          # no table
                [np.zeros(376, np.uint8), np.zeros(1, np.float32)],        # 0 bits
                [np.zeros(376, np.uint8)]):                                # one array
        with pytest.raises(ProtocolError):
            receiver.decode(bad, x.size)


def test_auto_specs_are_checked():
    assert get_codec("sketch8:auto").spec == "sketch8:auto"
    assert get_codec("sketch8:auto=0.05").spec == "sketch8:auto=0.05"
    assert get_codec("sketch8p:auto").spec == "sketch8p:auto"
    odd = get_codec("sketch8:auto=0.123456789")
    assert get_codec(odd.spec).tol == odd.tol == 0.123456789  # the spec round-trips exactly
    for bad in ("auto=0", "auto=1", "auto=-0.1", "auto=2"):
        with pytest.raises(ConfigError, match="between 0 and 1"):
            get_codec(f"sketch8:{bad}")
    for bad in ("auto=x", "auto=", "auto=nan"):
        with pytest.raises(ConfigError, match="tolerance must be"):
            get_codec(f"sketch8:{bad}")
    with pytest.raises(ConfigError, match="bit width"):
        get_codec("sketch8:autox")
    assert "sketch8[:BITS|:auto[=TOL]]" in codec_usage()


def test_the_wire_accepts_exactly_the_codecs_the_compress_registry_knows():
    """One vocabulary, two homes that must agree: a codec added to p2psync.compress without the
    wire's CODECS would have its frames refused on receipt, and the reverse accepts frames
    nobody can decode. ``raw`` is the wire's marker for frames that are not a tensor codec's."""
    from p2psync.compress import CODECS as COMPRESS_CODECS
    from p2psync.wire import CODECS as WIRE_CODECS

    assert set(COMPRESS_CODECS) == WIRE_CODECS - {"raw"}
    assert "raw" not in COMPRESS_CODECS

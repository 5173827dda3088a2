"""Piece codecs: ``none``, ``fp16``, ``int8`` (uniform min/max), ``sketch8`` (Canary's gradient
sketch, *Canary* §4.3.1) and ``sketch8p`` (the same sketch exactly as the paper
describes it: quantile boundaries, midpoint representatives), plus error feedback for any lossy codec, and the
registry ``CODECS`` / :func:`get_codec` (which also knows ``topk[:FRACTION]``, the sparsifying
codec of :mod:`p2psync.compress.topk`, and ``e3m0[:BLOCK][:sr]``, the 4-bit floats of
:mod:`p2psync.compress.e3m0`). Pure.

A codec turns one float32 piece into a few arrays for the wire and back. ``sketch8`` follows the
paper's three steps:

1. *Quantiles split the piece into buckets of (nearly) equal mass.* Exact quantiles need a sort
   (O(n log n), far too slow for MiB pieces), so the quantiles are those of a strided sample of
   at most ``sample`` values (default 16384; a numba radix sort takes ~0.1 ms, numpy's
   quicksort 0.3-0.5 ms here) and the outer boundaries are the piece's exact min and max
   (one pass). With a sample of m values each bucket's mass
   is within O(1/sqrt(m)) of its target. ``boundaries="quantile"`` uses 255 such quantiles,
   exactly as the paper. Gradients are heavy-tailed, and a few large values dominate the L2
   norm; equal-mass buckets leave those in a handful of very wide tail buckets. The default
   ``boundaries="hybrid"`` therefore merges 127 equal-mass quantiles with 128 evenly spaced
   levels over [min, max], so no bucket is wider than (max - min) / 128 while the dense middle
   keeps quantile resolution. Measured relative L2 error (``python -m bench.codecs``; real
   gradients of the MLP/CNN/ResNet-18 models and Student-t(2) data): quantile 0.15-0.61,
   int8 uniform 0.011-0.35, hybrid 0.010-0.080, below int8 on every input.
2. *Each bucket is represented by one value.* The paper takes the mean of the bucket's start
   and end quantiles (``representative="mid"``). At the tails that is a poor choice: the
   outermost buckets stretch from the last sampled quantile to the piece's extreme value, and
   every value in them is sent as the midpoint of that long interval (measured on real CNN
   gradients: relative L2 error 0.41, worse than int8's 0.03). The default here is the mean
   of the values that fell into the bucket (``representative="mean"``), the L2-optimal value
   for the same buckets, accumulated in the same pass at no extra cost.
3. *Each value is sent as its one-byte bucket index*, with the 256 float32 representatives
   (1 KiB) alongside: 4x less traffic for a 1 MiB piece.

``sketch8:BITS`` sends BITS bits per value (§4.3.1's "fewer and flexible bits"), and
``sketch8:auto[=TOL]`` chooses BITS per piece: the fewest whose sketch keeps the piece's
relative L2 error within TOL (0.1 by default), estimated on the sorted sample (Canary:
``--opt sketch_bits=0``).

``sketch8p[:BITS]`` is the paper-exact variant (``boundaries="quantile"``,
``representative="mid"``), for
comparing the paper's sketch with p2psync's default on a run (``--codec sketch8p``).

Decoding is a table lookup. All hot loops are numba kernels (``kernels.py``); the bucket search
goes through a per-piece table indexed by the value's float32 bit pattern
(:func:`~p2psync.compress.kernels.bucketize_keyed`), exactly the 8-step search's codes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from p2psync.compress import kernels as K
from p2psync.compress.base import Codec
from p2psync.compress.base import expect_arrays as _expect
from p2psync.compress.e3m0 import E3M0
from p2psync.compress.topk import TopK
from p2psync.errors import ConfigError

FP16_MAX = float(np.finfo(np.float16).max)


class NoCodec(Codec):
    """The identity codec ``none``: the float32 piece goes out as is (lossless)."""

    name = "none"
    lossy = False

    def encode(self, x: np.ndarray) -> list[np.ndarray]:
        """``[x]``, not copied."""
        return [x]

    def decode(self, arrays: Sequence[np.ndarray], n: int) -> np.ndarray:
        """The one float32 array of ``n`` values (ProtocolError otherwise)."""
        _expect(arrays, [(np.dtype(np.float32), n)], self.name)
        return arrays[0]


class Fp16(Codec):
    """float32 -> float16, round to nearest even, values beyond float16's range clamped to
    +-65504 (NaN stays NaN). numpy's float32 -> float16 cast is scalar code (~0.5 GB/s); torch's
    is vectorized (F16C), so a writable input is cast by torch and clamped in float16 afterwards
    (bit-identical to clip-then-cast: a value that rounds to inf is clamped to 65504 either way).
    torch is imported on first use only (the training process has it loaded already)."""

    name = "fp16"

    def encode(self, x: np.ndarray) -> list[np.ndarray]:
        """``[x as float16]``, clamped to float16's range."""
        if x.flags.writeable and x.flags.c_contiguous and x.dtype == np.float32:
            import torch  # a hard dependency of the package; imported lazily for start-up time

            h = torch.from_numpy(x).to(torch.float16).clamp_(-FP16_MAX, FP16_MAX)
            return [h.numpy()]
        return [np.clip(x, -FP16_MAX, FP16_MAX).astype(np.float16)]

    def decode(self, arrays: Sequence[np.ndarray], n: int) -> np.ndarray:
        """The float16 array of ``n`` values widened to float32."""
        _expect(arrays, [(np.dtype(np.float16), n)], self.name)
        return arrays[0].astype(np.float32)


class Int8Uniform(Codec):
    """256 evenly spaced levels between the piece's min and max."""

    name = "int8"

    def __init__(self, *, use_numba: bool = True) -> None:
        self.use_numba = use_numba

    def encode(self, x: np.ndarray) -> list[np.ndarray]:
        """``[uint8 codes, float32 [min, step]]``: each value as the nearest of 256 levels."""
        if x.size == 0:
            return [np.empty(0, np.uint8), np.zeros(2, np.float32)]
        lo, hi = K.minmax_fast(x) if self.use_numba else (float(x.min()), float(x.max()))
        scale = (hi - lo) / 255.0
        inv = 1.0 / scale if scale > 0 else 0.0
        if self.use_numba:
            codes = np.empty(x.size, np.uint8)
            K.quantize_uniform(x, float(lo), float(inv), codes)
        else:
            codes = K.quantize_uniform_np(x, float(lo), float(inv))
        return [codes, np.array([lo, scale], dtype=np.float32)]

    def decode(self, arrays: Sequence[np.ndarray], n: int) -> np.ndarray:
        """``min + step * code`` for each of the ``n`` codes."""
        _expect(arrays, [(np.dtype(np.uint8), n), (np.dtype(np.float32), 2)], self.name)
        lo, scale = arrays[1]
        table = (lo + scale * np.arange(256, dtype=np.float32)).astype(np.float32)
        return _lookup(arrays[0], table, self.use_numba)


def _lookup(codes: np.ndarray, table: np.ndarray, use_numba: bool) -> np.ndarray:
    if not use_numba:
        return K.lookup_np(codes, table)
    out = np.empty(codes.size, np.float32)
    K.lookup(codes, table, out)
    return out


class Sketch8(Codec):
    """Canary's gradient sketch: 256 equal-mass quantile buckets, one byte per value.

    ``sketch8:BITS`` (1..8) uses ``2**BITS`` buckets and packs the codes into BITS bits each
    (the paper's "fewer and flexible bits (instead of the fixed 8 bits)", §4.3.1): 6 bits send
    0.75 byte per value; the representatives table has 2**BITS floats.

    ``sketch8:auto[=TOL]`` chooses the width per piece "according to the property" of the data
    (§4.3.1): the fewest bits, from 2 to 8, whose sketch of the piece's sorted sample has a
    relative L2 error ``|x - decode(x)| / |x|`` of at most TOL (default 0.1, i.e. at most 1 % of
    the piece's energy is left for error feedback to carry into the next round). The error of a
    width is that of sketching the sorted sample (exact for a piece no larger than the sample),
    in one pass over it (:func:`~p2psync.compress.kernels.auto_bits`), from 2 bits up. One
    width per piece, and per hop (a forwarded partial sum is sketched afresh): a finer grain
    than the spec's reading of §4.3.1, one width per colayer (spec §2.1).
    The width travels implicitly: the representatives table has 2**BITS entries, and the codes
    are packed BITS bits each, so a receiver needs no option to decode."""

    name = "sketch8"
    usage = "sketch8[:BITS|:auto[=TOL]]"
    #: ``sketch8:auto`` without ``=TOL``: relative L2 error allowed per piece
    AUTO_TOL = 0.1
    #: the narrowest width ``auto`` chooses
    AUTO_MIN_BITS = 2

    def __init__(self, *, sample: int = 16384, boundaries: str = "hybrid",
                 representative: str = "mean", use_numba: bool = True, bits: int = 8,
                 tol: float | None = None) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise ConfigError(f"codec {self.name}: the bit width must be 1 to 8, got {bits!r}")
        if tol is not None and not (isinstance(tol, (int, float)) and 0.0 < tol < 1.0):
            raise ConfigError(f"codec {self.name}:auto: the tolerance must be between 0 and 1, got {tol!r}")
        #: the width (``auto``: the widest it may choose)
        self.bits = bits
        self.buckets = 1 << bits
        #: ``auto``'s relative error bound; None for a fixed width
        self.tol = None if tol is None else float(tol)
        if sample < 256:
            raise ConfigError("sketch8 needs a sample of at least 256 values")
        if representative not in ("mean", "mid"):
            raise ConfigError("sketch8 representative must be 'mean' or 'mid'")
        if boundaries not in ("hybrid", "quantile"):
            raise ConfigError("sketch8 boundaries must be 'hybrid' or 'quantile'")
        self.sample = sample
        self.boundaries = boundaries
        self.representative = representative
        self.use_numba = use_numba

    @classmethod
    def with_param(cls, param: str) -> Sketch8:
        """The codec for ``sketch8:BITS`` (BITS 1..8) or ``sketch8:auto[=TOL]`` (0 < TOL < 1);
        ConfigError naming the spec for anything else; via :func:`get_codec`."""
        if param == "auto" or param.startswith("auto="):
            text = param.partition("=")[2]
            try:
                tol = float(text) if param != "auto" else cls.AUTO_TOL
            except ValueError:
                raise ConfigError(f"codec {cls.name}:{param}: the tolerance must be a number") from None
            return cls(tol=tol)
        try:
            bits = int(param)
        except ValueError:
            raise ConfigError(f"codec {cls.name}:{param}: the bit width must be a whole number 1 to 8, "
                              "or auto[=TOL]") from None
        return cls(bits=bits)

    @property
    def spec(self) -> str:
        """``sketch8`` at 8 bits, ``sketch8:BITS``, or ``sketch8:auto[=TOL]``."""
        if self.tol is not None:
            return f"{self.name}:auto" + ("" if self.tol == self.AUTO_TOL else f"={self.tol!r}")
        return self.name if self.bits == 8 else f"{self.name}:{self.bits}"

    def _sample(self, x: np.ndarray) -> tuple[float, float, np.ndarray]:
        """The piece's exact min and max, and its sorted strided sample (at most ``sample`` values)."""
        lo, hi = K.minmax_fast(x) if self.use_numba else (float(x.min()), float(x.max()))
        stride = max(1, -(-x.size // self.sample))  # ceil: at most ``sample`` values are sorted
        m = -(-x.size // stride)
        if not self.use_numba or m < K.RADIX_MIN or x.dtype != np.float32 or not x.flags.c_contiguous:
            return lo, hi, K.sorted_sample_np(x, stride)
        s = np.empty(m, np.float32)
        K.sorted_sample(x, stride, s)
        return lo, hi, s

    def _bounds(self, lo: float, hi: float, s: np.ndarray, bits: int) -> np.ndarray:
        """B + 1 boundaries q_0 = min <= q_1 <= ... <= q_B = max for B = 2**bits, from the sorted sample."""
        if not self.use_numba:
            return K.sketch_bounds_np(s, lo, hi, bits, self.boundaries == "hybrid")
        q = np.empty((1 << bits) + 1, np.float32)
        K.sketch_bounds(s, lo, hi, bits, self.boundaries == "hybrid", q)
        return q

    def quantiles(self, x: np.ndarray) -> np.ndarray:
        """B + 1 boundaries q_0 = min <= q_1 <= ... <= q_B = max (Step 1; B = 2**bits)."""
        lo, hi, s = self._sample(x)
        return self._bounds(lo, hi, s, self.bits)

    def choose_bits(self, s: np.ndarray, lo: float, hi: float, tol: float) -> int:
        """``auto``'s width for a piece with sorted sample ``s``: the fewest bits within ``tol``
        on the sample (``bits`` when none is), every width tried from the narrowest up."""
        args = (s, lo, hi, self.boundaries == "hybrid", self.representative == "mid", tol,
                self.AUTO_MIN_BITS, self.bits)
        return int(K.auto_bits(*args) if self.use_numba else K.auto_bits_np(*args))

    @staticmethod
    def _nbytes(n: int, bits: int) -> int:
        return (n * bits + 7) // 8

    def encode(self, x: np.ndarray) -> list[np.ndarray]:
        """``[codes packed BITS bits each, float32 representatives (2**BITS)]``: the three steps
        of the module docstring (``auto``: BITS chosen for this piece first)."""
        if x.size == 0:
            narrowest = self.buckets if self.tol is None else 1 << self.AUTO_MIN_BITS
            return [np.empty(0, np.uint8), np.zeros(narrowest, np.float32)]
        lo, hi, s = self._sample(x)
        bits = self.bits if self.tol is None else self.choose_bits(s, lo, hi, self.tol)
        b = 1 << bits
        q = self._bounds(lo, hi, s, bits)
        bounds = np.empty(b, np.float32)
        bounds[:b - 1] = q[1:-1]
        bounds[b - 1] = np.inf
        sums: np.ndarray
        counts: np.ndarray
        if self.use_numba:  # Step 3: the bucket index (and bucket sums for Step 2)
            codes = np.empty(x.size, np.uint8)
            sums = np.zeros(256, np.float64)
            counts = np.zeros(256, np.int64)
            lo, hi = float(q[0]), float(q[-1])
            if b == 256:
                K.bucketize_keyed(x, bounds, lo, hi, codes, sums, counts)
            else:  # the 8-halving search over each boundary repeated 256/B times: index = 256/B x bucket
                r = 256 // b
                wide = np.full(256, np.inf, np.float32)
                wide[:(b - 1) * r] = np.repeat(bounds[:b - 1], r)
                K.bucketize_keyed(x, wide, lo, hi, codes, sums, counts)
                codes >>= 8 - bits
                sums, counts = sums[::r], counts[::r]
        else:
            codes = np.searchsorted(bounds[:b - 1], x, side="right").astype(np.uint8)
            counts = np.bincount(codes, minlength=b).astype(np.int64)
            sums = np.bincount(codes, weights=x.astype(np.float64), minlength=b)
        mid = (q[:-1] + q[1:]) * 0.5  # Step 2 as in the paper
        if self.representative == "mid":
            reps = mid
        else:
            reps = np.where(counts > 0, sums / np.maximum(counts, 1), mid)
        if bits < 8:
            packed = np.zeros(self._nbytes(x.size, bits), np.uint8)
            K.pack_bits(codes, bits, packed)
            codes = packed
        return [codes, reps.astype(np.float32)]

    def warm(self) -> None:
        """:meth:`Codec.warm`; ``auto`` also at its widest code, which a Gaussian piece does
        not reach (its 8-bit search and lookup are kernels of their own)."""
        super().warm()
        if self.tol is not None:
            type(self)(sample=self.sample, use_numba=self.use_numba, bits=self.bits).warm()

    def _width(self, arrays: Sequence[np.ndarray]) -> int:
        """The width a payload was encoded with: fixed, or (``auto``) read from the table's size."""
        if self.tol is None or len(arrays) != 2:
            return self.bits
        size = arrays[1].size
        if 2 <= size <= 1 << self.bits and size & (size - 1) == 0:  # 2**bits, 1 <= bits <= self.bits
            return size.bit_length() - 1
        return self.bits  # a bad table fails the shape check below

    def decode(self, arrays: Sequence[np.ndarray], n: int) -> np.ndarray:
        """Each of the ``n`` codes looked up in the representatives table."""
        bits = self._width(arrays)
        _expect(arrays, [(np.dtype(np.uint8), self._nbytes(n, bits)), (np.dtype(np.float32), 1 << bits)], self.spec)
        if bits == 8:
            return _lookup(arrays[0], arrays[1], self.use_numba)
        out = np.empty(n, np.float32)
        K.unpack_lookup(np.ascontiguousarray(arrays[0]), bits, np.ascontiguousarray(arrays[1]), out)
        return out


class Sketch8Paper(Sketch8):
    """Canary's gradient sketch as the paper gives it (§4.3.1; spec §2.2): ``2**BITS``
    equal-mass buckets between sampled quantiles (no evenly spaced levels merged in), every
    value sent as the midpoint of its bucket's boundaries (not the mean of its values).
    ``sketch8`` is p2psync's default variant (see the module docstring for why, and
    ``python -m bench.codecs`` for the errors of both); this one reproduces the paper."""

    name = "sketch8p"
    usage = "sketch8p[:BITS|:auto[=TOL]]"

    def __init__(self, *, sample: int = 16384, use_numba: bool = True, bits: int = 8,
                 tol: float | None = None) -> None:
        super().__init__(sample=sample, boundaries="quantile", representative="mid", use_numba=use_numba,
                         bits=bits, tol=tol)


CODECS: dict[str, type[Codec]] = {c.name: c for c in (NoCodec, Fp16, Int8Uniform, Sketch8, Sketch8Paper, TopK, E3M0)}


def codec_usage() -> str:
    """The known codecs as written on the command line: ``none, fp16, ..., topk[:FRACTION]``."""
    return ", ".join(c.usage or c.name for c in CODECS.values())


def get_codec(spec: str) -> Codec:
    """The codec ``spec`` names: a registry name, or ``name:PARAM`` for a codec with a parameter
    (``topk:0.01``). ConfigError naming the spec for anything else."""
    name, sep, param = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if name not in CODECS:
        raise ConfigError(f"unknown codec {spec!r} (choose from {codec_usage()})")
    return CODECS[name].with_param(param) if sep else CODECS[name]()


class ErrorFeedback:
    """Adds what a lossy codec failed to send last time to the next contribution (per key).

    ``compensate(key, x)`` returns x + residual[key]; ``record(key, sent, decoded)`` stores
    sent - decoded. Over many steps the sum of what was decoded tracks the sum of the inputs.

    Example, asgd.py: ``x = self.feedback.compensate("asgd", grad)``, ``enc =
    self.codec.encode(x)``, ``self.feedback.record("asgd", x, self.codec.decode(enc, x.size))``;
    the collectives keep one per node, keyed by operation family and piece.
    """

    def __init__(self) -> None:
        self.residual: dict[object, np.ndarray] = {}

    def compensate(self, key: object, x: np.ndarray) -> np.ndarray:
        """``x`` plus the residual recorded under ``key`` (a new array; the residual is ignored
        when its shape differs)."""
        r = self.residual.get(key)
        return x + r if r is not None and r.shape == x.shape else x.copy()

    def record(self, key: object, sent: np.ndarray, decoded: np.ndarray) -> None:
        """Keep ``sent - decoded`` under ``key`` for the next :meth:`compensate`."""
        self.residual[key] = sent - decoded

"""``e3m0[:B][:sr]``: 4-bit floats (1 sign bit, 3 exponent bits, no mantissa) with one float32
scale per block of B values (default 128): the 4-bit outer gradients of Streaming DiLoCo; ``:sr``
rounds stochastically. Pure.

The format (the paper names it but fixes neither bias, zero, rounding nor scaling; p2psync's
choices):

* Per block of B values (blocks restart at each piece's start; the last may be shorter), the
  scale ``s`` is the block's largest magnitude, sent as float32 (0 for an all-zero block).
* Each value is a 4-bit code ``(sign << 3) | e``: ``e = 0`` is zero (the sign ignored; the
  encoder writes 0b0000), ``e = 1..7`` is ``(-1)**sign * s * 2**(e - 7)``: the magnitudes
  s/64, s/32, ..., s/2, s. No infinities or NaNs.
* Encoding rounds to the nearest level, ties toward the smaller magnitude: the thresholds are
  s/128 (between 0 and s/64) and 1.5 times each level s/64 .. s/2, computed in float32. They
  only steer the sender's choice; every receiver decodes the same bytes to the same values.
* ``e3m0:sr`` / ``e3m0:B:sr`` (stochastic rounding; spec §4.2's optional variant, not the
  default): between the adjacent levels L_lo <= |x| <= L_hi (L_lo = 0 below s/64), the code of
  L_hi with probability (|x| - L_lo) / (L_hi - L_lo), else L_lo's, so E[decoded] = x for every
  value (|x| <= s by the scale's definition), to within 2**-24 of the gap (24-bit draws) and
  float32's rounding of |x| / s. Every value decodes to one of its two adjacent levels: an
  error below their gap, at most max(|x|, s/64) (relative error below 1 from s/64 up, against
  round-to-nearest's 1/3), but unbiased where round-to-nearest is not (that flushes values up
  to s/128 to 0 and, for a density that falls between levels, leans toward the smaller).
* The random source of ``:sr`` is a pure function of the piece: a counter-based hash
  (splitmix64's finalizer ``mix``, identical in the numba kernel and its numpy twin). The
  piece's digest is the sum mod 2**64 of ``mix(pair_j + j * G)`` over its float32 bit patterns
  taken two at a time (``G``: splitmix64's increment), the seed ``mix(digest ^ mix(n + salt *
  G))``, and value i draws 24 bits of ``mix(seed + (i // 2 + 1) * G)`` (splitmix64's stream from
  that seed; the two values of a pair take bits 8..31 and 40..63). ``salt`` is 0 for every codec
  :func:`~p2psync.compress.get_codec` builds (tests pass others to draw independent encodings).
  This deviates from the spec's wording, a generator "seeded by (run seed, tag, piece, node)":
  ``Codec.encode`` sees only the piece (the collectives build a codec per operation from its
  spec and hand it nothing else), and threading that context through every codec would buy no
  more than the content gives. Runs repeat all the same: a run that repeats (same seed, data
  and schedule) encodes the same bytes at each (tag, piece, node), so it draws the same bits.
  Draws differ between pieces, steps and nodes because their contents differ (any bit of the
  piece changes every draw); two encodings of bitwise-equal pieces draw alike, as any encoder
  that is a function of its input would (their rounding errors are then correlated, never
  biased). And encoding stays a pure function of the piece: encoding it again gives the same
  bytes.
* Decoding does not depend on the rounding: ``e3m0:sr`` goes on the wire as codec ``e3m0``
  (``Codec.name``; the collectives check frames and operation signatures by name) and any
  ``e3m0`` receiver of the same block size decodes its bytes identically, so a member
  configured ``e3m0`` and one ``e3m0:sr`` would exchange harmlessly (a run's nodes agree on
  ``--codec`` and ``--opt`` anyway: both are in the configuration fingerprint checked at
  registration). The parameter store and Canary's exchange compare the full spec, and refuse a
  mix.
* Wire: ``[uint8 codes, two per byte (element 2j in the low nibble, an odd count padded with
  0), float32 scales]``: 4 + 32/B bits per value (4.25 at B = 128).
* Error per value (round to nearest): at most max(|x|/3, s/128) (relative 1/3 between s/64 and s; values up to
  s/128 flush to 0). Coarser than ``int8`` or ``sketch8``; meant for DiLoCo's outer gradients,
  averaged over replicas and filtered by the outer momentum, or with error feedback.

Sums of decoded contributions are accumulated in float32 by the collectives (the paper's "FP32
accumulation"); the owner of a reduced piece seals decode(encode(sum)), so every member holds
the same bits. Encoding a piece that holds NaN or infinity raises
:class:`~p2psync.errors.Diverged` (nothing is sent).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from p2psync.compress import kernels as K
from p2psync.compress.base import Codec, expect_arrays
from p2psync.errors import ConfigError, Diverged, ProtocolError

#: the block size ``e3m0`` alone means
DEFAULT_BLOCK = 128
#: the largest block size accepted
MAX_BLOCK = 1 << 20


class E3M0(Codec):
    """4-bit floats with a per-block float32 scale (see the module docstring); ``sr``: stochastic
    rounding (``e3m0:sr``). ``salt`` (0 to 2**64 - 1, default 0) is mixed into the stochastic
    draws' seed: for tests and benchmarks that want independent encodings of one vector; it is
    not part of the spec, and every codec :func:`~p2psync.compress.get_codec` builds has 0."""

    name = "e3m0"
    usage = "e3m0[:BLOCK][:sr]"

    def __init__(self, *, block: int = DEFAULT_BLOCK, sr: bool = False, salt: int = 0,
                 use_numba: bool = True) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_BLOCK:
            raise ConfigError(f"codec e3m0:{block}: the block size must be a whole number from 1 to {MAX_BLOCK}")
        if not isinstance(sr, bool):
            raise ConfigError(f"codec e3m0: sr must be True or False, got {sr!r}")
        if isinstance(salt, bool) or not isinstance(salt, int) or not 0 <= salt < 1 << 64:
            raise ConfigError(f"codec e3m0: the salt must be a whole number from 0 to 2**64 - 1, got {salt!r}")
        self.block = block
        #: stochastic rounding (``e3m0:sr``); else round to nearest
        self.sr = sr
        self.salt = salt
        self.use_numba = use_numba

    @classmethod
    def with_param(cls, param: str) -> E3M0:
        """``e3m0:BLOCK`` (values per scale), ``e3m0:sr`` or ``e3m0:BLOCK:sr`` (stochastic
        rounding); ConfigError naming the spec otherwise."""
        parts = param.split(":")
        sr = parts[-1] == "sr"
        if sr:
            parts.pop()
        if len(parts) > 1:
            raise ConfigError(f"codec e3m0:{param}: expected e3m0[:BLOCK][:sr] (e3m0:128:sr)")
        if not parts:
            return cls(sr=sr)
        text = parts[0]
        if not (text.isascii() and text.isdigit()):
            raise ConfigError(f"codec e3m0:{param}: the block size must be a whole number (e3m0:128)")
        if not 1 <= int(text) <= MAX_BLOCK:
            raise ConfigError(f"codec e3m0:{param}: the block size must be a whole number from 1 to {MAX_BLOCK}")
        return cls(block=int(text), sr=sr)

    @property
    def spec(self) -> str:
        """``e3m0``, ``e3m0:BLOCK``, ``e3m0:sr`` or ``e3m0:BLOCK:sr`` (the salt is not in it)."""
        base = self.name if self.block == DEFAULT_BLOCK else f"{self.name}:{self.block}"
        return f"{base}:sr" if self.sr else base

    def sizes(self, n: int) -> tuple[int, int]:
        """(code bytes, scales) of an ``n``-value piece."""
        return (n + 1) // 2, -(-n // self.block)

    def encode(self, x: np.ndarray) -> list[np.ndarray]:
        """``[uint8 codes, float32 scales]``; Diverged for a piece holding NaN or infinity."""
        nc, ns = self.sizes(x.size)
        codes = np.zeros(nc, np.uint8)
        scales = np.empty(ns, np.float32)
        if self.use_numba:
            xc = np.ascontiguousarray(x, dtype=np.float32)
            if self.sr:
                ok = K.e3m0_encode_sr(xc, self.block, np.uint64(self.salt), codes, scales)
            else:
                ok = K.e3m0_encode(xc, self.block, codes, scales)
        else:
            xf = np.asarray(x, np.float32)
            got = K.e3m0_encode_sr_np(xf, self.block, self.salt) if self.sr else K.e3m0_encode_np(xf, self.block)
            ok = got is not None
            if got is not None:
                codes, scales = got
        if not ok:
            raise Diverged("e3m0: a piece holding NaN or infinity cannot be encoded (not sent)")
        return [codes, scales]

    def decode(self, arrays: Sequence[np.ndarray], n: int) -> np.ndarray:
        """The ``n`` values; ProtocolError for arrays of the wrong shape or a scale that is not
        a finite number >= 0."""
        nc, ns = self.sizes(n)
        expect_arrays(arrays, [(np.dtype(np.uint8), nc), (np.dtype(np.float32), ns)], self.spec)
        codes, scales = arrays
        if ns and not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise ProtocolError("codec_payload", f"{self.spec}: a block scale is negative or not finite")
        if not self.use_numba:
            return K.e3m0_decode_np(codes, scales, self.block, n)
        out = np.empty(n, np.float32)
        K.e3m0_decode(np.ascontiguousarray(codes), np.ascontiguousarray(scales), self.block, out)
        return out


__all__ = ["DEFAULT_BLOCK", "E3M0", "MAX_BLOCK"]

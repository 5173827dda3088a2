"""``e3m0[:B]``: 4-bit floats (1 sign bit, 3 exponent bits, no mantissa) with one float32 scale
per block of B values (default 128): the 4-bit outer gradients of Streaming DiLoCo. Pure.

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
* Wire: ``[uint8 codes, two per byte (element 2j in the low nibble, an odd count padded with
  0), float32 scales]``: 4 + 32/B bits per value (4.25 at B = 128).
* Error per value: at most max(|x|/3, s/128) (relative 1/3 between s/64 and s; values up to
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
    """4-bit floats with a per-block float32 scale (see the module docstring)."""

    name = "e3m0"
    usage = "e3m0[:BLOCK]"

    def __init__(self, *, block: int = DEFAULT_BLOCK, use_numba: bool = True) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_BLOCK:
            raise ConfigError(f"codec e3m0:{block}: the block size must be a whole number from 1 to {MAX_BLOCK}")
        self.block = block
        self.use_numba = use_numba

    @classmethod
    def with_param(cls, param: str) -> E3M0:
        """``e3m0:BLOCK`` (values per scale); ConfigError naming the spec otherwise."""
        try:
            block = int(param)
        except ValueError:
            raise ConfigError(f"codec e3m0:{param}: the block size must be a whole number (e3m0:128)") from None
        return cls(block=block)

    @property
    def spec(self) -> str:
        return self.name if self.block == DEFAULT_BLOCK else f"{self.name}:{self.block}"

    def sizes(self, n: int) -> tuple[int, int]:
        """(code bytes, scales) of an ``n``-value piece."""
        return (n + 1) // 2, -(-n // self.block)

    def encode(self, x: np.ndarray) -> list[np.ndarray]:
        """``[uint8 codes, float32 scales]``; Diverged for a piece holding NaN or infinity."""
        nc, ns = self.sizes(x.size)
        codes = np.zeros(nc, np.uint8)
        scales = np.empty(ns, np.float32)
        if self.use_numba:
            ok = K.e3m0_encode(np.ascontiguousarray(x, dtype=np.float32), self.block, codes, scales)
        else:
            got = K.e3m0_encode_np(np.asarray(x, np.float32), self.block)
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

"""The codec interface every piece codec implements, and a payload-shape check. Pure.

Lives apart from :mod:`p2psync.compress.codecs` so that codecs in their own modules
(:mod:`p2psync.compress.topk`) and the registry can import it without a cycle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Sequence

import numpy as np

from p2psync.errors import ConfigError, ProtocolError


class Codec(ABC):
    """Turns one 1-D float32 piece into arrays for the wire and back.

    Subclasses set :attr:`name` and add themselves to ``codecs.CODECS``; :func:`get_codec`
    builds one from ``--codec``. Called from the collectives' executor per piece
    (``enc = self.codec.encode(x)``) and by ASGD for whole gradients.
    """

    #: the registry name (``--codec NAME``)
    name: ClassVar[str]
    #: decoding does not give back exactly what was encoded
    lossy: ClassVar[bool] = True
    #: how the codec is written on the command line (``topk[:FRACTION]`` for a parameter)
    usage: ClassVar[str] = ""
    #: the codec always carries what it dropped into the next contribution (``topk``), not
    #: only with ``error_feedback=True``
    always_feedback: ClassVar[bool] = False

    @abstractmethod
    def encode(self, x: np.ndarray) -> list[np.ndarray]:
        """Encode a 1-D float32 piece into wire arrays."""

    @abstractmethod
    def decode(self, arrays: Sequence[np.ndarray], n: int) -> np.ndarray:
        """Rebuild an ``n``-element float32 piece; ProtocolError if the arrays do not fit."""

    def roundtrip(self, x: np.ndarray) -> np.ndarray:
        """``decode(encode(x))``: what a receiver of ``x`` gets (tests and benchmarks)."""
        return self.decode(self.encode(x), x.size)

    def warm(self) -> None:
        """Encode and decode a small piece once, so that what the codec does on first use
        (load its numba kernels from their on-disk cache, or compile them) happens now and not
        in a run's first exchange (about 0.3 s of CPU per process for the sketch). Decoded
        twice: a payload as the transport delivers it (read-only arrays) is a kernel
        specialization of its own."""
        x = np.random.default_rng(0).standard_normal(WARM_VALUES).astype(np.float32)
        enc = self.encode(x)
        self.decode(enc, x.size)
        self.decode([read_only(a) for a in enc], x.size)

    @property
    def spec(self) -> str:
        """The codec as written on the command line, parameter included (``"topk:0.01"``)."""
        return self.name

    @classmethod
    def with_param(cls, param: str) -> Codec:
        """The codec for ``name:param``; ConfigError for a codec that takes no parameter."""
        raise ConfigError(f"codec {cls.name!r} takes no parameter, got {cls.name}:{param}")


#: :meth:`Codec.warm`'s piece: large enough for every kernel a piece can reach (the sketch's
#: radix-sorted sample starts at 512 values)
WARM_VALUES = 5000


def read_only(a: np.ndarray) -> np.ndarray:
    """``a`` as the transport delivers it: a read-only view of received bytes."""
    return np.frombuffer(a.tobytes(), dtype=a.dtype).reshape(a.shape)


def expect_arrays(arrays: Sequence[np.ndarray], spec: Sequence[tuple[np.dtype, int]], codec: str) -> None:
    """ProtocolError unless ``arrays`` have exactly these (dtype, size) pairs."""
    if len(arrays) != len(spec) or any(a.dtype != dt or a.size != n for a, (dt, n) in zip(arrays, spec)):
        got = [(str(a.dtype), a.size) for a in arrays]
        raise ProtocolError("codec_payload", f"{codec}: expected {[(str(d), n) for d, n in spec]}, got {got}")

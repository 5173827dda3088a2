"""The plain values a replica hands to strategies and takes back: what one SGD step fed to its
momentum buffer and with which numbers (DTS's compensation), the model's buffers (BatchNorm
statistics), one layer of the flat parameter vector (Canary's colayers group them).

Pure data (numpy only): importable by every layer above, from ``strategies/`` to ``api/``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: bytes of an encoded training state (``Replica.export_meta``) a peer may send
MAX_META_BYTES = 16 << 20

#: a learning rate or weight decay: one number, or one value per parameter element when the
#: optimizer's parameter groups differ
PerElement = float | np.ndarray


@dataclass(frozen=True)
class SgdHyper:
    """The plain-SGD hyper-parameters in effect for the next step (DTS's compensation needs
    them)."""

    lr: PerElement
    momentum: float
    weight_decay: PerElement


@dataclass(frozen=True)
class SgdStep:
    """One local SGD step: ``grad`` is what SGD fed to its momentum buffer (the gradient plus
    weight_decay times the parameters before the step), ``hyper`` the numbers it used."""

    grad: np.ndarray
    hyper: SgdHyper


@dataclass(frozen=True)
class Buffers:
    """A replica's buffers: ``raw`` every buffer's bytes (uint8), ``floats`` the floating-point
    ones as one float32 vector (only read for ``average``, else None)."""

    raw: np.ndarray
    floats: np.ndarray | None = None

    @property
    def empty(self) -> bool:
        return self.raw.size == 0


@dataclass(frozen=True)
class Layer:
    """A module with trainable parameters of its own: its parameters are consecutive in the
    flat parameter vector (``offset``, ``numel``)."""

    name: str
    kind: str  # "fc" or "conv" (convolutions, norms and anything else)
    offset: int  # first element in the flat parameter vector
    numel: int
    #: indices of its parameters in the flat parameter list
    params: tuple[int, ...]


__all__ = ["MAX_META_BYTES", "Buffers", "Layer", "PerElement", "SgdHyper", "SgdStep"]

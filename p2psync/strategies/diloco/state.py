"""The state a member behind adopts (pure): θ_g, the outer momentum, with eager updates the own
fresh term θ_g holds of the round in flight, and the counters of the operation the donor
launched last, packed as one float32 vector (Regroup broadcasts it). Its length and layout
follow from the options every member shares (``eager``); the counters check their own range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from p2psync.errors import ConfigError, ProtocolError

#: the fragment number of the final full-model operation
FULL = -1
#: the counters' fragment of the stop's closing checks (after the final sync)
CLOSE = -2

#: integer counters travel as pairs of float32 (high and low 20 bits): exact below 2**43
_SPLIT = 1 << 20


@dataclass(frozen=True)
class Counters:
    """Where a node stands when it launches operation ``op`` (of fragment ``frag``: :data:`FULL`
    for the final full-model sync, :data:`CLOSE` for the stop's closing checks after it): its
    inner step ``t``, its loop's step, and the outer steps applied so far. ``at_stop``: the
    members had agreed to stop when it was launched (eager's completion round, a fragment's
    operation that the stop's completion step awaits)."""

    op: int
    t: int
    step: int
    applied: int
    frag: int = 0
    at_stop: bool = False

    @property
    def stopping(self) -> bool:
        """The members had agreed to stop when this operation was launched: the final sync,
        the closing checks, or a round ``at_stop``."""
        return self.frag in (FULL, CLOSE) or self.at_stop

    def pack(self) -> np.ndarray:
        vals = (self.op, self.t, self.step, self.applied, self.frag + 2,  # (frag >= -2: the stop's markers)
                int(self.at_stop))
        if any(v < 0 or v >= 1 << 43 for v in vals):
            raise ConfigError(f"DiLoCo counters out of range: {vals}")
        return np.array([x for v in vals for x in divmod(v, _SPLIT)], np.float32)

    @classmethod
    def unpack(cls, vec: np.ndarray) -> Counters:
        if vec.size != COUNTERS or not np.isfinite(vec).all() or (vec < 0).any() or (vec != np.floor(vec)).any():
            raise ProtocolError("state", "malformed DiLoCo counters")
        v = [int(vec[2 * i]) * _SPLIT + int(vec[2 * i + 1]) for i in range(6)]
        if v[5] > 1:
            raise ProtocolError("state", "malformed DiLoCo counters")
        return cls(op=v[0], t=v[1], step=v[2], applied=v[3], frag=v[4] - 2, at_stop=bool(v[5]))


COUNTERS = 12


def state_size(numel: int, parts: int, *, eager: bool = False) -> int:
    """Length of :func:`pack_state`'s vector (``eager``: with the own fresh term θ_g holds)."""
    return (3 if eager else 2) * numel + parts + COUNTERS


def pack_state(theta: np.ndarray, bufs: Sequence[np.ndarray | None], frags: Sequence[np.ndarray],
               counters: Counters, held: np.ndarray | None = None) -> np.ndarray:
    """θ_g ‖ b (zeros where a fragment has no buffer yet) ‖ (eager) ``held`` ‖ which fragments
    have a buffer ‖ counters.

    ``held`` (eager updates only, one value per parameter): the own fresh term
    (:func:`~.outer.own_term`) of the round ``counters`` launched that θ_g holds already (zeros
    when θ_g holds none: the stop's final sync and closing checks). A member that adopts this
    state takes it out of that round's mean in its next late part instead of its own (it took
    part with Δ = 0), so the donor's contribution enters its θ_g once, as it enters the donor's."""
    mom = np.zeros_like(theta)
    have = np.zeros(len(frags), np.float32)
    for f, (b, idx) in enumerate(zip(bufs, frags)):
        if b is not None:
            mom[idx] = b
            have[f] = 1.0
    pieces = [theta, mom] + ([] if held is None else [np.asarray(held, np.float32)]) + [have, counters.pack()]
    if held is not None and held.size != theta.size:
        raise ConfigError(f"DiLoCo: a held term of {held.size} values for a θ_g of {theta.size}")
    return np.concatenate(pieces).astype(np.float32, copy=False)


def unpack_state(vec: np.ndarray, numel: int, frags: Sequence[np.ndarray], *, eager: bool = False
                 ) -> tuple[np.ndarray, list[np.ndarray | None], Counters, np.ndarray | None]:
    """:func:`pack_state`'s parts back: θ_g, the buffers, the counters, and (``eager``) the
    held own fresh term (None otherwise)."""
    parts = len(frags)
    if vec.size != state_size(numel, parts, eager=eager):
        raise ProtocolError("state", f"a DiLoCo state of {vec.size} values, expected "
                                     f"{state_size(numel, parts, eager=eager)}")
    theta = np.array(vec[:numel], np.float32, copy=True)
    mom = vec[numel:2 * numel]
    at = 2 * numel
    held: np.ndarray | None = None
    if eager:
        held = np.array(vec[at:at + numel], np.float32, copy=True)
        at += numel
    have = vec[at:at + parts]
    bufs: list[np.ndarray | None] = [np.array(mom[idx], np.float32, copy=True) if have[f] else None
                                     for f, idx in enumerate(frags)]
    return theta, bufs, Counters.unpack(np.asarray(vec[at + parts:])), held


__all__ = ["CLOSE", "COUNTERS", "FULL", "Counters", "pack_state", "state_size", "unpack_state"]

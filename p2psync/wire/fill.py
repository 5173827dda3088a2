"""A payload frame computed in the place it is sent from (:class:`Fill`).

A collective that adds a received piece to its own values and sends the sum straight on would
write the sum into its working buffer and the transport would then copy it into shared memory
(:mod:`p2psync.transport.shm`): two writes and a read of the piece where one write does. A
``Fill`` instead carries the function that computes the frame, and whoever places the frame
calls it: the shared-memory ring writes the sum into its own slot (:meth:`Fill.into`), any other
path has it computed into ``like`` first (:meth:`Fill.own`) and sends that. Either way the bytes
on the wire are what ``fill`` computes. Pure: numpy only.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np


class Fill:
    """A payload frame of ``like``'s dtype and shape whose values ``fill(out)`` writes into an
    array ``out`` (``like`` itself, or a slot of the transport's memory of that dtype and
    shape).

    ``like`` is C-contiguous and writable. ``fill`` may run more than once (a retried send is
    placed again), so it must not change its own inputs, except that :meth:`own` runs it with
    ``out`` = ``like``, once (``like`` may be one of its inputs: an add in place). It may raise:
    the send then fails with that exception and nothing of the frame is sent; a Fill whose
    :meth:`own` raised is not to be placed again (an add in place may have changed ``like``
    already). After :meth:`own`, the values are in ``like`` and :meth:`into` copies them from
    there."""

    __slots__ = ("like", "_fill", "owned", "nbytes")

    def __init__(self, like: np.ndarray, fill: Callable[[np.ndarray], None]) -> None:
        if not (like.flags.c_contiguous and like.flags.writeable):
            raise ValueError("a Fill's array must be C-contiguous and writable")
        self.like = like
        self._fill = fill
        #: the values are in ``like`` (:meth:`own` ran)
        self.owned = False
        self.nbytes = like.nbytes

    def __len__(self) -> int:
        return self.nbytes

    def into(self, out: np.ndarray) -> None:
        """Write the frame's values into ``out`` (``like``'s dtype and shape)."""
        if self.owned:
            np.copyto(out, self.like)
        else:
            self._fill(out)

    def own(self) -> np.ndarray:
        """The frame's values in ``like`` (computed there the first time), for a path that
        sends an array rather than writing into memory of its own."""
        if not self.owned:
            self._fill(self.like)
            self.owned = True
        return self.like


def placed(frames: Sequence[Any]) -> list[Any]:
    """``frames`` with every :class:`Fill` computed into its own array and given as bytes (a
    ``memoryview``), for a path that sends buffers as they are."""
    return [f.own().reshape(-1).data.cast("B") if type(f) is Fill else f for f in frames]


__all__ = ["Fill", "placed"]

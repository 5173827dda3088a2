"""What one node holds of Canary's exchange of one colayer: results and outboxes (pure).

Follows the routing rules of :mod:`p2psync.strategies.canary.plan` (additive, exactly once).
Every piece of data is a :class:`Datum`: the sum of some contributions (the gradient of one
colayer slot from one worker and iteration each), how many, the mask of the workers they come
from (Canary's GEI bits, paper §4.4.2: masks travel with partial sums and
are OR-ed when summed) and the span of their iterations (for the staleness rule: data whose
newest contribution is older than ``ζ − s`` is discarded on receipt, spec §6.5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from p2psync.strategies.canary.plan import Layout, Slot


@dataclass
class Datum:
    vec: np.ndarray
    count: int
    mask: int
    newest: int
    oldest: int
    #: a contributor asked the run to stop (OR-ed like the mask: in a complete round every
    #: node sees every contributor's flag)
    stop: bool = False

    def merge(self, other: Datum) -> None:
        """Add ``other`` in (this datum owns its ``vec``)."""
        self.vec += other.vec
        self.count += other.count
        self.mask |= other.mask
        self.newest = max(self.newest, other.newest)
        self.oldest = min(self.oldest, other.oldest)
        self.stop = self.stop or other.stop

    def copy(self) -> Datum:
        return Datum(self.vec.copy(), self.count, self.mask, self.newest, self.oldest, self.stop)


class Flow:
    """One node's results and outboxes for the slots of one colayer."""

    def __init__(self, layout: Layout, me: int, slots: Sequence[Slot]) -> None:
        self.layout, self.me, self.slots = layout, me, tuple(slots)
        self.result: dict[int, Datum] = {}
        self.outbox: dict[tuple[int, int, int], Datum] = {}  # (step, peer, slot) -> datum
        self._send: dict[tuple[int, int, int], tuple[Slot, ...]] = {}
        self._recv: dict[tuple[int, int, int], tuple[Slot, ...]] = {}
        for t in range(layout.levels):
            mine = [s for s in self.slots if s.thread == t]
            for k in range(layout.steps):
                for y in layout.peers(me, t, k):
                    self._send[(t, k, y)] = tuple(s for s in mine if s.owner == layout.sent_owner(me, t, k, y))
                    self._recv[(t, k, y)] = tuple(s for s in mine if s.owner == layout.received_owner(me, t, k, y))

    def send_slots(self, thread: int, step: int, peer: int) -> tuple[Slot, ...]:
        """The slots this node sends ``peer`` at ``step`` of ``thread`` (KeyError: not a peer)."""
        return self._send[(thread, step, peer)]

    def recv_slots(self, thread: int, step: int, peer: int) -> tuple[Slot, ...]:
        return self._recv[(thread, step, peer)]

    def add(self, slot: Slot, stage: int, d: Datum, source: int | None = None) -> None:
        """Data for ``slot`` reached this node at ``stage`` (0: own, k + 1: received at step
        k, from ``source``): into the result and/or the outboxes the routing rules name. Takes
        ownership of ``d.vec``."""
        into_result, outs = self.layout.route(self.me, slot, stage, source)
        for k, y in outs:
            held = self.outbox.get((k, y, slot.index))
            if held is None:
                self.outbox[(k, y, slot.index)] = d.copy()
            else:
                held.merge(d)
        if into_result:
            held = self.result.get(slot.index)
            if held is None:
                self.result[slot.index] = d
            else:
                held.merge(d)

    def take_outbox(self, step: int, peer: int, slot: Slot) -> Datum | None:
        """The outbox for ``peer`` at ``step`` when it holds a contribution (None when it is
        empty or holds only a codec's residue, which waits for the next contribution)."""
        d = self.outbox.get((step, peer, slot.index))
        if d is None or d.count == 0:
            return None
        return self.outbox.pop((step, peer, slot.index))

    def holds(self, step: int, peer: int, slots: Sequence[Slot]) -> bool:
        """Whether the outbox for ``peer`` at ``step`` holds a contribution for one of ``slots``."""
        return any((d := self.outbox.get((step, peer, s.index))) is not None and d.count > 0 for s in slots)

    def put_back(self, step: int, peer: int, slot: Slot, d: Datum) -> None:
        """Return ``d`` (a codec's residue: count 0, no contributor) to an outbox: it leaves
        with the next data for that peer, so what a lossy codec drops is delayed, not lost."""
        held = self.outbox.get((step, peer, slot.index))
        if held is None:
            self.outbox[(step, peer, slot.index)] = d
        else:
            held.merge(d)

    def take_result(self, slot: Slot) -> Datum | None:
        return self.result.pop(slot.index, None)

    def clear(self) -> None:
        self.result.clear()
        self.outbox.clear()


__all__ = ["Datum", "Flow"]

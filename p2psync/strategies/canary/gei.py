"""Canary's GEI (gradient exchange indicator) and staleness bounding, pure
(Zhou et al., *Canary*, §5.2 Fig. 16, §5.3 Pseudocode 1, Table 3).

**GEI row vector** ``r_(i)``: one integer bitmask per colayer; worker ``W_(j)`` (1-based, the
paper's convention) is bit ``j − 1``, so ``r = 233 = 0b1110_1001`` says workers {1, 4, 6, 7, 8}
(Fig. 16b). p2psync's node ids are 0-based: node ``i`` is worker ``i + 1``, bit ``i``
(:func:`node_bit`). Masks are accumulated with bitwise OR, not the paper's "+": a worker's
contribution can reach a node inside several partial sums, and OR is idempotent (spec §4.4.1).
Masks are Python ints, so any number of workers fits (the paper's footnote 3: 2^34 for 34).

**GEI matrix** ``Q``: one row per iteration of this node (a contribution is recorded in the row
of the iteration it will be applied in, spec §4.4.5); ``ζ`` is the newest iteration seen
anywhere (own, and every message's header, empty packets included: spec §4.4.6, §6.5), i.e.
the fastest worker's, and the node at ``ζ`` (the lowest id of those seen there, spec §5.4's
tie rule): both a maximum, so they do not depend on the order messages arrive in.

**Staleness bounding** (Pseudocode 1 as the spec resolves it, §5.3-§5.4): at the end of
iteration ``t`` with ``s_cur = ζ − t``:

* A — ``s_cur <= s``: apply, go on;
* B — ``s_cur > s`` but at least ``p`` colayers are complete: apply, go on (the paper does not
  write this branch out; overtime needs both conditions);
* C — *overtime*: drop the iteration's gradients, pull the model from the fastest worker,
  adopt ``t = ζ`` (the strategy adopts the iteration of the model it took: see
  :mod:`p2psync.strategies.canary`).

A colayer is *complete* when its mask holds every bit of the required mask (``(r & m) == m``;
the printed line 10 compares with 1, which only works for worker 1), by default every member
of the view (``proportion_mask = full``), or only this node's own bit (``own``). The proportion
is a bitmap over colayers (line 11, :func:`calc_proportion`) compared to ``p`` as a *count*
(popcount >= p, :func:`check_proportion`): the printed line 22 ANDs the bitmap with p
(:func:`literal_check_proportion`, kept to show why that reading is wrong: 0b0011 & 6 = 2 is
"true" with 2 of the required 6 colayers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Sequence

#: staleness threshold meaning "never stale" (ASP-like)
UNBOUNDED = math.inf


def encode_workers(workers: Iterable[int]) -> int:
    """The mask of 1-based workers (``{1, 4, 6, 7, 8}`` -> 233)."""
    out = 0
    for w in workers:
        if w < 1:
            raise ValueError(f"worker {w}: workers are numbered from 1")
        out |= 1 << (w - 1)
    return out


def decode_workers(mask: int) -> set[int]:
    """The 1-based workers in a mask (233 -> ``{1, 4, 6, 7, 8}``)."""
    if mask < 0:
        raise ValueError(f"mask {mask} is negative")
    return {i + 1 for i in range(mask.bit_length()) if mask >> i & 1}


def own_bit(worker: int) -> int:
    """Worker ``W_(j)``'s own value ``2^(j-1)`` (``W_(4)`` -> 8)."""
    return encode_workers((worker,))


def full_mask(n: int) -> int:
    """Every one of ``n`` workers: ``2^n − 1``."""
    return (1 << n) - 1


def node_bit(node: int) -> int:
    """p2psync node ``i`` (0-based) is worker ``i + 1``: bit ``i``."""
    if node < 0:
        raise ValueError(f"node id {node} is negative")
    return 1 << node


def members_mask(nodes: Iterable[int]) -> int:
    out = 0
    for n in nodes:
        out |= node_bit(n)
    return out


def calc_staleness(zeta: int, t: int) -> int:
    """``s_(i),⟨t⟩ = ζ − t`` (line 5; never negative: ζ includes this node's own t)."""
    return max(0, zeta - t)


def calc_proportion(row: Sequence[int], mask: int) -> int:
    """Bitmap over colayers: bit ``z`` set when colayer ``z``'s mask holds all of ``mask``."""
    out = 0
    for z, r in enumerate(row):
        if r & mask == mask:
            out |= 1 << z
    return out


def check_staleness(s_cur: int, s: float) -> bool:
    """Line 19: within the bound."""
    return s_cur <= s


def check_proportion(bitmap: int, p: int) -> bool:
    """At least ``p`` colayers complete (the prose's reading of line 22)."""
    return bitmap.bit_count() >= p


def literal_check_proportion(bitmap: int, p: int) -> int:
    """Line 22 as printed (``bitmap AND p``), for the record: not what the prose means."""
    return bitmap & p


class Branch(Enum):
    APPLY = "A"  # within the staleness bound
    STALE_APPLY = "B"  # beyond it, but at least p colayers complete
    OVERTIME = "C"  # drop the gradients, pull the fastest worker's model, adopt ζ


@dataclass(frozen=True)
class Decision:
    branch: Branch
    staleness: int
    bitmap: int

    @property
    def complete(self) -> int:
        return self.bitmap.bit_count()


def decide(*, zeta: int, t: int, row: Sequence[int], mask: int, s: float, p: int) -> Decision:
    """The end-of-iteration decision (spec §5.4)."""
    s_cur = calc_staleness(zeta, t)
    bitmap = calc_proportion(row, mask)
    if check_staleness(s_cur, s):
        return Decision(Branch.APPLY, s_cur, bitmap)
    if check_proportion(bitmap, p):
        return Decision(Branch.STALE_APPLY, s_cur, bitmap)
    return Decision(Branch.OVERTIME, s_cur, bitmap)


def validate(*, s: float, p: int, colayers: int) -> None:
    """``0 <= p <= k`` colayers and ``s >= 0`` (spec C19: s = 18, p = 6, k = 10 is valid)."""
    if not (s >= 0):
        raise ValueError(f"staleness threshold s={s} must be >= 0")
    if not 0 <= p <= colayers:
        raise ValueError(f"proportion threshold p={p} must be between 0 and the {colayers} colayers")


class GEIMatrix:
    """``Q`` of node ``me``: per iteration, one mask per colayer; ``ζ`` and the node at ``ζ``."""

    def __init__(self, colayers: int, me: int = 0) -> None:
        if colayers < 1:
            raise ValueError("at least one colayer")
        self.k = colayers
        self.me = me
        self.rows: dict[int, list[int]] = {}
        self.zeta = 0
        #: the fastest worker: of the nodes seen at ζ, the lowest id
        self.zeta_node = me

    def row(self, t: int) -> list[int]:
        """Row ``⟨t⟩`` (created on first use; a new iteration also raises ζ)."""
        self.see(t)
        r = self.rows.get(t)
        if r is None:
            r = self.rows[t] = [0] * self.k
        return r

    def record(self, t: int, z: int, mask: int) -> None:
        """OR ``mask`` into ``r^[z]`` of row ``t`` (idempotent, any order)."""
        if not 0 <= z < self.k:
            raise ValueError(f"colayer {z} outside [0, {self.k})")
        self.row(t)[z] |= mask

    def see(self, iteration: int, node: int | None = None) -> None:
        """``node`` (default: this one) reached ``iteration``: ζ = max; the node at ζ with the
        lowest id."""
        node = self.me if node is None else node
        if iteration > self.zeta or (iteration == self.zeta and node < self.zeta_node):
            self.zeta, self.zeta_node = iteration, node

    def heard(self, origin: int, it: int, zeta: int, zeta_node: int) -> None:
        """A message's header, data or empty packet: its sender ``origin`` is at iteration
        ``it`` and knew of ``zeta``, reached by ``zeta_node`` (ζ spreads hop by hop). Sets no
        GEI bit: bits come with data only."""
        self.see(it, origin)
        self.see(zeta, zeta_node)

    def forget_before(self, t: int) -> None:
        """Drop rows older than ``t`` (rows older than ζ − s − 1 can change no decision)."""
        for old in [r for r in self.rows if r < t]:
            del self.rows[old]


__all__ = ["Branch", "Decision", "GEIMatrix", "UNBOUNDED", "calc_proportion", "calc_staleness",
           "check_proportion", "check_staleness", "decide", "decode_workers", "encode_workers", "full_mask",
           "literal_check_proportion", "members_mask", "node_bit", "own_bit", "validate"]

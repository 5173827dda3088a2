"""Whether the members hold one value: a 63-bit hash of an array (:func:`digest`) and the
nodes whose row differs from the first member's once the rows are allgathered
(:func:`differing`). What diloco's stop and diloco-async's stop check θ_g with."""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from p2psync.collectives import Collectives


def digest(a: np.ndarray) -> int:
    """A 63-bit hash of ``a``'s bytes."""
    return int.from_bytes(hashlib.blake2b(a.tobytes(), digest_size=8).digest(), "little") >> 1


async def differing(coll: Collectives, row: np.ndarray, members: Sequence[int], *,
                    tag: str) -> tuple[tuple[int, ...], list[np.ndarray]]:
    """Allgather ``row`` over ``members`` (every member calls it with the same ``tag``): the
    members whose row differs from the first member's, and the rows."""
    rows = await coll.allgather(row, members, tag=tag)
    return tuple(n for n, r in zip(members, rows) if not np.array_equal(r, rows[0])), rows


__all__ = ["differing", "digest"]

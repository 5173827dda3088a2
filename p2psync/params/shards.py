"""Which peer owns which part of the flat parameter vector. Pure.

The vector is split into one contiguous shard per member, in member-id order, balanced to
within one element (every element is a float32: byte-balanced); shards are sent as pieces of
at most ``piece_elems`` elements (the collectives' ~1 MiB pieces).
"""

from __future__ import annotations

from typing import Sequence

from p2psync.errors import ConfigError


def shard_bounds(numel: int, members: Sequence[int]) -> dict[int, tuple[int, int]]:
    """``{member: (lo, hi)}``: contiguous shards covering ``[0, numel)``, sizes within one
    element of each other, the larger ones first; the k-th smallest id owns the k-th shard."""
    if numel < 0:
        raise ConfigError(f"numel must be >= 0, not {numel}")
    ids = sorted(set(members))
    if not ids or len(ids) != len(members):
        raise ConfigError(f"bad member list {list(members)}")
    base, extra = divmod(numel, len(ids))
    out, lo = {}, 0
    for k, m in enumerate(ids):
        hi = lo + base + (1 if k < extra else 0)
        out[m] = (lo, hi)
        lo = hi
    return out


def piece_ranges(lo: int, hi: int, piece_elems: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into consecutive pieces of at most ``piece_elems`` elements (one empty
    piece for an empty range, so an empty shard still answers)."""
    if piece_elems < 1:
        raise ConfigError(f"piece_elems must be >= 1, not {piece_elems}")
    if hi <= lo:
        return [(lo, lo)]
    return [(a, min(a + piece_elems, hi)) for a in range(lo, hi, piece_elems)]

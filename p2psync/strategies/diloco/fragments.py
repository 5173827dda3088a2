"""The fragment map (pure): which parameters of the flat vector each fragment holds (Streaming
DiLoCo §2.2), their positions, and a digest members compare.
"""

from __future__ import annotations

import re
from typing import Literal, Sequence

import numpy as np

from p2psync.errors import ConfigError
from p2psync.model import Layer

#: a fragment: (lo, hi) ranges of the flat parameter vector, in increasing order
Ranges = tuple[tuple[int, int], ...]


def _block_key(name: str) -> tuple[str, int] | None:
    """(prefix, index) of a module name inside a repeated block (``blocks.3.attn`` ->
    ``("blocks", 3)``; ``3`` -> ``("", 3)``), else None."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if re.fullmatch(r"[0-9]+", p):
            return ".".join(parts[:i]), int(p)
    return None


def fragment_map(layers: Sequence[Layer], numel: int, fragments: int, *, by: Literal["blocks", "flat"],
                 pattern: Literal["strided", "sequential"]) -> list[Ranges]:
    """The fragments of a flat vector of ``numel`` values (Streaming DiLoCo §2.2: strided or
    sequential groups of blocks).

    ``fragments`` = 1: the whole vector. ``by="blocks"``: the repeated blocks (modules named
    ``<prefix>.<index>...``; the prefix with the most indices wins) are dealt to ``fragments``
    fragments, ``strided`` (block i to fragment i mod P) or ``sequential`` (block i to
    ⌊i·P/L⌋); every other parameter (embeddings, final norm, head) forms one more fragment,
    the last. ``by="flat"``: ``fragments`` contiguous ranges of near-equal size cut at layer
    boundaries. ConfigError when the model cannot be cut so."""
    if fragments == 1:
        return [((0, numel),)]
    if by == "flat":
        cuts = sorted({layer.offset for layer in layers} | {numel}) if layers else []
        if len(cuts) < fragments:
            cuts = [round(i * numel / fragments) for i in range(1, fragments + 1)]
        bounds = [0]
        for i in range(1, fragments):
            want = i * numel / fragments
            best = min((c for c in cuts if bounds[-1] < c < numel), key=lambda c: abs(c - want), default=None)
            if best is None:
                raise ConfigError(f"--opt fragments={fragments}: the model has too few layers to cut "
                                  f"{fragments} fragments")
            bounds.append(best)
        bounds.append(numel)
        if any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise ConfigError(f"--opt fragments={fragments}: the model has too few layers to cut "
                              f"{fragments} fragments")
        return [((a, b),) for a, b in zip(bounds, bounds[1:])]
    keyed = [(layer, _block_key(layer.name)) for layer in layers]
    counts: dict[str, set[int]] = {}
    for _, key in keyed:
        if key is not None:
            counts.setdefault(key[0], set()).add(key[1])
    if not counts:
        raise ConfigError(f"--opt fragments={fragments}: the model has no repeated blocks (modules named "
                          "like blocks.3 or layers.3): use --opt fragment_by=flat")
    prefix = max(counts, key=lambda p: len(counts[p]))
    index = {b: i for i, b in enumerate(sorted(counts[prefix]))}
    n_blocks = len(index)
    if fragments > n_blocks:
        raise ConfigError(f"--opt fragments={fragments}: the model has only {n_blocks} blocks "
                          f"({prefix or 'top-level'} modules)")
    parts: list[list[tuple[int, int]]] = [[] for _ in range(fragments + 1)]
    covered = 0
    for layer, key in keyed:
        if key is not None and key[0] == prefix:
            i = index[key[1]]
            f = i % fragments if pattern == "strided" else i * fragments // n_blocks
        else:
            f = fragments
        parts[f].append((layer.offset, layer.offset + layer.numel))
        covered += layer.numel
    if covered != numel:
        raise ConfigError(f"--opt fragments={fragments}: the model's layers cover {covered} of its {numel} "
                          "parameters: use --opt fragment_by=flat")
    if not parts[fragments]:
        parts.pop()
    return [_coalesce(p) for p in parts]


def part_count(fragments: int, *, by: Literal["blocks", "flat"], blocks: int, rest: bool) -> int:
    """P_total: how many fragments :func:`fragment_map` cuts ``fragments`` into for a model of
    ``blocks`` repeated blocks with (``rest``) or without parameters outside them, known before
    the model is built. ConfigError as :func:`fragment_map` raises it when ``by="blocks"``
    asks for more fragments than blocks."""
    if fragments == 1 or by == "flat":
        return fragments
    if fragments > blocks:
        raise ConfigError(f"--opt fragments={fragments}: the model has only {blocks} blocks")
    return fragments + int(rest)


def _coalesce(ranges: Sequence[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def indices(ranges: Ranges) -> np.ndarray:
    """The flat-vector positions of a fragment, in its fixed order (its ranges in turn)."""
    return np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in ranges])


def map_digest(frags: Sequence[Ranges]) -> float:
    """A float32-exact digest of a fragment map (members compare it: same model, same cut)."""
    h = 0
    for f, ranges in enumerate(frags):
        for lo, hi in ranges:
            h = (h * 1_000_003 + f * 7919 + lo * 31 + hi) % (1 << 23)
    return float(h)


__all__ = ["Ranges", "fragment_map", "indices", "map_digest", "part_count"]

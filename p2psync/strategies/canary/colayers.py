"""Canary's colayers: the model's layers grouped in backprop order (pure;
Zhou et al., *Canary*, §4.3.2).

A *layer* is a module with trainable parameters of its own; its parameters are consecutive in
the flat parameter vector, so a colayer (consecutive layers) is one contiguous range of it.
Colayer ``c^[0]`` is the output-most group, whose gradients backprop produces first.

Grouping (fixed for a run; the paper's "the colayer number changes during training" has no
algorithm behind it, spec §9.15):

* ``layers_per_colayer`` — explicit counts, output to input (VGG-19: 3, 4, 4, 8, spec C12);
* ``count`` — that many colayers of nearly equal bytes (consecutive layers);
* otherwise the spec's automatic rule: a new colayer where the layer type changes (fully
  connected vs convolutional/other) or where the colayer would exceed ``max_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from p2psync.errors import ConfigError
from p2psync.model import Layer


@dataclass(frozen=True)
class Colayer:
    index: int
    layers: tuple[Layer, ...]

    @property
    def lo(self) -> int:
        return min(layer.offset for layer in self.layers)

    @property
    def hi(self) -> int:
        return max(layer.offset + layer.numel for layer in self.layers)

    @property
    def params(self) -> frozenset[int]:
        return frozenset(p for layer in self.layers for p in layer.params)


def group(layers: Sequence[Layer], *, count: int = 0, layers_per_colayer: Sequence[int] = (),
          max_bytes: int = 4 << 20) -> tuple[Colayer, ...]:
    """``layers`` in registration order (input to output) -> colayers in backprop order."""
    if not layers:
        raise ConfigError("canary: the model has no layers with trainable parameters")
    back = list(reversed(layers))
    if layers_per_colayer:
        if any(k < 1 for k in layers_per_colayer) or sum(layers_per_colayer) != len(back):
            raise ConfigError(f"canary: colayer_layers={','.join(map(str, layers_per_colayer))} must be "
                              f"positive counts adding up to the model's {len(back)} layers")
        sizes = list(layers_per_colayer)
    elif count:
        if not 1 <= count <= len(back):
            raise ConfigError(f"canary: colayers={count} must be between 1 and the model's {len(back)} layers")
        sizes = _balanced(back, count)
    else:
        sizes = _auto(back, max_bytes)
    out, i = [], 0
    for z, k in enumerate(sizes):
        out.append(Colayer(z, tuple(back[i:i + k])))
        i += k
    return tuple(out)


def _balanced(back: list[Layer], count: int) -> list[int]:
    """Cut ``back`` into ``count`` consecutive groups, each cut where the running size first
    reaches its share of the total (every group keeps at least one layer)."""
    total = sum(layer.numel for layer in back)
    sizes: list[int] = []
    run, start = 0, 0
    for i, layer in enumerate(back):
        run += layer.numel
        left_layers = len(back) - i - 1
        left_groups = count - len(sizes) - 1
        if left_groups and (run * count >= total * (len(sizes) + 1) or left_layers == left_groups):
            sizes.append(i + 1 - start)
            start = i + 1
    sizes.append(len(back) - start)
    return sizes


def _auto(back: list[Layer], max_bytes: int) -> list[int]:
    sizes: list[int] = []
    kind, nbytes = None, 0
    for layer in back:
        if sizes and layer.kind == kind and nbytes + 4 * layer.numel <= max_bytes:
            sizes[-1] += 1
            nbytes += 4 * layer.numel
        else:
            sizes.append(1)
            kind, nbytes = layer.kind, 4 * layer.numel
    return sizes


def parse_counts(text: str) -> tuple[int, ...]:
    """``"3,4,4,8"`` -> (3, 4, 4, 8); ConfigError for anything else."""
    if not text:
        return ()
    try:
        return tuple(int(p) for p in text.split(","))
    except ValueError:
        raise ConfigError(f"canary: colayer_layers={text!r}: expected comma-separated layer counts") from None


__all__ = ["Colayer", "Layer", "group", "parse_counts"]

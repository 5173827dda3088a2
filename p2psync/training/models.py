"""Models: an MLP, a small CNN, and a ResNet-18-style CNN (for GPU runs). All take (C, H, W).

The modules live in :mod:`p2psync.training.nets`, imported by :func:`build_model`: the model
names are read by the launcher, which never needs torch (about 1.2 s of start-up per run)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2psync.errors import ConfigError
from p2psync.training.config import MODELS

if TYPE_CHECKING:
    from torch import nn


def build_model(name: str, input_shape: tuple[int, ...], classes: int, *, hidden: int = 128) -> nn.Module:
    """``hidden``: the MLP's width (the other models ignore it)."""
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r} (choose from {', '.join(MODELS)})")
    from p2psync.training import nets

    if name == "mlp":
        return nets.mlp(input_shape, classes, hidden)
    return nets.cnn(input_shape, classes) if name == "cnn" else nets.resnet18(input_shape, classes)

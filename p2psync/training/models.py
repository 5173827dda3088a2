"""Models: an MLP, a small CNN, and a ResNet-18-style CNN (for GPU runs), which take (C, H, W);
and the byte-level language models ``lm-tiny``/``lm-small``/``lm-base`` (shapes:
:data:`~p2psync.training.config.LM_SPECS`), which take int64 tokens (batch, time).

The modules live in :mod:`p2psync.training.nets`, imported by :func:`build_model`: the model
names are read by the launcher, which never needs torch (about 1.2 s of start-up per run)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2psync.errors import ConfigError
from p2psync.training.config import LM_SPECS, MODELS

if TYPE_CHECKING:
    from torch import nn


def build_model(name: str, input_shape: tuple[int, ...], classes: int, *, hidden: int = 128) -> nn.Module:
    """``hidden``: the MLP's width (the other models ignore it); the language models ignore
    ``input_shape`` and ``classes`` too (byte tokens in, 256 logits out)."""
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r} (choose from {', '.join(MODELS)})")
    from p2psync.training import nets

    spec = LM_SPECS.get(name)
    if spec is not None:
        return nets.ByteLM(width=spec.width, layers=spec.layers, heads=spec.heads, context=spec.context)
    if name == "mlp":
        return nets.mlp(input_shape, classes, hidden)
    return nets.cnn(input_shape, classes) if name == "cnn" else nets.resnet18(input_shape, classes)

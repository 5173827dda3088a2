"""Closed vocabularies that more than one layer names (no p2psync imports, so any layer may
import them). A vocabulary that belongs to one layer lives there (codecs in ``compress``,
shapers in ``transport.shaping``, strategy modes next to their strategy's options)."""

from __future__ import annotations

from typing import Literal, get_args

#: a peer fails: synchronous strategies re-form over the survivors (continue) or stop
OnFailure = Literal["continue", "stop"]
ON_FAILURE: tuple[str, ...] = get_args(OnFailure)

#: module buffers at a synchronizing step: the lowest member's, the group's mean, or each node's own
BufferMode = Literal["broadcast", "average", "local"]
BUFFER_MODES: tuple[str, ...] = get_args(BufferMode)

__all__ = ["BUFFER_MODES", "BufferMode", "ON_FAILURE", "OnFailure"]

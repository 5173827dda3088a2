"""p2psync: an asyncio peer-to-peer runtime for data-parallel training on heterogeneous,
far-apart clusters. See DESIGN.md for the layers; imports point down only.

The user-facing API is :mod:`p2psync.api` (``attach``, ``shard``, ``Session``, ``log``,
``should_stop``); it is imported on first use, so ``import p2psync`` stays cheap (no torch)."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = {"attach", "shard", "Session", "session", "should_stop", "log"}


def __getattr__(name: str) -> Any:
    if name in _API:
        from p2psync import api

        return api.log_values if name == "log" else getattr(api, name)
    raise AttributeError(f"module 'p2psync' has no attribute {name!r}")

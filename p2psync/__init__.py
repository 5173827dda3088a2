"""p2psync: an asyncio peer-to-peer runtime for data-parallel training on heterogeneous,
far-apart clusters. See docs/architecture.md for the layers; imports point down only.

The user-facing API (``attach``, ``shard``, ``Session``, ``session``, ``log``, ``should_stop``)
lives in :mod:`p2psync.api.facade`; it is imported on first use, so ``import p2psync`` stays
cheap (no torch), and ``dir(p2psync)`` lists it all the same."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

#: public name -> its name in :mod:`p2psync.api.facade`
_API = {"attach": "attach", "shard": "shard", "Session": "Session", "session": "session",
        "should_stop": "should_stop", "log": "log_values", "no_sync": "no_sync"}

__all__ = ["Session", "attach", "log", "no_sync", "session", "shard", "should_stop"]


def __getattr__(name: str) -> Any:
    """The API's functions and classes, from :mod:`p2psync.api.facade` (not through the package
    :mod:`p2psync.api`, whose attribute ``session`` is its submodule once that is imported)."""
    if name in _API:
        from p2psync.api import facade

        return getattr(facade, _API[name])
    raise AttributeError(f"module 'p2psync' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

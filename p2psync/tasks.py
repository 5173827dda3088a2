"""Task lifecycle helpers shared by every layer (no p2psync imports)."""

from __future__ import annotations

import asyncio
from typing import Any, Iterable


async def cancel_all(tasks: Iterable[asyncio.Future[Any] | None]) -> None:
    """Cancel ``tasks`` (None entries are skipped) and wait until each has ended; their
    cancellation and any exception they ended with are consumed (a closing owner has no one
    left to report them to)."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    if live:
        await asyncio.gather(*live, return_exceptions=True)

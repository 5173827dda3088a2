"""The argument checks and the bounded hold shared by the coordinator's long-poll services
(P-Reduce's controller, the parameter-server scheduler). Call arguments are remote input:
anything malformed is a :class:`~p2psync.errors.ProtocolError` naming the service."""

from __future__ import annotations

import asyncio
from typing import Any, Collection, Mapping

from p2psync.errors import ProtocolError

#: seconds a long poll is held before it is answered "wait" (the caller asks again)
HOLD_S = 5.0


def int_arg(args: Mapping[str, Any], key: str, *, who: str, lo: int = 0) -> int:
    v = args.get(key)
    if type(v) is not int or v < lo:
        raise ProtocolError(who, f"{key} must be an integer >= {lo}, not {v!r}"[:120])
    return v


def bool_arg(args: Mapping[str, Any], key: str, *, who: str) -> bool:
    v = args.get(key, False)
    if not isinstance(v, bool):
        raise ProtocolError(who, f"{key} must be a boolean")
    return v


def view_arg(args: Mapping[str, Any], ids: Collection[int], *, who: str) -> tuple[int, tuple[int, ...]] | None:
    """The caller's membership view ``(epoch, sorted members)``, or None when it sent none."""
    epoch, members = args.get("epoch"), args.get("members")
    if epoch is None:
        return None
    if (type(epoch) is not int or epoch < 0 or not isinstance(members, list) or not members
            or any(type(m) is not int or m not in ids for m in members)):
        raise ProtocolError(who, "bad view (epoch, members)")
    return epoch, tuple(sorted(set(members)))


async def hold(answer: asyncio.Future[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """``answer``'s value if it comes within ``seconds``, else ``{"wait": True}`` (the future
    stays pending for the caller's next poll)."""
    try:
        return dict(await asyncio.wait_for(asyncio.shield(answer), seconds))
    except asyncio.TimeoutError:
        return {"wait": True}

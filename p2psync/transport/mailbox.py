"""Mailbox: matches incoming messages to waiters by tag (exact) or tag prefix.

Concurrent operations each wait on their own tags, so they never steal each other's messages.
A message nobody waits for yet is queued (bounded); a waiter that arrives later takes it.
Timeouts are armed with ``call_later`` and resolve the waiter's future only if it is still
pending, so a message is never lost to a race between delivery and timeout.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Callable

from p2psync.errors import P2PSyncError, PeerTimeout, ProtocolError
from p2psync.wire import Message


@dataclass
class _Waiter:
    exact: str | None
    prefix: str | None
    future: asyncio.Future[Message]

    def matches(self, tag: str) -> bool:
        if self.exact is not None:
            return tag == self.exact
        return self.prefix is not None and tag.startswith(self.prefix)


class Mailbox:
    def __init__(self, *, max_pending: int = 65536) -> None:
        self._queues: dict[str, deque[tuple[int, Message]]] = {}
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()
        self._pending = 0
        self._max_pending = max_pending
        self._closed: BaseException | None = None

    @property
    def pending(self) -> int:
        return self._pending

    def deliver(self, msg: Message) -> None:
        """Hand ``msg`` to the oldest matching waiter, or queue it. Raises ProtocolError when full."""
        for i, w in enumerate(self._waiters):
            if not w.future.done() and w.matches(msg.tag):
                del self._waiters[i]
                w.future.set_result(msg)
                return
        if self._pending >= self._max_pending:
            raise ProtocolError("mailbox_full", f"{self._pending} unclaimed messages")
        self._queues.setdefault(msg.tag, deque()).append((next(self._seq), msg))
        self._pending += 1

    def _pop(self, tag: str) -> Message:
        q = self._queues[tag]
        _, msg = q.popleft()
        if not q:
            del self._queues[tag]
        self._pending -= 1
        return msg

    def _take(self, exact: str | None, prefix: str | None) -> Message | None:
        if exact is not None:
            return self._pop(exact) if exact in self._queues else None
        best: tuple[int, str] | None = None
        for tag, q in self._queues.items():
            if tag.startswith(prefix or "") and (best is None or q[0][0] < best[0]):
                best = (q[0][0], tag)
        return self._pop(best[1]) if best else None

    async def _get(self, exact: str | None, prefix: str | None, timeout: float | None) -> Message:
        msg = self._take(exact, prefix)
        if msg is not None:
            return msg
        if self._closed is not None:
            raise self._closed
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Message] = loop.create_future()
        waiter = _Waiter(exact, prefix, fut)
        self._waiters.append(waiter)
        what = f"tag {exact!r}" if exact is not None else f"tag prefix {prefix!r}"
        handle = None
        if timeout is not None:
            handle = loop.call_later(
                timeout,
                lambda: fut.done() or fut.set_exception(PeerTimeout(f"no message for {what} within {timeout:g}s")),
            )
        try:
            return await fut
        finally:
            if handle is not None:
                handle.cancel()
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def get_nowait(self, tag: str) -> Message | None:
        """A queued message with this tag, or None."""
        return self._take(tag, None)

    async def get(self, tag: str, timeout: float | None = None) -> Message:
        return await self._get(tag, None, timeout)

    async def get_prefix(self, prefix: str, timeout: float | None = None) -> Message:
        return await self._get(None, prefix, timeout)

    def abort(self, exc: P2PSyncError, match: Callable[[str], bool] | None = None) -> int:
        """Fail every pending waiter (or those whose tag/prefix ``match``es) with ``exc``."""
        n = 0
        for w in list(self._waiters):
            key = w.exact if w.exact is not None else (w.prefix or "")
            if match is None or match(key):
                if not w.future.done():
                    w.future.set_exception(exc)
                    n += 1
                self._waiters.remove(w)
        return n

    def close(self, exc: P2PSyncError) -> None:
        self._closed = exc
        self.abort(exc)
        self._queues.clear()
        self._pending = 0

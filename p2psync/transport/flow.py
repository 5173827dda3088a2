"""Bulk flow control: a byte window per peer for ``data`` sends.

A ``data`` send first acquires its bytes from the peer's :class:`ByteWindow` and gives them back
once the bytes have been *handed off*: to the ZeroMQ socket or a datagram (unshaped), or
serialized onto the emulated link by the in-process shaper (the moment a real NIC would be done with them). A send
that finds the window full waits, FIFO, bounded by its own timeout: that is the backpressure the
sender feels instead of piling up pieces in shaper queues or ZeroMQ pipes. The window does not
cover bytes already propagating (the bandwidth-delay product), so it never limits throughput on
long fat links; it bounds what queues *behind* a busy link.

Default: 8 MiB per peer (``Transport(window_bytes=...)``): at least a few pieces (pieces are
<= 1 MiB in the collectives) so the link never idles between two sends, and small enough that
a 100 Mb/s link drains it in 0.7 s. A message larger than the window is let through alone (it
takes the whole window) rather than deadlocking. Control messages never take window bytes.
"""

from __future__ import annotations

import asyncio
from collections import deque


class ByteWindow:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("window capacity must be >= 1 byte")
        self.capacity = capacity
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        #: sends that had to wait for room (a measure of backpressure)
        self.waits = 0

    def _fits(self, n: int) -> bool:
        return self.used + n <= self.capacity

    def _size(self, nbytes: int) -> int:
        """What a request of ``nbytes`` takes: a message larger than the window takes all of it."""
        return max(0, min(nbytes, self.capacity))

    def try_acquire(self, nbytes: int) -> int | None:
        """Take ``min(nbytes, capacity)`` bytes now if they fit and nobody waits ahead (FIFO);
        returns the amount to :meth:`release`, or None: then :meth:`acquire` waits. The common
        case of every bulk send, with no coroutine to create."""
        n = self._size(nbytes)
        if not self._waiters and self._fits(n):
            self.used += n
            return n
        return None

    async def acquire(self, nbytes: int, timeout: float | None) -> int:
        """Take ``min(nbytes, capacity)`` bytes; returns the amount to :meth:`release`.
        Raises :class:`TimeoutError` when no room came within ``timeout``."""
        got = self.try_acquire(nbytes)
        if got is not None:
            return got
        n = self._size(nbytes)
        self.waits += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        item = (n, fut)
        self._waiters.append(item)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted just as we gave up: hand it on
            else:
                fut.cancel()
                try:
                    self._waiters.remove(item)
                except ValueError:
                    pass
                self._wake()
            raise
        return n

    def release(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if not self._fits(n):
                return
            self._waiters.popleft()
            self.used += n
            fut.set_result(None)

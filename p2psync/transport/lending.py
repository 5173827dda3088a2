"""Lending received frames to the consumer that asked to borrow them, without a copy.

Frames a peer on this host wrote into shared memory (:mod:`p2psync.transport.shm`) arrive as
read-only views of the sender's ring with a lease on their space. By default the transport
copies them out at once and gives the space back, so every consumer gets arrays that own their
memory, as for any received frame. A consumer that reads a message once and is done with it
(the collectives add a piece into their working buffer) can borrow the views instead: it opens
a scope (:meth:`Lending.scope`, ``Transport.lend``) for the tags it will receive, and releases
each message (:meth:`Message.release <p2psync.wire.Message.release>`) once it has read it.

Only the consumer's own tags are lent: a ``data`` message whose tag is the scope's prefix
followed by exactly ``depth`` dot-separated parts (the collectives' ``<op>.<phase>.<src>.<piece>``
under ``<op>.`` is depth 3), so another operation nested under the same prefix
(``<op>.flag.rs0.1.2``) is never lent by it. When the scope closes, every message it lent and
that was not released (still queued in the mailbox, dropped there, or taken by a consumer that
failed before it released it) gets copies of its arrays and is released: after the scope,
nothing views the ring any more. A lease that is never given back would only stall the ring
(the sender falls back to ZeroMQ), never corrupt a value; one given back too early would, which
is why lending is opt-in and scoped. Pure bookkeeping: no transport, no sockets.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import numpy as np

from p2psync.errors import ConfigError
from p2psync.wire import Message


class Releasable(Protocol):
    def release(self) -> None: ...


class _Scope:
    __slots__ = ("depth", "count", "loans")

    def __init__(self, depth: int) -> None:
        self.depth, self.count = depth, 0
        self.loans: set[_Loan] = set()


class _Loan:
    """The lease of one lent message, tied to the scope that lent it."""

    __slots__ = ("_scope", "_lease", "msg")

    def __init__(self, scope: _Scope, lease: Releasable, msg: Message) -> None:
        self._scope, self.msg = scope, msg
        self._lease: Releasable | None = lease

    def release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            self._scope.loans.discard(self)
            lease.release()


def own(msg: Message) -> None:
    """Give ``msg`` arrays of its own (copies) in place of the views it holds; if a copy fails,
    no arrays at all (a consumer then rejects it as malformed: never a view of given-back
    memory)."""
    try:
        msg.arrays = [np.array(a, copy=True) for a in msg.arrays]
    except BaseException:
        msg.arrays = []
        raise


class Lending:
    """The open lend scopes of one transport, by tag prefix."""

    def __init__(self) -> None:
        self._scopes: dict[str, _Scope] = {}
        self.lent = 0  # messages lent so far
        self.copied = 0  # messages with lent frames copied out for a consumer that did not borrow

    @contextlib.contextmanager
    def scope(self, prefix: str, depth: int) -> Iterator[None]:
        """Lend the ``data`` messages tagged ``prefix`` + ``depth`` more parts while open (see
        the module docstring); on close, what was lent and not released is copied and
        released."""
        if depth < 1:
            raise ConfigError("a lend scope's depth must be >= 1")
        sc = self._scopes.get(prefix)
        if sc is None:
            sc = self._scopes[prefix] = _Scope(depth)
        elif sc.depth != depth:
            raise ConfigError(f"lend scope {prefix!r} is open with depth {sc.depth}, not {depth}")
        sc.count += 1
        try:
            yield
        finally:
            sc.count -= 1
            if not sc.count:
                del self._scopes[prefix]
                failed: BaseException | None = None
                for loan in list(sc.loans):
                    try:
                        own(loan.msg)
                    except BaseException as exc:  # e.g. MemoryError: every loan is still given back
                        failed = failed or exc
                    loan.msg.release()
                if failed is not None:
                    raise failed

    def _match(self, tag: str) -> _Scope | None:
        for prefix, sc in self._scopes.items():
            if tag.startswith(prefix) and tag.count(".", len(prefix)) == sc.depth - 1:
                return sc
        return None

    def place(self, msg: Message, lease: Releasable) -> None:
        """``msg``'s arrays view memory ``lease`` holds: lend them, if a scope wants this
        message, else copy them out and release the lease now."""
        h = msg.header
        sc = self._match(h.tag) if self._scopes and h.kind == "data" else None
        if sc is None:
            try:
                own(msg)
                self.copied += 1
            finally:
                lease.release()
            return
        loan = _Loan(sc, lease, msg)
        sc.loans.add(loan)
        msg.lease = loan
        self.lent += 1

    @property
    def outstanding(self) -> int:
        """Messages lent and not yet released, over every open scope."""
        return sum(len(sc.loans) for sc in self._scopes.values())


__all__ = ["Lending", "Releasable", "own"]

"""The NaN / infinity checks of received tensor pieces, and offences.

A :class:`FiniteChecks`, held by :class:`~p2psync.transport.base.Transport`, rejects a ``data``
message with NaN or infinity on arrival (:meth:`FiniteChecks.admits`), unless its consumer
promised to check what it uses itself (:meth:`FiniteChecks.defer`: the collectives fuse the
check with the add that reads the piece anyway), and counts each such value as an offence of
the node that sent it (:meth:`FiniteChecks.check`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable, Iterator

import numpy as np

from p2psync.errors import NonFinitePiece
from p2psync.transport.finite import all_finite
from p2psync.transport.mailbox import Mailbox
from p2psync.wire import Message


class FiniteChecks:
    """The finiteness checks of node ``node_id`` (see the module docstring)."""

    def __init__(self, node_id: int, *, mailbox: Mailbox, count: Callable[[int, str, str], None]) -> None:
        """``mailbox``: whose waiters for a rejected piece's tag fail at once; ``count``: counts
        and logs one rejected value of a node, ``(node, reason, detail)``."""
        self.node_id = node_id
        self.mailbox = mailbox
        self._count = count
        #: node -> tensor pieces with non-finite values it sent (rejected)
        self.offences: Counter[int] = Counter()
        #: called with (node, reason) for every offence (the membership client reports it)
        self.listeners: list[Callable[[int, str], None]] = []
        #: tag prefix -> open :meth:`defer` scopes
        self._deferred: Counter[str] = Counter()

    @contextlib.contextmanager
    def defer(self, prefix: str) -> Iterator[None]:
        """While open, ``data`` messages whose tag starts with ``prefix`` are admitted without
        the NaN / infinity scan of :meth:`admits`: the consumer promises to call :meth:`check`
        (offence, :class:`NonFinitePiece`) on every one it uses. Messages arriving before or
        after are scanned as usual."""
        self._deferred[prefix] += 1
        try:
            yield
        finally:
            self._deferred[prefix] -= 1
            if not self._deferred[prefix]:
                del self._deferred[prefix]

    def admits(self, msg: Message, sender: int) -> bool:
        """Whether the tensor message ``msg`` (``data``) may be delivered: its consumer checks it
        (:meth:`defer`), or no floating-point frame holds NaN or infinity. A rejected one counts
        as an offence of ``sender``, the node the value came from (the neighbour that handed it
        over, or a relayed message's origin: relays pass data on unscanned, and in a keyed
        cluster its destination has verified the origin's digest), and a consumer already
        waiting for its tag fails at once with :class:`NonFinitePiece` naming that node."""
        if self._deferred:
            tag = msg.header.tag
            for prefix in self._deferred:
                if tag.startswith(prefix):
                    return True
        for a in msg.arrays:
            if not all_finite(a):
                exc = self.check(sender, a, f"piece {msg.tag!r}", raise_=False)
                if exc is not None:
                    self.mailbox.abort(exc, match=lambda t: t == msg.tag)
                return False
        return True

    def check(self, src: int, arr: np.ndarray, what: str, *, raise_: bool = True) -> NonFinitePiece | None:
        """If the floating-point array ``arr`` that node ``src`` sent holds NaN or infinity: count
        an offence of ``src`` and raise (or, ``raise_=False``, return) :class:`NonFinitePiece`;
        finite values and other dtypes pass (None)."""
        if all_finite(arr):
            return None
        self.offence(src, "non_finite", f"{what}: NaN or infinity in a tensor piece")
        exc = NonFinitePiece(f"node {self.node_id}: {what} from node {src} holds non-finite values "
                             "(rejected; the node is reported for exclusion)", peer=src)
        if raise_:
            raise exc
        return exc

    def offence(self, peer: int, reason: str, detail: str) -> None:
        """Node ``peer`` sent a value this node rejected (counted, logged once, reported)."""
        self.offences[peer] += 1
        self._count(peer, reason, detail)
        for cb in list(self.listeners):
            cb(peer, reason)


__all__ = ["FiniteChecks"]

"""The NaN / infinity checks of received tensor pieces, and offences (split from :mod:`.base`).

:class:`FiniteChecks` is the part of :class:`~p2psync.transport.base.Transport` that rejects a
``data`` message with NaN or infinity on arrival (:meth:`FiniteChecks._finite`), unless its
consumer promised to check what it uses itself (:meth:`FiniteChecks.defer_finite`: the
collectives fuse the check with the add that reads the piece anyway), and counts each such
value as an offence of the node that sent it (:meth:`FiniteChecks.check_finite`).
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
    """Mixin of :class:`~p2psync.transport.base.Transport` (which sets these attributes)."""

    node_id: int
    mailbox: Mailbox
    #: node -> tensor pieces with non-finite values it sent (rejected)
    offences: Counter[int]
    #: called with (node, reason) for every offence (the membership client reports it)
    offence_listeners: list[Callable[[int, str], None]]
    #: tag prefix -> open :meth:`defer_finite` scopes
    _deferred_finite: Counter[str]

    def _reject(self, nic: str, peer: str, reason: str, detail: str, *, per_peer: bool = True) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def defer_finite(self, prefix: str) -> Iterator[None]:
        """While open, ``data`` messages whose tag starts with ``prefix`` are delivered without
        the NaN / infinity scan of :meth:`_finite`: the consumer (the collectives, which fuse the
        check with the add that reads the piece anyway) promises to call :meth:`check_finite`
        (offence, :class:`NonFinitePiece`) on every one it uses. Messages arriving before or
        after are scanned as usual."""
        self._deferred_finite[prefix] += 1
        try:
            yield
        finally:
            self._deferred_finite[prefix] -= 1
            if not self._deferred_finite[prefix]:
                del self._deferred_finite[prefix]

    def _finite_deferred(self, tag: str) -> bool:
        return bool(self._deferred_finite) and any(tag.startswith(p) for p in self._deferred_finite)

    def _finite(self, msg: Message, sender: int) -> bool:
        """A tensor message (``data``) with NaN or infinity in a floating-point frame is rejected
        here, for every consumer: counted as an offence of ``sender``, the node the value came
        from (the neighbour that handed it over, or a relayed message's origin: relays pass
        data on unscanned, and in a keyed cluster its destination has verified the origin's
        digest), and a consumer already waiting for its tag fails at once with
        :class:`NonFinitePiece` naming that node."""
        for a in msg.arrays:
            if not all_finite(a):
                exc = self.check_finite(sender, a, f"piece {msg.tag!r}", raise_=False)
                if exc is not None:
                    self.mailbox.abort(exc, match=lambda t: t == msg.tag)
                return False
        return True

    def check_finite(self, src: int, arr: np.ndarray, what: str, *, raise_: bool = True) -> NonFinitePiece | None:
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
        self._reject("", str(peer), reason, detail)
        for cb in list(self.offence_listeners):
            cb(peer, reason)


__all__ = ["FiniteChecks"]

"""The identity of one collective operation, and the tags it is known by on the wire.

Every member of a group names an operation the same way: its ``kind`` (the component and what
it exchanges: ``"ssgd"``, ``"dts.win"``, ``"preduce"``), its ``seq`` within that kind (a step,
a count, a window, or parts of them: ``(resyncs, window)``; a name for one-off operations:
``"sync"``) and the view ``epoch`` it runs over. Its tag is ``<kind>.<seq parts>.e<epoch>``
(:attr:`OpId.tag`); operations that run alongside it (a stop flag, buffers, another tensor)
are named by :meth:`OpId.sub`; the pieces of a collective add ``.<phase><round>.<src>.<piece>``
(:mod:`p2psync.collectives.executor`), so every tag of the operation starts with
:attr:`OpId.root`, the root its :class:`~p2psync.transport.mailbox.Scope` is opened over. The
group is not part of the tag: each piece carries a signature of the operation's group and plan,
and a member that runs the same tag over another group is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

Part = int | str


@dataclass(frozen=True)
class OpId:
    """One operation: ``kind``, ``seq`` (one part or a tuple of parts) and view ``epoch``."""

    kind: str
    seq: Part | tuple[Part, ...]
    epoch: int

    @property
    def tag(self) -> str:
        """``<kind>.<seq parts>.e<epoch>``, e.g. ``OpId("ssgd", 12, 3).tag == "ssgd.12.e3"``."""
        parts = self.seq if isinstance(self.seq, tuple) else (self.seq,)
        return ".".join((self.kind, *map(str, parts), f"e{self.epoch}"))

    @property
    def root(self) -> str:
        """The prefix of every tag of this operation and of its :meth:`sub` operations."""
        return f"{self.tag}."

    def sub(self, name: str) -> str:
        """The tag of an operation run as part of this one (``"flag"``, ``"steps"``, ``"p0"``)."""
        return f"{self.tag}.{name}"

    def __str__(self) -> str:
        return self.tag


__all__ = ["OpId"]

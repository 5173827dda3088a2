"""Membership views: the coordinator's authoritative, epoch-numbered list of members. Pure.

A :class:`View` is ``(epoch, members, incarnations, coordinator, term)``; the coordinator bumps the
epoch on every membership change (a registration, a failure, a coordinator takeover; joins of a
running run later) and publishes the view as an ``event.view`` event and in the reply to every
heartbeat of a node that has not applied it yet. The view names the coordinator that published it: after a failover (see
:mod:`p2psync.coordinator.takeover`) nodes follow the coordinator named by the highest-epoch
view. Wire form (message meta)::

    {"epoch": int, "members": [int, ...], "inc": [[node, incarnation], ...], "coord": int,
     "dep": [int, ...], "end": str, "term": int}

``term`` numbers the coordinator's election (:mod:`p2psync.coordinator.quorum`): views are
ordered by ``(term, epoch)`` (:attr:`View.key`), one coordinator per term, and a takeover
starts its epochs above every epoch its voters had applied, so epochs keep growing too.

``end`` (optional) is set when the coordinator ended the run as diverged (most members were
reported for sending non-finite tensor values, see :mod:`p2psync.coordinator.membership_state`): every
node that applies such a view stops with :class:`~p2psync.errors.Diverged`.

A node that finishes (its training loop ended and it entered the finish barrier) *departs*:
the coordinator publishes a view without it that lists it in ``departed``, so the others re-form
without waiting for it and can tell a graceful departure from a crash.

:class:`ViewTracker` is the client side: it applies views in epoch order, ignores stale or
duplicate ones, and reports which members left (failed) and joined, so the membership client
can call its listeners exactly once per failed peer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from p2psync.errors import ProtocolError
from p2psync.wire.schema import MAX_U64

#: longest reason a view may give for ending the run
MAX_END_CHARS = 400


@dataclass(frozen=True)
class View:
    """One membership view: the training group (``members``) of one ``epoch``, published by the
    coordinator on every change. Strategies get each newer one in ``Strategy.on_view`` and the
    current one as ``ctx.view``; e.g. ssgd.py tags its allreduce with it:
    ``tag = OpId("ssgd", step, v.epoch).tag`` (``"ssgd.<step>.e<epoch>"``), ``group=v.members``."""

    epoch: int
    members: tuple[int, ...]
    #: node -> incarnation of the member's registered process
    incarnations: Mapping[int, int] = field(default_factory=dict)
    #: the node that published this view (the coordinator of this epoch)
    coordinator: int = 0
    #: nodes that left the run gracefully (finished; no longer members); not failures
    departed: tuple[int, ...] = ()
    #: why the coordinator ended the run (diverged), or ""
    ended: str = ""
    #: the term of the coordinator that published it (its election)
    term: int = 0

    @property
    def key(self) -> tuple[int, int]:
        """The view's place in the order of views: ``(term, epoch)``."""
        return (self.term, self.epoch)

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-able map :meth:`from_wire` parses (heartbeat replies, ``event.view``)."""
        out: dict[str, Any] = {"epoch": self.epoch, "members": list(self.members),
                               "inc": [[n, i] for n, i in sorted(self.incarnations.items())],
                               "coord": self.coordinator, "dep": list(self.departed), "term": self.term}
        if self.ended:
            out["end"] = self.ended
        return out

    @staticmethod
    def from_wire(obj: Any) -> "View":
        """Parse an untrusted view; raises :class:`ProtocolError` (reason ``view``)."""
        if not isinstance(obj, dict):
            raise ProtocolError("view", "view must be a map")
        epoch, members, inc = obj.get("epoch"), obj.get("members"), obj.get("inc", [])
        coord = obj.get("coord")
        if type(epoch) is not int or epoch < 0:
            raise ProtocolError("view", f"bad epoch {epoch!r}"[:100])
        if type(coord) is not int or not 0 <= coord <= MAX_U64:
            raise ProtocolError("view", f"bad coordinator {coord!r}"[:100])
        term = obj.get("term", 0)
        if type(term) is not int or not 0 <= term <= MAX_U64:
            raise ProtocolError("view", f"bad term {term!r}"[:100])
        if not isinstance(members, list) or any(type(m) is not int or m < 0 for m in members):
            raise ProtocolError("view", "members must be a list of node ids")
        if not isinstance(inc, list):
            raise ProtocolError("view", "inc must be a list of [node, incarnation]")
        dep = obj.get("dep", [])
        if not isinstance(dep, list) or any(type(m) is not int or m < 0 for m in dep):
            raise ProtocolError("view", "dep must be a list of node ids")
        ended = obj.get("end", "")
        if not isinstance(ended, str) or len(ended) > MAX_END_CHARS:
            raise ProtocolError("view", f"end must be a text of at most {MAX_END_CHARS} characters")
        incs: dict[int, int] = {}
        for pair in inc:
            if (not isinstance(pair, list) or len(pair) != 2 or type(pair[0]) is not int
                    or type(pair[1]) is not int or not 0 <= pair[1] <= MAX_U64):
                raise ProtocolError("view", "inc must be a list of [node, incarnation]")
            incs[pair[0]] = pair[1]
        return View(epoch=epoch, members=tuple(sorted(set(members))), incarnations=incs,
                    coordinator=coord, departed=tuple(sorted(set(dep))), ended=ended, term=term)


def news_for(view: View | None, args: Any) -> bool:
    """Whether ``view`` is news to a node whose request ``args`` name the view it applied
    (``"epoch"``, ``"term"``; a probe's): True when they name none, or an older one. A node
    applies only views newer than its own (:class:`ViewTracker`), so an answer without the
    view loses nothing otherwise, and costs O(1) instead of O(N)."""
    if view is None:
        return False
    if not isinstance(args, Mapping):
        return True
    epoch, term = args.get("epoch"), args.get("term")
    if type(epoch) is not int or type(term) is not int:
        return True
    return view.key > (term, epoch)


@dataclass(frozen=True)
class ViewChange:
    """What applying a newer view changed: the nodes that ``left`` and ``joined`` the members
    (:meth:`ViewTracker.apply`)."""

    view: View
    left: tuple[int, ...]
    joined: tuple[int, ...]


class ViewTracker:
    """Applies views in ``(term, epoch)`` order (client side)."""

    def __init__(self) -> None:
        self.view: View | None = None

    def apply(self, view: View) -> ViewChange | None:
        """The change ``view`` brings, or None when it is not newer than the current one."""
        old = self.view
        if old is not None and view.key <= old.key:
            return None
        self.view = view
        before = set(old.members) if old is not None else set(view.members)
        after = set(view.members)
        return ViewChange(view=view, left=tuple(sorted(before - after)),
                          joined=tuple(sorted(after - before)))


__all__ = ["View", "ViewChange", "ViewTracker", "news_for"]

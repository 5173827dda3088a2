"""Which peers one node counts failed or departed, which it routes around, and when it routes
through them again.

Routes around a suspicion. A peer this node judged failed itself (its detector, a successor
passed over, a member's report of deposed coordinators) is marked dead in its transport, so
that its messages route around it; a view that still names it is the only other thing that
routes through it again. A message that arrives from such a peer, or through it, after it was
marked is proof that it lives and relays (:func:`heard_again`): while it is a member of this
node's view it is routed through again and no longer counted failed here (its heartbeats stop
reporting it to the coordinator, a candidate that wins keeps it, and a later failure of it is
declared again); whether it stays a member is the coordinator's decision, and the next view
that names it makes it a possible successor again (no longer deposed here), as it does for
every member this node counted failed. Without that a node that suspected the other side of a
partition that healed could reach it only through a view, and when no view could be made (each
side's candidate unable to reach the voters it marked dead, the coordinator short of the
majority those voters would complete) the run stayed split for good.

:class:`PeerStatus` is owned by :class:`~p2psync.coordinator.membership_client.MembershipClient`,
which decides when a peer failed, departed or is a member again; this module keeps the sets,
the transport's routing and the listeners consistent with those decisions.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Collection, Iterable, Mapping

from p2psync import clock
from p2psync.coordinator.views import View
from p2psync.transport import Transport

log = logging.getLogger("p2psync.membership")


def heard_again(marked: Mapping[int, float], arrivals: Mapping[int, float], members: Collection[int],
                dead: Collection[int]) -> list[int]:
    """The peers to route through again (see the module docstring). Pure.

    ``marked``: peer -> when this node marked it dead on its own judgement; ``arrivals``: peer ->
    when a message last arrived from it or through it (``Transport.last_arrival``); ``members``:
    the members of this node's view; ``dead``: the peers marked dead now. A peer is heard again
    when it is still marked dead, is a member, and a message arrived from or through it after
    it was marked (a message at the same instant may have been sent before)."""
    return sorted(n for n, at in marked.items()
                  if n in dead and n in members and arrivals.get(n, -math.inf) > at)


def left_out(view: View, nodes: Collection[int], me: int) -> list[int]:
    """The ``nodes`` (the topology's) that a process whose first view is ``view`` routes
    around from the start: neither members nor departed, and not ``me``. Pure.

    Every process that applied the views that removed them marks them dead as each one does;
    a process whose first view comes later (a restarted node joining, whose view lists no
    change from any earlier one) must route around them too: a removed node may still be
    running and relaying (fenced, not restarted yet), and a path through it is one the
    coordinator and the other members do not use, so the failure of a relay on the members'
    paths would not cut this node off as it cuts off every member behind that relay."""
    out = set(view.members) | set(view.departed) | {me}
    return sorted(n for n in nodes if n not in out)


class PeerStatus:
    """The failed and departed peers of one node and its routing around them.

    ``listeners`` are called once per peer that failed or departed (strategies'
    ``on_peer_failure``), in the order of the calls that declare them."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.me = transport.node_id
        #: peers counted failed here (reported in heartbeats)
        self.failed: set[int] = set()
        #: peers that finished and left the run gracefully
        self.departed: set[int] = set()
        #: called once per failed or departed peer
        self.listeners: list[Callable[[int], None]] = []
        #: failed peers this node marked dead on its own judgement -> when (:func:`heard_again`)
        self._marked_at: dict[int, float] = {}
        #: peers heard again since (:meth:`reroute`), until a view names them or removes them
        self._rerouted: set[int] = set()

    def declare(self, peers: Iterable[int], *, coordinator: int, reborn: Collection[int] = ()) -> None:
        """``peers`` failed: counted failed here and routed around, but for ``coordinator``
        (the one this node follows: its failover decides) and the ``reborn`` ones
        (:func:`~p2psync.coordinator.membership_state.reborn`: their new process relays for the
        nodes behind it). A departed peer is only routed around (a coordinator exits after its
        finish barrier)."""
        for p in peers:
            if p in self.failed or p == self.me:
                continue
            self._rerouted.discard(p)
            if p in self.departed:
                self.transport.mark_dead(p)
                continue
            self.failed.add(p)
            if p != coordinator and p not in reborn:
                self.transport.mark_dead(p)
                self._marked_at[p] = clock.now()
            log.warning("node %d: peer %d failed (at %.3f)", self.me, p, clock.wall())
            for cb in list(self.listeners):
                cb(p)

    def depart(self, peers: Iterable[int]) -> None:
        """``peers`` finished and left the run (graceful, not failures): the listeners drop
        them from the training groups, as for a failure, but nothing is declared dead."""
        for p in peers:
            if p in self.departed or p == self.me:
                continue
            self.departed.add(p)
            log.info("node %d: peer %d finished and left the run", self.me, p)
            for cb in list(self.listeners):
                cb(p)

    def reroute(self, view: View | None) -> None:
        """Route again through the failed peers heard since this node marked them dead, while
        they are members of ``view``, and count them failed no more (:func:`heard_again`)."""
        dead = self.transport.dead
        for n in list(self._marked_at):
            if n not in dead:
                del self._marked_at[n]  # routed through again already (a view, a restart)
        if view is None or not self._marked_at:
            return
        for n in heard_again(self._marked_at, self.transport.last_arrival, view.members, dead):
            del self._marked_at[n]
            self.failed.discard(n)
            self._rerouted.add(n)
            self.transport.revive(n)
            log.warning("node %d: node %d, judged failed here, was heard again: routed through again", self.me, n)

    def suspected_members(self, view: View) -> set[int]:
        """The members of ``view`` that this node routes around, counts failed, or heard again
        after it did: alive to the coordinator that names them, so :meth:`readmit` them."""
        dead = self.transport.dead
        return {n for n in view.members if n in dead or n in self.failed or n in self._rerouted}

    def readmit(self, node: int) -> None:
        """``node`` is a member again (a joiner, a new life, a member named by a view): routed
        through, and its next failure or departure is reported again."""
        self.transport.revive(node)
        self.failed.discard(node)
        self._marked_at.pop(node, None)
        self._rerouted.discard(node)
        self.departed.discard(node)


__all__ = ["PeerStatus", "heard_again", "left_out"]

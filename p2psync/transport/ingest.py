"""Sans-IO ingest: what a node does with one message it received.

:class:`Ingest` takes the frames of one message as a link handed them over, the neighbour that
sent them and this run's id, and returns a decision: :class:`Deliver` (the message is for this
node), :class:`Forward` (for another node: pass it on; the relay picks the next hop, which
depends on the links' state) or :class:`Reject` (drop it, counted under its reason). It does no
IO, starts no task, reads no clock and reports every refusal as a :class:`Reject`, never as an
exception; the transport acts on the decision
(:meth:`p2psync.transport.base.Transport._ingest`).

The stages, in order (the first that refuses names the reason):

1. **sender**: the link must name a node of the topology (``unknown_peer``);
2. **decode**: the strict wire decoder (:func:`p2psync.wire.decode`; its reasons, such as
   ``header_msgpack``, pass through);
3. **authenticate**: a header naming an origin other than the neighbour must be a relayed one
   (``dst`` set, ``hops`` > 0), else ``src_mismatch``; in a keyed cluster
   (:class:`~p2psync.transport.relay_auth.OriginAuth`) a relayed message must also carry its
   origin's digest and counter, and one for this node must verify and be new (``relay_auth``,
   ``relay_replay``); the origin is *proven* when the neighbour is the origin or the digest
   verified here;
4. **admit**: the run id must be this run's (``wrong_run``) and the origin's incarnation no
   older than the one registered for it (``stale_incarnation``);
5. **route**: for this node, :class:`Deliver`; for another, :class:`Forward` unless it has
   used up its hops or names a node outside the topology (``relay``).

Every decision from stage 5 also says what the message proves about who is alive, for the
caller to record: ``alive`` lists the nodes it proves alive (the neighbour that handed it over,
unless that neighbour's own messages came from a newer life than the registered one: a
restarted process relays at once, and what it relays proves nothing about its previous
process, which must be declared failed before the new one is admitted; and its origin when
proven and of the registered incarnation, or of any when none is registered), and
``revive`` is set when it is a proven new life of a node marked dead (a restarted process):
the caller registers that incarnation and routes through the node again;
whether it is a member again is the membership's decision. A proven new life of a node not
marked dead yet is remembered (:meth:`Ingest.newer_life`): when its previous process is
declared failed later, the node is not routed around (the new process relays at once). An
unproven origin (a message this node only relays, in a keyed cluster) proves nothing about it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Literal, Mapping, Sequence, Union

from p2psync.errors import ProtocolError
from p2psync.transport.relay_auth import OriginAuth
from p2psync.wire import MAX_HOPS, Message, WireLimits, decode

#: the stage that refused a message (see the module docstring)
Stage = Literal["sender", "decode", "authenticate", "admit", "route"]
#: the reasons of the pipeline's own stages; a message the decoder refuses is rejected under the
#: decoder's reason (:attr:`p2psync.errors.ProtocolError.reason`)
Reason = Literal["unknown_peer", "src_mismatch", "relay_auth", "relay_replay", "wrong_run", "stale_incarnation",
                 "relay"]


@dataclass(slots=True)
class Revive:
    """A proven message of ``node``, marked dead, from a newer ``incarnation`` than the
    registered one: register it and route through ``node`` again."""

    node: int
    incarnation: int


@dataclass(slots=True)
class Deliver:
    """The message is for this node: hand it to the mailbox (after the finiteness check)."""

    message: Message
    #: nodes this message proves alive (record their arrival time)
    alive: tuple[int, ...] = ()
    revive: Revive | None = None


@dataclass(slots=True)
class Forward:
    """The message is for node ``message.header.dst``: pass it on towards it, never back to
    ``came_from`` (the neighbour that handed it over)."""

    message: Message
    came_from: int
    alive: tuple[int, ...] = ()
    revive: Revive | None = None


@dataclass(slots=True)
class Reject:
    """Drop the message; count it under ``reason`` (a :data:`Reason` or the decoder's).
    ``message``: the decoded message, when decoding got that far (to release). A message refused
    at the route stage was admitted: it carries ``alive`` and ``revive`` like the others."""

    reason: str
    detail: str
    stage: Stage
    message: Message | None = None
    alive: tuple[int, ...] = ()
    revive: Revive | None = None


#: a decision is a value: nothing changes it once the pipeline made it (plain slotted
#: dataclasses, not frozen ones, whose construction costs several times more per message)
Decision = Union[Deliver, Forward, Reject]


def hop_limit(nodes: int) -> int:
    """The most hops a relayed message may take in a topology of ``nodes`` nodes: as many as
    it has nodes (no simple path is longer), at most the wire's :data:`~p2psync.wire.MAX_HOPS`.
    A message past it has looped: relays that cannot reach its destination (a partition, a
    node not yet declared dead) pass it to their other neighbours, and without the limit it
    wandered until the wire's limit, each reply to it wandering too (a storm of relayed
    probes: a 9 s even split of BCube(4, 2) cost 780 k events instead of 47 k)."""
    return min(MAX_HOPS, nodes)


class Ingest:
    """The ingest pipeline of one node (see the module docstring). It reads, never writes,
    ``incarnations`` (registered incarnation per node) and ``dead`` (nodes marked dead), which
    their owner updates in place; ``auth`` (keyed clusters only) remembers the counters of the
    relayed messages it accepted; :attr:`newest` remembers the newest incarnation each
    neighbour's own messages carried, when newer than the registered one, and :attr:`reborn`
    the newest proven incarnation of every origin, when newer than the registered one."""

    def __init__(self, *, node_id: int, nodes: Collection[int], limits: WireLimits,
                 incarnations: Mapping[int, int], dead: Collection[int], auth: OriginAuth | None = None) -> None:
        """``nodes``: the ids of the topology's nodes (a relayed message's possible destinations)."""
        self.node_id = node_id
        self.nodes = nodes
        self.limits = limits
        self.incarnations = incarnations
        self.dead = dead
        self.auth = auth
        #: neighbour -> the newest incarnation its own messages carried, newer than the one
        #: registered then (a restarted process not admitted yet)
        self.newest: dict[int, int] = {}
        #: origin -> the newest incarnation its proven messages carried, newer than the one
        #: registered then (a restarted process, heard before or after its previous one failed)
        self.reborn: dict[int, int] = {}

    def newer_life(self, node: int, than: int | None = None) -> int | None:
        """The newest incarnation of ``node`` that a proven message carried, if it is newer
        than ``than`` (None: the registered one), a process started after that one; else None
        (also when neither is known)."""
        inc = self.reborn.get(node)
        known = self.incarnations.get(node) if than is None else than
        return inc if inc is not None and known is not None and inc > known else None

    def admit(self, frames: Sequence[Any], peer: int | None, run: int) -> Decision:
        """The decision for one message: ``frames`` as received (a shared-memory marker already
        resolved), ``peer`` the neighbour that handed them over (None: the link names no node of
        the topology), ``run`` this run's id."""
        if peer is None:
            return Reject("unknown_peer", "sender is not a node of the topology", "sender")
        try:
            msg = decode(frames, self.limits)
        except ProtocolError as exc:
            return Reject(exc.reason, exc.detail, "decode")
        h = msg.header
        proven = True
        if h.src != peer:
            if h.dst is None or h.hops == 0:
                return Reject("src_mismatch", f"header src {h.src} on connection of {peer}", "authenticate",
                              msg)
            if self.auth is not None:
                try:
                    proven = self.auth.proven(h, frames[1:])
                except ProtocolError as exc:
                    return Reject(exc.reason, exc.detail, "authenticate", msg)
        if h.run != run:
            return Reject("wrong_run", f"run id {h.run:#x} is not this run's ({run:#x})", "admit", msg)
        known = self.incarnations.get(h.src)
        if known is not None and h.inc < known:
            return Reject("stale_incarnation",
                          f"node {h.src}'s incarnation {h.inc} is older than the one this node already knows, "
                          f"{known}: a message of its previous process, or a restarted process with a stepped-back "
                          "clock? (its messages are dropped until it runs with a newer incarnation)", "admit", msg)
        if h.src == peer and (known is None or h.inc == known) and (h.dst is None or h.dst == self.node_id):
            return Deliver(msg, (peer,))  # the common case (a neighbour's own message for this node), inline
        alive, revive = self._liveness(h.src, h.inc, known, peer, proven)
        return self._route(msg, peer, alive, revive)

    def _liveness(self, src: int, inc: int, known: int | None, peer: int,
                  proven: bool) -> tuple[tuple[int, ...], Revive | None]:
        """What an admitted message from ``src`` (incarnation ``inc``; ``known``: the registered
        one) that ``peer`` handed over proves: the nodes it proves alive, and a revival. What it
        says about its origin counts only when the origin is ``proven``: a relay must not let a
        forged new life of a dead node outrank its real restart."""
        revive = None
        alive: tuple[int, ...] = ()
        if proven and known is not None and inc > known:
            self.reborn[src] = max(inc, self.reborn.get(src, inc))
        if proven and known is not None and inc > known and src in self.dead:
            revive = Revive(src, inc)
        elif proven and (known is None or inc == known):  # a newer, unregistered life proves
            alive = (src,)                                # nothing about the registered process
        if src == peer and known is not None and inc > known:
            self.newest[peer] = max(inc, self.newest.get(peer, inc))
        if peer != src and self.newest.get(peer, -1) <= self.incarnations.get(peer, -1):
            alive = (*alive, peer)  # (a neighbour seen in a newer life relays for that life)
        return alive, revive

    def _route(self, msg: Message, peer: int, alive: tuple[int, ...], revive: Revive | None) -> Decision:
        dst = msg.header.dst
        if dst is None or dst == self.node_id:
            return Deliver(msg, alive, revive)
        if msg.header.hops + 1 > hop_limit(len(self.nodes)):
            return Reject("relay", f"hop limit reached for message to node {dst}", "route", msg, alive, revive)
        if dst not in self.nodes:
            return Reject("relay", f"unknown destination {dst}", "route", msg, alive, revive)
        return Forward(msg, peer, alive, revive)


__all__ = ["Decision", "Deliver", "Forward", "Ingest", "Reason", "Reject", "Revive", "Stage", "hop_limit"]

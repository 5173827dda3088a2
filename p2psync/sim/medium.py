"""The simulated medium: the in-memory transport of every simulated node, with per-link
latency, cut links and slowed links, and the express path of relayed control messages.

:class:`SimHub` is the medium of one simulated run (the links' latency, the cuts of the
partitions in force, the slowdowns) and :class:`SimTransport` a node's endpoint on it. A
message goes to its receiver as a callback of the receiver's actor of the
:class:`~p2psync.sim.loop.VirtualLoop`, one loop iteration after it was handed over (after the
link latency when the link has one). A relayed control message whose whole path is clear
crosses it in one step (the express path: :class:`SimTransport`), crediting every relay on the
way as the hop-by-hop path would; a blocked path goes hop by hop. The cluster
(:mod:`p2psync.sim.cluster`) builds the nodes over it and applies the faults.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import itertools
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, NamedTuple

import msgpack

from p2psync import clock
from p2psync.coordinator.votes import MemoryVotes
from p2psync.sim.faults import Fault
from p2psync.sim.loop import ACTOR
from p2psync.topology import Route, Topology
from p2psync.transport import MemoryHub
from p2psync.transport.base import NotReady
from p2psync.transport.ingest import hop_limit
from p2psync.transport.relay import resend_number
from p2psync.transport.memory import MemoryTransport
from p2psync.wire import PATH_KEPT, placed


class SimHub(MemoryHub):
    """The simulated medium: in-memory endpoints, links cut by partitions, and each node's
    actor context (deliveries run in it).

    ``latency(a, b)``: the one-way latency of the link between neighbours ``a`` and ``b``
    (:meth:`latency`: times the factor of the slowdowns in force on it, :attr:`slow`);
    ``express``: relayed control messages take the express path (see :class:`SimTransport`)."""

    def __init__(self, topology: Topology, *, latency: Callable[[int, int], float] | None = None,
                 express: bool = False) -> None:
        super().__init__(topology)
        #: pairs of sides whose links are down now
        self.cuts: list[tuple[frozenset[int], frozenset[int]]] = []
        self.contexts: dict[int, contextvars.Context] = {}
        #: sends refused because the link was cut (retried by the sender)
        self.refused = 0
        self.base_latency = latency or (lambda a, b: 0.0)
        #: the slowdowns in force
        self.slow: list[Fault] = []
        #: node -> the actor its current process runs as (the node id unless restarted)
        self.actors: dict[int, Hashable] = {}
        self.express = express
        #: relayed control messages that took the express path, and the relay hops it stood for
        self.expressed = 0
        self.express_hops = 0
        #: bumped whenever a node's router marks a node dead or revives one: express paths kept
        #: from before are checked again
        self.generation = 0
        #: every node's transport, killed ones too (their counters)
        self.transports: dict[int, SimTransport] = {}
        #: each node's votes, kept across its processes as on its disk (:mod:`p2psync.coordinator.votes`)
        self.votes: dict[int, MemoryVotes] = {}
        #: bumped whenever a fault begins or ends (express paths are checked again)
        self.faults = 0
        #: (sender, first relay, destination, reply, resend spread) -> the express path kept
        self.paths: dict[tuple[int, int, int, bool, int], _Path] = {}
        #: origin -> bumped whenever a router's memory of the way back to it changes (express
        #: paths whose relays' ways back to it were checked before are checked again)
        self.back_changes: dict[int, int] = {}
        #: (previous node, relay, destination, reply, resend spread) -> the relay's decision (:func:`_walk`)
        self.hops: dict[tuple[int, int, int, bool, int], _Hop] = {}

    def endpoint(self, node_id: int, **kwargs: Any) -> "SimTransport":
        """Node ``node_id``'s endpoint on this medium (not started; ``kwargs``: the
        :class:`SimTransport` keywords)."""
        return SimTransport(hub=self, node_id=node_id, **kwargs)

    def flush(self) -> None:
        """Bring every relay's counters up to date with the express paths' traffic (their
        messages are counted on the paths as they cross, and credited here)."""
        for path in self.paths.values():
            path.flush(self)

    def context(self, node: int) -> contextvars.Context:
        """The context that ``node``'s current process runs in (its :data:`ACTOR`)."""
        ctx = self.contexts.get(node)
        if ctx is None:
            ctx = self.contexts[node] = contextvars.copy_context()
            ctx.run(ACTOR.set, self.actors.get(node, node))
        return ctx

    def factor(self, a: int, b: int) -> float:
        """How many times slower the link between ``a`` and ``b`` is now (1: not slowed)."""
        return max((f.factor or 1.0 for f in self.slow if f.slows(a, b)), default=1.0)

    def latency(self, a: int, b: int) -> float:
        """The one-way latency of the link between neighbours ``a`` and ``b`` now."""
        lat = self.base_latency(a, b)
        return lat * self.factor(a, b) if self.slow else lat

    def leave(self, transport: MemoryTransport) -> None:
        """As :meth:`MemoryHub.leave`; the express paths check their nodes again."""
        self.faults += 1
        super().leave(transport)

    def links_changed(self) -> None:
        """Cuts began or ended: every node's sends waiting for a connection look again."""
        for t in self.endpoints.values():
            if isinstance(t, SimTransport):
                t._links_changed()
                t._peers_changed()

    def cut(self, a: int, b: int) -> bool:
        """Whether the link between ``a`` and ``b`` is down now."""
        return any((a in x and b in y) or (a in y and b in x) for x, y in self.cuts)


class SimTransport(MemoryTransport):
    """A :class:`MemoryTransport` whose deliveries run as callbacks of the receiver's actor
    and stop at cut links (see the module docstring).

    **Express path** (``hub.express``). On a ring of N nodes a control message to the
    coordinator crosses N/4 relays on average, so the heartbeats alone cost O(N²) relay steps
    per interval: a simulation of 1024 nodes would spend its time re-encoding relayed
    heartbeats. A relayed control message handed to its first relay therefore takes the path
    that every relay's own decisions give (the first candidate of its router's ``next_hops``,
    or ``reply_hops`` for a reply, never back where it came from) in one step, when that whole
    path is clear now: every relay and the destination up and not held, no link on it cut,
    no next hop marked dead by the relay before it, no keys, no revival or stale incarnation
    to judge on the way. The path ends early at a node that would do anything else than pass
    the message on at once (e.g. the end of a line that a kill left, with no next hop): the
    relays before it are crossed in one step and it ingests the message as usual. Each relay is credited as if it had passed the message on:
    :meth:`Router.heard` and the proof of life its ingest records at once; a message received
    and one sent on its NICs' counters, and one relayed, when :meth:`SimHub.flush` brings the
    counters up to date (the summary does), and the destination ingests it after the latencies of the links of the path, with
    its hop count, from the last relay. When the path is not clear the message goes hop by
    hop, as always. What the express path does not model: a relay that fails or is cut off
    while the message crosses it (a few link latencies)."""

    def __init__(self, *, hub: SimHub, node_id: int, **options: Any) -> None:
        super().__init__(hub=hub, node_id=node_id, **options)
        self.sim = hub
        hub.transports[node_id] = self
        #: bumped whenever this node's router marks a node dead or revives one
        self.routes_version = 0
        self.router.back = _Backs(hub)

    def _transmit(self, peer: int, route: Route, frames: list[Any], *, bulk: bool = False,
                  unordered: bool = False) -> None:
        hub = self.sim
        target = hub.endpoints.get(peer)
        if target is None:
            raise NotReady
        if hub.cuts and hub.cut(self.node_id, peer):
            hub.refused += 1
            raise NotReady
        copied = [bytes(f) for f in placed(frames)]
        loop = asyncio.get_running_loop()
        if hub.express and not bulk:
            cpu = getattr(loop, "actor_cpu", None)
            if cpu is None:
                if self._express(peer, copied, loop):
                    return
            else:  # the express path is the simulator's work, not the sender's (VirtualLoop.actor_cpu)
                t = time.process_time()
                done = self._express(peer, copied, loop)
                spent = time.process_time() - t
                cpu[ACTOR.get()] -= spent
                cpu[None] += spent
                if done:
                    return
        loop.call_soon(target._ingest, route.remote_nic, self.node_id, f"{self.node_id}/{route.local_nic}",
                       copied, context=hub.context(peer))

    def _connected(self, peer: int, bulk: bool) -> bool:
        """Up unless the link is cut: a cut is known to both ends at once here, as a dropped
        connection is (a peer not started yet, or killed, is found at delivery, as before)."""
        hub = self.sim
        return not (hub.cuts and hub.cut(self.node_id, peer))

    def _express(self, peer: int, frames: list[bytes], loop: asyncio.AbstractEventLoop) -> bool:
        """Deliver a relayed control message over its whole path at once, if the path is clear
        (see the class docstring); False: it goes to ``peer`` the ordinary way. The path is
        walked again only when a router on it changed its dead nodes (:meth:`_Path.current`);
        what changes between messages (nodes up and held, cut links, a relay's memory of the
        way back, incarnations) is checked on every use."""
        hub = self.sim
        try:
            header = msgpack.unpackb(frames[0], raw=False)
        except (ValueError, msgpack.ExtraData):
            return False
        if not isinstance(header, dict):
            return False
        dst, src, kind = header.get("dst"), header.get("src"), header.get("kind")
        inc, hops = header.get("inc"), header.get("hops", 0)
        if (type(dst) is not int or dst == peer or kind == "data" or type(src) is not int
                or header.get("auth") is not None or type(inc) is not int or type(hops) is not int
                or "path" in header):  # (a relay's own decisions: the path from its origin is not kept)
            return False
        reply = kind == "reply"
        spread = 0 if reply else resend_number(header)
        key = (self.node_id, peer, dst, reply, spread)
        path = hub.paths.get(key)
        if path is None or not path.current(hub) or not path.clear(hub, loop, src, inc):
            path = _walk(hub, self.node_id, peer, dst, reply, spread)
            if path is None or hops + len(path.nodes) - 1 > hop_limit(len(self.topology.ids)) \
                    or not path.clear(hub, loop, src, inc):
                return False
            if len(hub.paths) >= 4 * len(hub.endpoints) + 1024:
                hub.flush()
                hub.paths.clear()  # (kept for the steady traffic: heartbeats and their replies)
            old = hub.paths.get(key)
            if old is not None:
                old.flush(hub)
            hub.paths[key] = path
        now = clock.now()
        nodes = path.nodes
        path.uses += 1  # (the relays' counters: SimHub.flush)
        path.bytes += sum(len(f) for f in frames)
        # every relay, as if it passed the message on: the arrival of the origin and of the
        # neighbour it came from (in that order), and its way back to the origin (set once:
        # checked again only when some router's way back changed, or for another origin)
        _consume(map(operator.setitem, path.arrivals, itertools.repeat(src), itertools.repeat(now)))
        _consume(map(operator.setitem, path.arrivals, nodes[:-2], itertools.repeat(now)))
        if path.backs_src != src or path.backs_seen != hub.back_changes.get(src, 0):
            for i in range(1, len(nodes) - 1):
                prev = nodes[i - 1]
                router = path.relays[i - 1].router
                if prev != src and router.back.get(src) != prev:
                    router.heard(src, prev)
            path.backs_src, path.backs_seen = src, hub.back_changes.get(src, 0)
        last = nodes[-2]
        header["hops"] = hops + len(nodes) - 2
        if len(nodes) > 2:
            header["path"] = _passed(nodes)
        out = [msgpack.packb(header, use_bin_type=True), *frames[1:]]
        end = nodes[-1]  # the destination, or the node that does anything else than pass it on
        loop.call_at(loop.time() + path.latency, hub.endpoints[end]._ingest, path.final_nic, last,
                     f"{last}/{path.nics[-1][1]}", out, context=hub.context(end))
        hub.expressed += 1
        hub.express_hops += len(nodes) - 2
        return True

    def mark_dead(self, peer: int, incarnation: int | None = None) -> None:
        if peer not in self.router.dead:
            self.sim.generation += 1  # kept express paths through this node are walked again
            self.routes_version += 1
        super().mark_dead(peer, incarnation)

    def revive(self, peer: int) -> None:
        if peer in self.router.dead:
            self.sim.generation += 1
            self.routes_version += 1
        super().revive(peer)


@dataclass
class _Path:
    """An express path (see :class:`SimTransport`): ``nodes`` from the sender of the first hop
    to the destination; per node, the NICs it receives on and sends on (the last entry: the
    last relay's NIC towards the destination); ``backs``: each relay's memory of the way back
    to the destination when walked (replies follow it); the links' summed latency after the
    first hop; ``final_nic``: the destination's NIC the message arrives on."""

    generation: int
    #: each node's :attr:`SimTransport.routes_version` when walked
    versions: list[int]
    nodes: list[int]
    nics: list[tuple[str, str]]
    backs: list[int | None]
    latency: float
    final_nic: str
    reply: bool
    #: the message's destination (``nodes[-1]`` unless the path ends where a node does anything
    #: else than pass it on at once)
    dst: int
    #: the relays' transports (``nodes[1:-1]``) and their arrival times (``last_arrival``)
    relays: list["SimTransport"]
    arrivals: list[dict[int, float]]
    #: messages and bytes that crossed it since the relays' counters were last brought up to date
    uses: int = 0
    bytes: int = 0
    #: the origin whose way back every relay was last set to, and its :attr:`SimHub.back_changes` then
    backs_src: int = -1
    backs_seen: int = -1
    #: the reply's destination's :attr:`SimHub.back_changes` when the relays' ways back to it were
    #: last found as when walked
    replies_seen: int = -1

    def flush(self, hub: SimHub) -> None:
        """Credit every relay with the messages that crossed the path since the last flush:
        received and sent (its NICs' counters) and relayed."""
        if not self.uses:
            return
        nodes = self.nodes
        for i in range(1, len(nodes) - 1):
            rt = hub.transports.get(nodes[i])
            if rt is None:
                continue
            recv_nic, send_nic = self.nics[i]
            st = rt.nic_stats[recv_nic]
            st.bytes_recv += self.bytes
            st.msgs_recv += self.uses
            st = rt.nic_stats[send_nic]
            st.bytes_sent += self.bytes
            st.msgs_sent += self.uses
            rt.relaying.relayed += self.uses
        self.uses = self.bytes = 0

    def current(self, hub: SimHub) -> bool:
        """Whether no router on the path changed its dead nodes since the path was walked
        (checked node by node only when some router anywhere changed since the last check)."""
        if self.generation == hub.generation:
            return True
        transports = hub.transports
        for n, v in zip(self.nodes, self.versions):
            if transports[n].routes_version != v:
                return False
        self.generation = hub.generation
        return True

    #: the origin and incarnation of the message last checked, and :attr:`SimHub.faults` then
    src: int = -1
    inc: int = -1
    faults: int = -1

    def clear(self, hub: SimHub, loop: asyncio.AbstractEventLoop, src: int, inc: int) -> bool:
        """Whether the message can cross the whole path now (see :class:`SimTransport`): every
        node up and not held, no link cut, each relay's incarnation of ``src`` (if it knows
        one) ``inc``, each relay's incarnation of the node before it (if it knows one) that node's
        current one, and, for a reply, each relay's way back as when walked. Nodes, links and
        incarnations are checked again only after a fault began or ended, or for another
        origin or incarnation (an incarnation a relay knows only changes to the current one)."""
        nodes, dst = self.nodes, self.dst
        if self.faults == hub.faults and self.src == src and self.inc == inc:
            if self.reply and self.replies_seen != hub.back_changes.get(dst, 0):
                backs = self.backs
                for i, relay in enumerate(self.relays, 1):
                    if relay.router.back.get(dst) != backs[i]:
                        return False
                self.replies_seen = hub.back_changes.get(dst, 0)
            return True
        held = getattr(loop, "held", None)
        endpoints = hub.endpoints
        for i in range(1, len(nodes)):
            n = nodes[i]
            rt = endpoints.get(n)
            if rt is None or (held is not None and held(hub.actors.get(n, n))) \
                    or (hub.cuts and hub.cut(nodes[i - 1], n)):
                return False
            if i < len(nodes) - 1 and rt is not self.relays[i - 1]:
                return False
            if i < len(nodes) - 1:
                known = rt.peer_incarnations.get(src)
                if known is not None and known != inc:  # a stale message or a new life: judged hop by hop
                    return False
                prev = nodes[i - 1]
                known = rt.peer_incarnations.get(prev)
                if known is not None and known != hub.transports[prev].incarnation:
                    return False  # (a restarted neighbour not admitted yet: its relaying proves nothing)
                if self.reply and rt.router.back.get(dst) != self.backs[i]:
                    return False
        self.faults, self.src, self.inc = hub.faults, src, inc
        self.replies_seen = hub.back_changes.get(dst, 0)
        return True


def _passed(nodes: list[int]) -> list[int]:
    """The header ``path`` a message walked along ``nodes`` (the sender first, then every node
    it reached) carries at the last of them: the nodes before the relay that handed it over
    (the sender included), the latest :data:`~p2psync.wire.PATH_KEPT` of them, as real relays
    write it."""
    return nodes[max(0, len(nodes) - 2 - PATH_KEPT):-2]


def _walk(hub: SimHub, sender: int, peer: int, dst: int, reply: bool, spread: int = 0) -> _Path | None:
    """The path every relay's own router gives a message that ``sender`` hands to ``peer`` for
    ``dst`` (the first candidate, never back where it came from, the ``spread``-th of the
    equal-cost ones for a resent request: :func:`~p2psync.transport.relay.resend_number`; a reply to a node the relay
    marked dead goes to it directly when adjacent, as :meth:`Relay._relay` sends it), up to
    ``dst`` or to the first node that would do anything else than pass it on to that candidate
    at once (no candidate, a candidate marked dead or gone: it ingests the message as usual and
    its own code decides; also a relay whose choice the message's ``path`` would change, see
    :mod:`p2psync.transport.relay`); None when that is ``peer`` itself, for a keyed relay, or a
    loop."""
    nodes, nics = [sender, peer], [("", "")]
    backs: list[int | None] = [None]
    latency = 0.0
    endpoints, memo = hub.endpoints, hub.hops
    if len(memo) >= MAX_HOP_MEMO:
        memo.clear()
    while nodes[-1] != dst:
        prev, cur = nodes[-2], nodes[-1]
        rt = endpoints.get(cur)
        if not isinstance(rt, SimTransport) or rt.relay_keys is not None or len(nodes) > len(endpoints) + 1:
            return None
        back = rt.router.back.get(dst)
        key = (prev, cur, dst, reply, spread)
        hop = memo.get(key)
        if hop is None or hop.transport is not rt or hop.version != rt.routes_version \
                or (reply and hop.back != back):
            hop = memo[key] = _hop(hub, rt, prev, dst, reply, back, spread)
        nb = hop.next
        passed = _passed(nodes)  # (never passed on to those)
        if nb is None or nb not in endpoints or nb in passed \
                or (spread and any(rt.topology.routes(cur, p) for p in passed)):
            # the message stops being passed on at once here, or the relay would decide
            # otherwise with the message's path (a neighbour of it on the path: the memo's
            # choice is on it, or the spread's equal-cost tier is smaller), so it ingests the
            # message and decides itself
            if len(nodes) < 3:
                return None
            break
        nics.append(hop.nics)
        backs.append(back)
        latency += hop.latency
        nodes.append(nb)
    last, end = hub.endpoints[nodes[-2]], nodes[-1]
    versions = [hub.transports[n].routes_version for n in nodes]
    relays = [hub.transports[n] for n in nodes[1:-1]]
    return _Path(generation=hub.generation, versions=versions, nodes=nodes, nics=nics, backs=backs, latency=latency,
                 final_nic=last.route(end).remote_nic, reply=reply, dst=dst, relays=relays,
                 arrivals=[rt.last_arrival for rt in relays])


#: decisions of relays that :func:`_walk` keeps (cleared when there are this many)
MAX_HOP_MEMO = 1 << 21


class _Hop(NamedTuple):
    """What relay ``transport`` does with a message for ``dst`` that came from ``prev`` (see
    :func:`_walk`), as decided when its routes were at ``version`` and, for a reply, its way
    back to ``dst`` was ``back``: ``next`` (None: anything but passing it on at once), the
    NICs it receives and sends it on, and the latency of the link to ``next``."""

    transport: "SimTransport"
    version: int
    back: int | None
    next: int | None
    nics: tuple[str, str]
    latency: float


def _hop(hub: SimHub, rt: "SimTransport", prev: int, dst: int, reply: bool, back: int | None,
         spread: int = 0) -> _Hop:
    """The decision of relay ``rt`` (see :class:`_Hop`), from its router now."""
    router, cur = rt.router, rt.node_id
    nb: int | None
    if dst in router.dead and not reply:
        nb = None
    elif dst in router.dead and rt.topology.routes(cur, dst):
        nb = dst  # a reply goes to an adjacent node marked dead directly (it asked)
    else:
        nbs = (router.reply_hops(dst, exclude=prev) if reply
               else router.next_hops(dst, exclude=prev, to_dead=True, spread=spread))
        nb = nbs[0] if nbs and nbs[0] not in router.dead else None
    if nb is None:
        return _Hop(rt, rt.routes_version, back, None, ("", ""), 0.0)
    return _Hop(rt, rt.routes_version, back, nb, (rt.route(prev).local_nic, rt.route(nb).local_nic),
                hub.latency(cur, nb))


def _consume(it: Iterable[object]) -> None:
    """Run an iterator to its end (in C: the express path's per-relay bookkeeping)."""
    collections.deque(it, maxlen=0)


class _Backs(dict[int, int]):
    """A router's :attr:`~p2psync.transport.router.Router.back` that bumps
    :attr:`SimHub.back_changes` of the origin whenever its value changes (the express paths'
    checks)."""

    __slots__ = ("hub",)

    def __init__(self, hub: SimHub) -> None:
        super().__init__()
        self.hub = hub

    def __setitem__(self, key: int, value: int) -> None:
        if dict.get(self, key) != value:
            changes = self.hub.back_changes
            changes[key] = changes.get(key, 0) + 1
        dict.__setitem__(self, key, value)

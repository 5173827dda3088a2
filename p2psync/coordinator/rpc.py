"""A small request/response RPC over the transport; coordinator services plug into it.

Request: kind ``rpc``, tag ``rpc.call``, meta ``{"id": int, "method": str, "args": {...}}``
(optional arrays; ``"att"``: the attempt, i.e. the first hop it was relayed through). Reply:
kind ``reply``, tag ``rpc.ret.<id>``, meta ``{"ok": value}`` or ``{"err": {"kind": str,
"message": str}}``, with the ``"att"`` of the copy it answers and ``"to"``, the incarnation of
the caller that sent the request: a restarted process numbers its calls from 1 again, and a
reply to its previous process that comes after the restart (queued for the node, or held at a
relay) is dropped, counted as ``foreign``, instead of being taken for the reply to its own
call with that id. Requests to non-adjacent nodes
are relayed by the transport. A call to the local node runs the handler in-process. A call that fails or times out
retires its reply tag in the mailbox, so a reply that comes late is dropped (counted as
``retired``) instead of piling up. Handlers may wait (long
polls such as a rendezvous): each request runs in its own task, started as the request is
delivered (a mailbox subscription, no receive loop in between); at most
``MAX_INFLIGHT_PER_CALLER`` run for one caller, and a request over that is dropped and counted
(``overloaded``) until its caller resends it.

End-to-end delivery: a relayed request or reply can be lost when a relay dies. The
client therefore resends a request that got no reply within the retransmission timeout
(:class:`~p2psync.coordinator.detector.RttEstimator`, RFC 6298, per destination; doubled on
every retry) until the call's own timeout, each attempt relayed through the next candidate first
hop (:meth:`Transport.send_control`); the first hop that worked last time is tried first next
time (the reply names the attempt whose copy it answers: an earlier copy held up at a relay may
be answered after a resend; a call that got no reply over any hop leaves it). A relayed call resends at the latest after half its timeout (:func:`attempt_wait`), so
that a call shorter than the RTO still tries two first hops. The server deduplicates by
(caller, caller incarnation, request id): a duplicate of a request still running is dropped
(its reply goes out when done, over the routes live then), a duplicate of a finished one gets
the cached reply again. Handlers therefore run at most once
per request. The reply cache is bounded per caller, not by the size of the run: every request
carries ``low``, the lowest request id its caller still waits for (``{"id", "low", "method",
"args"}``), and the server forgets that caller's replies below it and drops any request
below it that still comes (counted ``stale``: the caller gave that call up); at most ``REPLY_CACHE_PER_CALLER`` finished
replies are kept per caller in any case (the oldest go first), and only for its newest
incarnation. RTT samples come from first-attempt replies only (Karn), and only from calls made
with ``measure=True`` (long polls would distort them). A reply that arrives after its call gave
up is dropped on arrival (its tag is retired). :meth:`RpcClient.abort_calls` fails the calls in
flight to one node at once (its coordinator role moved: callers retry at the new coordinator).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter, OrderedDict
from typing import Any, Awaitable, Callable, Mapping, Sequence

import numpy as np

from p2psync.coordinator.detector import RttEstimator
from p2psync.errors import P2PSyncError, PeerFailure, PeerTimeout, RemoteError
from p2psync.tasks import TaskSet
from p2psync.transport import Transport
from p2psync.wire import Message

log = logging.getLogger("p2psync.rpc")

#: handler(caller node id, args, arrays) -> JSON-like result (msgpack-able)
Handler = Callable[[int, Mapping[str, Any], Sequence[np.ndarray]], Awaitable[Any]]

CALL_TAG = "rpc.call"
#: the tag of the reply to call ``<id>``: ``REPLY_PREFIX + str(id)``
REPLY_PREFIX = "rpc.ret."
#: finished requests of one caller whose replies are kept for duplicates, at most (fewer once
#: the caller's ``low`` passes them, see the module docstring)
REPLY_CACHE_PER_CALLER = 256
#: requests of one caller handled at once; more from that caller are dropped and counted
#: (``overloaded``): a flood must not grow memory without bound, and a real caller resends after
#: its retransmission timeout. Per caller, not in all: long polls (a rendezvous holds every
#: node's ``register`` until all have come) take one slot of each caller however large the
#: cluster, and one flooding peer cannot starve the others.
MAX_INFLIGHT_PER_CALLER = 1024


class RpcServer:
    """Serves this node's RPC methods: receives ``rpc.call`` requests, runs each registered
    handler in its own task (at most once per request, see the module docstring) and replies.

    One per node, built by ``NodeRuntime`` (api/runtime.py: ``RpcServer(self.transport)``);
    strategies reach it as ``ctx.rpc_server`` and coordinator services take it as ``server``.
    """

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.handlers: dict[str, Handler] = {}
        #: requests being handled (each in its own task: handlers may wait)
        self._inflight = TaskSet(f"rpc-request-{transport.node_id}", isolated=True)  # a request fails alone
        self._started = False
        self.bad_requests = 0
        self.duplicates = 0
        self.overloaded = 0
        #: caller -> its requests being handled now
        self._busy: Counter[int] = Counter()
        #: caller -> the replies of its newest incarnation
        self._seen: dict[int, _Replies] = {}
        #: requests dropped because their caller no longer waited for them (or was restarted)
        self.stale = 0

    def register(self, method: str, handler: Handler) -> None:
        """Serve ``method`` with ``handler(caller, args, arrays)`` (ValueError when taken).
        Example, state_server.py: ``server.register("esync.query", self._query)``."""
        if method in self.handlers:
            raise ValueError(f"RPC method {method!r} is already registered")
        self.handlers[method] = handler

    def start(self) -> None:
        """Serve requests until :meth:`close` (once; a closed server stays closed). Requests are
        taken from the mailbox as they are delivered (:meth:`Mailbox.subscribe`), each handled
        in its own task: no receive loop stands between a request and its handler."""
        if self._started:
            return
        asyncio.get_running_loop()  # RuntimeError before anything is taken: handlers need the loop
        self._started = True
        try:
            self.transport.mailbox.subscribe(CALL_TAG, self._arrived)
        except P2PSyncError:
            pass  # the transport is closed already: nothing to serve

    @property
    def serving(self) -> bool:
        """True while requests are taken (from :meth:`start` until :meth:`close` or until the
        transport closes)."""
        return self.transport.mailbox.subscribed(CALL_TAG, self._arrived)

    def _arrived(self, msg: Message) -> None:
        """A request was delivered (mailbox callback: must not raise)."""
        src = msg.src
        if self._busy[src] >= MAX_INFLIGHT_PER_CALLER:
            self.overloaded += 1
            if self.overloaded == 1 or self.overloaded % 1000 == 0:
                log.warning("node %d: %d RPC requests dropped so far; node %d has %d being handled "
                            "already", self.transport.node_id, self.overloaded, src,
                            MAX_INFLIGHT_PER_CALLER)
            return
        self._busy[src] += 1
        self._inflight.spawn(self._handle(msg)).add_done_callback(lambda _t: self._done(src))

    def _done(self, src: int) -> None:
        self._busy[src] -= 1
        if not self._busy[src]:
            del self._busy[src]

    async def invoke(self, caller: int, method: str, args: Mapping[str, Any],
                     arrays: Sequence[np.ndarray] = ()) -> Any:
        """Run the handler of ``method`` for ``caller`` here, with no deduplication (RemoteError
        ``UnknownMethod`` when none). Used for remote requests and by :meth:`RpcClient.call`
        when a node calls itself."""
        handler = self.handlers.get(method)
        if handler is None:
            raise RemoteError("UnknownMethod", f"no RPC method {method!r} on node {self.transport.node_id}")
        return await handler(caller, args, arrays)

    async def _handle(self, msg: Message) -> None:
        meta = msg.meta
        rid, method, args = meta.get("id"), meta.get("method"), meta.get("args", {})
        if type(rid) is not int or not isinstance(method, str) or not isinstance(args, dict):
            self.bad_requests += 1
            log.warning("node %d: malformed RPC request from node %d", self.transport.node_id, msg.src)
            return
        low = meta.get("low", 0)
        seen = self._replies_of(msg.src, msg.header.inc, low if type(low) is int else 0)
        if seen is None or rid < seen.low:  # its caller gave that call up: no reply is awaited
            self.stale += 1
            return
        att = meta.get("att")
        att = att if type(att) is int else None
        if rid in seen.replies:
            self.duplicates += 1
            cached = seen.replies[rid]
            if cached is not None:  # finished: its reply may have been lost, send it again
                await self._reply(msg.src, rid, cached, att, msg.header.inc)
            return
        seen.replies[rid] = None
        reply = await self._run(msg, method, args)
        if rid in seen.replies:  # (not when the caller's ``low`` passed it meanwhile)
            seen.replies[rid] = reply
            seen.trim(REPLY_CACHE_PER_CALLER)
        await self._reply(msg.src, rid, reply, att, msg.header.inc)

    def _replies_of(self, caller: int, inc: int, low: int) -> "_Replies | None":
        """The reply cache of ``caller``'s incarnation ``inc`` (an older incarnation's is
        dropped; None for a request of an incarnation older than the cached one), without the
        requests below ``low``."""
        seen = self._seen.get(caller)
        if seen is None or seen.inc < inc:
            seen = self._seen[caller] = _Replies(inc)
        elif seen.inc > inc:
            return None
        seen.forget_below(low)
        return seen

    def cached_replies(self) -> int:
        """How many requests are remembered for deduplication now (finished or running)."""
        return sum(len(seen.replies) for seen in self._seen.values())

    async def _reply(self, dst: int, rid: int, reply: dict[str, Any], att: int | None = None,
                     inc: int | None = None) -> None:
        """Send ``reply`` to request ``rid`` of ``dst``'s incarnation ``inc``, naming the attempt
        ``att`` of the copy it answers (:meth:`RpcClient.call` keeps that copy's first hop for
        its next calls)."""
        meta = reply if att is None else {**reply, "att": att}
        if inc is not None:
            meta = {**meta, "to": inc}
        try:
            await self.transport.send(dst, f"{REPLY_PREFIX}{rid}", kind="reply", meta=meta, timeout=10.0)
        except P2PSyncError as exc:
            log.info("node %d: could not reply to node %d: %s", self.transport.node_id, dst, exc)

    async def _run(self, msg: Message, method: str, args: Mapping[str, Any]) -> dict[str, Any]:
        try:
            reply: dict[str, Any] = {"ok": await self.invoke(msg.src, method, args, msg.arrays)}
        except RemoteError as exc:
            reply = {"err": {"kind": exc.kind, "message": exc.message}}
        except P2PSyncError as exc:
            reply = {"err": {"kind": type(exc).__name__, "message": str(exc)}}
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a handler bug must not kill the server
            log.exception("RPC handler %s failed", method)
            reply = {"err": {"kind": "InternalError", "message": repr(exc)[:500]}}
        return reply

    async def close(self, grace: float = 2.0) -> None:
        """Stop serving; replies already being computed get ``grace`` seconds to go out."""
        self._started = True  # a closed server stays closed
        self.transport.mailbox.unsubscribe(CALL_TAG, self._arrived)  # (a no-op when not ours)
        await self._inflight.close(grace=grace)


class _Replies:
    """One caller incarnation's requests, for deduplication: request id -> reply (None while
    the handler runs), in arrival order; ``low``: the lowest request id the caller still waits
    for (ids below it are neither cached nor served again)."""

    def __init__(self, inc: int) -> None:
        self.inc = inc
        self.low = 0
        self.replies: OrderedDict[int, dict[str, Any] | None] = OrderedDict()

    def forget_below(self, low: int) -> None:
        """The caller waits for no request below ``low`` any more (it never moves back)."""
        if low <= self.low:
            return
        self.low = low
        for rid in [r for r in self.replies if r < low]:  # (few: calls finished since the last request)
            del self.replies[rid]

    def trim(self, keep: int) -> None:
        """Forget the oldest finished replies beyond ``keep`` (running requests stay)."""
        over = len(self.replies) - keep
        if over > 0:
            for rid in [r for r, v in self.replies.items() if v is not None][:over]:
                del self.replies[rid]


def attempt_wait(*, rto: float, left: float, timeout: float, attempt: int, relayed: bool) -> float:
    """How long attempt ``attempt`` (0: the first) of a call with ``timeout`` waits for its reply
    before the request is resent: the retransmission timeout ``rto``, within the ``left``
    seconds of the call. The first attempt of a ``relayed`` call (its destination is not
    adjacent: a resend may take another first hop) waits at most half the call's timeout, so
    that a call shorter than its RTO (a probe; a destination not measured yet has the initial
    RTO) still tries a second first hop: the first one tried is the one the last call to that
    destination ended on (:meth:`RpcClient.call`), which may lead across a partition that cut
    it off then."""
    wait = min(rto, left)
    if attempt == 0 and relayed:
        wait = min(wait, timeout / 2)
    return max(0.0, wait)


class RpcClient:
    """Calls RPC methods on other nodes, resending over other first hops after each
    retransmission timeout (one :class:`RttEstimator` per destination); calls to this node go
    to ``local`` in-process.

    One per node, built by ``NodeRuntime`` (api/runtime.py: ``RpcClient(self.transport,
    local=self.server)``); strategies use ``ctx.rpc``, e.g. regroup.py:
    ``rep = await ctx.rpc.call(d, f"{name}.state", {"tag": tag}, timeout=ctx.peer_timeout)``.
    """

    def __init__(self, transport: Transport, local: RpcServer | None = None) -> None:
        self.transport = transport
        self.local = local
        self._ids = itertools.count(1)
        #: replies dropped because they answer a previous process of this node (``"to"``)
        self.foreign = 0
        self.rtt: dict[int, RttEstimator] = {}
        self._path: dict[int, int] = {}  # destination -> attempt index (first hop) that worked
        self.retries = 0
        self._calls: dict[str, int] = {}  # reply tag of a remote call in flight -> destination
        self._waiting: set[int] = set()  # the ids of the remote calls in flight
        self._aborted: dict[str, P2PSyncError] = {}  # reply tag -> why its call was aborted
        #: the reply waits of the calls in flight, each labelled with the node called
        self._replies = transport.scope(REPLY_PREFIX)

    def abort_calls(self, node: int, exc: P2PSyncError) -> int:
        """Fail every remote call in flight to ``node`` with ``exc`` at once (its coordinator
        role moved or it was declared dead: waiting for its replies is pointless)."""
        for t in [t for t, n in self._calls.items() if n == node]:
            self._aborted[t] = exc  # a call between two attempts (sending, or about to resend) sees it too
        return self._replies.abort(exc, peer=node)

    def _check_abort(self, tag: str, node: int, to_dead: bool = False) -> None:
        """Raise when the call was aborted (:meth:`abort_calls`) or its node declared dead
        (unless ``to_dead``): a call to a dead node must not keep resending until its own
        deadline (with a shaper or a relay, a send to a dead node is accepted and only lost
        later), since callers such as ``call_coordinator`` retry elsewhere within the same
        budget."""
        exc = self._aborted.get(tag)
        if exc is not None:
            raise exc
        if node in self.transport.dead and not to_dead:
            raise PeerFailure(f"node {self.transport.node_id}: node {node} has failed", peers=(node,))

    def estimator(self, node: int) -> RttEstimator:
        """The RTT estimate of calls to ``node`` (created on first use); membership_client.py
        reads it to size heartbeat waits: ``est = self.rpc.estimator(c)``."""
        est = self.rtt.get(node)
        if est is None:
            est = self.rtt[node] = RttEstimator()
        return est

    def _answers_me(self, rep: Message, tag: str) -> bool:
        """Whether the reply ``rep`` under ``tag`` answers this process: one naming another
        incarnation of this node (``"to"``) is dropped and counted (:attr:`foreign`)."""
        to = rep.meta.get("to")
        if to is None or to == self.transport.incarnation:
            return True
        self.foreign += 1
        rep.release()
        log.info("node %d: reply %s to incarnation %s of this node dropped", self.transport.node_id, tag, to)
        return False

    async def call(self, node: int, method: str, args: Mapping[str, Any] | None = None, *,
                   arrays: Sequence[Any] = (), timeout: float = 10.0, measure: bool = False,
                   to_dead: bool = False, any_path: bool = False) -> Any:
        """Call ``method`` on ``node``; raises RemoteError, PeerTimeout or PeerUnreachable.

        Resent (over another first hop when relayed) after every retransmission timeout until
        ``timeout``; ``measure``: feed the round trip to the RTT estimate (quick handlers only).
        ``to_dead``: call an adjacent ``node`` even when it is marked dead (a node cut off from
        the run asking what the run's view is now; ``Transport.send``), else that fails at once;
        ``any_path``: call ``node`` even when it and the nodes between are marked dead, by any
        way (a new coordinator's proof of life; ``Transport.send``)."""
        to_dead = to_dead or any_path
        args = dict(args or {})
        if node == self.transport.node_id and self.local is not None:
            return await asyncio.wait_for(
                self.local.invoke(node, method, args, [np.asarray(a) for a in arrays]), timeout)
        rid = next(self._ids)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + timeout
        est = self.estimator(node)
        rto = est.rto()
        first = self._path.get(node, 0)
        self._waiting.add(rid)
        meta = {"id": rid, "low": min(self._waiting), "method": method, "args": args}
        tag = f"{REPLY_PREFIX}{rid}"
        self._calls[tag] = node
        relayed = not self.transport.topology.routes(self.transport.node_id, node)
        try:
            attempt = 0
            while True:
                self._check_abort(tag, node, to_dead)
                sent_at = loop.time()
                try:
                    await self.transport.send_control(node, CALL_TAG, kind="rpc", meta={**meta, "att": first + attempt},
                                                      arrays=arrays,
                                                      timeout=max(0.0, deadline - sent_at),
                                                      attempt=first + attempt, to_dead=to_dead, any_path=any_path)
                except PeerFailure:
                    if loop.time() >= deadline or (node in self.transport.dead and not to_dead):
                        raise
                self._check_abort(tag, node, to_dead)
                left = deadline - loop.time()
                wait = attempt_wait(rto=rto, left=left, timeout=timeout, attempt=attempt, relayed=relayed)
                try:  # the reply that answers this process within ``wait`` (else PeerTimeout)
                    until = loop.time() + max(0.0, wait)
                    rep = await self.transport.recv(tag, timeout=max(0.0, wait), peer=node)
                    while not self._answers_me(rep, tag):
                        rep = await self.transport.recv(tag, timeout=max(0.0, until - loop.time()), peer=node)
                    break
                except PeerTimeout:
                    if loop.time() >= deadline:
                        # unanswered over every first hop it tried (at least two when relayed):
                        # no reason to prefer another one; the one that worked last stays first
                        raise PeerTimeout(f"RPC {method} to node {node}: no reply within {timeout:g}s "
                                          f"({attempt + 1} attempt{'s' if attempt else ''})") from None
                attempt += 1
                self.retries += 1
                if wait < min(rto, left):
                    continue  # resent before the RTO ran out (attempt_wait): no backoff
                if relayed and attempt < len(self.transport.next_hops(node)):
                    continue  # the resend takes a first hop this call has not tried: another path, no backoff
                if measure:  # the estimate backs off (RFC 6298 5.5) only for quick calls:
                    est.backoff()  # a long poll (register, finish) is slow by design
                    rto = est.rto()
                else:
                    rto = min(est.max_rto, rto * 2)
        except BaseException:
            self.transport.retire(tag)  # a late reply is dropped on arrival
            raise
        finally:
            self._calls.pop(tag, None)
            self._aborted.pop(tag, None)
            self._waiting.discard(rid)
        if attempt == 0 and measure:
            est.sample(loop.time() - sent_at)
        elif attempt:  # a resent request may be answered twice: drop the duplicate on arrival
            self.transport.retire(tag)
        att = rep.meta.get("att")  # the attempt (first hop) whose copy was answered
        self._path[node] = att if type(att) is int and first <= att <= first + attempt else first + attempt
        if "err" in rep.meta:
            err = rep.meta["err"]
            raise RemoteError(str(err.get("kind", "Error")), str(err.get("message", "")))
        return rep.meta.get("ok")

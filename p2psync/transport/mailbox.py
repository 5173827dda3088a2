"""Mailbox: matches incoming messages to waiters by tag (exact) or tag prefix; bounded memory.

Concurrent operations each wait on their own tags, so they never steal each other's messages.
A message nobody waits for yet is queued; a waiter that arrives later takes it. Timeouts are
armed with ``call_later`` and resolve the waiter's future only if it is still pending, so a
message is never lost to a race between delivery and timeout.

Matching is O(1) per message: exact-tag waiters are indexed by tag (a deque
per tag, oldest first); prefix waiters, which are few (``recv_any``), live in one list scanned
in order. A message goes to the oldest matching waiter of either kind (waiters carry a sequence
number). Before, every delivery scanned every waiter: 4000 pending receives cost 1.4 s of loop
time; 10^4 pending receives now take a few ms to satisfy (tests/unit/test_mailbox_budget.py).
Queued messages are indexed by tag too; a prefix take scans only the tags of the prefix's
*family* (the part before the first ``.``) when the prefix contains a dot.

Memory is bounded:

* ``data`` messages: a byte budget per sending peer (``budget_bytes``, sum of the payload bytes
  of that peer's queued, unclaimed messages; default 256 MiB). Over budget, that peer's *oldest*
  unclaimed data messages are dropped and counted (reason ``mailbox_budget``): the newest data
  is the most likely to be waited for. ``max_pending`` caps the number of queued data messages
  (a new one over the cap is rejected: ``mailbox_full``).
* control messages (``rpc``, ``reply``, ``event``, ``hb``) are never dropped for data: they have
  their own count cap per peer (``max_control_pending``, default 4096; a new one over it is
  rejected with ``mailbox_control_full``), so a data flood cannot make the node deaf.
* expiry: a message unclaimed for ``ttl`` seconds (default 600 s; None: never) is dropped at the
  next delivery or :meth:`Mailbox.sweep` (``expired``); :meth:`Mailbox.expire` drops queued
  messages by prefix or predicate now.
* scopes: a :class:`Scope` owns the receives of one operation, or of a family of operations
  (the tags under its roots); cancelling it fails its pending waits and retires its tags (below).
  Components end operations through their scopes, never by matching tags themselves.
* retire: :meth:`Mailbox.retire` declares a tag (``exact=True``) or a tag family (prefix)
  finished: queued messages are dropped and later arrivals that no waiter wants are dropped too
  (``retired``). The memory of retired tags is bounded (``max_retired`` exact tags, oldest
  forgotten first; at most 256 prefixes). The RPC client retires ``rpc.ret.<id>`` of a call that
  timed out, so late replies do not accumulate.

Drops of queued messages are reported through ``on_drop(msg, reason)`` (the transport counts
them in ``Transport.rejected``) and counted in :attr:`Mailbox.dropped`. Rejecting a *new*
message over a count cap raises :class:`~p2psync.errors.ProtocolError` (as before).
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections import Counter, deque
from typing import Any, Callable, Coroutine, Iterable

from p2psync.clock import now as clock_now
from p2psync.errors import P2PSyncError, PeerTimeout, ProtocolError
from p2psync.transport.retired import RetiredTags
from p2psync.wire import Message

#: message kinds that are control traffic (never dropped to make room for data)
CONTROL_KINDS: frozenset[str] = frozenset({"rpc", "reply", "event", "hb"})

DEFAULT_BUDGET_BYTES = 256 << 20
DEFAULT_TTL = 600.0

DropHook = Callable[[Message, str], None]


class _Waiter:
    __slots__ = ("exact", "prefix", "future", "seq", "peer", "scopes")

    def __init__(self, exact: str | None, prefix: str | None, future: asyncio.Future[Message],
                 seq: int, peer: int | None) -> None:
        self.exact = exact
        self.prefix = prefix
        self.future = future
        self.seq = seq
        self.peer = peer
        self.scopes: tuple[Scope, ...] = ()


class Scope:
    """The receives of one operation, or of one family of operations (this epoch's operations,
    one re-shard, one exchange), on one mailbox: the tags that start with one of its ``roots``.
    Opened with :meth:`Mailbox.scope` (``Transport.scope``); the owner ends the operations
    through it instead of matching tags itself.

    * Every wait (:meth:`Mailbox.get`, :meth:`Mailbox.get_prefix`) begun while the scope is
      open whose tag, or prefix, starts with one of the roots is registered with it until the
      wait ends. A wait begun before the scope was opened, or after it was closed, is not.
    * :meth:`abort` fails the registered waits (or those that expect a message from one peer)
      with an error; the scope stays open and later operations under it go on.
    * :meth:`retire` ends the operations for good: the roots are retired (queued messages
      under them are dropped now, later ones that no waiter takes are dropped on arrival,
      reason ``retired``), so late pieces cost no memory. :meth:`cancel` fails the registered
      waits first.
    * :meth:`close` ends the scope without touching anything (the operations completed).

    The mailbox holds open scopes weakly: a scope its owner drops is forgotten (its pending
    waits keep it alive while they last)."""

    __slots__ = ("roots", "_mailbox", "_waits", "_open", "__weakref__")

    def __init__(self, mailbox: Mailbox, roots: tuple[str, ...]) -> None:
        if not roots or any(not r for r in roots):
            raise ValueError("a scope needs at least one non-empty root")
        self.roots = roots
        self._mailbox = mailbox
        #: insertion-ordered (a dict, not a set): an abort fails its waits in the order they
        #: were registered, the same in every run (a set of objects iterates by address)
        self._waits: dict[_Waiter, None] = {}
        self._open = True

    @property
    def open(self) -> bool:
        """New waits under the roots are registered (not closed or cancelled yet)."""
        return self._open

    @property
    def waiting(self) -> int:
        """Registered waits still pending."""
        return sum(1 for w in self._waits if not w.future.done())

    def covers(self, tag: str) -> bool:
        """``tag`` (or a wait's prefix) lies under one of the roots."""
        return tag.startswith(self.roots)

    def abort(self, exc: P2PSyncError, *, peer: int | None = None) -> int:
        """Fail the registered pending waits with ``exc``: every one, or with ``peer`` those
        that expect a message from that node (``Transport.recv(..., peer=)``). Returns how many
        failed. The scope stays open."""
        return self._mailbox._fail([w for w in self._waits if peer is None or w.peer == peer], exc)

    def cancel(self, exc: P2PSyncError) -> int:
        """End the operations for good: fail the registered pending waits with ``exc``, then
        :meth:`retire`. Returns how many waits failed. Safe to call again."""
        n = self.abort(exc)
        self.retire()
        return n

    def retire(self) -> int:
        """The operations are over: close the scope and retire its roots (queued messages under
        them are dropped now, later ones that no waiter takes on arrival). Waits still pending
        are left to end by themselves (a message they wait for still reaches them). Returns
        how many queued messages were dropped. Safe to call again."""
        self.close()
        return sum(self._mailbox.retire(root) for root in self.roots)

    def close(self) -> None:
        """Stop registering new waits; pending ones and the roots are left as they are."""
        if self._open:
            self._open = False
            self._mailbox._unregister(self)

    def __repr__(self) -> str:
        state = "open" if self._open else "closed"
        return f"Scope({', '.join(map(repr, self.roots))}, {state}, waiting={self.waiting})"


class _Entry:
    """A queued message. Entries sit in several arrival-ordered deques; removal is lazy
    (``alive`` False, message reference dropped at once so its buffers are freed)."""

    __slots__ = ("msg", "tag", "peer", "nbytes", "at", "seq", "control", "alive")

    def __init__(self, msg: Message, at: float, seq: int) -> None:
        self.msg: Message | None = msg
        self.seq = seq
        self.tag = msg.tag
        self.peer = msg.src
        self.nbytes = msg.nbytes
        self.at = at
        self.control = msg.header.kind in CONTROL_KINDS
        self.alive = True


def _family(prefix: str) -> str | None:
    head, dot, _ = prefix.partition(".")
    return head if dot else None


class Mailbox:
    """Matches arriving messages to receivers by tag or tag prefix, queueing the rest within
    bounded memory (see the module docstring).

    One per transport (``Transport.mailbox``): ``Transport._ingest`` calls :meth:`deliver`,
    ``Transport.recv`` calls :meth:`get`; components that run operations open a :class:`Scope`
    per operation or family (``Transport.scope``) and end them through it.
    """

    def __init__(self, *, max_pending: int = 65536, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 max_control_pending: int = 4096, ttl: float | None = DEFAULT_TTL,
                 max_retired: int = 65536, clock: Callable[[], float] = clock_now,
                 on_drop: DropHook | None = None) -> None:
        if max_pending < 1 or budget_bytes < 1 or max_control_pending < 1 or max_retired < 1:
            raise ValueError("mailbox caps must be >= 1")
        if ttl is not None and ttl <= 0:
            raise ValueError("mailbox ttl must be > 0 (or None)")
        self._max_pending = max_pending
        self.budget_bytes = budget_bytes
        self._max_control = max_control_pending
        self.ttl = ttl
        self._clock = clock
        self.on_drop = on_drop
        # waiters
        self._exact: dict[str, deque[_Waiter]] = {}
        self._prefix: list[_Waiter] = []
        self._wseq = itertools.count()
        # queued messages
        self._queues: dict[str, deque[_Entry]] = {}  # tag -> entries (lazy), arrival order
        self._families: dict[str, set[str]] = {}  # tag family -> tags with a queue
        self._arrivals: deque[_Entry] = deque()  # every entry (lazy), arrival order
        self._eseq = itertools.count()
        self._data_by_peer: dict[int, deque[_Entry]] = {}  # data entries (lazy), arrival order
        self._peer_bytes: Counter[int] = Counter()
        self._control_by_peer: Counter[int] = Counter()
        self._pending = 0
        self._data_pending = 0
        self._bytes = 0
        #: the most messages, and payload bytes, queued unclaimed at once so far
        self.peak_pending = 0
        self.peak_bytes = 0
        # retired tags / prefixes
        self._retired = RetiredTags(max_retired)
        self.dropped: Counter[str] = Counter()
        self._closed: BaseException | None = None
        #: tag -> callback that takes every message with exactly that tag (:meth:`subscribe`)
        self._subscribers: dict[str, Callable[[Message], None]] = {}
        #: open scopes (weakly) by the family of each root (None: a root without a dot)
        self._scopes: dict[str | None, list[weakref.ref[Scope]]] = {}

    # -- counters ------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Queued, unclaimed messages."""
        return self._pending

    @property
    def bytes_pending(self) -> int:
        """Payload bytes of queued, unclaimed messages (all peers)."""
        return self._bytes

    def bytes_pending_from(self, peer: int) -> int:
        """Payload bytes of queued, unclaimed data messages from ``peer``."""
        return self._peer_bytes.get(peer, 0)

    @property
    def waiting(self) -> int:
        """Receivers currently waiting (exact and prefix)."""
        return sum(len(d) for d in self._exact.values()) + len(self._prefix)

    # -- delivery ------------------------------------------------------------------------

    def _match(self, tag: str) -> _Waiter | None:
        best: _Waiter | None = None
        dq = self._exact.get(tag)
        if dq is not None:
            while dq and dq[0].future.done():
                dq.popleft()
            if dq:
                best = dq[0]
            else:
                del self._exact[tag]
        for w in self._prefix:
            if w.prefix is not None and tag.startswith(w.prefix) and not w.future.done():
                if best is None or w.seq < best.seq:
                    best = w
                break
        return best

    def _unlink(self, w: _Waiter) -> None:
        for sc in w.scopes:
            sc._waits.pop(w, None)
        if w.exact is not None:
            dq = self._exact.get(w.exact)
            if dq is not None:
                if dq and dq[0] is w:
                    dq.popleft()
                else:
                    try:
                        dq.remove(w)
                    except ValueError:
                        pass
                if not dq:
                    del self._exact[w.exact]
        else:
            try:
                self._prefix.remove(w)
            except ValueError:
                pass

    def is_retired(self, tag: str) -> bool:
        """``tag`` was retired, exactly or by a retired prefix (see :meth:`retire`)."""
        return self._retired.covers(tag)

    def deliver(self, msg: Message) -> None:
        """Hand ``msg`` to the oldest matching waiter, or queue it.

        Raises :class:`ProtocolError` when a count cap rejects it (``mailbox_full`` for data,
        ``mailbox_control_full`` for control). Over the byte budget, older data from the same
        peer is dropped instead (see the module docstring).
        """
        tag = msg.header.tag
        sub = self._subscribers.get(tag)
        if sub is not None:
            sub(msg)
            return
        w = self._match(tag)
        if w is not None:
            self._unlink(w)
            w.future.set_result(msg)
            return
        now = self._clock()
        self._sweep(now)
        if self._retired and self._retired.covers(msg.tag):
            self._report(msg, "retired")
            return
        e = _Entry(msg, now, next(self._eseq))
        if e.control:
            if self._control_by_peer[e.peer] >= self._max_control:
                raise ProtocolError("mailbox_control_full",
                                    f"{self._control_by_peer[e.peer]} unclaimed control messages "
                                    f"from node {e.peer}")
            self._control_by_peer[e.peer] += 1
        else:
            if self._data_pending >= self._max_pending:
                raise ProtocolError("mailbox_full", f"{self._data_pending} unclaimed messages")
            self._data_pending += 1
            self._peer_bytes[e.peer] += e.nbytes
            self._data_by_peer.setdefault(e.peer, deque()).append(e)
        self._pending += 1
        self._bytes += e.nbytes
        q = self._queues.get(e.tag)
        if q is None:
            q = self._queues[e.tag] = deque()
            fam = _family(e.tag)
            if fam is not None:
                self._families.setdefault(fam, set()).add(e.tag)
        q.append(e)
        self._arrivals.append(e)
        if not e.control and self._peer_bytes[e.peer] > self.budget_bytes:
            self._enforce_budget(e.peer)
        if self._pending > self.peak_pending:
            self.peak_pending = self._pending
        if self._bytes > self.peak_bytes:
            self.peak_bytes = self._bytes
        self._maybe_compact()

    def _enforce_budget(self, peer: int) -> None:
        dq = self._data_by_peer[peer]
        while self._peer_bytes[peer] > self.budget_bytes and dq:
            old = dq.popleft()
            if old.alive:
                self._kill(old, "mailbox_budget")

    def _report(self, msg: Message, reason: str) -> None:
        self.dropped[reason] += 1
        if self.on_drop is not None:
            self.on_drop(msg, reason)

    def _kill(self, e: _Entry, reason: str | None) -> Message | None:
        """Remove ``e`` from the accounting (claimed when ``reason`` is None, else dropped)."""
        msg = e.msg
        e.alive = False
        e.msg = None
        self._pending -= 1
        self._bytes -= e.nbytes
        if e.control:
            self._control_by_peer[e.peer] -= 1
            if not self._control_by_peer[e.peer]:
                del self._control_by_peer[e.peer]
        else:
            self._data_pending -= 1
            self._peer_bytes[e.peer] -= e.nbytes
            if not self._peer_bytes[e.peer]:
                del self._peer_bytes[e.peer]
        q = self._queues.get(e.tag)
        if q is not None:
            while q and not q[0].alive:
                q.popleft()
            if not q:
                self._drop_queue(e.tag)
        if reason is not None and msg is not None:
            self._report(msg, reason)
        return msg

    def _drop_queue(self, tag: str) -> None:
        del self._queues[tag]
        fam = _family(tag)
        if fam is not None:
            tags = self._families.get(fam)
            if tags is not None:
                tags.discard(tag)
                if not tags:
                    del self._families[fam]

    def _sweep(self, now: float) -> None:
        arr = self._arrivals
        while arr and not arr[0].alive:
            arr.popleft()
        if self.ttl is None:
            return
        limit = now - self.ttl
        while arr and arr[0].at <= limit:
            e = arr.popleft()
            if e.alive:
                self._kill(e, "expired")
            while arr and not arr[0].alive:
                arr.popleft()

    def sweep(self) -> int:
        """Drop messages unclaimed for longer than ``ttl``; returns how many were dropped."""
        before = self.dropped["expired"]
        self._sweep(self._clock())
        return self.dropped["expired"] - before

    def _maybe_compact(self) -> None:
        """Lazy deques hold dead entries behind a live head; rebuild them when mostly dead."""
        if len(self._arrivals) > 2 * self._pending + 1024:
            self._arrivals = deque(e for e in self._arrivals if e.alive)
            for peer in list(self._data_by_peer):
                dq = deque(e for e in self._data_by_peer[peer] if e.alive)
                if dq:
                    self._data_by_peer[peer] = dq
                else:
                    del self._data_by_peer[peer]
            for tag in list(self._queues):
                self._queues[tag] = deque(e for e in self._queues[tag] if e.alive)

    # -- taking --------------------------------------------------------------------------

    def _pop(self, tag: str) -> Message | None:
        q = self._queues.get(tag)
        while q:
            e = q[0]
            if e.alive:
                return self._kill(e, None)
            q.popleft()
        if q is not None:
            self._drop_queue(tag)
        return None

    def _take(self, exact: str | None, prefix: str | None) -> Message | None:
        if exact is not None:
            return self._pop(exact) if exact in self._queues else None
        p = prefix or ""
        fam = _family(p)
        tags = self._families.get(fam, ()) if fam is not None else self._queues.keys()
        best: _Entry | None = None
        for tag in tags:
            if tag.startswith(p):
                q = self._queues[tag]
                head = next((e for e in q if e.alive), None)
                if head is not None and (best is None or head.seq < best.seq):
                    best = head
        return self._pop(best.tag) if best is not None else None

    async def _get(self, exact: str | None, prefix: str | None, timeout: float | None,
                   peer: int | None = None) -> Message:
        msg = self._take(exact, prefix)
        if msg is not None:
            return msg
        if self._closed is not None:
            raise self._closed
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Message] = loop.create_future()
        waiter = _Waiter(exact, prefix, fut, next(self._wseq), peer)
        if self._scopes:
            waiter.scopes = self._scopes_over(exact if exact is not None else prefix or "")
            for sc in waiter.scopes:
                sc._waits[waiter] = None
        if exact is not None:
            self._exact.setdefault(exact, deque()).append(waiter)
        else:
            self._prefix.append(waiter)
        handle = None
        if timeout is not None:
            def expire() -> None:
                if not fut.done():
                    what = f"tag {exact!r}" if exact is not None else f"tag prefix {prefix!r}"
                    fut.set_exception(PeerTimeout(f"no message for {what} within {timeout:g}s"))

            handle = loop.call_later(timeout, expire)
        try:
            return await fut
        finally:
            if handle is not None:
                handle.cancel()
            if not fut.done() or fut.cancelled() or fut.exception() is not None:
                self._unlink(waiter)

    def subscribe(self, tag: str, callback: Callable[[Message], None]) -> None:
        """Hand every message with exactly ``tag`` to ``callback`` as it is delivered (those
        queued now first), instead of queueing it for :meth:`get` (waiters for the tag are not
        served meanwhile): a server that takes every request of one tag (the RPC server) saves
        the waiter, the future and a loop turn per message. ``callback`` runs inside delivery
        (a loop callback): it must not block or raise, and bounds what it keeps itself; if it
        raises while the queued messages are handed over, the subscription is undone and the
        error propagates. Ends with :meth:`unsubscribe` or :meth:`close`; ValueError when the
        tag already has a subscriber, the close error when closed."""
        if self._closed is not None:
            raise self._closed
        if tag in self._subscribers:
            raise ValueError(f"tag {tag!r} already has a subscriber")
        self._subscribers[tag] = callback
        try:
            while (msg := self._pop(tag)) is not None:
                callback(msg)
        except BaseException:
            del self._subscribers[tag]
            raise

    def unsubscribe(self, tag: str, callback: Callable[[Message], None]) -> None:
        """Stop handing ``tag`` to ``callback`` (another component's subscription is left
        alone); later arrivals queue again."""
        if self._subscribers.get(tag) == callback:
            del self._subscribers[tag]

    def subscribed(self, tag: str, callback: Callable[[Message], None]) -> bool:
        """``callback`` takes ``tag`` (false once unsubscribed or the mailbox closed)."""
        return self._subscribers.get(tag) == callback

    def get_nowait(self, tag: str) -> Message | None:
        """A queued message with this tag, or None."""
        return self._take(tag, None)

    def get(self, tag: str, timeout: float | None = None, *,
            peer: int | None = None) -> Coroutine[Any, Any, Message]:
        """The next message with ``tag`` (queued, else the next to arrive); PeerTimeout after
        ``timeout`` seconds (None: no limit); the close error once closed. ``peer``: the node
        the message is expected from, for :meth:`Scope.abort` (the message is not checked
        against it). Called from ``Transport.recv`` and ``Transport.listen``."""
        return self._get(tag, None, timeout, peer)

    def get_prefix(self, prefix: str, timeout: float | None = None) -> Coroutine[Any, Any, Message]:
        """Like :meth:`get` for the oldest message whose tag starts with ``prefix``
        (``Transport.recv_any``)."""
        return self._get(None, prefix, timeout)

    # -- scopes --------------------------------------------------------------------------

    def scope(self, *roots: str) -> Scope:
        """Open a :class:`Scope` over the tags starting with any of ``roots``: the waits begun
        under them from now on are registered with it (see :class:`Scope`)."""
        sc = Scope(self, roots)
        ref = weakref.ref(sc)
        for fam in {_family(root) for root in roots}:
            live = self._scopes.setdefault(fam, [])
            live[:] = [r for r in live if r() is not None]  # forget dropped scopes
            live.append(ref)
        return sc

    def _scopes_over(self, key: str) -> tuple[Scope, ...]:
        """The open scopes that cover a wait for ``key`` (a tag or a prefix)."""
        found: tuple[Scope, ...] = ()
        fam = _family(key)
        for live in (self._scopes.get(fam, ()) if fam is not None else (), self._scopes.get(None, ())):
            for ref in live:
                sc = ref()
                if sc is not None and key.startswith(sc.roots) and sc not in found:
                    found += (sc,)
        return found

    def _unregister(self, sc: Scope) -> None:
        for fam in {_family(root) for root in sc.roots}:
            live = self._scopes.get(fam)
            if live is not None:
                live[:] = [r for r in live if r() is not None and r() is not sc]
                if not live:
                    del self._scopes[fam]

    def _fail(self, waiters: Iterable[_Waiter], exc: P2PSyncError) -> int:
        n = 0
        for w in list(waiters):
            self._unlink(w)
            if not w.future.done():
                w.future.set_exception(exc)
                n += 1
        return n

    # -- abort, expiry, retire -----------------------------------------------------------

    def abort(self, exc: P2PSyncError, match: Callable[[str], bool] | None = None) -> int:
        """Fail every pending waiter (or those whose tag/prefix ``match``es) with ``exc``.
        Operations end through their :class:`Scope`; this is for the transport's own waits
        (closing, one tag's receive)."""
        hit = [w for dq in self._exact.values() for w in dq
               if match is None or match(w.exact or "")]
        hit += [w for w in self._prefix if match is None or match(w.prefix or "")]
        return self._fail(hit, exc)

    def expire(self, what: str | Callable[[str], bool]) -> int:
        """Drop queued messages whose tag starts with ``what`` (or satisfies it, a predicate);
        counted as ``expired``. Returns how many were dropped."""
        pred: Callable[[str], bool] = (lambda t: t.startswith(what)) if isinstance(what, str) else what
        return self._drop_where(pred, "expired")

    def _drop_where(self, pred: Callable[[str], bool], reason: str) -> int:
        return self._drop_entries([e for t in self._queues if pred(t) for e in self._queues[t]], reason)

    def _drop_entries(self, entries: list[_Entry], reason: str) -> int:
        n = 0
        for e in entries:
            if e.alive:
                self._kill(e, reason)
                n += 1
        return n

    def retire(self, tag: str, *, exact: bool = False) -> int:
        """Declare ``tag`` (``exact``) or every tag starting with ``tag`` finished: queued
        messages are dropped now and later ones that no waiter takes are dropped on arrival
        (reason ``retired``). Returns how many queued messages were dropped."""
        self._retired.add(tag, exact=exact)
        if exact:
            return self._drop_entries(list(self._queues.get(tag, ())), "retired")
        return self._drop_where(lambda t: t.startswith(tag), "retired")

    def unretire(self, tag: str) -> None:
        """Forget that ``tag`` (exact or prefix) was retired."""
        self._retired.forget(tag)

    def close(self, exc: P2PSyncError) -> None:
        """Fail every waiter, and every later :meth:`get` that finds nothing queued, with
        ``exc``; drop what is queued. Called when the transport closes."""
        self._closed = exc
        self._subscribers.clear()
        self.abort(exc)
        self._queues.clear()
        self._families.clear()
        self._arrivals.clear()
        self._data_by_peer.clear()
        self._peer_bytes.clear()
        self._control_by_peer.clear()
        self._pending = self._data_pending = self._bytes = 0


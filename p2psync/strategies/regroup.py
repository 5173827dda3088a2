"""Nodes that leave and join: synchronous strategies re-form over the current view
(membership is a sequence of views).

What: :class:`Regroup` runs one synchronous operation of a strategy (SSGD's gradient allreduce,
ESync's aggregation of deltas, Eq. 6-7 of the ESync paper) over the members of the
current membership view and redoes it over the next view when it fails, and brings a joiner
(or a survivor that fell one step behind) to the same state as the others.
:func:`serve_state` / :func:`fetch_state` let a joiner of an asynchronous strategy copy the
state of a live neighbour without stopping anyone.

Why this protocol (and not another):

* **The view epoch is in every tag.** An operation at epoch ``e`` over the view's members runs
  under ``<name>.<step>.e<e>`` and over those members only, so nodes holding different views
  never mix pieces: they fail to meet, and meet again once they share the newer view (every
  node learns it within a heartbeat interval or from the ``event.view`` push).
* **A newer view abandons the operation in flight.** Collectives never write their input (they
  return a new tensor), so abandoning one applies nothing (never a half-applied average). A
  PeerFailure makes the node wait, bounded by a few failure-detection bounds, for a newer view;
  if none comes, the PeerFailure ends the run as before (a live but silent peer is not silently
  dropped).
* **Members agree on their state at every new epoch.** The first operation of an epoch is a
  tiny exact allgather of the step every member is at (``<name>.sync.e<e>``; ``-1`` for a
  joiner). An operation can complete on some members and fail on others (a member dies after
  its last piece went out), so survivors may be a step apart, and a joiner has no state. If the
  steps differ (:func:`sync_decision`), the lowest-id member at the highest step broadcasts its
  state at the start of that step — parameters and optimizer state as one float32 vector,
  ``<name>.state.e<e>``, over a tree of the group's own links, or of its relay links when its
  own do not join it (live non-members, such as departed nodes still up, forward the pieces:
  :mod:`p2psync.collectives.plan`) — and every member behind adopts it and continues at that
  step. Survivors and joiners therefore hold bitwise the same state as the members they meet
  (SSGD stays bitwise equal). A group the live nodes no longer join fails with
  :class:`~p2psync.errors.GroupCutOff` (a PeerFailure: the node waits for a newer view).

With ``--on-failure stop``, or without a membership service (unit tests), the strategy's
failure policy is :class:`~p2psync.strategies.failure.Stop`: an operation runs once over every
node and a failed peer ends the run. :class:`Regroup` runs its operations under the policy
(:attr:`Regroup.failure`, :meth:`~p2psync.strategies.failure.FailurePolicy.run`), so neither it
nor the strategies using it test the setting.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

import numpy as np

from p2psync import clock
from p2psync.collectives import Collectives, OpId
from p2psync.coordinator import View
from p2psync.errors import ConfigError, NonFinitePiece, P2PSyncError, PeerFailure, ProtocolError
from p2psync.model import MAX_META_BYTES, MODEL_BUFFERS
from p2psync.strategies.base import StrategyContext
from p2psync.strategies.failure import FailurePolicy, Reform, failure_policy
from p2psync.strategies.buffers import sync_buffers
from p2psync.tasks import cancel_all, wait_or_event
from p2psync.topology.paths import hop_distances
from p2psync.transport import Scope

log = logging.getLogger("p2psync.regroup")

T = TypeVar("T")
#: the step a joiner reports in the state sync: it has no state yet
JOINING = -1


@dataclass(frozen=True)
class Adopted:
    """The operation was not run: this node adopted a peer's state at the start of ``step``."""

    step: int


def sync_decision(steps: Mapping[int, int]) -> tuple[int, int] | None:
    """Pure: ``(donor, step)`` when the members' steps differ — the lowest id at the highest
    step gives its state at the start of that step — else None (nothing to transfer)."""
    if not steps:
        raise ConfigError("a state sync needs at least one member")
    top = max(steps.values())
    if top < 0:
        raise PeerFailure(f"no live member has a state to give (members {sorted(steps)} are all "
                          "joining)", peers=tuple(sorted(steps)))
    if all(s == top for s in steps.values()):
        return None
    return min(n for n, s in steps.items() if s == top), top


def backward_from(steps: Mapping[int, int], redo: bool) -> int:
    """Pure: the first step of a newly synced epoch whose operation may run as an optional
    early attempt (SSGD's averaging during backward) instead of the plain operation. Every
    member computes it from the same sync, so all choose alike: the sync's step itself when
    every member was there and none is redoing a failed attempt, else the step after it (a
    member that redoes, adopts or joins runs the plain operation at that step, and so must
    everyone)."""
    top = max(steps.values())
    return top if not redo and all(s == top for s in steps.values()) else top + 1


def exact_mean_input(vec: np.ndarray) -> np.ndarray:
    """``vec`` widened to float64 for a mean of whole states: float32 sums of three or more
    equal values round (x + x + x is not always 3x), so the mean of identical replicas would
    move them by an ulp; in float64 it is exact, and the result is cast back to float32."""
    return np.asarray(vec, dtype=np.float64)


#: elements of a state vector one operation of :func:`exact_mean` averages (16 MiB in float64)
EXACT_MEAN_CHUNK = 1 << 21


async def exact_mean(coll: Collectives, vec: np.ndarray, group: Sequence[int], *, tag: str,
                     chunk: int | None = None) -> np.ndarray:
    """The exact mean over ``group`` of the flat float32 ``vec`` (a whole state), written into
    ``vec`` itself, which is returned. ``vec`` is handed over: a fresh array of the caller's
    that nothing else reads (after a failure it holds a partial result: take a fresh one to
    redo). Chunks of ``chunk`` elements (default :data:`EXACT_MEAN_CHUNK`) are averaged one
    after the other, each widened to float64 (:func:`exact_mean_input`), reduced in place by
    one allreduce (``donate=True``, tag ``<tag>.c<i>``) and cast back into ``vec``: the working
    memory is one chunk in float64 and its pieces in flight, not a float64 copy of the whole
    state plus a working buffer of that size. Every member passes the same length and
    chunk."""
    step = chunk or EXACT_MEAN_CHUNK
    if vec.dtype != np.float32 or vec.ndim != 1 or step < 1:
        raise ConfigError(f"exact_mean takes a flat float32 vector and a positive chunk, got {vec.dtype} "
                          f"{vec.shape} and {step}")
    for i, lo in enumerate(range(0, vec.size, step)):
        part = vec[lo:lo + step]
        part[...] = await coll.allreduce(exact_mean_input(part), group, op="mean", codec="none",
                                         tag=f"{tag}.c{i}", donate=True)
    return vec


def regroup_bound(failure_timeout: float, interval: float) -> float:
    """Seconds a node waits for a newer view after a PeerFailure: a few detection bounds."""
    return max(10.0, 4.0 * failure_timeout + 4.0 * interval)


class Regroup:
    """One per synchronous strategy instance; create it in ``start()`` (after rendezvous)."""

    def __init__(self, *, ctx: StrategyContext, name: str,
                 snapshot: Callable[[], Awaitable[np.ndarray]] | None = None,
                 restore: Callable[[np.ndarray], Awaitable[None]] | None = None,
                 size: Callable[[], int] | None = None, failure: FailurePolicy | None = None) -> None:
        """``snapshot`` / ``restore`` / ``size``: the state a member behind adopts (default: the
        replica's parameters and optimizer state, ``export_state`` / ``import_state`` /
        ``state_size``); a strategy with state of its own (DiLoCo's global copy and outer
        momentum) passes its own three. ``snapshot`` returns a fresh float32 vector each time,
        which the caller may write (:meth:`average_state` averages it in place). ``failure``: the strategy's failure policy (default:
        :func:`~p2psync.strategies.failure.failure_policy` of ``name``)."""
        self.ctx = ctx
        self.name = name
        #: re-form over survivors (Reform) or stop (Stop): decided once
        self.failure = failure if failure is not None else failure_policy(ctx, name)
        self.snapshot = snapshot if snapshot is not None else ctx.replica.export_state
        self.restore = restore if restore is not None else ctx.replica.import_state
        self.size = size if size is not None else ctx.replica.state_size
        #: the epoch whose members last agreed on their state: none yet, so every node runs one
        #: sync on its first operation (one tiny allgather). Starting from the epoch seen at
        #: construction could differ between nodes (a view may land between two nodes'
        #: start-ups) and they would then wait for each other's different tags.
        self.synced: int | None = None
        self._changed = asyncio.Event()
        self.bound = regroup_bound(ctx.membership.failure_timeout, ctx.membership.interval)
        #: failed operations that later succeeded over a newer view (the strategies' metrics
        #: report it as ``reforms``)
        self.reformations = 0
        #: states this node took from a peer at a new epoch's sync
        self.adoptions = 0
        #: seconds from the failed operation to the first operation that succeeded after it
        self.last_reform_s: float | None = None
        #: steps before this one run the plain operation in the synced epoch (:func:`backward_from`)
        self.backward_from = 0

    # -- hooks (event loop) --------------------------------------------------------------

    def on_peer_failure(self, peer: int) -> None:
        self.failure.on_peer_failure(peer)

    def on_view(self, view: View) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    @property
    def next_view(self) -> asyncio.Event:
        """Set when a view newer than the current one arrives (a fresh event per view)."""
        return self._changed

    def unsynced(self) -> bool:
        """Whether, re-forming, the current view is newer than the one whose members last
        agreed on their state: the next :meth:`run` begins with that view's state sync, which
        waits for every member. A strategy whose local work between operations waits on the
        others (ESync's iterations until the State Server says READY, which waits on the
        slowest member) ends that work when this turns True, and goes to its operation."""
        return isinstance(self.failure, Reform) and self.synced is not None and self.ctx.epoch != self.synced

    def check(self) -> None:
        """Raise PeerFailure when the policy stops the run on a failed peer (never when
        re-forming). The step driver checks the policy before every step; a strategy calls
        this within a step (between local iterations)."""
        self.failure.check()

    # -- the retry loop ------------------------------------------------------------------

    async def join(self) -> int:
        """A joiner: take the state of the members at their current step; returns that step."""
        async def refuse(_: View) -> None:
            raise ConfigError(f"{self.name}: joining a running run needs --on-failure continue")

        got = await self.failure.run(refuse, lambda: self._reform(JOINING, None))
        if not isinstance(got, Adopted):
            raise PeerFailure(f"{self.name}: joined but no member gave its state")
        return got.step

    async def run(self, step: int, op: Callable[[View], Awaitable[T]] | None, *, redo: bool = False,
                  failed_at: float | None = None) -> T | Adopted | None:
        """Run ``op(view)`` over the current view, after the members of a new epoch agreed on
        their state; redo it over the next view if it fails. Returns op's result, or
        :class:`Adopted` when this node took a peer's state instead (then op did not run), or
        None when ``op`` is None and nothing was adopted. ``redo``: this step was already
        attempted and failed (outside this call, at ``failed_at``); the members of the next
        sync learn it (:attr:`backward_from`). The failure policy runs it once over its view
        (a failed peer ends the run: PeerFailure before or after ``op``) or re-forms."""

        async def once(view: View) -> T | Adopted | None:
            self.failure.check()
            out = None if op is None else await op(view)
            self.failure.check()
            return out

        return await self.failure.run(once, lambda: self._reform(step, op, redo=redo, failed_at=failed_at))

    async def _reform(self, step: int, op: Callable[[View], Awaitable[T]] | None, *, redo: bool = False,
                      failed_at: float | None = None) -> T | Adopted | None:
        """:meth:`run` re-forming: the state sync of a new epoch, then ``op``, redone over the
        next view while they fail with an error the policy recovers from."""
        while True:
            view = self.ctx.view
            me = self.ctx.node_id
            if me not in view.members:
                raise PeerFailure(f"{self.name}: node {me} is not a member of view {view.epoch} "
                                  "(the coordinator declared it failed)", peers=(me,))
            attempt = self._scope(view, step)
            try:
                if view.epoch != self.synced:
                    adopted = await self._race(self._sync(step, view, redo=redo or failed_at is not None), view,
                                               attempt)
                    if adopted is not None:
                        attempt.close()
                        self._reformed(failed_at)
                        return Adopted(adopted)
                out = None if op is None else await self._race(op(view), view, attempt)
                attempt.close()
                self._reformed(failed_at)
                return out
            except (PeerFailure, ProtocolError) as exc:  # (a PeerTimeout is not redone here: it ends the run)
                if not self.failure.recovers(exc):
                    raise
                # A NonFinitePiece is a PeerFailure: its sender is being excluded, wait for that view.
                # collective_mismatch: a member runs this epoch's operation over another group.
                # Two coordinators can publish views with the same epoch around a takeover (the
                # new one moves past the old one's epoch once a member reports it), so the
                # members disagree until the newer view arrives: wait for it, as for a failure.
                if failed_at is None:
                    failed_at = clock.now()
                log.warning("node %d: %s step %d over view %d failed (%s); waiting for a newer view",
                            me, self.name, step, view.epoch, exc)
                attempt.retire()  # its pieces still on their way are dropped
                err = exc if isinstance(exc, PeerFailure) else PeerFailure(str(exc))
                if not isinstance(exc, NonFinitePiece):  # (its sender's exclusion is the next view)
                    self.ctx.membership.request_redo(view.epoch, err.peers)
                await self._await_newer(view, err)

    async def prepare(self, step: int) -> View | Adopted | None:
        """Before an operation of ``step`` that runs outside :meth:`run` (SSGD's averaging
        during backward): the members of a new epoch agree on their state first. Returns the
        view to run it over, :class:`Adopted` when this node took a peer's state instead, or
        None when this step must run the plain operation through :meth:`run` (the first step
        of a sync that a member redoes, adopts or joins at: :func:`backward_from`). Without
        re-forming, the policy's view."""

        async def fixed(view: View) -> View | Adopted | None:
            return view

        return await self.failure.run(fixed, lambda: self._prepare(step))

    async def _prepare(self, step: int) -> View | Adopted | None:
        """:meth:`prepare` re-forming."""
        if self.ctx.epoch != self.synced:
            got = await self._reform(step, None)
            if isinstance(got, Adopted):
                return got
        if step < self.backward_from:
            return None
        return self.ctx.view

    async def average_state(self, count: int, step: int, flag: bool = False) -> tuple[int, int, bool]:
        """Every member of the current view averages its whole state (weights and optimizer
        state, exactly: :func:`exact_mean`) and they agree on the step to go on at: the highest
        member's next, so a joiner or a node that ran ahead lines up. ``count`` numbers these
        averagings (the same on every member: it keys their tags); a node that missed one
        (it failed here, succeeded elsewhere) adopts a member's state and count and joins
        the next. ``flag`` rides along (a member that averages because it stops makes the
        others stop with it). Returns (the next count, the step to go on at, any flag)."""
        got = await self.run(count, lambda v: self._mean_state(v, count, step, flag))
        while isinstance(got, Adopted):
            count = got.step
            got = await self.run(count, lambda v: self._mean_state(v, count, step, flag))
        top, any_flag = got if got is not None else (0, flag)
        return count + 1, max(step + 1, top), any_flag

    async def _mean_state(self, view: View, count: int, step: int, flag: bool) -> tuple[int, bool]:
        coll = self.ctx.collectives
        tag = OpId(self.name, count, view.epoch).tag
        steps = asyncio.ensure_future(coll.allgather(np.array([step, int(flag)], np.int64), view.members,
                                                     tag=f"{tag}.steps"))
        try:
            mean = await exact_mean(coll, await self.snapshot(), view.members, tag=tag)  # in the fresh snapshot
            rows = await steps
        finally:
            await cancel_all([steps])  # when the average failed first
        await self.restore(mean)
        await sync_buffers(MODEL_BUFFERS.of(self.ctx.replica, self.name), coll, self.ctx.buffers, tag=tag,
                           group=view.members)
        return max(int(a[0]) for a in rows) + 1, any(int(a[1]) for a in rows)

    def _reformed(self, failed_at: float | None) -> None:
        if failed_at is not None:
            self.reformations += 1
            self.last_reform_s = clock.now() - failed_at
            log.warning("node %d: %s re-formed over view %d (members %s) in %.2fs", self.ctx.node_id,
                        self.name, self.ctx.epoch, list(self.ctx.group), self.last_reform_s)

    async def _race(self, coro: Awaitable[T], view: View, scope: Scope) -> T:
        """``coro``, abandoned (PeerFailure, ``scope`` retired) as soon as a view newer than
        ``view`` arrives."""
        task = asyncio.ensure_future(coro)
        try:
            if self.ctx.epoch == view.epoch:
                await wait_or_event(task, self._changed)
        finally:
            await cancel_all([task])  # a newer view (or this call cancelled): abandoned
        if task.cancelled():
            scope.retire()
            now = self.ctx.view
            left = tuple(sorted(set(view.members) - set(now.members)))
            raise PeerFailure(f"{self.name}: view {view.epoch} replaced by view {now.epoch} "
                              f"(left {list(left)}, members {list(now.members)})", peers=left)
        return task.result()

    def _scope(self, view: View, step: int) -> Scope:
        """The receives of one attempt of ``step`` over ``view``: its sync, its state transfer
        and its operation. Retired when the attempt fails, so that pieces of it that are
        queued, or still on their way, are dropped (bounded memory). Tags follow
        ``<name>.<step|sync|state>.e<epoch>``; pieces add ``.<phase>...``."""
        return self.ctx.transport.scope(*(OpId(self.name, kind, view.epoch).root for kind in ("sync", "state", step)))

    async def _await_newer(self, view: View, exc: PeerFailure) -> None:
        """Wait for a view newer than ``view``: bounded by :attr:`bound`, or, while this node
        hears no majority of the run (a partition, a coordinator election), by the quorum
        wait of the membership client (the minority side waits for the heal)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.bound
        m = self.ctx.membership
        while self.ctx.epoch <= view.epoch:
            if m.fenced is not None:
                raise m.fenced
            if not m.has_quorum:
                await m.wait_quorum(self.ctx.quorum_timeout)
                deadline = max(deadline, loop.time() + self.bound)
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise exc
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def _sync(self, step: int, view: View, *, redo: bool = False) -> int | None:
        """The state sync of a new epoch (see the module docstring); returns the step adopted."""
        coll, me, members = self.ctx.collectives, self.ctx.node_id, view.members
        got = await coll.allgather(np.array([float(step), float(redo)]), members, tag=OpId(self.name, "sync", view.epoch).tag)
        steps = {n: int(a[0]) for n, a in zip(members, got, strict=True)}
        self.backward_from = backward_from(steps, any(a[1] for a in got))
        decision = sync_decision(steps)
        if decision is None:
            self.synced = view.epoch
            return None
        donor, top = decision
        size = self.size()
        buf = await self.snapshot() if me == donor else np.zeros(size, np.float32)
        if buf.size != size or buf.dtype != np.float32:
            raise ConfigError(f"{self.name}: state snapshot has {buf.size} {buf.dtype} values, expected {size} float32")
        state_op = OpId(self.name, "state", view.epoch)
        state = await coll.broadcast(buf, donor, members, tag=state_op.tag)
        meta = await self._meta(donor, members, state_op.tag)
        self.synced = view.epoch
        if steps[me] >= top:
            log.info("node %d: gave/kept the state of step %d at view %d", me, top, view.epoch)
            return None
        await self.restore(np.asarray(state, dtype=np.float32))
        await self.ctx.replica.import_meta(meta)
        self.adoptions += 1
        log.warning("node %d: adopted node %d's state at step %d (was at step %d), view %d members %s",
                    me, donor, top, step, view.epoch, list(members))
        return top


    async def _meta(self, donor: int, members: Sequence[int], tag: str) -> bytes:
        """The donor's training state beyond the vector (hyperparameters, LR schedulers:
        ``Replica.export_meta``), broadcast as its length, then its bytes."""
        coll, me = self.ctx.collectives, self.ctx.node_id
        mine = await self.ctx.replica.export_meta() if me == donor else b""
        size = await coll.broadcast(np.array([len(mine)], np.int64), donor, members, tag=f"{tag}.metalen")
        n = int(size[0])
        if not 0 <= n <= MAX_META_BYTES:
            raise ProtocolError("state", f"node {donor} announced a training state of {n} bytes")
        raw = np.frombuffer(mine, np.uint8) if me == donor else np.zeros(n, np.uint8)
        got = await coll.broadcast(raw, donor, members, tag=f"{tag}.meta")
        return np.asarray(got, np.uint8).tobytes()


# -- joiners of asynchronous strategies ------------------------------------------------------

async def _until_member(ctx: StrategyContext, node: int, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while node not in ctx.group:
        if loop.time() > deadline:
            raise PeerFailure(f"node {node} is not a member of view {ctx.epoch}", peers=(node,))
        await asyncio.sleep(0.05)  # the view arrives within a heartbeat interval


def serve_state(ctx: StrategyContext, name: str, step: Callable[[], int]) -> None:
    """Answer ``<name>.state`` RPCs from joiners: the state goes back as one ``data`` message
    to the joiner (relayed through live nodes when it is not adjacent: ``send(...,
    relay=True)``); the reply carries the step it was taken at."""

    async def handler(caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        tag = args.get("tag")
        if not isinstance(tag, str) or not tag.startswith(f"{name}.join."):
            raise ProtocolError("state", f"bad state tag {tag!r}"[:100])
        await _until_member(ctx, caller, ctx.peer_timeout)  # our view may lag the joiner's
        at = step()
        vec = await ctx.replica.export_state()
        meta = np.frombuffer(await ctx.replica.export_meta(), np.uint8)
        await ctx.transport.send(caller, tag, [vec, meta], kind="data", step=max(0, at), timeout=ctx.peer_timeout,
                                 relay=True)
        return {"step": at}

    ctx.rpc_server.register(f"{name}.state", handler)


#: seconds between a joiner's rounds of asking for the state when no member could give it
FETCH_RETRY_S = 0.1


async def fetch_state(ctx: StrategyContext, name: str) -> int:
    """A joiner: copy the state of a live member, the nearest first over live nodes (adjacent
    ones first, lowest id first among equals; a farther one's state is relayed); returns its
    step. When none can give it (none reachable yet: the neighbours on every way to the
    members may be new processes joining too), it asks again every :data:`FETCH_RETRY_S`
    until ``peer_timeout`` seconds have passed (a round under way ends first: each member's
    call is bounded by the peer timeout), then raises PeerFailure with each member's answer.
    Each ask has a tag of its own, retired after it: a state that comes late is dropped."""
    me = ctx.node_id
    deadline = clock.now() + ctx.peer_timeout
    asks = 0
    while True:
        dist = hop_distances(ctx.topology, me, avoid=ctx.transport.dead)
        donors = sorted((n for n in ctx.group if n != me and n in dist), key=lambda n: (dist[n], n))
        errors: list[str] = []
        for d in donors:
            asks += 1
            tag = f"{name}.join.{me}.{ctx.transport.incarnation}.{asks}"
            try:
                rep = await ctx.rpc.call(d, f"{name}.state", {"tag": tag}, timeout=ctx.peer_timeout)
                msg = await ctx.transport.recv(tag, timeout=ctx.peer_timeout)
                at = rep.get("step") if isinstance(rep, dict) else None
                vec, meta = (msg.arrays[0], msg.arrays[1]) if len(msg.arrays) == 2 else (None, None)
                if type(at) is not int or vec is None or meta is None or vec.dtype != np.float32 \
                        or vec.size != ctx.replica.state_size() or meta.dtype != np.uint8 \
                        or meta.size > MAX_META_BYTES or msg.src != d:
                    raise ProtocolError("state", f"node {d} sent a malformed state")
            except P2PSyncError as exc:
                errors.append(f"node {d}: {exc}")
                continue
            finally:
                ctx.transport.retire(tag)
            await ctx.replica.import_state(np.array(vec, copy=True))
            await ctx.replica.import_meta(np.asarray(meta).tobytes())
            log.warning("node %d: joined with node %d's state at its step %d", me, d, at)
            return at
        left = deadline - clock.now()
        if left <= 0:
            raise PeerFailure(f"node {me}: no live member gave its state within {ctx.peer_timeout:g}s "
                              f"({'; '.join(errors) or 'none reachable'})", peers=tuple(donors))
        await asyncio.sleep(min(FETCH_RETRY_S, left))

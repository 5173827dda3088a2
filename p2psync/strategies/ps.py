"""BSP, ASP, SSP, Dynamic SSP and ElasticBSP on the sharded parameter store.

Thesis: *Elastic Synchronization for Efficient and Effective Distributed Deep Learning*, §3.1
(BSP, ASP, SSP), ch. 5 (DSSP), ch. 6 (ElasticBSP), mapped onto p2psync as a scheduler on the
coordinator (:mod:`p2psync.coordinator.ssp`: DSSP with its pseudocode fixed to enforce s_U,
ElasticBSP as an online protocol) plus a parameter store sharded over the peers
(:mod:`p2psync.params`), so that all five run on one mechanism and compare honestly.

A worker's step: the user's iteration computes a gradient on the weights it holds
(the first on the run's identical initial weights), the gradient is pushed to the shard owners
(applied on arrival, acknowledged), the push is reported to the scheduler, which answers OK
(now or when the slowest worker catches up; at an ElasticBSP barrier when everyone arrived),
then the weights are pulled and become the replica's for the next iteration. The user's
optimizer does not step: the owners run its class with its options on their shards
(:mod:`p2psync.params.optim`; elementwise ``torch.optim`` optimizers: SGD with or without
momentum or Nesterov, Adam, AdamW, ...), each push with the hyperparameters the worker's
optimizer has when the push leaves (read from its ``param_groups``, so LR schedulers and manual
changes apply; lr/N per push outside barriers, one unscaled step on the round's mean under
BSP); the user's optimizer keeps no state.

Barriers (every OK of ``bsp``, ``ssp`` with s = 0 and ``dssp`` with s_U = 0; ElasticBSP's
releases): the pull after one is tagged with the barrier's number and each push with the
number of the last barrier its worker passed, so every worker pulls the same weights even when a
faster one has already pushed again (:mod:`p2psync.params.barriers`). The BSP-like ones keep
each round at the owners and apply it in origin order once complete (one SGD step on the
round's mean), so they are bitwise reproducible and SSP(0) = DSSP(0, 0) = BSP exactly.

Options: ``ssp``: ``s`` (staleness, default 3); ``dssp``: ``s_lower`` (3), ``s_upper`` (15);
``elastic_bsp``: ``R`` (15), ``search`` (``zipline_opt_bs``). ``bsp`` is SSP(0), ``asp`` never
waits.

Stopping: the first worker that wants to stop tells the scheduler; every held and later report
is answered STOP. Each worker then waits (an exact allreduce barrier over the store's members)
until every worker's last push is applied, and pulls: every node ends with the same weights. A
join or a failure meanwhile moves the store first: a worker in the barrier leaves it for the
re-shard (a joiner waits in it), and the barrier and the pull are redone in the new split.

Codecs: pushes are gradients, so every codec applies to their pieces (error feedback per
shard piece with ``--error-feedback``, always for ``topk``); pulls are exact.

Failures: a worker that dies (or leaves) is dropped by the scheduler (its count no longer holds
anyone back; ElasticBSP recomputes its barrier without it) and by the store: the survivors
re-split the shards over themselves, restoring the dead owner's shard from the freshest pulled
copy (:meth:`p2psync.params.ParamStore.reshard`), and go on. A worker notices the new view at
the start of a step, while the scheduler holds it, or when a push or pull fails (the failed
peer's pending receives are aborted at once); a push lost that way is counted (``lost_pushes``
in the step metrics).

Joins: a node that joins the run (the launcher's new process of a node the majority declared
failed and fenced: a pause, a partition) joins the store: every member of the view that admits
it re-splits the vector over the new member list, the joiner contributing nothing and taking
its shard (weights and optimizer state) and the whole vector it starts from
(:meth:`p2psync.params.ParamStore.reshard`; a leave and a join in one view, such as a member's
process that restarted before the others saw it leave, are one re-shard: its old shard is
restored from the freshest pulled copy like a dead owner's). The same re-shard tells the joiner
the members' clocks: its push count (and :attr:`Strategy.start_step`) is the slowest member's,
its barrier generation the highest member's, as :mod:`p2psync.coordinator.ssp` ("Joiners")
admits it. It then takes the user state (hyperparameters, LR schedulers, scaler:
:meth:`Replica.export_meta`) of the slowest member, whose count it joined at, so its pushes
carry the hyperparameters the schedule gives at that count.

The coordinator dying is such a failure too (it is a worker and a shard owner like any other):
the survivors re-shard without it, and the node taking over (the lowest live id) starts a fresh
scheduler. The report in flight is retried there (``call_coordinator``), rebuilt at every
attempt with the newest view minus the peers this node knows failed; it carries the worker's
own count and barrier generation (``gen``), which the new scheduler adopts (module docstring of
:mod:`p2psync.coordinator.ssp`: bounds kept, ElasticBSP's barrier in progress abandoned and a
lost release owed).
"""

from __future__ import annotations

import asyncio
import logging
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from p2psync import clock
from p2psync.collectives import OpId
from p2psync.coordinator.rpc import RpcServer
from p2psync.coordinator.views import View
from p2psync.coordinator.ssp import ElasticScheduler, StalenessScheduler
from p2psync.coordinator.ssp_service import SchedulerService
from p2psync.coordinator.zipline import SEARCHERS
from p2psync.errors import ConfigError, P2PSyncError, PeerFailure, PeerTimeout, ProtocolError
from p2psync.params import ParamStore
from p2psync.strategies.needs import Needs
from p2psync.strategies.options import StrategyOptions, option, require
from p2psync.model import MAX_META_BYTES, OPTIMIZER_SHARDS
from p2psync.strategies.base import (StepReport, Strategy, StrategyContext, parse_options,
                                    register)
from p2psync.tasks import cancel_all, wait_or_event
from p2psync.topology import Topology

log = logging.getLogger("p2psync.strategies")

#: the largest clock value (push count, barrier generation) a re-shard carries exactly
_CLOCK_MAX = (1 << 24) - 1


def store_changes(members: Sequence[int], incarnations: Mapping[int, int],
                  view: View) -> tuple[list[int], list[int]]:
    """What ``view`` changes for a store split over ``members`` whose processes had
    ``incarnations``: the members it lost (gone from the view, not departed; or restarted: the
    view names another incarnation, whose process holds none of the old one's shard) and its
    members that hold no shard (joiners, restarted members). An incarnation unknown on either
    side is taken as unchanged. Pure."""
    incs = view.incarnations

    def restarted(m: int) -> bool:
        return m in incarnations and m in incs and incs[m] != incarnations[m]
    gone = [m for m in members if (m not in view.members and m not in view.departed) or restarted(m)]
    fresh = [m for m in view.members if m not in members or restarted(m)]
    return gone, fresh


class _ViewWait:
    """The bound of a wait that a newer view ends: ``bound`` seconds on the one clock, renewed
    (:meth:`renew`) whenever the run moves; ``seen`` is the newest view epoch seen so far."""

    def __init__(self, bound: float, seen: int) -> None:
        self.bound = bound
        self.seen = seen
        self.deadline = clock.now() + bound

    def renew(self) -> None:
        self.deadline = max(self.deadline, clock.now() + self.bound)

    @property
    def expired(self) -> bool:
        return clock.now() > self.deadline


class _StoreStrategy(Strategy):
    """The worker loop shared by the five (spec §5)."""

    kind: ClassVar[str] = ""
    requires = (OPTIMIZER_SHARDS,)
    needs = Needs(optimizer="elementwise",
                  schedules="honoured: every push carries the worker's current hyperparameters of every "
                            "parameter group",
                  clipping="clips the worker's gradient before it is pushed",
                  why="the shard owners run the optimizer's class on slices of the flat parameter vector")

    @classmethod
    @abstractmethod
    def scheduler(cls, opts: Any, ids: list[int]) -> StalenessScheduler | ElasticScheduler:
        """The coordinator's scheduler of this strategy over workers ``ids``, built from
        ``opts`` (its :attr:`Options`); ConfigError when the options do not fit (checked by
        :meth:`check_options` before anything starts)."""

    @classmethod
    def check_options(cls, opts: Any, topology: Topology) -> None:
        cls.scheduler(opts, list(topology.ids))  # the scheduler's own checks (s_upper >= s_lower, R, ...)

    @classmethod
    def coordinator_services(cls, server: RpcServer, topology: Topology, options: Mapping[str, Any]) -> None:
        opts = parse_options(cls, options)
        SchedulerService(server, topology.ids, cls.scheduler(opts, topology.ids), name=cls.name)

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)  # the options are checked there (check_options) on every node
        self.store: ParamStore | None = None
        self.count = 0
        self.reshards = 0
        self.gen = 0  # barriers this worker was released from (its pushes' generation)
        #: the incarnation of every store member's process at the current split (from its view)
        self._incs: dict[int, int] = {}
        self._next_view = asyncio.Event()  # set when a newer view arrives (a fresh event per view)
        #: the receives of the end-of-training exchange (failed when a peer fails)
        self._end_ops = ctx.transport.scope(f"{self.name}.end")

    async def start(self) -> None:
        """Build this node's part of the store; a joiner then joins it (:meth:`_join`)."""
        spec = await OPTIMIZER_SHARDS.of(self.ctx.replica).optim_spec()
        view = self.ctx.view
        joining = self.ctx.joining
        self.store = ParamStore(transport=self.ctx.transport, rpc_server=self.ctx.rpc_server, rpc=self.ctx.rpc,
                                members=view.members, params=await self.ctx.replica.get_params(), optim=spec,
                                piece_bytes=self.ctx.collectives.piece_bytes, timeout=self.ctx.peer_timeout,
                                name=f"{self.name}.ps", codec=self.ctx.collectives.codec,
                                error_feedback=self.ctx.collectives.feedback is not None,
                                rounds=self.scheduler(self.opts, list(view.members)).lockstep,
                                joining=joining, epoch=max(0, view.epoch - 1) if joining else 0)
        self._incs = self._incarnations(view)
        self.ctx.rpc_server.register(f"{self.name}.meta", self._serve_meta)
        self.store.start()
        if joining:
            await self._join()

    @staticmethod
    def _incarnations(view: View) -> dict[int, int]:
        return {m: view.incarnations[m] for m in view.members if m in view.incarnations}

    async def _join(self) -> None:
        """A joiner (a new process of a node the members declared failed) takes part in the
        members' re-shard over the view that admitted it (over the newest view if that fails,
        as the members do; PeerFailure after twice the peer timeout), then starts from the
        weights it gives, at the members' clocks (module docstring): its push count is the
        slowest member's (:attr:`start_step` too), its barrier generation the highest member's."""
        store = self._store()
        me = self.ctx.node_id
        wait = _ViewWait(2 * self.ctx.peer_timeout, self.ctx.view.epoch)
        while True:
            view = self.ctx.view
            if me in view.members and len(view.members) < 2 and view.departed:
                raise PeerFailure(f"{self.name}: node {me} joined view {view.epoch} after every other member "
                                  f"finished ({list(view.departed)}): nobody holds the parameter store's state",
                                  peers=view.departed)
            if me not in view.members or len(view.members) < 2:
                if wait.expired:
                    raise PeerFailure(f"{self.name}: node {me} joined view {view.epoch} {list(view.members)}, "
                                      "which holds no other member to take the parameter store's state from",
                                      peers=tuple(m for m in view.members if m != me))
                await asyncio.sleep(0.05)
                continue
            try:
                w = await store.reshard(view.members, view.epoch, self._allreduce, clock=(0, 0))
            except (PeerFailure, PeerTimeout) as exc:  # a member failed meanwhile: over the next view
                lost = PeerFailure(f"{self.name}: node {me} could not join the parameter store: {exc}",
                                   peers=tuple(m for m in view.members if m != me))
                await self._retry_after(wait, lost)
                continue
            break
        self._incs = self._incarnations(view)
        self.gen = max(g for g, _ in store.clocks.values())
        self.count = self.start_step = min(c for _, c in store.clocks.values())
        self.reshards += 1
        await self.ctx.replica.set_params(w)
        log.warning("node %d: %s joined the parameter store over %s (view %d) at push count %d, barrier generation "
                    "%d", me, self.name, list(view.members), view.epoch, self.count, self.gen)
        slowest = sorted(store.clocks, key=lambda m: (store.clocks[m][1], m))
        await self._fetch_meta([m for m in slowest if m != me])

    async def _serve_meta(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        """A joiner asks for this worker's user state (:meth:`Replica.export_meta`: the
        optimizer's hyperparameters, LR schedulers, scaler); it goes back as one ``data``
        message to the joiner's tag."""
        tag = args.get("tag")
        if not isinstance(tag, str) or not tag.startswith(f"{self.name}.meta."):
            raise ProtocolError("state", f"bad user-state tag {tag!r}"[:100])
        raw = np.frombuffer(await self.ctx.replica.export_meta(), np.uint8)
        await self.ctx.transport.send(caller, tag, [raw], kind="data", timeout=self.ctx.peer_timeout, relay=True)
        return {"bytes": int(raw.size)}

    async def _fetch_meta(self, donors: Sequence[int]) -> None:
        """Take the user state of the first of ``donors`` that gives it (the slowest member
        first: the joiner is at its count, so its schedules are where the joiner's should be);
        without any, the joiner keeps its own (a warning)."""
        me = self.ctx.node_id
        errors: list[str] = []
        for d in donors:
            tag = f"{self.name}.meta.{me}.{self.ctx.transport.incarnation}.{d}"
            try:
                await self.ctx.rpc.call(d, f"{self.name}.meta", {"tag": tag}, timeout=self.ctx.peer_timeout)
                msg = await self.ctx.transport.recv(tag, timeout=self.ctx.peer_timeout)
                raw = msg.arrays[0] if len(msg.arrays) == 1 else None
                if raw is None or raw.dtype != np.uint8 or raw.ndim != 1 or raw.size > MAX_META_BYTES:
                    raise ProtocolError("state", f"node {d} sent a malformed user state")
                await self.ctx.replica.import_meta(np.asarray(raw).tobytes())
            except P2PSyncError as exc:
                errors.append(f"node {d}: {exc}")
                continue
            finally:
                self.ctx.transport.retire(tag)
            log.info("node %d: %s took node %d's user state (hyperparameters, schedulers)", me, self.name, d)
            return
        log.warning("node %d: %s joined without a member's user state (its LR schedulers and hyperparameters are "
                    "its own): %s", me, self.name, "; ".join(errors) or "no other member")

    def on_peer_failure(self, peer: int) -> None:
        """A pending push, pull or re-shard waiting on ``peer`` fails now, not at its timeout.
        A peer that finished and left is not a failure: it serves its shard until every node
        has finished (the membership's finish barrier), and the store is not re-split."""
        if peer in self.ctx.membership.departed:
            return
        exc = PeerFailure(f"{self.name}: peer {peer} failed", peers=(peer,))
        if self.store is not None:
            self.store.abort_waits(exc)
        self._end_ops.abort(exc)

    def on_view(self, view: View) -> None:
        """A newer view wakes the waits for one, and supersedes a re-shard under way over an
        older view: its allreduces fail now (a member may never adopt the older view, e.g. one
        cut off by a partition that learns only the views after the heal) and the caller
        re-shards over this one."""
        ev, self._next_view = self._next_view, asyncio.Event()
        ev.set()
        store = self.store
        if store is not None and store.moving is not None and store.moving < view.epoch:
            store.abort_reshard(PeerFailure(f"{self.name}: view {view.epoch} supersedes the re-shard over view "
                                            f"{store.moving}"))

    async def _retry_after(self, wait: _ViewWait, exc: PeerFailure) -> None:
        """Between two tries of a re-shard (or of the wait for the view after a failed push):
        returns when the next try may begin, or raises ``exc`` past ``wait``'s deadline. A
        newer view renews the deadline (the run moves); while this node hears no majority of
        the run it waits for one, bounded by the quorum timeout (the minority side of a
        partition waits for the heal), and raises :class:`~p2psync.errors.Fenced` once removed."""
        m = self.ctx.membership
        if m.fenced is not None:
            raise m.fenced
        if m.registered and not m.has_quorum:
            await m.wait_quorum(self.ctx.quorum_timeout)
            wait.renew()
        if self.ctx.view.epoch > wait.seen:
            wait.seen = self.ctx.view.epoch
            wait.renew()
            return
        if wait.expired:
            raise exc
        await asyncio.sleep(0.05)  # the pace of tries over the same view

    def _store(self) -> ParamStore:
        if self.store is None:
            raise ConfigError(f"{self.name}: not started")
        return self.store

    async def _allreduce(self, vec: np.ndarray, group: list[int], tag: str) -> np.ndarray:
        out: np.ndarray = await self.ctx.collectives.allreduce(vec, group, codec="none", tag=tag)
        return out

    async def _follow_view(self, failure: PeerFailure | None = None, *, ask: bool = True) -> np.ndarray | None:
        """Re-shard the store when the view dropped some of its members or admitted joiners
        (every member of the view takes part, joiners with nothing; leaves and joins in one
        view are one re-shard); returns the weights to continue from, or None if nothing
        changed. After ``failure`` (a push or pull that failed), wait for a newer view: one
        that drops the peer re-shards; one that keeps every member (a suspicion that healed,
        e.g. a partition: the push stays lost and counted) goes on; with ``ask``, this node asks
        the coordinator for that view (:meth:`MembershipClient.request_redo`: one that hears
        every failed peer moves the epoch on over the same members), once per operation: a
        caller retrying the same operation asks only the first time, so a failure that stays
        ends it. Bounded by the peer timeout from the last view seen, and while this node hears
        no majority by the quorum wait."""
        store = self._store()
        first = self.ctx.view.epoch
        wait = _ViewWait(self.ctx.peer_timeout, first)
        while True:
            view = self.ctx.view
            gone, fresh = store_changes(store.members, self._incs, view)
            if not gone and not fresh:
                if failure is None or view.epoch > first:  # a newer view keeps every member: the
                    return None                            # failure was a suspicion since healed
                if ask:
                    # as the re-forming strategies: the coordinator declares the peer, or, when it
                    # hears every one of them, moves the epoch on (a newer view naming them: this
                    # node counts them failed no more)
                    ask = False
                    self.ctx.membership.request_redo(view.epoch, failure.peers)
                await self._retry_after(wait, failure)
                continue
            members = list(view.members)  # the store's members that stay, and the fresh ones
            ticks = (min(self.gen, _CLOCK_MAX), min(self.count, _CLOCK_MAX))
            try:
                w = await store.reshard(members, view.epoch, self._allreduce, fresh=fresh, clock=ticks)
            except (PeerFailure, PeerTimeout) as exc:  # another member failed meanwhile, a joiner did
                # not come, or a newer view superseded this one (on_view): over the next view
                failure = exc if isinstance(exc, PeerFailure) else PeerFailure(str(exc), peers=tuple(fresh))
                await self._retry_after(wait, failure)
                continue
            self._incs = self._incarnations(view)
            self.reshards += 1
            log.warning("node %d: %s store re-sharded over %s (view %d; gone: %s, joined: %s)",
                        self.ctx.transport.node_id, self.name, members, view.epoch, gone, fresh)
            return w

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        store = self._store()
        moved = await self._follow_view()
        if moved is not None:  # the weights this iteration starts from: the restored state
            await self.ctx.replica.set_params(moved)
        loss, grad = await self.ctx.replica.compute_gradients()
        # this iteration's (the schedule's)
        hypers = await OPTIMIZER_SHARDS.of(self.ctx.replica).optim_hypers(store.optim)
        t0 = clock.now()
        forwarded = 0
        try:
            forwarded = (await store.push(grad, gen=self.gen, hypers=hypers)).forwarded
        except PeerFailure as exc:  # reported (lost_pushes), then the store follows the view
            log.warning("node %d: %s push lost: %s", self.ctx.transport.node_id, self.name, exc)
            await self._follow_view(exc)
        except PeerTimeout as exc:  # acks late (a slow link): counted lost; a failure is the views' to say
            log.warning("node %d: %s push may be lost: %s", self.ctx.transport.node_id, self.name, exc)
        self.count += 1
        t1 = clock.now()
        ok = await self._report(want_stop)
        t2 = clock.now()
        extra: dict[str, Any] = {"push_s": round(t1 - t0, 5), "gate_s": round(t2 - t1, 5),
                                 "forwarded": forwarded, "lost_pushes": store.lost_pushes, "reshards": self.reshards}
        if ok is None:
            w = await self._end()
        else:
            extra.update(ok)
            w = await self._pull(bool(ok.get("barrier")))
        await self.ctx.replica.set_params(w)
        wait = clock.now() - t1
        return StepReport(loss=loss, stop=ok is None, comm_s=clock.now() - t0, wait_s=wait,
                          extra={**extra, "pull_s": round(clock.now() - t2, 5), "pushes": self.count})

    async def _end(self) -> np.ndarray:
        """STOP: every worker's last push is applied before anyone's final pull (an exact
        allreduce barrier over the store's members in the view, tagged with the store epoch),
        then the final pull. The store's split must not change meanwhile: a view that admits a
        joiner or loses a member is followed first (the joiner waits in that re-shard), a barrier
        such a view interrupts is left, and when the barrier or the pull ends in another split
        (a member re-sharded after it passed the barrier) both are redone in the new one."""
        store = self._store()
        ask = True  # (the coordinator is asked for a new view after the first failure only)
        while True:
            await self._follow_view()
            epoch = store.epoch
            group = [m for m in store.members if m in self.ctx.group]
            changed = self._next_view
            barrier = asyncio.ensure_future(self.ctx.collectives.allreduce(
                np.zeros(1, np.float32), group, codec="none", tag=OpId(self.name, "end", epoch).tag))
            try:
                while not await wait_or_event(barrier, changed):
                    if any(store_changes(store.members, self._incs, self.ctx.view)):
                        log.info("node %d: %s leaves the end barrier of store epoch %d: view %d moves the store",
                                 self.ctx.node_id, self.name, epoch, self.ctx.view.epoch)
                        break  # redone in the new split
                    changed = self._next_view
            finally:
                if not barrier.done():
                    await cancel_all([barrier])
            if barrier.cancelled():
                continue
            try:
                barrier.result()
            except PeerFailure as exc:  # a member failed: over the view without it
                await self._follow_view(exc, ask=ask)
                ask = False
                continue
            w = await self._pull()
            if store.epoch == epoch:
                return w

    async def _pull(self, barrier: bool = False) -> np.ndarray:
        """The weights after an OK; after a barrier's, as they were at that barrier (identical
        for every worker: :mod:`p2psync.params.barriers`), and the pushes that follow belong
        to it. Barriers are numbered by this worker (every barrier releases every worker), so
        the store's generations do not depend on the coordinator's numbering."""
        store = self._store()
        if barrier:
            self.gen += 1
        barrier_no = self.gen if barrier else 0
        ask = True  # (the coordinator is asked for a new view after the first failure only)
        while True:
            try:
                return await store.pull(barrier=barrier_no)
            except PeerFailure as exc:
                moved = await self._follow_view(exc, ask=ask)
                ask = False
                if moved is not None:
                    return moved

    async def _report(self, stop: bool) -> dict[str, Any] | None:
        """PUSHED to the scheduler; its grant, or None for STOP. While held, a view that drops
        store members is followed at once (the others may be re-sharding, waiting for this one,
        before they report: the scheduler may hold this worker until they do), not only when
        the long poll answers "wait"."""
        def args() -> dict[str, Any]:
            # the newest view at every poll and attempt; after a failover the members this node
            # knows failed (the dead coordinator) are left out before the view drops them
            view, failed = self.ctx.view, self.ctx.membership.failed
            return {"count": self.count, "inc": self.ctx.transport.incarnation, "stop": stop, "gen": self.gen,
                    "epoch": view.epoch, "members": [m for m in view.members if m not in failed]}

        while True:
            changed = self._next_view
            moved = await self._follow_view()
            if moved is not None:
                await self.ctx.replica.set_params(moved)
            call = asyncio.ensure_future(self.ctx.membership.call_coordinator(
                f"{self.name}.pushed", args, timeout=self.ctx.peer_timeout + 10.0))
            try:  # a newer view: follow it at once and ask again (a held report is not counted twice)
                await wait_or_event(call, changed)
            finally:
                await cancel_all([call])
            if call.cancelled():
                continue
            rep = call.result()
            if not isinstance(rep, dict):
                raise ProtocolError("scheduler", "answer is not a map")
            if rep.get("stop"):
                return None
            ok = rep.get("ok")
            if isinstance(ok, dict):
                return {k: ok.get(k) for k in ("gap", "r", "barrier")}
            if not rep.get("wait"):
                raise ProtocolError("scheduler", f"unexpected answer {sorted(rep)!r}"[:80])


@register
class BSP(_StoreStrategy):
    name = "bsp"

    @classmethod
    def scheduler(cls, opts: dict[str, Any], ids: list[int]) -> StalenessScheduler:
        return StalenessScheduler(workers=ids, s_lower=0)


@dataclass(frozen=True)
class SSPOptions(StrategyOptions):
    s: int = option(3, "staleness threshold: no worker runs more than s pushes ahead of the slowest")


@dataclass(frozen=True)
class DSSPOptions(StrategyOptions):
    s_lower: int = option(3, "s_L: the staleness always allowed")
    s_upper: int = option(15, "s_U: the most the controller may allow")


@dataclass(frozen=True)
class ElasticBSPOptions(StrategyOptions):
    R: int = option(15, "predicted future pushes per worker the barrier search considers")
    search: str = option("zipline_opt_bs", f"barrier search: {', '.join(SEARCHERS)}")

    def __post_init__(self) -> None:
        require(self.search in SEARCHERS, self, "search", f"choose from {', '.join(SEARCHERS)}")


@register
class ASP(_StoreStrategy):
    name = "asp"

    @classmethod
    def scheduler(cls, opts: StrategyOptions, ids: list[int]) -> StalenessScheduler:
        return StalenessScheduler(workers=ids, s_lower=None)


@register
class SSP(_StoreStrategy):
    name = "ssp"
    Options = SSPOptions

    @classmethod
    def scheduler(cls, opts: SSPOptions, ids: list[int]) -> StalenessScheduler:
        return StalenessScheduler(workers=ids, s_lower=opts.s)


@register
class DSSP(_StoreStrategy):
    name = "dssp"
    Options = DSSPOptions

    @classmethod
    def scheduler(cls, opts: DSSPOptions, ids: list[int]) -> StalenessScheduler:
        return StalenessScheduler(workers=ids, s_lower=opts.s_lower, s_upper=opts.s_upper)


@register
class ElasticBSP(_StoreStrategy):
    name = "elastic_bsp"
    Options = ElasticBSPOptions

    @classmethod
    def scheduler(cls, opts: ElasticBSPOptions, ids: list[int]) -> ElasticScheduler:
        return ElasticScheduler(workers=ids, R=opts.R, searcher=opts.search)

"""Membership service: rendezvous, heartbeats, failure detection, views and the finish
barrier, over RPC on the coordinator node.

The bookkeeping is pure and lives in :mod:`p2psync.coordinator.membership_state`
(:class:`~p2psync.coordinator.membership_state.MembershipState`: who registered under which
incarnation, who failed, the current :class:`~p2psync.coordinator.views.View`, its epoch and
term, the quorum, joins and the policy for non-finite tensor values). This module is the glue
around it: the RPC handlers, the failure monitor and the publishing of views.

:class:`MembershipService` exposes it over RPC on the coordinator node; its handlers and its
failure monitor feed the state's phi-accrual detector (heartbeat arrivals, any other traffic:
``Transport.last_arrival``, and the RTT each client measures; a node's traffic counts only
until the transport heard a newer process of it than the one registered here: a restarted
node's new process proves nothing of the registered one). On every change it bumps the
view's epoch and publishes the view to every live node as an ``event.view`` event (owned
tasks) and in the reply to every heartbeat whose sender has not applied it yet (a heartbeat
names the sender's view: epoch, coordinator and term), so a lost event is repaired by the next
reply while a heartbeat of an up-to-date member costs O(1) bytes whatever the size of the run.
A second
registration under a node id whose registered process is alive is rejected with an error naming
both incarnations and addresses.

:class:`~p2psync.coordinator.membership_client.MembershipClient`
(:mod:`p2psync.coordinator.membership_client`) runs on every node: rendezvous, pipelined
heartbeats, views in epoch order, failure listeners, coordinator failover and the finish
barrier.

The finish barrier (``membership.finish``) replies once every expected node finished, failed
or departed (``finished``, ``failed``, and ``ended``: the joiners the run's end left out).
Once every member but the joiners still joining has finished at a stop, the run is ending: a
failed or departed node's new process is refused (:class:`~p2psync.errors.RunEnded`), and a
joiner whose strategy has not joined the training (its heartbeats say ``joining``) is not
waited for: a failure timeout and two heartbeats after the last finish, one that said
``joining`` again since departs, and learns from the view that the run ended without it (it
ends with ``RunEnded`` and is not started again; ``summary.json`` names it in ``ended``).

Coordinator failover: a service built with a ``state`` rebuilt after a
takeover (:mod:`p2psync.coordinator.failover`) publishes its view at once, names itself as the
coordinator in every view, merges the failures members report and moves its epoch past any
epoch a member reports (so a view the old coordinator published late cannot outrank it).

Joins (admitted by the state, see :mod:`p2psync.coordinator.membership_state`): the
coordinator publishes the new view to every member at once and answers ``joined: true`` so the
joiner fetches its state from live peers before training. A joiner that no live path reaches
(:func:`~p2psync.coordinator.membership_state.walled_in`) is refused as ``Unreachable``
(logged once per incarnation) and admitted once one of its neighbours is back; the joiner asks
again until its start timeout, whether the refusal reached it or its attempt timed out (the
refusal takes the same ways back as an admission would).

Non-finite tensor values (the policy: :mod:`p2psync.coordinator.membership_state`): a member
reports a sum it computed that overflowed (``membership.diverged``) and, in its heartbeats, the
neighbours that delivered such values; the service hands both to the state and publishes the
view that excludes the reported nodes or ends the run. The excluded node is told (the view
without it) before it is cut off, so it stops instead of waiting for peers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from p2psync import clock
from p2psync.coordinator.detector import StallMeter
from p2psync.coordinator.membership_state import EVENT_VIEW, UNREACHABLE, MembershipState, reachable, reborn, walled_in
from p2psync.coordinator.rpc import Handler, RpcServer
from p2psync.coordinator.views import MAX_END_CHARS, View, news_for
from p2psync.errors import P2PSyncError, PeerTimeout, ProtocolError, RemoteError
from p2psync.tasks import Conditions, TaskSet

log = logging.getLogger("p2psync.membership")

#: characters of a member's reason for its divergence that the coordinator keeps
MAX_WHY = 300


class MembershipService:
    """Coordinator side. Methods: membership.register / heartbeat / finish.

    ``state``: a state rebuilt after a takeover (:func:`p2psync.coordinator.failover.rebuild_state`);
    such a service publishes its view at once and merges the failures members report.
    ``rpc_methods=False``: do not register the handlers (a :class:`CoordinatorHost` dispatches
    to :attr:`handlers`)."""

    def __init__(self, *, server: RpcServer, expected: Sequence[int], start_timeout: float = 60.0,
                 failure_timeout: float = 2.0, heartbeat_interval: float = 0.5,
                 phi_threshold: float = 8.0, check_interval: float = 0.1,
                 run_info: Mapping[str, Any] | None = None, state: MembershipState | None = None,
                 rpc_methods: bool = True, allow_join: bool = True) -> None:
        self.server = server
        self.transport = server.transport
        self.rebuilt = state is not None
        self.state = state if state is not None else MembershipState(
            expected=frozenset(expected), failure_timeout=failure_timeout,
            heartbeat_interval=heartbeat_interval, phi_threshold=phi_threshold,
            coordinator=server.transport.node_id, allow_join=allow_join)
        self.start_timeout = start_timeout
        self.check_interval = check_interval
        self.run_info = dict(run_info or {})
        #: the handlers waiting for the rendezvous or the finish barrier (:meth:`_wait_until`),
        #: judged on every change and every monitor tick
        self._conditions = Conditions()
        #: changes notified so far, and the finish barrier's verdict for (changes, quarter
        #: second): every caller waiting in the barrier shares it (:meth:`_barrier_done`)
        self._changes = 0
        self._barrier_seen: tuple[tuple[int, int], bool] = ((-1, -1), False)
        #: the failure monitor
        self._tasks = TaskSet("membership-service")
        #: the view pushes (``event.view``) in flight: one per peer, each on its own (the next
        #: heartbeat reply carries the view anyway), so they fail alone, logged
        self._tells = TaskSet("view-push", isolated=True)
        self._t0 = clock.now()
        #: (when, whether) the majority was last found heard (:meth:`_quorum`)
        self._quorum_seen: tuple[float, bool] | None = None
        #: when the rendezvous completed (this node's clock); a rebuilt service is given it
        self.run_started: float | None = None
        #: joiner -> the incarnation whose registration was refused as unreachable (logged once)
        self._walled: dict[int, int] = {}
        self.handlers: dict[str, Handler] = {"membership.register": self._register, "membership.heartbeat": self._heartbeat,
                         "membership.finish": self._finish, "membership.diverged": self._diverged}
        if rpc_methods:
            for method, handler in self.handlers.items():
                server.register(method, handler)

    def start(self) -> None:
        """Start the failure monitor (an owned task); a rebuilt service also marks the failed
        nodes dead and publishes its view at once. Called from failover.py: ``svc.start()``."""
        self._t0 = clock.now()
        self._tasks.spawn(self._monitor(), name="membership-monitor")
        if self.rebuilt:
            for n in self.state.failed:
                self.transport.mark_dead(n)
            self._publish(self.state.view())

    async def close(self) -> None:
        """Cancel the view pushes in flight and the failure monitor (``CoordinatorHost.close``);
        raises the monitor's failure, if it failed."""
        await self._tells.close()
        await self._tasks.close()

    def _notify(self) -> None:
        self._changes += 1
        self._conditions.changed()

    async def _wait_until(self, pred: Callable[[], bool], deadline: float) -> bool:
        """Wait until ``pred()`` holds (True) or ``deadline`` passes (False); ``pred`` is judged
        once per change for all the handlers waiting on it (one bound method per condition)."""
        return await self._conditions.wait(pred, deadline, clock.now)

    def _complete(self) -> bool:
        return self.state.complete

    async def _register(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        inc = args.get("incarnation", 0)
        if type(inc) is not int or inc < 0:
            raise ProtocolError("register", f"bad incarnation {inc!r}"[:100])
        addr = str(args.get("address", "?"))[:200]
        before = self.state.epoch
        if self.state.started and not self.state.has_quorum(clock.now()):
            # a coordinator cut off from the majority admits nobody: the joiner asks elsewhere
            raise RemoteError("NotCoordinator", f"node {self.transport.node_id} coordinates no majority of "
                                                "the run now")
        if self.state.started:  # a new process that comes back as the run ends: told so at once
            self.state.refuse_at_end(caller, inc, addr)
        if self.state.started and caller in self.state.failed and self.state.allow_join:
            around = walled_in(self.transport.topology, self.transport.node_id, caller, self.transport.dead)
            if around is not None:
                # admitted, it would be a member that no answer reaches: declared failed once
                # its grace ran out, a false failure, while every view until then names it
                if self._walled.get(caller) != inc:
                    self._walled[caller] = inc
                    log.warning("coordinator %d: node %d (incarnation %d at %s) asks to rejoin, but every "
                                "way to it crosses nodes removed from the run (its neighbours %s): not "
                                "admitted while none of them is back", self.transport.node_id, caller, inc,
                                addr, around)
                raise RemoteError(UNREACHABLE, f"node {self.transport.node_id} coordinates the run but no live "
                                               f"path leads from it to node {caller}: its neighbours {around} "
                                               "are removed from the run (or reach it only through removed "
                                               "nodes); it is admitted once one of them rejoins")
        self._walled.pop(caller, None)
        joined = self.state.register(caller, str(args.get("fingerprint", "")), clock.now(),
                                     incarnation=inc, address=addr)
        self.transport.register_incarnation(caller, inc)
        self._notify()
        if joined and self.state.epoch != before:
            self.transport.revive(caller)
            view = self.state.view()
            log.warning("coordinator: node %d rejoined (incarnation %d at %s); view epoch %d members %s",
                        caller, inc, addr, view.epoch, list(view.members))
            self._publish(view, skip=caller)
        ok = await self._wait_until(self._complete, self._t0 + self.start_timeout)
        if not ok:
            raise PeerTimeout(f"nodes {self.state.missing} never registered with the coordinator "
                              f"(node {self.transport.node_id}) within {self.start_timeout:g}s")
        now = clock.now()
        if self.run_started is None:
            self.run_started = now
        # ``elapsed``: how long the run has been going, so a joiner's time budget (--time) ends
        # with the run's, not a full budget after its own start
        return {"members": sorted(self.state.registered), "view": self.state.wire_view(),
                "joined": joined, "elapsed": now - self.run_started, **self.run_info}

    async def _heartbeat(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        if args.get("probe") is True:  # a starting process asks for the view: no proof of life
            # (a probe naming the prober's view gets this one only when it is newer)
            return {"view": self.state.wire_view()} if news_for(self.state.view(), args) else {}
        if self.state.started and caller in self.state.failed:
            # fenced: a node declared failed (it paused, or was cut off) learns that it is no
            # member; its progress since is void, it rejoins as a new process
            why = self.state.excluded.get(caller, "declared failed")
            return {"fenced": True, "why": why, "view": self.state.wire_view()}
        epoch, coord = args.get("epoch"), args.get("coord")
        if type(epoch) is int and epoch < 1 << 62 and (epoch > self.state.epoch or (
                epoch == self.state.epoch and coord != self.state.coordinator)):
            # the caller applied a view at least as new as ours from another coordinator (a
            # takeover's first view may reuse an epoch the old coordinator published late):
            # move past it so every member takes ours
            self.state.epoch = epoch + 1
        failed = args.get("failed")
        seen = epoch if type(epoch) is int else -1  # a report without an epoch: oldest
        if self.rebuilt and isinstance(failed, list) and all(type(n) is int for n in failed):
            self._failed(self.state.declare_failed(failed, seen_epoch=seen), f"reported failed by node {caller}")
        await self._offenders(caller, args.get("offenders"), seen)
        self._redo(caller, args.get("redo"))
        srtt, rttvar = args.get("srtt"), args.get("rttvar", 0.0)
        term = args.get("term", 0)
        applied = (term, epoch) if type(term) is int and type(epoch) is int \
            and coord == self.state.coordinator else None
        now = clock.now()
        joining = args.get("joining") is True
        if isinstance(srtt, float) and isinstance(rttvar, float):
            self.state.heartbeat(caller, now, srtt=srtt, rttvar=rttvar, applied=applied, joining=joining)
        else:
            self.state.heartbeat(caller, now, applied=applied, joining=joining)
        reply: dict[str, Any] = {"quorum": self._quorum(now)}
        view = self.state.view()
        if (epoch, coord, term) != (view.epoch, view.coordinator, view.term):
            reply["view"] = self.state.wire_view()  # the caller has not applied it yet
        return reply

    def _quorum(self, now: float) -> bool:
        """Whether this coordinator hears a majority (:meth:`MembershipState.has_quorum`), as
        the failure monitor found it at most ``check_interval`` ago: the answer of every
        heartbeat reply, at O(N) once per check instead of once per heartbeat."""
        last = self._quorum_seen
        if last is None or not 0 <= now - last[0] <= self.check_interval:
            last = self._quorum_seen = (now, self.state.has_quorum(now))
        return last[1]

    def _redo(self, caller: int, redo: Any) -> None:
        """A member's report ``{"epoch": e, "peers": [...]}`` that an operation of view ``e``
        failed while its peers live: a new epoch over the same members (:meth:`MembershipState.redo`)."""
        if not isinstance(redo, dict):
            return
        epoch, peers = redo.get("epoch"), redo.get("peers", [])
        if type(epoch) is not int or not isinstance(peers, list) or not all(type(n) is int for n in peers):
            return
        if self.state.redo(caller, epoch, peers, clock.now()):
            view = self.state.view()
            log.warning("coordinator %d: node %d's operation of view %d failed waiting for live nodes %s: "
                        "view epoch %d members %s, so it is redone", self.transport.node_id, caller, epoch,
                        peers, view.epoch, list(view.members))
            self._notify()
            self._publish(view)

    async def _offenders(self, caller: int, offenders: Any, seen: int) -> None:
        """A member's report of the nodes that sent it non-finite tensor values: exclude them
        or end the run as diverged (:meth:`MembershipState.report_offences`)."""
        if not isinstance(offenders, list) or not all(type(n) is int for n in offenders):
            return
        topo = self.transport.topology
        ended = self.state.diverged
        new = self.state.report_offences(caller, offenders, lambda n: topo.neighbors(n) if n in topo.ids else [],
                                         seen_epoch=seen)
        for n in new:  # told first (and why), so it stops instead of waiting for peers
            await self._tell(n, self.state.view(), excluded=self.state.excluded.get(n))
        self._failed(new, "excluded: sent non-finite tensor values")
        if self.state.diverged and not ended:
            self._ended()

    async def _diverged(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        """A member's report that a sum it computed overflowed: the run ends as diverged
        (:meth:`MembershipState.report_diverged`)."""
        why = args.get("why")
        if self.state.report_diverged(caller, why[:MAX_WHY] if isinstance(why, str) else "no reason given"):
            self._ended()
        return {}

    def _ended(self) -> None:
        """Tell every member the view that ends the run as diverged."""
        view = self.state.view()
        log.error("coordinator %d: the run ends: training diverged (%s); view epoch %d",
                  self.transport.node_id, self.state.diverged, view.epoch)
        self._notify()
        self._publish(view)

    async def _finish(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        if self.state.started and caller in self.state.failed:  # fenced: its records are void
            raise RemoteError("Fenced", f"node {caller} was removed from the run; its finish is not recorded")
        if self.state.finish(caller, args.get("stats"), depart=args.get("depart") is True, now=clock.now()):
            view = self.state.view()
            log.info("coordinator: node %d finished and left the run; view epoch %d members %s",
                     caller, view.epoch, list(view.members))
            self._publish(view, skip=caller)
        self._notify()
        timeout = float(args.get("timeout", 30.0))
        await self._wait_until(self._barrier_done, clock.now() + timeout)
        st = self.state
        out = {"finished": sorted(st.finished), "failed": sorted(st.failed)}
        ended = sorted(st.ended - st.failed)
        if ended:  # (joiners that the run's end left out: :meth:`_barrier_done`)
            out["ended"] = ended
        return out

    def _barrier_done(self) -> bool:
        """Whether the finish barrier may end (every expected node finished, failed or
        departed); first, once every other node did, the joiners still joining the training
        depart (:meth:`MembershipState.end_joiners`: they could take no part in the agreed
        stop, and each learns from the view that the run ended without it). Judged once per
        change and quarter second for all the callers waiting (each check costs O(nodes): one
        per caller would be a million per finish at 1024 nodes)."""
        key = (self._changes, int(clock.now() * 4))
        if self._barrier_seen[0] == key:
            return self._barrier_seen[1]
        done = self._judge_barrier()
        self._barrier_seen = ((self._changes, key[1]), done)
        return done

    def _judge_barrier(self) -> bool:
        st = self.state
        ended = st.end_joiners(clock.now(), grace=st.failure_timeout + 2 * st.heartbeat_interval)
        if ended:
            view = st.view()
            log.warning("coordinator %d: the run ends while nodes %s still join the training: they depart; view "
                        "epoch %d members %s", self.transport.node_id, ended, view.epoch, list(view.members))
            self._publish(view)
            for n in ended:  # (no members any more: told apart)
                self._tells.spawn(self._tell(n, view), name=f"view-to-{n}")
            self._notify()
        return st.all_finished

    async def _monitor(self) -> None:
        me = self.transport.node_id
        stalls = StallMeter(self.check_interval, clock.now())
        quorum = True
        while True:
            await asyncio.sleep(self.check_interval)
            self.state.detector.pause(stalls.tick(clock.now()))
            heard = reachable(self.transport.topology, me, self.transport.dead)
            incs = self.state.incarnations
            for n, at in list(self.transport.last_arrival.items()):
                # (once a newer process of a node than the one registered here was heard, its
                # arrivals prove nothing of the registered one: that one is gone)
                if n != me and heard(n) and self.transport.newer_life(n, incs.get(n, 0)) is None:
                    self.state.alive(n, at)
            now = clock.now()
            silences = {n: self.state.detector.silence(n, now) for n in self.state.detector.peers}
            new = self.state.check(now)
            self._failed(new, f"silent for {[round(silences.get(n, 0.0), 2) for n in new]} s")
            self._conditions.changed()  # (a wait's condition may turn true as time passes)
            held = self.state.has_quorum(now)
            self._quorum_seen = (now, held)
            if held != quorum:
                quorum = held
                agreed = sorted(self.state.agreement.members) if self.state.agreement is not None else []
                if not held:
                    log.error("coordinator %d: lost the majority of the agreed view %s (silent: %s); "
                              "no failure is declared and no node steps until it is heard again",
                              me, agreed, self.state.blocked or self.state.detector.suspects(now))
                else:  # a new epoch: operations that failed meanwhile are redone over it
                    self.state.epoch += 1
                    view = self.state.view()
                    log.warning("coordinator %d: the majority of %s is heard again; view epoch %d members %s",
                                me, agreed, view.epoch, list(view.members))
                    self._notify()
                    self._publish(view)

    def publish_now(self, view: View) -> None:
        """A view changed outside the service's own handlers (its coordinator was re-elected in
        a new term): wake the waiters and push it to every member."""
        self._notify()
        self._publish(view)

    def _failed(self, new: Sequence[int], why: str) -> None:
        if not new:
            return
        view = self.state.view()
        log.warning("coordinator %d: nodes %s %s: declared failed; view epoch %d members %s",
                    self.transport.node_id, list(new), why, view.epoch, list(view.members))
        heard = set(reborn(new, self.state.incarnations, self.transport.peer_incarnations))
        for n in new:  # the declared process; a newer one already heard relays on
            if n not in heard:
                self.transport.mark_dead(n, self.state.incarnations.get(n))
        self._notify()
        self._publish(view)

    def _publish(self, view: View, skip: int | None = None) -> None:
        """Push ``view`` to every member but this node (and ``skip``), in owned tasks; the
        coordinator's own client learns it from its (local) heartbeat reply."""
        for peer in view.members:
            if peer not in (self.transport.node_id, skip):
                self._tells.spawn(self._tell(peer, view), name=f"view-to-{peer}")

    async def _tell(self, peer: int, view: View, *, excluded: str | None = None) -> None:
        meta = view.to_wire()
        if excluded is not None:  # the view fences this node for good
            meta["excluded"] = excluded[:MAX_END_CHARS]
        try:
            await self.transport.send(peer, EVENT_VIEW, kind="event", meta=meta, timeout=2.0)
        except P2PSyncError as exc:  # the next heartbeat reply carries the view anyway
            log.info("could not send view %d to node %d: %s", view.epoch, peer, exc)


__all__ = ["MAX_WHY", "MembershipService"]

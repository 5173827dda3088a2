"""The parameter-server scheduler's RPC shell (decision logic: :mod:`p2psync.coordinator.ssp`).

One method, ``<name>.pushed``, a bounded long poll: a worker whose push was applied and acked by
every shard owner reports ``{count, inc, stop, epoch, members}``; the coordinator timestamps the
report on arrival with its own clock (the thesis' ``clock_p^push``, spec §6.1: no clock sync)
and the call returns as soon as the worker may go on, ``{"ok": {count, gap, r, barrier}}``, or
the run stops, ``{"stop": true}``, or after :data:`HOLD_S` seconds ``{"wait": true}`` (the
worker asks again with the same ``count``, which is then not counted twice; asked again after
its OK, it gets the same OK). The first report of a process (a new ``inc``: a worker that
restarted, or one this service has not heard from) is one push whatever its count (an
adoption at a scheduler rebuilt after a failover, below), and the worker counts on from there: 1 at the run's start, or for a joiner of the parameter-server
strategies the slowest member's count plus one (it joined at that count; the scheduler admitted
it at its own slowest count from the view, :meth:`StalenessScheduler.set_workers`); if the
scheduler held a restarted worker's previous process (the view that removed it never reached
the scheduler), that first report waits for that OK instead of counting a push. Messages are a
few bytes; no tensor passes through the coordinator. Remote bad input is a ProtocolError.

Failover: the node that takes over as coordinator registers a fresh service (the strategy's
``coordinator_services``), which knows nothing of the run. A worker's first report to a
scheduler is an adoption (:meth:`StalenessScheduler.adopt`, :meth:`ElasticScheduler.adopt`): its
``count`` (and ``gen``, the ElasticBSP barriers it was released from; 0 if absent) become its
state there, whatever the count, instead of being refused for not starting at 1; after that the
usual rules hold. The worker's report retried at the new coordinator
(:meth:`MembershipClient.call_coordinator`) carries the members of its view less the peers it
knows failed (the dead coordinator among them), so the scheduler does not wait for it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Mapping, Sequence

import numpy as np

from p2psync.coordinator.calls import HOLD_S, bool_arg, hold, int_arg, view_arg
from p2psync.coordinator.rpc import RpcServer
from p2psync.coordinator.ssp import ElasticScheduler, Grant, StalenessScheduler
from p2psync.errors import ProtocolError

log = logging.getLogger("p2psync.scheduler")



class SchedulerService:
    def __init__(self, server: RpcServer, members: Sequence[int], sched: StalenessScheduler | ElasticScheduler, *,
                 name: str, hold: float = HOLD_S) -> None:
        self.sched, self.name, self.hold = sched, name, hold
        self.ids = frozenset(members)
        self.epoch = -1
        self.stopped = False
        self._recorded: dict[int, int] = {}  # pushes counted per worker
        self._inc: dict[int, int] = {}
        self._granted: dict[int, tuple[int, dict[str, Any]]] = {}  # worker -> (count, answer)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.rejected = 0
        server.register(f"{name}.pushed", self._pushed)

    def _grant(self, grants: Sequence[Grant]) -> None:
        for g in grants:
            ans = {"ok": {"count": g.count, "gap": g.gap, "r": g.r, "barrier": g.barrier}}
            # kept under the worker's own count (a joiner's or a restarted worker's is not the scheduler's)
            self._granted[g.worker] = (self._recorded.get(g.worker, g.count), ans)
            fut = self._waiting.pop(g.worker, None)
            if fut is not None and not fut.done():
                fut.set_result(ans)

    def _stop(self) -> None:
        self.stopped = True
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_result({"stop": True})
        self._waiting.clear()

    def _view(self, args: Mapping[str, Any]) -> None:
        view = view_arg(args, self.ids, who="scheduler")
        if view is not None and view[0] > self.epoch:
            self.epoch, members = view
            for w in [w for w in self._waiting if w not in members]:
                self._waiting.pop(w).set_result({"stop": True, "left": True})
            self._grant(self.sched.set_workers(members, asyncio.get_running_loop().time()))

    async def _pushed(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        try:
            return await self._pushed_call(caller, args)
        except ProtocolError as exc:
            if not self.rejected:
                log.warning("%s scheduler: rejected a report from node %d: %s", self.name, caller, exc)
            self.rejected += 1
            raise

    async def _pushed_call(self, caller: int, args: Mapping[str, Any]) -> Any:
        count, inc = int_arg(args, "count", who="scheduler", lo=1), int_arg(args, "inc", who="scheduler")
        gen = int_arg(args, "gen", who="scheduler") if "gen" in args else 0
        stop = bool_arg(args, "stop", who="scheduler")
        self._view(args)
        if self._inc.get(caller) != inc:  # a process's first report here (a restarted node's too):
            self._inc[caller] = inc       # it counts on from the count it reports (1; a joiner's
            self._recorded[caller] = count - 1  # starting count plus one; or adopted, below)
            self._granted.pop(caller, None)
        if stop and not self.stopped:
            log.info("%s scheduler: node %d asked to stop", self.name, caller)
            self._stop()
        if self.stopped:
            return {"stop": True}
        done = self._granted.get(caller)
        if done is not None and done[0] == count:
            return done[1]
        have = self._recorded.get(caller, 0)
        adopted = caller in self.sched.unheard  # its first report here (a new scheduler)
        if count == have + 1 and caller in self._waiting and not adopted:  # restarted while held: it
            self._recorded[caller] = count                                # waits for the OK its old
            fut = self._waiting[caller]                                   # incarnation waited for
        elif adopted or count == have + 1:
            loop = asyncio.get_running_loop()
            grants = (self.sched.adopt(caller, count, loop.time(), gen=gen) if adopted
                      else self.sched.push(caller, loop.time()))  # ProtocolError: not a worker, held
            self._recorded[caller] = count
            fut = self._waiting[caller] = loop.create_future()
            self._grant(grants)
        elif count == have and caller in self._waiting:
            fut = self._waiting[caller]
        else:
            raise ProtocolError("scheduler", f"node {caller} reported push {count} after {have}")
        return await hold(fut, self.hold)

"""The P-Reduce controller's RPC shell (P-Reduce paper, Sec. 3.1.1 Alg. 2
"Controller", Sec. 4 Fig. 6; decision logic: :mod:`p2psync.coordinator.preduce`).

One method, ``preduce.ready``, a bounded long poll: a worker that finished a local step sends
READY ``{seq, inc, k, stop, epoch, members}`` and the call returns as soon as the controller put it in
a group, ``{"group": {ctl, op, epoch, members, weights, k}}``, or told the run to stop,
``{"stop": true}``, or after :data:`HOLD_S` seconds ``{"wait": true}`` (the worker asks again
with the same ``seq``; every wait on a peer stays bounded and a call never outlives the
coordinator). ``seq`` counts the worker's READYs, so a repeated poll (or a retransmission after
a lost reply) is recognized: it waits for, or gets again, the answer to the same READY;
``inc`` is the worker's incarnation: a restarted node starts counting again.

The group message is a few hundred bytes: tensors never pass through the controller (members
average peer to peer, docs/architecture.md, "Coordinator services hold no model tensors"). ``ctl`` is a random
id of this controller instance: after a coordinator takeover the new controller numbers its
groups from 1 again, and the id keeps the members' collective tags unique.

Membership: like ESync's State Server the controller learns the view from the workers' calls
(the newest epoch wins): departed workers leave the queue, joiners are admitted. ``stop`` from
any worker (its step budget, time limit or ``request_stop``) stops the run: every queued and
later READY is answered STOP. Malformed or impossible calls (remote input) are ProtocolErrors,
answered as errors, counted in ``rejected`` and logged once; the controller's state is unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any, Mapping, Sequence

import numpy as np

from p2psync.coordinator.calls import HOLD_S, bool_arg, hold, int_arg, view_arg
from p2psync.coordinator.preduce import Controller, Group
from p2psync.coordinator.rpc import RpcServer
from p2psync.errors import ProtocolError
from p2psync.topology import Topology

log = logging.getLogger("p2psync.preduce")



class PReduceService:
    """RPC glue on the coordinator node: one :class:`Controller`, one future per queued worker."""

    def __init__(self, server: RpcServer, topology: Topology, *, hold: float = HOLD_S, **controller: Any) -> None:
        self.topology = topology
        self.hold = hold
        self.ctl = Controller(members=topology.ids,
                              adjacency={n: topology.neighbors(n) for n in topology.ids}, **controller)
        self.id = secrets.randbits(31)
        self.epoch = -1
        self.members: tuple[int, ...] = tuple(topology.ids)
        #: the READY each worker is waiting on: seq and the future of its answer
        self._waiting: dict[int, tuple[int, asyncio.Future[dict[str, Any]]]] = {}
        #: the last answer given to each worker: (seq, answer), for a repeated poll
        self._answered: dict[int, tuple[int, dict[str, Any]]] = {}
        self._seq: dict[int, int] = {}
        self._inc: dict[int, int] = {}  # each worker's incarnation (a restarted node counts anew)
        self._timer: asyncio.TimerHandle | None = None
        self.readies = 0
        self.rejected = 0  # malformed or impossible READYs
        server.register("preduce.ready", self._ready)

    # -- answers -------------------------------------------------------------------------

    def _deliver(self, groups: Sequence[Group]) -> None:
        for g in groups:
            ans = {"group": {"ctl": self.id, "op": g.op, "epoch": max(self.epoch, 0), "members": list(g.members),
                             "weights": [float(w) for w in g.weights], "k": g.k_new, "swapped": g.swapped}}
            for m in g.members:
                self._answer(m, ans)
        if self.ctl.stopped:
            for m in list(self._waiting):
                self._answer(m, {"stop": True, "ops": self.ctl.ops})
        self._schedule()

    def _answer(self, worker: int, ans: dict[str, Any]) -> None:
        seq, fut = self._waiting.pop(worker, (self._seq.get(worker, 0), None))
        self._answered[worker] = (seq, ans)
        if fut is not None and not fut.done():
            fut.set_result(ans)

    def _schedule(self) -> None:
        """Wake the controller at its deferral deadline (group-frozen avoidance)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        at = self.ctl.wake_at()
        if at is not None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(max(0.0, at - loop.time()), self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._deliver(self.ctl.tick(asyncio.get_running_loop().time()))

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for _, fut in self._waiting.values():
            fut.cancel()

    # -- the RPC -------------------------------------------------------------------------

    def _view(self, args: Mapping[str, Any], now: float) -> None:
        view = view_arg(args, self.topology.ids, who="preduce")
        if view is not None and view[0] > self.epoch:
            self.epoch, self.members = view
            for w in [w for w in self._waiting if w not in self.members]:
                self._answer(w, {"stop": True, "left": True, "ops": self.ctl.ops})
            self._deliver(self.ctl.set_members(self.members, now))

    def _restarted(self, worker: int, inc: int, now: float) -> None:
        """A new incarnation of ``worker``: its previous life's READYs are forgotten."""
        self._inc[worker] = inc
        self._seq.pop(worker, None)
        self._answered.pop(worker, None)
        old = self._waiting.pop(worker, None)
        if old is not None:
            old[1].cancel()
        self._deliver(self.ctl.forget(worker, now))

    async def _ready(self, caller: int, args: Mapping[str, Any], arrays: Sequence[np.ndarray]) -> Any:
        try:
            return await self._ready_call(caller, args)
        except ProtocolError as exc:
            if not self.rejected:
                log.warning("preduce controller: rejected a READY from node %d: %s", caller, exc)
            self.rejected += 1
            raise

    async def _ready_call(self, caller: int, args: Mapping[str, Any]) -> Any:
        now = asyncio.get_running_loop().time()
        seq, k = int_arg(args, "seq", who="preduce", lo=1), int_arg(args, "k", who="preduce")
        stop = bool_arg(args, "stop", who="preduce")
        inc = int_arg(args, "inc", who="preduce")
        self._view(args, now)
        if inc != self._inc.setdefault(caller, inc):
            if inc < self._inc[caller]:
                raise ProtocolError("preduce", f"node {caller}: READY from a previous life")
            self._restarted(caller, inc, now)
        if stop and not self.ctl.stopped:
            log.info("preduce controller: node %d asked to stop after %d groups", caller, self.ctl.ops)
            self.ctl.request_stop()
            self._deliver(())
        done = self._answered.get(caller)
        if done is not None and done[0] == seq:  # a repeated poll of an answered READY
            return done[1]
        if self.ctl.stopped:
            self._answered[caller] = (seq, {"stop": True, "ops": self.ctl.ops})
            return self._answered[caller][1]
        waiting = self._waiting.get(caller)
        if waiting is None or waiting[0] != seq:
            if seq <= self._seq.get(caller, 0):
                raise ProtocolError("preduce", f"node {caller} sent READY {seq} after {self._seq[caller]}")
            fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            groups = self.ctl.ready(caller, k, now)  # ProtocolError: not a member, already queued
            self._seq[caller] = seq
            self._waiting[caller] = (seq, fut)
            self.readies += 1
            self._deliver(groups)
            waiting = self._waiting.get(caller, (seq, fut))
        return await hold(waiting[1], self.hold)

"""ASGD: asynchronous SGD without a barrier, the other baseline.

Each node applies its own gradient at once and sends it to every other node; each node applies
incoming gradients as they arrive. Gradients travel over direct links only: a gradient from
origin ``o`` is flooded down a BFS spanning tree of the live nodes rooted at ``o`` (on a mesh
that is a direct send to everyone; on a ring it is passed along), and every node applies it
exactly once. Staleness (how many local steps a node took since the sender's step) is recorded.

With ``average`` (default) every gradient is applied with weight 1/N (N = nodes in the run):
one round of N gradients then moves the model as far as one SSGD step on the mean gradient,
so the two baselines compare at the same learning rate (applying each gradient at full ``lr``
makes the effective step N times larger, which diverges with momentum).

A failed peer is dropped from the trees and training continues with the survivors; a node that
finishes early keeps applying what arrives until the finish barrier.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from p2psync.errors import P2PSyncError
from p2psync.strategies.base import StepReport, Strategy, register
from p2psync.topology.paths import spanning_tree
from p2psync.wire import Message

log = logging.getLogger("p2psync.asgd")

TAG = "asgd.g"
MAX_BATCH = 256


@register
class ASGD(Strategy):
    name = "asgd"
    options = {"max_inflight": (int, 16, "gradient sends in flight before a step waits"),
               "send_timeout": (float, 5.0, "seconds before a send to a silent peer is dropped"),
               "average": (bool, True, "apply every gradient with weight 1/N")}

    async def start(self) -> None:
        self.alive = set(self.ctx.topology.ids)
        self._trees: dict[tuple[int, frozenset[int]], dict[int, list[int]]] = {}
        self.local_step = 0
        self._staleness: list[int] = []
        self.applied_remote = 0
        self.dropped_sends = 0
        self._sends: set[asyncio.Task[None]] = set()
        self.scale = 1.0 / self.ctx.topology.size if self.opts["average"] else 1.0
        self._rx = asyncio.create_task(self._receive(), name="asgd-receive")

    def on_peer_failure(self, peer: int) -> None:
        self.alive.discard(peer)

    def _children(self, origin: int) -> list[int]:
        members = frozenset(self.alive | {origin})
        key = (origin, members)
        if key not in self._trees:
            try:
                self._trees[key] = spanning_tree(self.ctx.topology, sorted(members), root=origin)
            except ValueError:  # survivors not connected through origin any more
                self._trees[key] = {}
        return [c for c in self._trees[key].get(self.ctx.node_id, []) if c in self.alive]

    def _forward(self, origin: int, grad: np.ndarray, step: int) -> None:
        for child in self._children(origin):
            t = asyncio.create_task(self._send(child, origin, grad, step))
            self._sends.add(t)
            t.add_done_callback(self._sends.discard)

    async def _send(self, peer: int, origin: int, grad: np.ndarray, step: int) -> None:
        try:
            await self.ctx.transport.send(peer, TAG, [grad], step=step, meta={"origin": origin},
                                          timeout=self.opts["send_timeout"])
        except P2PSyncError as exc:
            self.dropped_sends += 1
            log.info("node %d: gradient to node %d dropped: %s", self.ctx.node_id, peer, exc)

    def _valid(self, msg: Message) -> bool:
        origin: Any = msg.meta.get("origin")
        ok = (type(origin) is int and origin in self.ctx.topology.ids and len(msg.arrays) == 1
              and msg.arrays[0].size == self.ctx.replica.numel and msg.arrays[0].dtype == np.float32)
        if not ok:
            log.warning("node %d: malformed gradient from node %d ignored", self.ctx.node_id, msg.src)
        return ok

    async def _receive(self) -> None:
        while True:
            try:
                batch = [await self.ctx.transport.recv(TAG, timeout=None)]
            except P2PSyncError:
                return
            # everything that has already arrived is applied in one compute job, so the
            # receiver keeps pace with the local loop (one job per step) instead of lagging
            while len(batch) < MAX_BATCH and (m := self.ctx.transport.recv_nowait(TAG)) is not None:
                batch.append(m)
            batch = [m for m in batch if self._valid(m)]
            grads = [np.array(m.arrays[0], copy=True) for m in batch]
            for m, g in zip(batch, grads):
                self._forward(int(m.meta["origin"]), g, m.header.step)
            await self.ctx.replica.apply_each([g * self.scale for g in grads])
            self.applied_remote += len(grads)
            self._staleness += [max(0, self.local_step - m.header.step) for m in batch]

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        loss, grad = await self.ctx.replica.compute_gradients()
        await self.ctx.replica.apply_gradients(grad * self.scale)
        self.local_step = step
        self._forward(self.ctx.node_id, grad, step)
        wait = 0.0
        loop = asyncio.get_running_loop()
        while len(self._sends) > self.opts["max_inflight"]:
            t0 = loop.time()
            await asyncio.wait(set(self._sends), return_when=asyncio.FIRST_COMPLETED)
            wait += loop.time() - t0
        st, self._staleness = self._staleness, []
        return StepReport(loss=loss, stop=want_stop, wait_s=wait, extra={
            "staleness_mean": float(np.mean(st)) if st else 0.0,
            "staleness_max": int(max(st)) if st else 0,
            "applied_remote": self.applied_remote, "alive": len(self.alive)})

    async def close(self) -> None:
        self._rx.cancel()
        pending = [self._rx, *self._sends]
        await asyncio.wait(pending, timeout=self.opts["send_timeout"])
        for t in pending:
            t.cancel()

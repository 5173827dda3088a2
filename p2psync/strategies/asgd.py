"""ASGD: asynchronous SGD without a barrier, the other baseline.

Each node applies its own gradient at once and sends it to every other node; each node applies
incoming gradients as they arrive. Gradients travel over direct links only: a gradient from
origin ``o`` is flooded down a BFS spanning tree of the live nodes rooted at ``o`` (on a mesh
that is a direct send to everyone; on a ring it is passed along), and every node applies it
exactly once. Staleness (how many local steps a node took since the sender's step) is recorded.
When the live members are not joined by links among themselves (ring-4 with members 1 and 3
only), the trees span their relay links (:func:`~p2psync.topology.paths.group_links`) and a
gradient to a child that is not adjacent is relayed by the nodes in between, members or not.

With ``average`` (default) every gradient is applied with weight 1/N (N = nodes in the run):
one round of N gradients then moves the model as far as one SSGD step on the mean gradient,
so the two baselines compare at the same learning rate (applying each gradient at full ``lr``
makes the effective step N times larger, which diverges with momentum).

Gradients travel through the run's codec (``--codec``): the origin encodes its gradient once
(adding its error-feedback residual first with ``--error-feedback``), and relays forward the
encoded bytes unchanged, so every node decodes the same values. The origin itself applies its
exact gradient. A gradient whose frames do not decode is counted and ignored. With ``topk:F``
the origin sends its gradient's largest fraction F (indices + values; error feedback always
on, as for every use of topk), and receivers apply that sparse gradient.

A failed peer is dropped from the trees and training continues with the survivors; a node that
finishes early keeps applying what arrives until the finish barrier. The trees span the members
of the current view (:meth:`ASGD.on_view`), so a node that joins a running run is added back to
them; the joiner first copies the parameters, optimizer state and step of a live neighbour
(:func:`~p2psync.strategies.regroup.fetch_state`) and then trains like everyone else.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from p2psync.compress import ErrorFeedback, get_codec
from p2psync.coordinator import View
from p2psync.errors import P2PSyncError, ProtocolError, TransportError
from p2psync.model import STEP_EACH
from p2psync.strategies.options import StrategyOptions, non_negative, option, positive
from p2psync.strategies.base import StepReport, Strategy, StrategyContext, register
from p2psync.strategies.regroup import fetch_state, serve_state
from p2psync.tasks import TaskSet
from p2psync.topology.paths import group_links, spanning_tree
from p2psync.wire import Message

log = logging.getLogger("p2psync.asgd")

TAG = "asgd.g"
MAX_BATCH = 256


@dataclass(frozen=True)
class ASGDOptions(StrategyOptions):
    """``--opt`` options of ``--strategy asgd``."""

    max_inflight: int = option(16, "gradient sends in flight before a step waits")
    send_timeout: float = option(5.0, "seconds before a send to a silent peer is dropped")
    average: bool = option(True, "apply every gradient with weight 1/N")

    def __post_init__(self) -> None:
        non_negative(self, "max_inflight")
        positive(self, "send_timeout")


@register
class ASGD(Strategy):
    """``--strategy asgd``: asynchronous SGD, gradients flooded to every node and applied on
    arrival (see the module docstring)."""

    name = "asgd"
    requires = (STEP_EACH,)
    Options = ASGDOptions
    opts: ASGDOptions

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self._rx = TaskSet("asgd-receive")
        #: gradient sends in flight (a step waits while there are more than max_inflight); each
        #: fails alone (a dropped send is counted by the send itself)
        self._sends = TaskSet("asgd-send", isolated=True)

    async def start(self) -> None:
        self.alive = set(self.ctx.topology.ids)
        self._trees: dict[tuple[int, frozenset[int]], dict[int, list[int]]] = {}
        self.local_step = 0
        self._staleness: list[int] = []
        self.applied_remote = 0
        self.dropped_sends = 0
        self.scale = 1.0 / self.ctx.topology.size if self.opts.average else 1.0
        self.codec = get_codec(self.ctx.collectives.codec)
        wants_feedback = self.ctx.collectives.feedback is not None or self.codec.always_feedback  # topk: always
        self.feedback = ErrorFeedback() if wants_feedback and self.codec.lossy else None
        self.malformed = 0
        #: set when this node's first iteration arrives: peers' gradients that come earlier are
        #: forwarded at once but applied only then, so ``attach`` returns with the run's
        #: identical start (DDP's: every replica equal until the first step)
        self._stepping = asyncio.Event()
        serve_state(self.ctx, "asgd", lambda: self.local_step)
        if self.ctx.joining:
            self.alive = set(self.ctx.group)
            self.start_step = self.local_step = await fetch_state(self.ctx, "asgd")
        self._rx.spawn(self._receive())

    def on_peer_failure(self, peer: int) -> None:
        self.alive.discard(peer)

    def on_view(self, view: View) -> None:
        self.alive = set(view.members) | {self.ctx.node_id}

    def _children(self, origin: int) -> list[int]:
        members = frozenset(self.alive | {origin})
        key = (origin, members)
        if key not in self._trees:
            group = sorted(members)
            try:
                self._trees[key] = spanning_tree(self.ctx.topology, group, root=origin,
                                                 links=group_links(self.ctx.topology, group))
            except ValueError:  # not connected even through other nodes
                self._trees[key] = {}
        return [c for c in self._trees[key].get(self.ctx.node_id, []) if c in self.alive]

    def _encode(self, grad: np.ndarray) -> list[np.ndarray]:
        if self.feedback is None:
            return self.codec.encode(grad)
        x = self.feedback.compensate("asgd", grad)
        enc = self.codec.encode(x)
        self.feedback.record("asgd", x, self.codec.decode(enc, x.size))
        return enc

    def _forward(self, origin: int, arrays: list[np.ndarray], step: int) -> None:
        for child in self._children(origin):
            self._sends.spawn(self._send(child, origin, arrays, step))

    async def _send(self, peer: int, origin: int, arrays: list[np.ndarray], step: int) -> None:
        try:
            await self.ctx.transport.send(peer, TAG, arrays, step=step, meta={"origin": origin},
                                          codecs=[self.codec.name] * len(arrays),
                                          timeout=self.opts.send_timeout, relay=True)
        except P2PSyncError as exc:
            self.dropped_sends += 1
            log.info("node %d: gradient to node %d dropped: %s", self.ctx.node_id, peer, exc)

    def _decode(self, msg: Message) -> np.ndarray | None:
        """The gradient a message carries, or None (counted, logged once) if it is malformed."""
        origin: Any = msg.meta.get("origin")
        try:
            if type(origin) is not int or origin not in self.ctx.topology.ids:
                raise ProtocolError("origin", f"bad origin {origin!r}")
            if any(f.codec != self.codec.name for f in msg.header.frames):
                raise ProtocolError("codec", f"expected codec {self.codec.name}")
            return self.codec.decode(msg.arrays, self.ctx.replica.numel)
        except ProtocolError as exc:
            if not self.malformed:
                log.warning("node %d: malformed gradient from node %d ignored: %s", self.ctx.node_id, msg.src, exc)
            self.malformed += 1
            return None

    async def _receive(self) -> None:
        while True:
            try:
                first = await self.ctx.transport.listen(TAG)
            except TransportError:  # closed
                return
            await self._apply_arrived(first)
            del first  # (not held while waiting for the next one)

    async def _apply_arrived(self, first: Message) -> None:
        """Forward and apply ``first`` and everything else that has already arrived, in one
        compute job, so the receiver keeps pace with the local loop (one job per step) instead
        of lagging. The gradients are held only until they are applied (and forwarded): none
        stays referenced while the receiver waits for the next one."""
        batch = [first]
        while len(batch) < MAX_BATCH and (m := self.ctx.transport.recv_nowait(TAG)) is not None:
            batch.append(m)
        decoded = [(m, self._decode(m)) for m in batch]
        batch = [m for m, g in decoded if g is not None]
        grads = [g for _, g in decoded if g is not None]
        del decoded
        for m in batch:  # the encoded bytes travel on unchanged
            self._forward(int(m.meta["origin"]), list(m.arrays), m.header.step)
        await self._stepping.wait()
        await STEP_EACH.of(self.ctx.replica).apply_each(grads, self.scale)  # scaled one at a time
        self.applied_remote += len(grads)
        self._staleness += [max(0, self.local_step - m.header.step) for m in batch]

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        loss, grad = await self.ctx.replica.compute_gradients()
        self._stepping.set()  # (the user's loop is past attach: its first iteration is here)
        await self.ctx.replica.apply_gradients(grad * self.scale)
        self.local_step = step
        self._forward(self.ctx.node_id, self._encode(grad), step)
        wait = 0.0
        loop = asyncio.get_running_loop()
        while len(self._sends) > self.opts.max_inflight:
            t0 = loop.time()
            await asyncio.wait(list(self._sends), return_when=asyncio.FIRST_COMPLETED)
            wait += loop.time() - t0
        st, self._staleness = self._staleness, []
        return StepReport(loss=loss, stop=want_stop, wait_s=wait, extra={
            "staleness_mean": float(np.mean(st)) if st else 0.0,
            "staleness_max": int(max(st)) if st else 0,
            "applied_remote": self.applied_remote, "alive": len(self.alive)})

    async def close(self) -> None:
        """Stop receiving; sends in flight get ``send_timeout`` to go out, then are cancelled."""
        await self._rx.close()
        await self._sends.close(grace=self.opts.send_timeout)

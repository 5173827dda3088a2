"""ASGD: asynchronous SGD without a barrier, the other baseline.

Each node applies its own gradient at once and sends it to every other node; each node applies
incoming gradients as they arrive. Gradients travel over direct links only: a gradient from
origin ``o`` is flooded down a BFS spanning tree of the live nodes rooted at ``o`` (on a mesh
that is a direct send to everyone; on a ring it is passed along), and every node applies it
once (exactly once while every node holds the same view; at most once always, see below).
Staleness (how many local steps a node took since the sender's step) is recorded.
When the live members are not joined by links among themselves (ring-4 with members 1 and 3
only), the trees span their relay links (:func:`~p2psync.topology.paths.group_links`) and a
gradient to a child that is not adjacent is relayed by the nodes in between, members or not.

A gradient is named by its origin, the origin process's incarnation
(:attr:`~p2psync.transport.Transport.incarnation`, carried in the message's meta next to the
origin) and the origin's step. Each node applies and forwards a gradient at most once
(:class:`SeenGradients`): a copy of one it already took (or sent: its own) is dropped unapplied
and unforwarded, and counted (``duplicates``). Copies arise while a new view spreads: nodes
that hold different views forward along different trees, so one node may get a gradient twice
or send it back to where it came from. A node forwards what it takes to its children in the
tree of its own view; a node that two views' trees both reach gets it from whichever parent
sends first. A node that took a gradient under one view does not send it again to the children
a later view gives it, so while a view spreads a node that only the later view's tree reaches
through it may miss that gradient. A gradient more than :data:`WINDOW` steps older than the
newest one taken from the same origin process, or one of a process older than the two newest
seen for that node id, can no longer be told from a copy and is dropped too (``too_old``).

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
from p2psync.errors import ProtocolError, TransportError
from p2psync.model import STEP_EACH
from p2psync.strategies.options import StrategyOptions, non_negative, option, positive
from p2psync.strategies.base import StepReport, Strategy, StrategyContext, register
from p2psync.strategies.flood import Flood
from p2psync.strategies.regroup import fetch_state, serve_state
from p2psync.tasks import TaskSet
from p2psync.wire import Message

log = logging.getLogger("p2psync.asgd")

TAG = "asgd.g"
MAX_BATCH = 256
#: steps behind the newest gradient taken from an origin process within which a late gradient
#: is still told apart from a copy (and applied once); an older one is dropped as too old
WINDOW = 4096
#: origin processes (incarnations) remembered per node id: the newest ones
KEEP_INCARNATIONS = 2

#: what :meth:`SeenGradients.check` says of a gradient
NEW, DUPLICATE, TOO_OLD = "new", "duplicate", "too_old"


class _Window:
    """The steps taken from one origin process: ``top`` (the highest) and ``mask``, whose bit
    ``i`` is set when step ``top - i`` was taken (``i < window``)."""

    __slots__ = ("top", "mask")

    def __init__(self, step: int) -> None:
        self.top = step
        self.mask = 1


class SeenGradients:
    """Which gradients a node has taken, to take each at most once, in bounded memory.

    A gradient is ``(origin, inc, step)``: the node that computed it, that node's process
    (incarnation: a restarted node's new process has a larger one, and its steps are counted
    apart from the old process's, whatever they are) and its step. :meth:`check` classifies
    one, :meth:`add` records it as taken (:meth:`take` does both). Per origin process the
    steps within ``window`` of the highest taken are remembered exactly (a bitmask), so copies
    and late, reordered gradients within the window are told apart; a step further behind is
    ``too_old``. Per origin id only the ``keep`` newest processes are remembered; a gradient of
    an older process than all of them is ``too_old``. Memory: ``keep`` windows of ``window``
    bits per origin id. Pure bookkeeping: no clock, no I/O.
    """

    def __init__(self, window: int = WINDOW, keep: int = KEEP_INCARNATIONS) -> None:
        if window < 1 or keep < 1:
            raise ValueError(f"window {window} and keep {keep} must be positive")
        self.window, self.keep = window, keep
        self._seen: dict[int, dict[int, _Window]] = {}

    def check(self, origin: int, inc: int, step: int) -> str:
        """:data:`NEW` (never taken), :data:`DUPLICATE` (taken before) or :data:`TOO_OLD`
        (cannot be told apart any more: treat as taken). Records nothing."""
        procs = self._seen.get(origin)
        if procs is None:
            return NEW
        w = procs.get(inc)
        if w is None:
            return TOO_OLD if len(procs) >= self.keep and inc < min(procs) else NEW
        if step > w.top:
            return NEW
        back = w.top - step
        if back >= self.window:
            return TOO_OLD
        return DUPLICATE if w.mask >> back & 1 else NEW

    def add(self, origin: int, inc: int, step: int) -> None:
        """Record ``(origin, inc, step)`` as taken (no-op for one that :meth:`check` does not
        call :data:`NEW`)."""
        if self.check(origin, inc, step) != NEW:
            return
        procs = self._seen.setdefault(origin, {})
        w = procs.get(inc)
        if w is None:
            procs[inc] = _Window(step)
            if len(procs) > self.keep:
                del procs[min(procs)]
            return
        if step > w.top:
            w.mask = (w.mask << (step - w.top) | 1) & ((1 << self.window) - 1)
            w.top = step
        else:
            w.mask |= 1 << (w.top - step)

    def take(self, origin: int, inc: int, step: int) -> str:
        """:meth:`check`, then :meth:`add` when the gradient is :data:`NEW`; the verdict."""
        verdict = self.check(origin, inc, step)
        if verdict == NEW:
            self.add(origin, inc, step)
        return verdict


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
        #: the flooding trees and the gradient sends in flight (a step waits while there are
        #: more than max_inflight)
        self.flood = Flood(ctx, TAG, name="asgd", send_timeout=self.opts.send_timeout)

    async def start(self) -> None:
        self.local_step = 0
        self._staleness: list[int] = []
        self.applied_remote = 0
        self.scale = 1.0 / self.ctx.topology.size if self.opts.average else 1.0
        self.codec = get_codec(self.ctx.collectives.codec)
        wants_feedback = self.ctx.collectives.feedback is not None or self.codec.always_feedback  # topk: always
        self.feedback = ErrorFeedback() if wants_feedback and self.codec.lossy else None
        self.malformed = 0
        #: the gradients this node took (its own included), to apply and forward each once
        self.seen = SeenGradients()
        #: copies of a gradient already taken, dropped (neither applied nor forwarded)
        self.duplicates = 0
        #: gradients dropped because they could no longer be told from copies (see SeenGradients)
        self.too_old = 0
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

    @property
    def alive(self) -> set[int]:
        """The nodes the flooding trees span."""
        return self.flood.alive

    @alive.setter
    def alive(self, nodes: set[int]) -> None:
        self.flood.alive = nodes

    @property
    def dropped_sends(self) -> int:
        return self.flood.dropped

    def _encode(self, grad: np.ndarray) -> list[np.ndarray]:
        if self.feedback is None:
            return self.codec.encode(grad)
        x = self.feedback.compensate("asgd", grad)
        enc = self.codec.encode(x)
        self.feedback.record("asgd", x, self.codec.decode(enc, x.size))
        return enc

    def _forward(self, origin: int, inc: int, arrays: list[np.ndarray], step: int) -> None:
        """Send gradient ``(origin, inc, step)`` down ``origin``'s tree (:class:`~.flood.Flood`;
        the caller took it once: see :meth:`_take`)."""
        self.flood.forward(origin, arrays, step=step, meta={"origin": origin, "inc": inc}, codec=self.codec.name)

    def _take(self, msg: Message) -> tuple[int, int, np.ndarray] | None:
        """``(origin, inc, gradient)`` of a message carrying a gradient this node has not
        taken yet, recorded as taken now; None for a copy of one taken before or one too old
        to tell (counted in :attr:`duplicates`, :attr:`too_old`) and for a malformed message
        (counted in :attr:`malformed`, logged once), none of which is recorded."""
        origin: Any = msg.meta.get("origin")
        inc: Any = msg.meta.get("inc")
        try:
            if type(origin) is not int or origin not in self.ctx.topology.ids:
                raise ProtocolError("origin", f"bad origin {origin!r}")
            if type(inc) is not int:
                raise ProtocolError("origin", f"bad incarnation {inc!r}")
            verdict = self.seen.check(origin, inc, msg.header.step)
            if verdict != NEW:
                self.duplicates += verdict == DUPLICATE
                self.too_old += verdict == TOO_OLD
                return None
            if any(f.codec != self.codec.name for f in msg.header.frames):
                raise ProtocolError("codec", f"expected codec {self.codec.name}")
            grad = self.codec.decode(msg.arrays, self.ctx.replica.numel)
        except ProtocolError as exc:
            if not self.malformed:
                log.warning("node %d: malformed gradient from node %d ignored: %s", self.ctx.node_id, msg.src, exc)
            self.malformed += 1
            return None
        self.seen.add(origin, inc, msg.header.step)
        return origin, inc, grad

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
        taken = [(m, t) for m in batch if (t := self._take(m)) is not None]
        batch = [m for m, _ in taken]
        grads = [g for _, (_, _, g) in taken]
        for m, (origin, inc, _) in taken:  # the encoded bytes travel on unchanged
            self._forward(origin, inc, list(m.arrays), m.header.step)
        del taken
        await self._stepping.wait()
        await STEP_EACH.of(self.ctx.replica).apply_each(grads, self.scale)  # scaled one at a time
        self.applied_remote += len(grads)
        self._staleness += [max(0, self.local_step - m.header.step) for m in batch]

    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        loss, grad = await self.ctx.replica.compute_gradients()
        self._stepping.set()  # (the user's loop is past attach: its first iteration is here)
        await self.ctx.replica.apply_gradients(grad * self.scale)
        self.local_step = step
        me, inc = self.ctx.node_id, self.ctx.transport.incarnation
        self.seen.add(me, inc, step)  # a copy of its own that comes back is dropped
        self._forward(me, inc, self._encode(grad), step)
        wait = 0.0
        loop = asyncio.get_running_loop()
        while len(self.flood.sends) > self.opts.max_inflight:
            t0 = loop.time()
            await asyncio.wait(list(self.flood.sends), return_when=asyncio.FIRST_COMPLETED)
            wait += loop.time() - t0
        st, self._staleness = self._staleness, []
        return StepReport(loss=loss, stop=want_stop, wait_s=wait, extra={
            "staleness_mean": float(np.mean(st)) if st else 0.0,
            "staleness_max": int(max(st)) if st else 0,
            "applied_remote": self.applied_remote, "duplicates": self.duplicates, "too_old": self.too_old,
            "alive": len(self.alive)})

    async def close(self) -> None:
        """Stop receiving; sends in flight get ``send_timeout`` to go out, then are cancelled."""
        await self._rx.close()
        await self.flood.close(self.opts.send_timeout)

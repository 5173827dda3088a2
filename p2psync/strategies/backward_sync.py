"""Gradients averaged during backward, in buckets, as torch's DDP does (SSGD's ``sync=backward``).

The replica (:meth:`~p2psync.api.replica.HookedReplica.enable_backward_sync`) hands this
object, on the event loop, every parameter's gradient as soon as backward accumulated it
(:meth:`BackwardAverager.on_grad`) and, when backward ends, the rest of the pass
(:meth:`BackwardAverager.pass_end`): the parameters whose hook did not fire (unused in the
forward pass) and the module buffers. Backward does not return before ``pass_end`` does; the
replica then writes the group's mean into every ``.grad`` (and the synchronized buffers into
the model), so the user's code between ``backward()`` and ``optimizer.step()`` sees the mean.

Buckets: the flat gradient is cut into contiguous ranges of whole parameters, from the last
parameter to the first (the order backward produces them), of about ``bucket_bytes`` each
(the first one a quarter of that, so communication starts early). A bucket's allreduce starts
as soon as its last parameter's gradient is in and the step is *armed*; the pass ends when
every bucket's mean is back.

Memory: each bucket's gradient is gathered into an array of its own, which its allreduce is
handed (``donate``: reduced in place, no second buffer); the mean that comes back is written
into ``.grad`` and then holds the bucket's next gradient. The averager thus keeps one flat
copy of the gradients across steps (a bucket whose allreduce failed, or whose last sends ZeroMQ
still held, gets fresh memory), besides the pieces in flight.

Tags: ``<name>.<step>.e<epoch>.p<pass>.b<bucket>`` (``pass``: the backward pass within the
step, for gradient accumulation), the buffers under
``<name>.<step>.e<epoch>.p<pass>`` (strategies/buffers.py), the stop flag under
``<name>.<step>.e<epoch>.bflag``.

Arming: the strategy arms a step (:meth:`BackwardAverager.arm`) once the members of the
current view agree on their state; passes that end before that wait for it (bounded by the
peer timeout). A pass computed on parameters that were replaced since (an adopted state) is
not averaged: its ``pass_end`` answers None at once, the replica keeps the local gradient and
the strategy skips that iteration. Any failure of a bucket's allreduce (a member died, a newer
view arrived) fails the whole step's backward averaging: the remaining passes answer None and
:meth:`BackwardAverager.outcome` returns None, so the strategy redoes the step at
``optimizer.step()`` over the survivors (the regroup path).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from p2psync import clock
from p2psync.collectives import OpId, OpStats
from p2psync.coordinator import View
from p2psync.errors import P2PSyncError, PeerFailure, ProtocolError
from p2psync.strategies.base import StrategyContext
from p2psync.model import Buffers, StepAsIs
from p2psync.strategies.buffers import exchange_buffers
from p2psync.tasks import cancel_all
from p2psync.vocab import BufferMode

log = logging.getLogger("p2psync.backward")


def plan_buckets(sizes: Sequence[int], bucket_bytes: int, itemsize: int = 4) -> list[tuple[int, int]]:
    """Pure: parameter index ranges ``[lo, hi)`` of the buckets, in the order backward fills
    them (last parameters first). Each bucket holds whole parameters, at least one; a bucket
    closes once it holds ``bucket_bytes`` (the first one: a quarter of it)."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    out: list[tuple[int, int]] = []
    hi = len(sizes)
    cap = max(1, bucket_bytes // 4)
    acc = 0
    for i in range(len(sizes) - 1, -1, -1):
        acc += sizes[i] * itemsize
        if acc >= cap:
            out.append((i, hi))
            hi, acc, cap = i, 0, bucket_bytes
    if hi > 0:
        out.append((0, hi))
    return out


def redoable(exc: BaseException) -> bool:
    """Pure: whether a failed averaging is redone over the next view (a member failed or did
    not answer; members ran another group's operation around a view change), as the regroup
    path redoes it; anything else (a divergence, a configuration error) ends the step."""
    if isinstance(exc, PeerFailure):
        return True
    return isinstance(exc, ProtocolError) and exc.reason == "collective_mismatch"


@runtime_checkable
class BackwardHooks(StepAsIs, Protocol):
    """A replica that can average its gradients during backward (the ``attach`` path's
    :class:`~p2psync.api.replica.HookedReplica`), then step on ``.grad`` as it stands; SSGD
    without it averages at the step."""

    async def enable_backward_sync(self, averager: "BackwardAverager") -> None:
        """Hand every backward pass to ``averager`` (see the module docstring)."""

    def param_sizes(self) -> list[int]:
        """Elements of each trainable parameter, in the flat vector's order."""


@dataclass(frozen=True)
class PassResult:
    """What backward writes back: the group's mean gradient, bucket by bucket, and the buffers
    to take (None: leave them)."""

    #: (offset in the flat vector, the mean there) per bucket, whole parameters each; valid
    #: until the next pass begins (the replica copies them into ``.grad`` at once)
    grads: list[tuple[int, np.ndarray]]
    buffers: Buffers | None


@dataclass(frozen=True)
class StepDone:
    """A step whose every synchronized pass was averaged during backward."""

    stop: bool
    passes: int
    comm_s: float
    compression: float
    nic_bytes: dict[str, int]


@dataclass
class _Armed:
    step: int
    view: View
    flag: asyncio.Task[Any]
    passes: int = 0
    bound: int = 0
    failed: bool = False
    #: what ended the averaging when a redo cannot help (raised by ``outcome``)
    fatal: BaseException | None = None
    comm_s: float = 0.0
    stats: list[OpStats] = field(default_factory=list)

    def op(self, name: str) -> OpId:
        """The step's operation of the strategy ``name``."""
        return OpId(name, self.step, self.view.epoch)


class _Pass:
    """One backward pass's gradient as it comes in."""

    def __init__(self, pass_id: int, gen: int, parts: list[np.ndarray | None], left: list[int]) -> None:
        self.pass_id = pass_id
        self.gen = gen
        #: per bucket: the array its gradients are gathered into (None once handed to its allreduce)
        self.parts = parts
        self.left = left  # per bucket: gradients still to come (each hook fires once a pass)
        self.k: int | None = None  # the pass's number within its step, once bound to one
        self.started: dict[int, asyncio.Future[Any]] = {}
        self.extra: list[asyncio.Future[Any]] = []


class BackwardAverager:
    """See the module docstring. Lives on the event loop; one per strategy instance."""

    def __init__(self, *, ctx: StrategyContext, name: str, bucket_bytes: int, sizes: Sequence[int]) -> None:
        self.ctx = ctx
        self.name = name
        self.sizes = list(sizes)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64).tolist()
        self.numel = int(self.offsets[-1])
        self.buckets = plan_buckets(self.sizes, bucket_bytes)
        self.bucket_of = [0] * len(self.sizes)
        for j, (lo, hi) in enumerate(self.buckets):
            for i in range(lo, hi):
                self.bucket_of[i] = j
        self.buffer_mode: BufferMode = ctx.buffers
        # per bucket, between passes: the array the next pass gathers that bucket's gradients
        # into (the last mean; None: fresh memory). One pass at a time (backward waits for its
        # end); fresh memory every step would page-fault its way through the whole vector
        self._store: list[np.ndarray | None] = [None] * len(self.buckets)
        self._armed: _Armed | None = None
        self._arm_event = asyncio.Event()
        self._pass: _Pass | None = None
        self._closed = False
        self._local = False  # the step is not armed: passes stay local
        #: when the armed step's averaging failed last (monotonic clock)
        self.failed_at: float | None = None

    # -- replica side (event loop) ---------------------------------------------------------

    def pass_begin(self, pass_id: int, gen: int) -> None:
        """Backward pass ``pass_id`` began, on parameter generation ``gen`` (the replica's
        count of replaced parameters): the gradients that follow are its."""
        parts: list[np.ndarray | None] = []
        for j, (lo, hi) in enumerate(self.buckets):
            a, self._store[j] = self._store[j], None
            parts.append(a if a is not None else np.empty(self.offsets[hi] - self.offsets[lo], np.float32))
        self._pass = _Pass(pass_id, gen, parts, [hi - lo for lo, hi in self.buckets])

    def on_grad(self, index: int, offset: int, grad: np.ndarray) -> None:
        """Parameter ``index`` (at ``offset`` in the flat vector) of the current pass has its
        gradient ``grad`` (a host float32 copy)."""
        p = self._pass
        if p is None:  # a pass that began before the averager existed: it stays local
            return
        j = self.bucket_of[index]
        self._put(p, j, offset, grad)
        p.left[j] -= 1
        if self._bound(p) and self._complete(p, j):
            self._start(p, j)

    async def pass_end(self, pass_id: int, rest: Sequence[tuple[int, np.ndarray]],
                       buffers: Buffers | None) -> PassResult | None:
        """Backward pass ``pass_id`` ended: ``rest`` holds the gradients whose hooks did not
        fire, ``buffers`` the model's buffers (None: not synchronized). Returns the mean and
        the buffers to write back, or None (keep the local gradient: see the module docstring)."""
        p = self._pass
        if p is None or p.pass_id != pass_id:
            return None
        for index, grad in rest:
            j = self.bucket_of[index]
            self._put(p, j, self.offsets[index], grad)
            p.left[j] -= 1
        try:
            return await self._average(p, buffers)
        finally:
            if self._pass is p:
                self._pass = None
            for j, a in enumerate(p.parts):  # never handed over: the next pass gathers into them
                if a is not None and self._store[j] is None:
                    self._store[j] = a

    async def _average(self, p: _Pass, buffers: Buffers | None) -> PassResult | None:
        if not await self._wait_armed(p):
            return None
        armed = self._armed
        if armed is None or armed.failed:
            return None
        t0 = clock.now()
        for j in range(len(self.buckets)):
            if j not in p.started:
                self._start(p, j)
        bufs: asyncio.Task[Buffers | None] | None = None
        if buffers is not None:
            bufs = asyncio.ensure_future(exchange_buffers(
                self.ctx.collectives, buffers, self.buffer_mode, tag=armed.op(self.name).sub(f"p{p.k}"),
                group=armed.view.members))
            p.extra.append(bufs)
        tasks: list[asyncio.Future[Any]] = [*p.started.values(), *p.extra]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            await cancel_all([t for t in tasks if not t.done()])
        failure = next((t for t in tasks if t.cancelled() or t.exception() is not None), None)
        if failure is not None:
            self._mark_failed(armed)
            exc = None if failure.cancelled() else failure.exception()
            if exc is not None and not redoable(exc):
                armed.fatal = exc  # a divergence, a bad configuration: the step is not redone
            why = "cancelled: a member failed or a newer view came" if exc is None else exc
            log.info("node %d: %s step %d pass %s: backward averaging failed (%s)", self.ctx.node_id,
                     self.name, armed.step, p.k, why)
            return None
        means: list[tuple[int, np.ndarray]] = []
        for j in sorted(p.started):
            part, st = p.started[j].result()
            means.append((self.offsets[self.buckets[j][0]], part))
            self._store[j] = part  # ours alone (see the module docstring): the next pass gathers into it
            armed.stats.append(st)
        armed.passes += 1
        armed.comm_s += clock.now() - t0
        return PassResult(grads=means, buffers=bufs.result() if bufs is not None else None)

    # -- strategy side ---------------------------------------------------------------------

    def arm(self, step: int, want_stop: bool, view: View) -> None:
        """Passes from now on belong to ``step`` over ``view``'s members; the stop flag's exact
        allreduce starts now."""
        if self._armed is not None:
            self._cancel(self._armed)
        self._local = False
        self.failed_at = None
        one = np.array([1.0 if want_stop else 0.0], dtype=np.float32)
        tag = OpId(self.name, step, view.epoch).sub("bflag")
        flag = asyncio.ensure_future(self.ctx.collectives.allreduce(one, view.members, op="sum", tag=tag,
                                                                    codec="none"))
        self._armed = _Armed(step=step, view=view, flag=flag)
        self._arm_event.set()
        p = self._pass
        if p is not None and self._bound(p):
            for j in range(len(self.buckets)):
                if self._complete(p, j):
                    self._start(p, j)

    def pass_through(self, step: int) -> None:
        """``step`` is averaged at ``optimizer.step()``: its backward passes stay local (they
        answer at once)."""
        if self._armed is not None:
            self._cancel(self._armed)
            self._armed = None
        self._local = True
        self._arm_event.set()

    async def outcome(self, step: int) -> StepDone | None:
        """After ``step``'s iteration reached ``optimizer.step()``: how its backward averaging
        went (None: not averaged, or failed; redo the step). Disarms."""
        self._local = False
        armed, self._armed = self._armed, None
        self._arm_event = asyncio.Event()
        if armed is None or armed.step != step:
            return None
        if armed.failed or armed.passes == 0:
            await cancel_all([armed.flag])
            if armed.fatal is not None:
                raise armed.fatal
            return None
        try:
            flags = await armed.flag
        except P2PSyncError as exc:
            log.info("node %d: %s step %d: stop flag failed (%s)", self.ctx.node_id, self.name, step, exc)
            return None
        raw = sum(s.raw_bytes for s in armed.stats)
        wire = sum(s.wire_bytes for s in armed.stats)
        nic: dict[str, int] = {}
        for s in armed.stats:
            for k, v in s.nic_bytes.items():
                nic[k] = nic.get(k, 0) + v
        stop = bool(flags[0] > 0)
        if stop:
            self._closed = True
        return StepDone(stop=stop, passes=armed.passes, comm_s=armed.comm_s,
                        compression=raw / wire if wire else 1.0, nic_bytes=nic)

    def on_view(self, view: View) -> None:
        """A newer view abandons the armed step's averaging (redone over the new view)."""
        armed = self._armed
        if armed is not None and view.epoch > armed.view.epoch:
            self._cancel(armed)

    def on_peer_failure(self, peer: int) -> None:
        """A member of the armed step failed: its averaging cannot complete."""
        armed = self._armed
        if armed is not None and peer in armed.view.members:
            self._cancel(armed)

    def close(self) -> None:
        """No more steps: passes answer None at once."""
        self._closed = True
        if self._armed is not None:
            self._cancel(self._armed)
            self._armed.flag.cancel()
        self._arm_event.set()

    # -- internals -------------------------------------------------------------------------

    def _bound(self, p: _Pass) -> bool:
        """Bind ``p`` to the armed step (a number within it); False while none is armed, the
        step failed, or ``p`` was computed on replaced parameters."""
        armed = self._armed
        if armed is None or armed.failed or self._closed:
            return False
        if p.gen != getattr(self.ctx.replica, "params_gen", p.gen):
            return False
        if p.k is None:  # passes are sequential: the next number of the step
            p.k = armed.bound
            armed.bound += 1
        return True

    def _put(self, p: _Pass, j: int, offset: int, grad: np.ndarray) -> None:
        """Write a parameter's gradient (at ``offset`` in the flat vector) into bucket ``j``'s array."""
        part = p.parts[j]
        if part is None:  # (hooks fire once a pass, before its end: not expected)
            log.error("node %d: %s: a gradient arrived for bucket %d after its allreduce started; ignored",
                      self.ctx.node_id, self.name, j)
            return
        lo = offset - self.offsets[self.buckets[j][0]]
        part[lo:lo + grad.size] = grad

    def _complete(self, p: _Pass, j: int) -> bool:
        return j not in p.started and p.left[j] == 0

    def _start(self, p: _Pass, j: int) -> None:
        armed = self._armed
        if armed is None:
            return
        part, p.parts[j] = p.parts[j], None  # handed over: reduced in place (see the module docstring)
        p.started[j] = asyncio.ensure_future(self.ctx.collectives.allreduce_with_stats(
            part, armed.view.members, op="mean", tag=armed.op(self.name).sub(f"p{p.k}.b{j}"),
            feedback=(self.name, "bucket", p.k, j), donate=True))

    async def _wait_armed(self, p: _Pass) -> bool:
        """Wait (bounded) until a step is armed and ``p`` is bound to it."""
        if self._closed or self._local:
            return False
        if self._armed is None:
            try:
                await asyncio.wait_for(self._arm_event.wait(), self.ctx.peer_timeout)
            except asyncio.TimeoutError:
                log.warning("node %d: %s: a backward pass ended but no step was armed within %.0f s; its "
                            "gradient stays local", self.ctx.node_id, self.name, self.ctx.peer_timeout)
                return False
        if self._closed or self._local:
            return False
        return self._bound(p)

    def _mark_failed(self, armed: _Armed) -> None:
        if not armed.failed:
            self.failed_at = clock.now()
        armed.failed = True

    def _cancel(self, armed: _Armed) -> None:
        self._mark_failed(armed)
        p = self._pass
        for t in ([*p.started.values(), *p.extra] if p is not None else []):
            t.cancel()


__all__ = ["BackwardAverager", "BackwardHooks", "PassResult", "StepDone", "plan_buckets"]

"""Whether one node may step: a fresh majority heard through its coordinator, and fencing.

Quorum (the rules: :mod:`p2psync.coordinator.quorum`). Every heartbeat reply of the
coordinator says whether it hears a majority of the agreed view; :attr:`QuorumGate.held` is
True while such a reply is fresh (within the coordinator's detection time), and
:meth:`QuorumGate.wait` is what the step loop awaits before every step: a node cut off from the
majority stops stepping.

Fencing. A node the coordinator declared failed (it paused, or it was on the minority side of
a partition) is told so in the reply to its next heartbeat, or finds a newer view without it by
probing; :meth:`QuorumGate.fence` then records why, once. A node whose whole process was
stopped longer than the failure detection (no CPU time passed either: SIGSTOP, swap) and that
hears no coordinator holding a majority within two detection times after fences itself
(:meth:`QuorumGate.after_stop`): the run has most likely removed it, and its connections may
not have survived the stop (ZeroMQ can file a neighbour's reconnection as a duplicate of the
connection it had before, and drop what comes over it). A fenced node stops for good
(:attr:`QuorumGate.fenced`, ``listeners``): its progress since it was removed is void, and it
rejoins the run as a new process, which adopts the majority's state.

The gate reads the one injectable clock (:mod:`p2psync.clock`); its waits are event-driven.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from p2psync import clock
from p2psync.errors import Fenced, NoQuorum, RunEnded

log = logging.getLogger("p2psync.membership")


class QuorumGate:
    """The quorum and fencing state of node ``me``.

    ``window()``: how long a coordinator's "I hold a majority" stays valid (its detection time
    plus a heartbeat interval); ``recheck``: the longest a waiter sleeps between two looks at
    the clock (the claim can expire without an event); ``failure_timeout``: the detector's
    floor, the least stop that counts (:meth:`after_stop`)."""

    def __init__(self, *, me: int, window: Callable[[], float], recheck: float, failure_timeout: float) -> None:
        self.me = me
        self._window = window
        self.recheck = recheck
        self.failure_timeout = failure_timeout
        #: why this node is no member any more, or None
        self.fenced: Fenced | None = None
        #: called once with the Fenced error when this node learns it was removed
        self.listeners: list[Callable[[Fenced], None]] = []
        #: when the coordinator last said it holds a majority (None: not now)
        self._at: float | None = None
        self._changed = asyncio.Event()  # replaced (after being set) on every change
        #: (when, how long) this whole process was last found stopped, until a majority is heard
        self._stopped: tuple[float, float] | None = None

    @property
    def held(self) -> bool:
        """Whether the coordinator this node follows recently said it hears a majority of the
        run; False once fenced."""
        at = self._at
        return self.fenced is None and at is not None and clock.now() - at <= self._window()

    def set(self, held: bool, *, coordinator: int) -> None:
        """The coordinator (``coordinator``, for the log) answered that it holds a majority, or
        that it does not."""
        before = self.held
        self._at = clock.now() if held else None
        if held != before:
            if not held:
                log.error("node %d: coordinator %d hears no majority of the run: this node stops stepping "
                          "until it does", self.me, coordinator)
            self._wake()

    async def wait(self, timeout: float, describe: Callable[[], str]) -> float:
        """Wait until :attr:`held` (returns at once when it is); returns the seconds waited.
        Raises the :class:`Fenced` error when this node is removed meanwhile, and
        :class:`NoQuorum` after ``timeout`` (its message ends with ``describe()``: whom this
        node follows, its view)."""
        if self.held:
            return 0.0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        log.warning("node %d: waiting for a majority of the run (%s)", self.me, describe())
        while not self.held:
            if self.fenced is not None:
                raise self.fenced
            remaining = t0 + timeout - loop.time()
            if remaining <= 0:
                raise NoQuorum(f"node {self.me}: no majority of the run for {timeout:g}s ({describe()})")
            try:
                await asyncio.wait_for(self._changed.wait(), min(remaining, self.recheck))
            except asyncio.TimeoutError:
                pass
        waited = loop.time() - t0
        log.warning("node %d: a majority again after %.2fs", self.me, waited)
        return waited

    def fence(self, why: str, *, rejoin: bool = True, ended: bool = False) -> None:
        """This node is no member of the run any more (see the module docstring), the first
        time only; ``rejoin``: whether a new process of it may join again (not after an
        exclusion); ``ended``: the run ends without it (:class:`RunEnded`: a joiner that took
        no part in the agreed stop). Wakes every :meth:`wait` and calls the listeners."""
        if self.fenced is not None:
            return
        self.fenced = (RunEnded(f"node {self.me} left the run as it ended: {why}") if ended else
                       Fenced(f"node {self.me} was removed from the run: {why}; its progress since is void"
                              + (", it rejoins as a new process" if rejoin else ""), rejoin=rejoin))
        log.error("node %d: fenced: %s", self.me, why)
        self._wake()
        for cb in list(self.listeners):
            cb(self.fenced)

    def after_stop(self, stall: float, cpu_used: float, now: float) -> None:
        """Self-fencing after the whole process was stopped: ``stall`` seconds passed where a
        heartbeat interval was due, with ``cpu_used`` seconds of CPU time (see the module
        docstring). Called once per heartbeat interval."""
        if stall >= self.failure_timeout and cpu_used < 0.5 * stall:
            self._stopped = (now, stall)
            log.warning("node %d: this process was stopped for %.1fs (no CPU time passed either): the run may "
                        "have removed it", self.me, stall)
        # judged at the end of a window of two detection times, not before: a coordinator's own
        # detectors are credited with the stop, so it claims a majority until they time out
        if self._stopped is not None and now - self._stopped[0] > 2 * self.failure_timeout + self.recheck:
            if self.held:
                self._stopped = None
            else:
                self.fence(f"its process was stopped for {self._stopped[1]:.1f}s and it hears no coordinator "
                           f"holding a majority {now - self._stopped[0]:.1f}s later")

    def _wake(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()


__all__ = ["QuorumGate"]

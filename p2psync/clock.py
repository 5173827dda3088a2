"""The one clock every timeout, heartbeat, detector and deadline of the runtime reads (no
p2psync imports).

:func:`now` is monotonic seconds, :func:`wall` seconds since the epoch (for timestamps written
into logs and records), :func:`cpu` this process's CPU seconds (the self-fencing check of the
membership client compares it with how long the process stood still).

Which clock answers is decided by the event loop running in the calling thread: a loop that
keeps a time of its own offers it with :func:`offer` (it becomes the loop's ``p2psync_clock``
attribute, a :class:`Clock`; the virtual-time loop of :mod:`p2psync.sim.loop` does), and every
read on that loop's thread goes to it. Until some loop has offered a clock in this process,
:func:`now` reads ``time.monotonic()`` at once, without looking up the running loop (the
receive path reads it for every message). Anywhere else (the stdlib's loop, uvloop, a thread
without a loop) the answer is the system's: ``time.monotonic()``, ``time.time()``,
``time.process_time()``, exactly what the runtime read before there was one clock. The stdlib
loop's ``time()`` is ``time.monotonic()`` itself; uvloop's is cached once per loop iteration in
whole milliseconds, which is why the system clock is read directly rather than through
``loop.time()``.

Code that needs its clock explicitly (pure state, a test) takes ``now`` as an argument or a
:class:`Clock`; code on the event loop calls :func:`now`.
"""

from __future__ import annotations

import time
from asyncio import events
from typing import Protocol, runtime_checkable

#: the attribute by which an event loop offers its own clock
LOOP_ATTRIBUTE = "p2psync_clock"


@runtime_checkable
class Clock(Protocol):
    """A source of time: ``now()`` monotonic seconds (never decreases), ``wall()`` seconds since
    the epoch, ``cpu()`` CPU seconds this process (or simulated node) used."""

    def now(self) -> float: ...

    def wall(self) -> float: ...

    def cpu(self) -> float: ...


class SystemClock:
    """The operating system's clocks: ``time.monotonic``, ``time.time``, ``time.process_time``."""

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def cpu(self) -> float:
        return time.process_time()


#: the clock of every thread whose running loop has none of its own
SYSTEM = SystemClock()

#: some loop in this process has offered its own clock (:func:`offer`)
_offered = False


def offer(loop: events.AbstractEventLoop, clock: Clock) -> None:
    """Make ``clock`` the clock of every read on ``loop``'s thread while ``loop`` runs."""
    global _offered
    setattr(loop, LOOP_ATTRIBUTE, clock)
    _offered = True


def current() -> Clock:
    """The clock of the calling thread: its running loop's own (``p2psync_clock``), else
    :data:`SYSTEM`."""
    loop = events._get_running_loop()
    if loop is None:
        return SYSTEM
    clock: Clock | None = getattr(loop, LOOP_ATTRIBUTE, None)
    return SYSTEM if clock is None else clock


def now() -> float:
    """Monotonic seconds on the calling thread's clock (see the module docstring)."""
    if not _offered:
        return time.monotonic()
    loop = events._get_running_loop()
    clock: Clock | None = getattr(loop, LOOP_ATTRIBUTE, None) if loop is not None else None
    return time.monotonic() if clock is None else clock.now()


def wall() -> float:
    """Seconds since the epoch on the calling thread's clock (timestamps in logs and records)."""
    return current().wall()


def cpu() -> float:
    """CPU seconds used, on the calling thread's clock."""
    return current().cpu()


__all__ = ["Clock", "LOOP_ATTRIBUTE", "SYSTEM", "SystemClock", "cpu", "current", "now", "offer", "wall"]

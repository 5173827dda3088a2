"""The phases of a :class:`~p2psync.api.session.Session` and the one place they change.

A session lives through these phases, in this order (a phase may be skipped, never revisited)::

    CREATED --attach--> ATTACHING --driver started--> RUNNING --run agreed to stop, or the
    user's loop ended--> STOPPED --close--> CLOSING --> CLOSED

and any phase before CLOSING may turn FAILED (the first error wins and is kept: the training
thread raises it at its next step and :meth:`Session.close` raises it). ``close`` moves any
phase to CLOSING (a failed ``attach`` closes the same way). An error found while closing (a
replica audit at the end, a fence) is recorded, the phase stays CLOSING.

Threads: the training thread (``attach``, ``close``) and the event loop (the driver starts,
stops and fails) both move the phase, so :class:`Lifecycle` takes a lock; a transition the
table does not allow is a bug in the caller and raises :class:`~p2psync.errors.TrainingError`.
"""

from __future__ import annotations

import enum
import threading

from p2psync.errors import TrainingError


class Phase(enum.Enum):
    """Where a session is (see the module docstring for the order)."""

    #: the node's event loop runs; no model is attached yet
    CREATED = "created"
    #: ``attach``: rendezvous and identical start under way
    ATTACHING = "attaching"
    #: the driver steps the strategy at every ``optimizer.step()``
    RUNNING = "running"
    #: the driver ended without an error: the run agreed to stop, or the user's loop ended
    STOPPED = "stopped"
    #: the run ended on this node with an error (:attr:`Lifecycle.error`)
    FAILED = "failed"
    #: ``close``: finish barrier, summary, sockets
    CLOSING = "closing"
    #: over; the event loop is stopped
    CLOSED = "closed"


#: the phases each phase may move to
NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.CREATED: frozenset({Phase.ATTACHING, Phase.CLOSING}),
    Phase.ATTACHING: frozenset({Phase.RUNNING, Phase.FAILED, Phase.CLOSING}),
    Phase.RUNNING: frozenset({Phase.STOPPED, Phase.FAILED, Phase.CLOSING}),
    Phase.STOPPED: frozenset({Phase.FAILED, Phase.CLOSING}),
    Phase.FAILED: frozenset({Phase.CLOSING}),
    Phase.CLOSING: frozenset({Phase.CLOSED}),
    Phase.CLOSED: frozenset(),
}

#: phases in which the training loop should end (``Session.should_stop``)
OVER = frozenset({Phase.STOPPED, Phase.FAILED, Phase.CLOSING, Phase.CLOSED})


class Lifecycle:
    """A session's phase and its error, safe to read and change from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phase = Phase.CREATED
        self._error: BaseException | None = None

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def error(self) -> BaseException | None:
        """The error that ended the run on this node (the first one), if any."""
        return self._error

    @property
    def over(self) -> bool:
        """The training loop should end: the run stopped, failed or is closing."""
        return self._phase in OVER

    def to(self, phase: Phase) -> None:
        """Move to ``phase``; raises TrainingError when the table does not allow it."""
        with self._lock:
            self._move(phase)

    def close(self) -> bool:
        """Move to CLOSING; False (and nothing changes) when the session is closing or closed
        already, so that only the first caller closes it."""
        with self._lock:
            if self._phase in (Phase.CLOSING, Phase.CLOSED):
                return False
            self._move(Phase.CLOSING)
            return True

    def stopped(self) -> None:
        """The driver ended: RUNNING becomes STOPPED; any other phase (FAILED, CLOSING) stays."""
        with self._lock:
            if self._phase is Phase.RUNNING:
                self._move(Phase.STOPPED)

    def fail(self, exc: BaseException) -> bool:
        """Record ``exc`` as the run's error; True when it is the first one (the caller then
        wakes the training thread and stops the driver). Before CLOSING the phase becomes
        FAILED; while closing only the error is recorded; once closed nothing changes."""
        with self._lock:
            if self._error is not None or self._phase is Phase.CLOSED:
                return False
            self._error = exc
            if Phase.FAILED in NEXT[self._phase]:
                self._move(Phase.FAILED)
            return True

    def _move(self, phase: Phase) -> None:
        if phase not in NEXT[self._phase]:
            raise TrainingError(f"session: {self._phase.value} cannot move to {phase.value}")
        self._phase = phase


__all__ = ["Lifecycle", "NEXT", "OVER", "Phase"]

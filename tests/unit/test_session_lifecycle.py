"""The phases of a session: one transition table, moved by the training thread and the event
loop alike; the first error wins and is kept through closing."""

from __future__ import annotations

import threading

import pytest

from p2psync.api.lifecycle import NEXT, OVER, Lifecycle, Phase
from p2psync.errors import TrainingError

pytestmark = pytest.mark.timeout(30)


def test_a_run_goes_through_the_phases_in_order() -> None:
    life = Lifecycle()
    assert life.phase is Phase.CREATED and not life.over
    life.to(Phase.ATTACHING)
    life.to(Phase.RUNNING)
    assert not life.over
    life.stopped()
    assert life.phase is Phase.STOPPED and life.over and life.error is None
    assert life.close()
    life.to(Phase.CLOSED)
    assert life.phase is Phase.CLOSED and life.over


def test_no_phase_is_revisited_and_a_wrong_move_is_refused() -> None:
    life = Lifecycle()
    with pytest.raises(TrainingError, match="created cannot move to running"):
        life.to(Phase.RUNNING)
    for phase, nxt in NEXT.items():
        assert phase not in nxt and Phase.CREATED not in nxt
    assert NEXT[Phase.CLOSED] == frozenset()


def test_the_first_error_wins_and_close_runs_once() -> None:
    life = Lifecycle()
    life.to(Phase.ATTACHING)
    life.to(Phase.RUNNING)
    first, second = RuntimeError("first"), RuntimeError("second")
    assert life.fail(first)
    assert not life.fail(second)
    assert life.phase is Phase.FAILED and life.error is first and life.over
    life.stopped()  # the driver's end after a failure: the phase stays FAILED
    assert life.phase is Phase.FAILED
    assert life.close() and not life.close()
    life.to(Phase.CLOSED)
    assert life.error is first


def test_an_error_while_closing_is_recorded_and_the_phase_stays() -> None:
    life = Lifecycle()
    life.to(Phase.ATTACHING)
    life.to(Phase.RUNNING)
    life.stopped()
    assert life.close()
    exc = RuntimeError("audit")
    assert life.fail(exc)
    assert life.phase is Phase.CLOSING and life.error is exc
    life.to(Phase.CLOSED)
    assert not life.fail(RuntimeError("late"))  # once closed nothing changes
    assert life.error is exc


def test_a_session_closed_before_attach_never_ran() -> None:
    life = Lifecycle()
    assert life.close()
    life.to(Phase.CLOSED)
    assert life.error is None and Phase.CLOSED in OVER


def test_failures_from_many_threads_keep_exactly_one() -> None:
    life = Lifecycle()
    life.to(Phase.ATTACHING)
    life.to(Phase.RUNNING)
    firsts: list[bool] = []
    errors = [RuntimeError(str(k)) for k in range(16)]
    threads = [threading.Thread(target=lambda e=e: firsts.append(life.fail(e))) for e in errors]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert firsts.count(True) == 1 and life.error in errors and life.phase is Phase.FAILED

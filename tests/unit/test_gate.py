"""The step gate and the hooked replica: how a strategy meets the user's loop (issue 11).

A real training thread (this test's thread) runs a plain PyTorch loop on an attached optimizer
stand-in; the "strategy" is a coroutine on an event loop in a background thread, as in a node.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable, Coroutine

import numpy as np
import pytest
import torch

from p2psync.api.gate import StepGate
from p2psync.api.replica import HookedReplica
from p2psync.errors import Aborted, P2PSyncError, TrainingEnded, TrainingError
from p2psync.tasks import AbortEvent
from p2psync.model.flat import FlatModel

pytestmark = pytest.mark.timeout(30)


class Loop:
    """An event loop in a background thread (the node's), and a gate on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.gate = StepGate(self.loop)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _setup() -> tuple[Loop, torch.nn.Linear, torch.optim.SGD, FlatModel, HookedReplica, Callable[[], None]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    flat = FlatModel(model=model, optimizer=opt)
    lp = Loop()
    replica = HookedReplica(flat=flat, gate=lp.gate, step=opt.step)

    def user_step() -> None:  # what the hooked optimizer.step() does: arrive with the gradient
        lp.gate.arrive(loss=1.0, samples=4, grads=flat.grads())

    return lp, model, opt, flat, replica, user_step


def _backward(model: torch.nn.Linear) -> None:
    model.zero_grad()
    model(torch.ones(4, 3)).sum().backward()


def test_each_iteration_is_taken_replaced_and_stepped_in_order() -> None:
    lp, model, opt, flat, replica, user_step = _setup()
    events: list[str] = []

    async def strategy() -> None:
        for k in range(3):
            loss, g = await replica.compute_gradients()
            events.append(f"took {k}")
            await replica.apply_gradients(np.full_like(g, 1.0))  # replaced gradient
            events.append(f"stepped {k}")
            lp.gate.release()

    try:
        before = flat.get_params()
        fut = lp.spawn(strategy())
        for k in range(3):
            _backward(model)
            events.append(f"arrive {k}")
            user_step()
            events.append(f"left {k}")
        fut.result(5)
        assert events == [x for k in range(3) for x in (f"arrive {k}", f"took {k}", f"stepped {k}", f"left {k}")]
        np.testing.assert_allclose(flat.get_params(), before - 3 * 0.1, atol=1e-6)
        assert replica.steps_taken == 3 and replica.samples == 12
    finally:
        lp.close()


def test_a_skipped_step_leaves_the_parameters_untouched() -> None:
    lp, model, opt, flat, replica, user_step = _setup()

    async def strategy() -> None:
        await replica.compute_gradients()
        lp.gate.release()  # no apply: the local step is skipped

    try:
        before = flat.get_params()
        fut = lp.spawn(strategy())
        _backward(model)
        user_step()
        fut.result(5)
        assert flat.get_params().tobytes() == before.tobytes()
    finally:
        lp.close()


def test_the_gradient_is_the_iterations_even_if_a_job_ran_first() -> None:
    """A peer's gradient applied while the user computes (ASGD) must not replace this
    iteration's own gradient: it is copied on arrival."""
    lp, model, opt, flat, replica, user_step = _setup()
    got: list[np.ndarray] = []

    async def strategy() -> None:
        applying = asyncio.ensure_future(replica.apply_each([np.zeros(flat.numel, np.float32)]))
        _, g = await replica.compute_gradients()
        got.append(g)
        await applying
        lp.gate.release()

    try:
        _backward(model)
        own = flat.grads()
        fut = lp.spawn(strategy())
        while lp.gate._inbox.empty():  # the job is queued before the thread arrives
            pass
        user_step()
        fut.result(5)
        assert got[0].tobytes() == own.tobytes()
    finally:
        lp.close()


def test_an_abandoned_iteration_is_released_unstepped_when_it_arrives() -> None:
    lp, model, opt, flat, replica, user_step = _setup()
    abort = threading.Event()
    seen: list[str] = []

    async def strategy() -> None:
        abort.set()
        try:
            await replica.compute_gradients(abort)
        except Aborted:
            seen.append("aborted")
        assert lp.gate.abandon.is_set()  # a cooperative loop may cut the iteration short
        await replica.compute_gradients()  # the abandoned one is skipped: this is the next
        seen.append("took")
        lp.gate.release()

    try:
        before = flat.get_params()
        fut = lp.spawn(strategy())
        while not lp.gate.abandon.is_set():
            pass
        for _ in range(2):
            _backward(model)
            user_step()
        fut.result(5)
        assert seen == ["aborted", "took"] and lp.gate.skipped == 1
        assert flat.get_params().tobytes() == before.tobytes()
    finally:
        lp.close()


def test_the_end_of_the_loop_ends_a_waiting_strategy() -> None:
    lp, model, opt, flat, replica, user_step = _setup()

    async def strategy() -> str:
        try:
            await replica.compute_gradients()
        except TrainingEnded:
            return "ended"
        return "took"

    try:
        fut = lp.spawn(strategy())
        lp.gate.end()
        assert fut.result(5) == "ended"
    finally:
        lp.close()


def test_a_failed_session_wakes_the_parked_thread() -> None:
    lp, model, opt, flat, replica, user_step = _setup()
    try:
        lp.loop.call_soon_threadsafe(lambda: lp.loop.call_later(0.1, lp.gate.fail, RuntimeError("peer gone")))
        with pytest.raises(RuntimeError, match="peer gone"):
            _backward(model)
            user_step()
    finally:
        lp.close()


def test_the_end_of_the_driver_lets_a_pending_iteration_go() -> None:
    """Regression (review): ESync's last round ends with an abandoned iteration parked at the
    gate, not taken by anyone; the driver's end must release it (the built-in job hung)."""
    lp, model, opt, flat, replica, user_step = _setup()
    abort = threading.Event()

    async def strategy() -> None:
        abort.set()
        try:
            await replica.compute_gradients(abort)
        except Aborted:
            pass
        await replica.get_params()  # served by the abandoned iteration, which stays pending

    try:
        fut = lp.spawn(strategy())
        while not lp.gate.abandon.is_set():
            pass
        _backward(model)
        done = threading.Event()
        t = threading.Thread(target=lambda: (user_step(), done.set()), daemon=True)
        t.start()
        fut.result(5)
        assert not done.wait(0.3)  # still parked: nobody released it
        lp.loop.call_soon_threadsafe(lp.gate.finish)
        assert done.wait(5)
        user_step()  # after the end every arrival passes at once
    finally:
        lp.close()


def test_an_iteration_computed_on_replaced_parameters_is_skipped() -> None:
    """Review item: a joiner's first iteration is computed on its own initial weights; the
    state it fetches replaces them while that iteration waits, so its gradient is dropped."""
    lp, model, opt, flat, replica, user_step = _setup()

    def arrive() -> None:
        lp.gate.arrive(loss=1.0, samples=4, grads=flat.grads(), params_gen=replica.params_gen)

    async def strategy() -> None:
        await replica.set_params(np.zeros(flat.numel, np.float32))  # runs at the first arrival
        await replica.compute_gradients()  # that arrival is stale: this is the second one
        lp.gate.release()

    try:
        fut = lp.spawn(strategy())
        for _ in range(2):
            _backward(model)
            arrive()
        fut.result(5)
        assert lp.gate.skipped == 1
    finally:
        lp.close()


def test_an_abort_set_while_the_strategy_waits_wakes_it() -> None:
    """No polling: the abort event itself wakes a strategy waiting for an iteration."""
    lp, model, opt, flat, replica, user_step = _setup()
    abort = AbortEvent()
    waiting = threading.Event()

    async def strategy() -> str:
        lp.loop.call_soon(waiting.set)  # once the wait below has begun
        try:
            await replica.compute_gradients(abort)
        except Aborted:
            return "aborted"
        return "took"

    try:
        fut = lp.spawn(strategy())
        assert waiting.wait(5)
        assert lp.gate.wanted.is_set()
        abort.set()  # from this thread: the gate hears of it through the event
        assert fut.result(5) == "aborted" and lp.gate.abandon.is_set()
    finally:
        lp.close()


def test_a_plain_event_that_is_not_set_is_refused_as_an_abort() -> None:
    lp, model, opt, flat, replica, user_step = _setup()
    try:
        with pytest.raises(TrainingError, match="AbortEvent"):
            lp.spawn(replica.compute_gradients(threading.Event())).result(5)
    finally:
        lp.close()


def test_a_parked_thread_learns_that_the_loop_stopped() -> None:
    lp, model, opt, flat, replica, user_step = _setup()
    try:
        lp.loop.call_soon_threadsafe(lambda: lp.loop.call_later(0.1, lp.gate.loop_stopped))
        with pytest.raises(P2PSyncError, match="event loop stopped"):
            _backward(model)
            user_step()
        with pytest.raises(P2PSyncError, match="event loop stopped"):  # and every later arrival
            user_step()
    finally:
        lp.close()


def test_serving_until_a_condition_wakes_on_a_nudge_and_a_timeout_bounds_it() -> None:
    lp, model, opt, flat, replica, user_step = _setup()
    try:
        done = threading.Event()
        lp.loop.call_soon_threadsafe(lambda: lp.loop.call_later(0.05, lambda: (done.set(), lp.gate.nudge())))
        lp.gate.serve(until=done.is_set)
        assert done.is_set()
        t0 = time.monotonic()
        lp.gate.serve(until=lambda: False, timeout=0.2)  # nothing makes it hold: the bound ends it
        assert 0.15 <= time.monotonic() - t0 < 5
    finally:
        lp.close()


def test_the_arrival_gradient_is_freed_while_the_thread_is_parked() -> None:
    """Neither the replica's arrival nor the gate keeps the gradient copy while the training
    thread is parked: once the strategy drops it, it is freed before the jobs it runs next (an
    optimizer step that allocates) and before the thread leaves."""
    import gc
    import weakref

    lp, model, opt, flat, replica, user_step = _setup()

    async def strategy() -> bool:
        _, g = await replica.compute_gradients()
        ref = weakref.ref(g)
        del g
        gc.collect()
        await replica.step_as_is()  # a job on the parked thread
        freed = ref() is None
        lp.gate.release()
        return freed

    try:
        before = flat.get_params()
        fut = lp.spawn(strategy())
        _backward(model)
        grads = flat.grads()
        assert replica.arrive(loss=1.0, samples=4)
        assert fut.result(5)
        np.testing.assert_allclose(flat.get_params(), before - 0.1 * grads, atol=1e-6)  # .grad, as it stood
        assert replica.steps_taken == 1
    finally:
        lp.close()

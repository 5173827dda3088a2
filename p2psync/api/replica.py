"""The replica a strategy sees in the attach path: the user's model and optimizer behind the
:class:`~p2psync.api.gate.StepGate`.

It implements the core :class:`~p2psync.model.replica.Replica` protocol and every capability
of :mod:`p2psync.model.replica`, so every strategy is written once and runs unchanged in the
built-in job, in users' scripts and in the tests (which drive it with a training thread running
the built-in job's plain loop):

* ``compute_gradients`` waits for the user's next iteration to reach ``optimizer.step()`` and
  returns its loss and flat gradient, copied on arrival, before any job (such as ASGD applying
  a peer's gradient) can overwrite ``.grad`` (the thread stays parked: the strategy may still
  replace the gradients, step or skip);
* ``apply_gradients(vec)`` sets the gradients to ``vec`` and runs the optimizer's own ``step``
  (the one the user's code would have run), so LR schedulers, weight decay and momentum behave
  as the user configured them; ``apply_each`` does one such step per vector;
* parameter and state access (``get_params``, ``set_params``, ``export_state``,
  ``import_state``) run as jobs on the training thread.

An iteration whose step the strategy never runs is a *skipped* local step: its gradient is
dropped and the parameters stay as they were.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.autograd import Variable

from p2psync.params.optim import HyperValues, OptimSpec
from p2psync.strategies.backward_sync import BackwardAverager
from p2psync.model import Buffers, Layer, SgdHyper, SgdStep
from p2psync.model.flat import FlatModel
from p2psync.training.user_state import UserState, decode, encode
from p2psync.training.grad_copies import GradCallback, GradCopies
from p2psync.api.gate import StepGate
from p2psync.transport import all_finite


class HookedReplica:
    """Implements :class:`~p2psync.model.replica.Replica` and every capability on the user's
    model and optimizer through the :class:`~p2psync.api.gate.StepGate`: every model access is
    a job run on the training thread while it is parked in ``optimizer.step()``.

    Built by ``Session.attach`` (api/session.py: ``HookedReplica(flat=flat, gate=self.gate,
    step=own_step)``) and handed to the strategy as ``ctx.replica``. ``step``: the optimizer's
    own ``step`` as it was before attach.
    """

    def __init__(self, *, flat: FlatModel, gate: StepGate, step: Callable[[], Any],
                 user_state: UserState | None = None) -> None:
        self.flat = flat
        #: the optimizer's schedulers, scaler and hyperparameters (training/user_state.py)
        self.user_state = user_state if user_state is not None else UserState(flat.optimizer)
        self.gate = gate
        self._step = step  # the optimizer's own step, as it was before attach
        self.numel = flat.numel
        self.steps_taken = 0
        #: parameter replacements so far (training thread; arrivals carry the value they saw)
        self.params_gen = 0
        self._hooks: list[Any] = []
        self._copies: GradCopies | None = None
        #: backward passes are averaged (False inside ``p2psync.no_sync()``)
        self.sync_enabled = True

    # -- per-parameter gradient-ready hooks (strategies that pipeline layer groups) ---------

    async def enable_grad_ready(self, callback: GradCallback) -> None:
        """During every backward pass, as soon as a parameter's gradient is accumulated into
        its ``.grad`` (``register_post_accumulate_grad_hook``), ``callback(index, offset,
        grad)`` runs on the event loop: the parameter's index, its offset in the flat vector
        and a host copy of its ``.grad`` as it is then (from a CUDA device: copied
        asynchronously, see :mod:`p2psync.training.grad_copies`; every one reaches the loop
        before the iteration's ``optimizer.step()`` does, through :meth:`flush_grad_ready`).
        Layers finish in reverse order, so a strategy can start sending the last layers while
        the first ones still compute (Canary's colayers). With gradient accumulation it fires
        once per backward pass; the value at ``optimizer.step()`` is the last one. Registered
        on the training thread."""
        await self.gate.run(functools.partial(self.register_grad_ready, self.gate.loop, callback))

    def register_grad_ready(self, loop: asyncio.AbstractEventLoop, callback: GradCallback) -> None:
        """The hooks of :meth:`enable_grad_ready`, posting to ``loop`` (call on the training thread)."""
        copies = self._copies = GradCopies(loop, callback)
        off = 0
        for idx, p in enumerate(self.flat.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(copies.hook(idx, off)))  # type: ignore[no-untyped-call]
            off += p.numel()

    def flush_grad_ready(self) -> None:
        """Post the gradient copies still in flight (training thread, at ``optimizer.step()``,
        before the iteration arrives at the gate)."""
        if self._copies is not None:
            self._copies.flush()

    def arrive(self, *, loss: float, samples: int) -> bool:
        """The user's iteration reached ``optimizer.step()`` (training thread, after
        ``user_state.on_step()``): False, and nothing arrives, when its gradient holds NaN or
        infinity (this node's own divergence, caught before any strategy can send it: the
        caller reports it); else the gradient copies still in flight are posted
        (:meth:`flush_grad_ready`) and the iteration arrives at the gate with a copy of its
        gradient, parked until the strategy releases it (:meth:`StepGate.arrive
        <p2psync.api.gate.StepGate.arrive>`). The one arrival path of ``Session`` and of the
        tests' training loop."""
        held = [self.flat.grads()]
        if not all_finite(held[0]):
            return False
        self.flush_grad_ready()
        # handed over, no reference kept here while parked (see StepGate.arrive)
        self.gate.arrive(loss=loss, samples=samples, grads=held.pop(), params_gen=self.params_gen)
        return True

    # -- gradients averaged during backward (SSGD's sync=backward) --------------------------

    async def enable_backward_sync(self, averager: BackwardAverager) -> None:
        """From now on every backward pass hands its gradients to ``averager`` as they become
        ready and, at its end, waits for the group's mean and writes it into ``.grad`` (and
        the synchronized buffers into the model): see
        :mod:`p2psync.strategies.backward_sync`. While :attr:`sync_enabled` is false
        (``p2psync.no_sync()``) passes stay local. Registered on the training thread."""
        await self.gate.run(functools.partial(self._register_backward_sync, averager))

    def param_sizes(self) -> list[int]:
        """Elements of each trainable parameter, in the flat vector's order."""
        return [p.numel() for p in self.flat.params]

    def _register_backward_sync(self, averager: BackwardAverager) -> None:
        loop = self.gate.loop
        copies = self._copies = GradCopies(loop, averager.on_grad)
        state = _PassState()

        def hook(index: int, offset: int, param: torch.Tensor) -> None:
            if not self.sync_enabled:
                return
            if not state.open:
                state.open = True
                state.pass_id += 1
                state.fired = set()
                loop.call_soon_threadsafe(averager.pass_begin, state.pass_id, self.params_gen)
                Variable._execution_engine.queue_callback(end)
            state.fired.add(index)
            copies.ready(index, offset, param.grad)

        def end() -> None:
            state.open = False
            copies.flush()
            rest = [(i, _host_grad(p)) for i, p in enumerate(self.flat.params) if i not in state.fired]
            mode = averager.buffer_mode
            bufs = self.flat.read_buffers(floats=mode == "average") \
                if mode != "local" and self.flat.buffer_bytes else None
            fut = asyncio.run_coroutine_threadsafe(averager.pass_end(state.pass_id, rest, bufs), loop)
            fut.add_done_callback(lambda _: self.gate.nudge())
            # model jobs (an adopted state) run meanwhile; a failed session ends the wait
            self.gate.serve(until=lambda: fut.done() or self.gate.failure is not None)
            failure = self.gate.failure
            if not fut.done() and failure is not None:
                fut.cancel()
                raise failure
            res = fut.result()
            if res is not None:
                self.flat.set_grads_parts(res.grads)
                if res.buffers is not None:
                    self.flat.write_buffers(res.buffers)

        off = 0
        for idx, p in enumerate(self.flat.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                functools.partial(hook, idx, off)))
            off += p.numel()

    def remove_hooks(self) -> None:
        """Remove the gradient-ready hooks :meth:`enable_grad_ready` installed."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._copies is not None:
            self._copies.close()

    @property
    def samples(self) -> int:
        """See :attr:`Replica.samples <p2psync.model.replica.Replica.samples>` (the gate's count)."""
        return self.gate.samples

    @property
    def compute_s(self) -> float:
        """Seconds the user's code computed in the iterations the strategy took (the gate's count)."""
        return self.gate.compute_s

    async def compute_gradients(self, abort: threading.Event | None = None) -> tuple[float, np.ndarray]:
        """See :meth:`Replica.compute_gradients <p2psync.model.replica.Replica.compute_gradients>`:
        takes the next iteration parked at the gate, skipping those computed on parameters
        replaced since."""
        while True:
            a = await self.gate.next_iteration(abort)
            if a.params_gen == self.params_gen:
                break
            # computed on parameters replaced since (a joiner's fetched state, an adopted
            # state): its gradient belongs to no current model, the step is skipped
            self.gate.skipped += 1
        return a.loss, a.grads

    async def step_as_is(self) -> None:
        """``optimizer.step()`` with ``.grad`` as it stands (a missing gradient as zeros):
        :meth:`apply_gradients` of the gradient the iteration arrived with, when nothing
        changed ``.grad`` since, without that vector."""
        def go() -> None:
            for p in self.flat.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._step()
            self.steps_taken += 1
        await self.gate.run(go)

    def _apply(self, vec: np.ndarray) -> None:
        self.flat.set_grads(vec)
        self._step()
        self.steps_taken += 1

    async def apply_gradients(self, vec: np.ndarray) -> None:
        """See :meth:`Replica.apply_gradients <p2psync.model.replica.Replica.apply_gradients>`."""
        await self.gate.run(lambda: self._apply(vec))

    async def sgd_step(self, vec: np.ndarray) -> SgdStep:
        """Like :meth:`apply_gradients`, reporting what plain SGD fed to its buffer (DTS)."""
        def go() -> SgdStep:
            out = self.flat.sgd_step(vec, self._step)
            self.steps_taken += 1
            return out
        return await self.gate.run(go)

    async def sgd_hyper(self) -> SgdHyper:
        """The optimizer's plain-SGD numbers (ConfigError for any other optimizer)."""
        return await self.gate.run(self.flat.sgd_hyper)

    async def optim_spec(self) -> OptimSpec:
        """See :meth:`Replica.optim_spec <p2psync.model.replica.OptimizerShards.optim_spec>`."""
        return await self.gate.run(self.flat.optim_spec)

    async def optim_hypers(self, spec: OptimSpec) -> dict[int, HyperValues]:
        """See :meth:`Replica.optim_hypers <p2psync.model.replica.OptimizerShards.optim_hypers>`."""
        return await self.gate.run(lambda: self.flat.optim_hypers(spec))

    async def correct(self, dw: np.ndarray, du: np.ndarray | None) -> None:
        """Add ``dw`` to the parameters and ``du`` to SGD's momentum buffers (a compensation:
        the iteration in flight was computed on nearly these parameters and stays valid)."""
        await self.gate.run(lambda: self.flat.correct(dw, du))

    async def apply_each(self, vecs: Sequence[np.ndarray], scale: float = 1.0) -> None:
        """See :meth:`Replica.apply_each <p2psync.model.replica.StepEach.apply_each>`."""
        def go() -> None:
            for v in vecs:
                self._apply(v if scale == 1.0 else v * scale)
        await self.gate.run(go)

    async def get_params(self) -> np.ndarray:
        """See :meth:`Replica.get_params <p2psync.model.replica.Replica.get_params>`."""
        return await self.gate.run(self.flat.get_params)

    def _replaced(self) -> None:
        self.params_gen += 1

    async def set_params(self, vec: np.ndarray) -> None:
        """See :meth:`Replica.set_params <p2psync.model.replica.Replica.set_params>`; iterations
        computed before it are then skipped."""
        def go() -> None:
            self.flat.set_params(vec)
            self._replaced()
        await self.gate.run(go)

    async def get_params_range(self, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
        """See :meth:`Replica.get_params_range <p2psync.model.replica.ParamRanges.get_params_range>`."""
        return await self.gate.run(lambda: self.flat.get_params_range(ranges))

    async def set_params_range(self, ranges: Sequence[tuple[int, int]], vec: np.ndarray) -> None:
        """See :meth:`Replica.set_params_range <p2psync.model.replica.ParamRanges.set_params_range>`;
        iterations computed before it are then skipped."""
        def go() -> None:
            self.flat.set_params_range(ranges, vec)
            self._replaced()
        await self.gate.run(go)

    async def export_meta(self) -> bytes:
        """See :meth:`Replica.export_meta <p2psync.model.replica.Replica.export_meta>`."""
        return await self.gate.run(lambda: encode(self.user_state.capture()))

    async def import_meta(self, raw: bytes) -> None:
        """See :meth:`Replica.import_meta <p2psync.model.replica.Replica.import_meta>`: the
        iteration parked now is skipped, so the scheduler step its loop makes next is absorbed."""
        state = decode(raw)
        await self.gate.run(lambda: self.user_state.restore(state, absorb=True))

    async def export_state(self) -> np.ndarray:
        """See :meth:`Replica.export_state <p2psync.model.replica.Replica.export_state>`."""
        return await self.gate.run(self.flat.export_state)

    async def import_state(self, vec: np.ndarray) -> None:
        """See :meth:`Replica.import_state <p2psync.model.replica.Replica.import_state>`; iterations
        computed before it are then skipped."""
        def go() -> None:
            self.flat.import_state(vec)
            self._replaced()
        await self.gate.run(go)

    @property
    def buffer_bytes(self) -> int:
        """See :attr:`Replica.buffer_bytes <p2psync.model.replica.ModelBuffers.buffer_bytes>`."""
        return self.flat.buffer_bytes

    async def get_buffers(self, floats: bool = False) -> Buffers:
        """See :meth:`Replica.get_buffers <p2psync.model.replica.ModelBuffers.get_buffers>`."""
        return await self.gate.run(lambda: self.flat.read_buffers(floats))

    async def set_buffers(self, buffers: Buffers) -> None:
        """See :meth:`Replica.set_buffers <p2psync.model.replica.ModelBuffers.set_buffers>`."""
        await self.gate.run(lambda: self.flat.write_buffers(buffers))

    async def digests(self, buffers: bool = True) -> list[tuple[str, bytes]]:
        """(name, 8-byte digest) of every parameter and (``buffers``) buffer: what the replica
        audit compares (strategies/audit.py)."""
        return await self.gate.run(lambda: self.flat.digests(buffers))

    def state_size(self) -> int:
        """See :meth:`Replica.state_size <p2psync.model.replica.Replica.state_size>`."""
        return self.flat.state_size()

    def layers(self) -> list[Layer]:
        """See :meth:`Replica.layers <p2psync.model.replica.Layered.layers>`."""
        return self.flat.layers()


class _PassState:
    """The backward pass in progress (training / autograd thread)."""

    def __init__(self) -> None:
        self.open = False
        self.pass_id = 0
        self.fired: set[int] = set()


def _host_grad(p: torch.Tensor) -> np.ndarray:
    """``p.grad`` (zeros when missing) as a host float32 vector."""
    g = p.grad if p.grad is not None else torch.zeros_like(p)
    return g.detach().reshape(-1).to("cpu", torch.float32).numpy().copy()


__all__ = ["HookedReplica"]

"""Gradients handed from backward to the event loop (p2psync.training.grad_copies): every one
arrives, in hook order, with the value the hook saw, before the step's flush returns; on CUDA
through asynchronous copies (skipped without CUDA)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from p2psync.training.grad_copies import GradCopies
from tests.helpers import until

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
async def test_every_gradient_reaches_the_loop_in_hook_order(device: str, dtype: torch.dtype) -> None:
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("half-precision training is a GPU case")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).to(device, dtype)
    params = list(model.parameters())
    got: list[tuple[int, int, np.ndarray]] = []
    order: list[int] = []
    seen: dict[int, torch.Tensor] = {}
    copies = GradCopies(asyncio.get_running_loop(), lambda i, off, g: got.append((i, off, g)))
    offs = np.concatenate([[0], np.cumsum([p.numel() for p in params])]).tolist()

    def hook(i: int, p: torch.Tensor) -> None:
        order.append(i)
        seen[i] = p.grad.detach().clone()
        copies.ready(i, offs[i], p.grad)

    handles = [p.register_post_accumulate_grad_hook(lambda p, i=i: hook(i, p)) for i, p in enumerate(params)]
    try:
        for _ in range(3):  # the pinned buffers of one pass are never those of the next
            got.clear(), order.clear()
            model.zero_grad()
            model(torch.randn(32, 64, device=device, dtype=dtype)).square().mean().backward()
            # every copy is posted (call_soon_threadsafe) before flush returns, so its callback
            # runs before this task resumes
            await asyncio.to_thread(copies.flush)
            assert copies.inflight == 0
            assert [i for i, _, _ in got] == order and sorted(order) == list(range(len(params)))
            for i, off, g in got:
                assert off == offs[i] and g.dtype == np.float32 and g.shape == (params[i].numel(),)
                np.testing.assert_array_equal(g, seen[i].float().cpu().numpy().reshape(-1))
    finally:
        for h in handles:
            h.remove()
        copies.close()


async def test_a_closed_loop_gets_nothing() -> None:
    loop = asyncio.new_event_loop()
    loop.close()
    copies = GradCopies(loop, lambda *a: pytest.fail("posted to a closed loop"))
    copies.ready(0, 0, torch.ones(3))
    copies.ready(0, 0, None)
    copies.flush()
    copies.close()
    assert copies.inflight == 0


class _Copy:
    """A started device copy whose ``synchronize()`` returns once the test lets it land."""

    def __init__(self) -> None:
        self.waited = threading.Event()  # the delivery thread waits for this copy now
        self.landed = threading.Event()

    def synchronize(self) -> None:
        self.waited.set()
        assert self.landed.wait(10)


async def test_the_delivery_thread_posts_in_hook_order_as_copies_land() -> None:
    """The CUDA path's bookkeeping with stand-in events (runs without a GPU): a copy is posted
    as soon as it and every earlier one have landed, during backward (no flush needed); flush
    waits for the rest; close forgets what is still in flight and ends the thread."""
    got: list[int] = []
    copies = GradCopies(asyncio.get_running_loop(), lambda i, off, g: got.append(i))
    started = [_Copy() for _ in range(3)]
    for i, c in enumerate(started):
        copies._track(i, 10 * i, c, torch.full((2,), float(i)))
    started[1].landed.set()  # a later copy lands first: nothing may overtake copy 0
    assert await asyncio.to_thread(started[0].waited.wait, 10)  # the thread is held at copy 0
    assert got == [] and copies.inflight == 3
    started[0].landed.set()
    await until(lambda: got == [0, 1], 10, "the two landed copies posted without a flush")
    assert copies.inflight == 1
    flushing = asyncio.create_task(asyncio.to_thread(copies.flush))  # returns once the last is posted
    started[2].landed.set()
    await flushing
    # posted (call_soon_threadsafe) before flush returned, so run before this task resumed
    assert copies.inflight == 0 and got == [0, 1, 2]
    late = _Copy()
    copies._track(3, 30, late, torch.zeros(1))
    thread = copies._thread
    assert await asyncio.to_thread(late.waited.wait, 10)
    closing = asyncio.create_task(asyncio.to_thread(copies.close))
    await until(lambda: copies._thread is None, 10, "close() to forget the copies in flight")
    late.landed.set()  # lands after close(): not posted
    await closing  # joined the thread: whatever it posted is queued ahead of this task
    assert thread is not None and not thread.is_alive() and copies.inflight == 0
    assert got == [0, 1, 2]

"""What P-Reduce and ASGD keep alive while they run, over the in-memory transport: weak
references to the vectors a step handles, and the peak of the allocations tracemalloc sees
(numpy's arrays and Python's objects; torch's own allocations are not traced), never the
process's resident memory."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import tracemalloc
import weakref
from typing import Any, Iterator

import numpy as np
import pytest

from p2psync.strategies import regroup
from p2psync.topology import mesh, ring
from tests.helpers import memory_collectives, memory_strategies, until

pytestmark = pytest.mark.timeout(120)


class Peak:
    """Bytes allocated at most at once inside a :func:`traced_peak` block, beyond its start."""

    bytes = 0


@contextlib.contextmanager
def traced_peak() -> Iterator[Peak]:
    out = Peak()
    tracemalloc.start()
    try:
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        yield out
        out.bytes = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("topo", [mesh(2), ring(3), mesh(4)], ids=["mesh2", "ring3", "mesh4"])
async def test_exact_mean_averages_chunk_by_chunk_in_place_in_float64(topo: Any) -> None:
    """``exact_mean``: every member gets the float64 mean of the members' float32 vectors cast
    back (identical vectors stay bitwise the same), written into the vector handed over,
    whatever the chunk (one that does not divide the length, one larger than it)."""
    rng = np.random.default_rng(3)
    xs = {i: rng.standard_normal(1000).astype(np.float32) for i in topo.ids}
    want = np.mean(np.stack(list(xs.values())).astype(np.float64), axis=0).astype(np.float32)
    for chunk in (128, 5000):
        async with memory_collectives(topo) as cs:
            mine = {i: x.copy() for i, x in xs.items()}
            outs = await asyncio.gather(*(regroup.exact_mean(cs[i], mine[i], topo.ids, tag="m", chunk=chunk)
                                          for i in topo.ids))
            same = await asyncio.gather(*(regroup.exact_mean(cs[i], xs[0].copy(), topo.ids, tag="s", chunk=chunk)
                                          for i in topo.ids))
        for i, out in zip(topo.ids, outs):
            assert out is mine[i] and out.tobytes() == want.tobytes()
        assert all(s.tobytes() == xs[0].tobytes() for s in same)


async def test_the_final_average_holds_one_state_vector_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """P-Reduce's final average (every member's whole state, exact): besides the exported state
    vector, a node holds one chunk of it in float64 at a time, not a float64 copy of the
    whole state and a working buffer of that size (five state vectors per node in all)."""
    monkeypatch.setattr(regroup, "EXACT_MEAN_CHUNK", 1 << 16, raising=False)
    topo = mesh(3)
    async with memory_strategies(topo, "preduce", {"P": 2}, model="lm-tiny") as pr:  # 2.1 M state entries
        state_bytes = pr[0].ctx.replica.state_size() * 4
        await asyncio.gather(*(s.ctx.replica.set_params(np.full(s.ctx.replica.numel, float(i), np.float32))
                               for i, s in enumerate(pr)))
        with traced_peak() as peak:
            await asyncio.gather(*(s._final_average() for s in pr))
        params = [await s.ctx.replica.get_params() for s in pr]
    assert all(np.array_equal(x, np.full_like(x, 1.0)) for x in params)  # the mean of 0, 1, 2
    assert peak.bytes < 1.5 * state_bytes * topo.size, (peak.bytes, state_bytes)


async def test_a_preduce_step_holds_no_gradient_copy_during_its_reduce() -> None:
    """The iteration's gradient (the copy it arrived with) is stepped with as ``.grad`` holds it
    and freed before the group's reduce: a P-Reduce step does not keep it alive meanwhile."""
    async with memory_strategies(mesh(2), "preduce", {"P": 2}) as pr:
        s0 = pr[0]
        rep, grads, alive = s0.ctx.replica, [], []
        compute, reduce = rep.compute_gradients, s0._group_allreduce

        async def compute_gradients(abort: Any = None) -> tuple[float, np.ndarray]:
            loss, g = await compute(abort)
            grads.append(weakref.ref(g))
            return loss, g

        async def group_allreduce(*args: Any) -> Any:
            gc.collect()
            alive.append(grads[-1]() is not None)
            return await reduce(*args)

        rep.compute_gradients, s0._group_allreduce = compute_gradients, group_allreduce
        reps = await asyncio.gather(*(s.run_step(0, False) for s in pr))
    assert all(r.extra["applied"] for r in reps)
    assert alive == [False]


async def test_a_preduce_round_averages_the_parameters_it_read_in_place() -> None:
    """A round's weighted allreduce reduces the parameter vector it read itself (handed over):
    what it writes back is that memory, not a working copy of the model (over the in-memory
    transport no send holds the buffer once its tasks have run). References to the vector that
    the loop drops meanwhile (the finished future that delivered it from a thread, under load)
    must not make the operation copy it (``collectives.buffers.own``)."""
    async with memory_strategies(mesh(2), "preduce", {"P": 2}) as pr:
        read: dict[int, np.ndarray] = {}
        written: dict[int, np.ndarray] = {}
        for s in pr:
            rep, me = s.ctx.replica, s.ctx.node_id
            get, put = rep.get_params, rep.set_params

            async def get_params(get: Any = get, me: int = me) -> np.ndarray:
                read[me] = x = await get()
                return x

            async def set_params(vec: np.ndarray, put: Any = put, me: int = me) -> None:
                written[me] = vec
                await put(vec)

            rep.get_params, rep.set_params = get_params, set_params
        reps = await asyncio.gather(*(s.run_step(0, False) for s in pr))
    assert all(r.extra["applied"] for r in reps) and sorted(written) == [0, 1]
    assert all(np.shares_memory(written[i], read[i]) for i in written)


async def test_asgd_holds_no_applied_gradient_while_it_waits_for_the_next() -> None:
    """Once the gradients that arrived are applied (and forwarded), the receiver keeps none of
    them while it waits for the next one."""
    async with memory_strategies(mesh(2), "asgd", {}) as st:
        s1 = st[1]
        refs: list[weakref.ref[np.ndarray]] = []
        take = s1._take

        def spy(msg: Any) -> tuple[int, int, np.ndarray] | None:
            got = take(msg)
            if got is not None:
                refs.append(weakref.ref(got[2]))
            return got

        s1._take = spy
        await asyncio.gather(*(s.run_step(0, False) for s in st))
        await until(lambda: s1.applied_remote == 1, 10, "node 0's gradient applied on node 1")
        assert len(refs) == 1
        # the training thread drops the job (and the list it stepped through) once it has handed
        # the result over, not when the next item reaches its inbox (which may be never)
        await until(lambda: gc.collect() >= 0 and refs[0]() is None, 5, "the applied gradient released")


async def test_asgd_scales_the_arrived_gradients_one_at_a_time() -> None:
    """Gradients that arrived while this node's loop was busy are applied in one job, each
    scaled (1/N) as it is applied: not a scaled copy of every one of them at once."""
    async with memory_strategies(mesh(2), "asgd", {}, model="lm-tiny") as st:
        s0, s1 = st
        queued = 12
        for k in range(queued):  # node 1 takes no step yet: node 0's gradients wait for it
            await s0.run_step(k, False)
        await until(lambda: s1.ctx.transport.mailbox.pending >= queued - 1, 10, "node 0's gradients queued")
        grad_bytes = s1.ctx.replica.numel * 4
        with traced_peak() as peak:
            await s1.run_step(0, False)
            await until(lambda: s1.applied_remote == queued, 10, "node 0's gradients applied on node 1")
    assert peak.bytes < 6 * grad_bytes, (peak.bytes, grad_bytes)

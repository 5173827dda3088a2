"""Collectives on the in-memory transport: tags, signatures, dtypes, error-feedback keys, group
errors (issue 9 items 4 and 5)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import memory_collectives as memory
from p2psync.collectives import Collectives
from p2psync.collectives.buffers import COPY_RATE, refs, sends_done
from p2psync.errors import ConfigError, GroupCutOff, PeerFailure, ProtocolError
from p2psync.topology import Route, mesh, ring, star
from p2psync.transport.memory import MemoryHub, MemoryTransport
from p2psync.wire.schema import DTYPES
from p2psync.wire import placed

pytestmark = pytest.mark.timeout(60)




async def test_a_tag_is_required():
    async with memory(mesh(2)) as cs:
        with pytest.raises(TypeError):
            await cs[0].allreduce(np.ones(3, np.float32))  # type: ignore[call-arg]
        with pytest.raises(ConfigError, match="tag"):
            await cs[0].allreduce(np.ones(3, np.float32), tag="x" * 97)
        with pytest.raises(ConfigError, match="tag"):
            await cs[0].allreduce(np.ones(3, np.float32), tag="bad tag")


async def test_operations_issued_in_different_orders_are_not_swapped():
    """Nodes 0 and 1 start A before B, nodes 2 and 3 start B before A: every node must still
    get sum(A) = +10 and sum(B) = -10 (with call-order tags they got -2 and +2)."""
    async with memory(ring(4)) as cs:
        async def node(i: int) -> tuple[np.ndarray, np.ndarray]:
            a = cs[i].allreduce(np.full(64, 2.5, np.float32), tag="op.a")
            b = cs[i].allreduce(np.full(64, -2.5, np.float32), tag="op.b")
            first, second = (a, b) if i < 2 else (b, a)
            t1 = asyncio.ensure_future(first)
            t2 = asyncio.ensure_future(second)
            r1, r2 = await asyncio.gather(t1, t2)
            return (r1, r2) if i < 2 else (r2, r1)

        outs = await asyncio.gather(*(node(i) for i in range(4)))
    for ra, rb in outs:
        np.testing.assert_array_equal(ra, np.full(64, 10.0, np.float32))
        np.testing.assert_array_equal(rb, np.full(64, -10.0, np.float32))


async def test_a_different_operation_under_the_same_tag_is_rejected():
    async with memory(ring(4), timeout=1.0) as cs:
        x = np.ones(1000, np.float32)
        res = await asyncio.gather(*(cs[i].allreduce(x, tag="same", op="mean" if i == 3 else "sum")
                                     for i in range(4)), return_exceptions=True)
    assert all(isinstance(r, (ProtocolError, PeerFailure)) for r in res), res
    assert any(isinstance(r, ProtocolError) and r.reason == "collective_mismatch" for r in res), res


@pytest.mark.parametrize("n,make", [(64, ring), (256, star)])
async def test_large_groups_keep_tags_short(n, make):
    topo = make(n)
    async with memory(topo) as cs:
        outs = await asyncio.gather(*(cs[i].allreduce(np.full(8, float(i), np.float32), tag="big.0")
                                      for i in topo.ids))
    expect = float(sum(topo.ids))
    assert all((o == expect).all() for o in outs)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
async def test_result_dtype_of_every_op(dtype):
    async with memory(mesh(3)) as cs:
        xs = {i: np.array([0, 1, 1, 0, 1], dtype=dtype) for i in range(3)}
        outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag="s") for i in range(3)))
        for o in outs:
            assert o.dtype == np.dtype(dtype)
            expect = np.array([0, 1, 1, 0, 1], bool) if dtype == "bool" else np.array([0, 3, 3, 0, 3], dtype)
            np.testing.assert_array_equal(o, expect)  # bool: logical or
        w = {0: 0.5, 1: 0.25, 2: 0.25}
        if np.dtype(dtype).kind == "f":
            means = await asyncio.gather(*(cs[i].allreduce(xs[i], tag="m", op="mean") for i in range(3)))
            wsum = await asyncio.gather(*(cs[i].allreduce(xs[i], tag="w", op="weighted", weights=w)
                                          for i in range(3)))
            for m, ws in zip(means, wsum):
                assert m.dtype == ws.dtype == np.dtype(dtype)
                np.testing.assert_array_equal(m, np.array([0, 1, 1, 0, 1], dtype))
                np.testing.assert_array_equal(ws, np.array([0, 1, 1, 0, 1], dtype))
        else:
            for op, kw in (("mean", {}), ("weighted", {"weights": w})):
                with pytest.raises(ConfigError, match="floating-point"):
                    await cs[0].allreduce(xs[0], tag="bad", op=op, **kw)


async def test_float16_accumulates_in_float32():
    async with memory(ring(4)) as cs:
        big = np.full(16, 30000, np.float16)
        means = await asyncio.gather(*(cs[i].allreduce(big, tag="m", op="mean") for i in range(4)))
        vals = [30000, 30000, 30000, -60000]  # partial sums reach 90000 > float16 max
        sums = await asyncio.gather(*(cs[i].allreduce(np.full(16, vals[i], np.float16), tag="s")
                                      for i in range(4)))
        ts = await asyncio.gather(*(cs[i].allreduce(torch.full((4,), 30000.0, dtype=dt), tag=f"t{j}",
                                                    op="mean")
                                    for j, dt in enumerate((torch.float16, torch.bfloat16)) for i in range(4)))
    for m, s in zip(means, sums):
        assert m.dtype == s.dtype == np.float16
        assert (m == 30000).all() and (s == 30000).all()
    assert all(t.dtype in (torch.float16, torch.bfloat16) and torch.isfinite(t).all() for t in ts)


async def test_error_feedback_residuals_belong_to_their_tensor():
    """Two tensors of the same shape and very different scales alternate through int8 with
    error feedback: each tensor's decoded sum over the steps tracks its own inputs' sum."""
    steps = 12
    async with memory(mesh(2), codec="int8", error_feedback=True) as cs:
        rng = np.random.default_rng(0)
        totals = {"small": np.zeros(4096), "large": np.zeros(4096)}
        inputs = {"small": np.zeros(4096), "large": np.zeros(4096)}
        for k in range(steps):
            for name, scale in (("small", 1e-3), ("large", 1.0)):
                xs = [(rng.standard_t(2, 4096) * scale).astype(np.float32) for _ in range(2)]
                outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag=f"{name}.{k}", feedback=name)
                                              for i in range(2)))
                totals[name] += outs[0]
                inputs[name] += xs[0] + xs[1]
    for name in totals:
        rel = np.linalg.norm(totals[name] - inputs[name]) / np.linalg.norm(inputs[name])
        assert rel < 0.05, (name, rel)


async def test_a_group_the_live_nodes_do_not_join_fails_at_once():
    """Members 0 and 2 of ring-4 share no link: their pieces go through node 1 or 3. With both
    dead the group is cut apart, and the allreduce says so at once (GroupCutOff, a
    PeerFailure), instead of waiting for pieces that cannot come."""
    async with memory(ring(4)) as cs:
        cs[0].transport.mark_dead(1)
        cs[0].transport.mark_dead(3)
        with pytest.raises(GroupCutOff, match=r"members \[0\] and \[2\] cannot reach each other"):
            await cs[0].allreduce(np.ones(4, np.float32), [0, 2], tag="g")


async def _drift(tag, feedback: Any, codec: str = "int8", steps: int = 30) -> tuple[float, int]:
    """Relative distance between the running sum of the decoded results and the running sum of
    the inputs over ``steps`` lossy allreduces tagged ``tag(k)``, and how many residuals node
    0 keeps at the end."""
    async with memory(mesh(2), codec=codec, error_feedback=True) as cs:
        rng = np.random.default_rng(1)
        total, inputs = np.zeros(4096), np.zeros(4096)
        for k in range(steps):
            xs = [rng.standard_t(2, 4096).astype(np.float32) for _ in range(2)]
            outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag=tag(k), feedback=feedback) for i in range(2)))
            total += outs[0]
            inputs += xs[0] + xs[1]
        kept = len((cs[0].sparse_feedback if codec.startswith("topk") else cs[0].feedback).residual)
    return float(np.linalg.norm(total - inputs) / np.linalg.norm(inputs)), kept


@pytest.mark.parametrize("codec", ["int8", "topk:0.1"])
async def test_error_feedback_follows_the_callers_key_whatever_the_tags(codec):
    """Round tags (``avg.r5``) keep error feedback: the residuals follow the caller's key, not
    a pattern over the tags, and one set of residuals is kept per key (not one per round)."""
    keyed, kept = await _drift(lambda k: f"avg.r{k}", ("avg", "grad"), codec)
    unkeyed, none_kept = await _drift(lambda k: f"avg.r{k}", None, codec)
    assert none_kept == 0  # no key: nothing applied, nothing kept
    assert kept == (2 if codec == "int8" else 1)  # one residual per piece (own + rs) or per tensor
    assert keyed < 0.5 * unkeyed, (keyed, unkeyed)  # without feedback the error accumulates


class _HoldingTransport(MemoryTransport):
    """Keeps every frame it sends, as ZeroMQ keeps a zero-copy frame until it has written it."""

    held: list[Any]

    def _transmit(self, peer: int, route: Route, frames: list[Any], *, bulk: bool = False,
                  unordered: bool = False) -> None:
        super()._transmit(peer, route, frames, bulk=bulk, unordered=unordered)
        self.held.extend(placed(frames))  # a Fill as ZeroMQ would hold it: its own array's bytes


@pytest.mark.parametrize("op", ["sum", "mean"])
async def test_a_result_never_shares_memory_with_a_send_in_flight(op):
    """The working buffer becomes the result only when no send still reads from it (issue 17:
    the result used to be a copy of the whole tensor, always): with frames still held, every
    result is a separate array; modifying it leaves what the sends carry unchanged."""
    topo = ring(4)
    hub = MemoryHub(topo)
    eps = {i: _HoldingTransport(hub=hub, node_id=i) for i in topo.ids}
    for e in eps.values():
        e.held = []
        await e.start()
    try:
        cs = {i: Collectives(e, piece_bytes=64) for i, e in eps.items()}
        xs = [np.arange(100, dtype=np.float32) * (i + 1) for i in range(4)]
        outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag="held", op=op) for i in range(4)))
        want = sum(xs) / (4 if op == "mean" else 1)
        for i, out in enumerate(outs):
            np.testing.assert_allclose(out, want, rtol=1e-6)
            held = [np.frombuffer(f, np.uint8) for f in eps[i].held if isinstance(f, memoryview)]
            assert held, "the ring sends pieces zero-copy"
            assert not any(np.shares_memory(out, h) for h in held)
            before = [h.copy() for h in held]
            out[...] = -1.0
            assert all(np.array_equal(h, b) for h, b in zip(held, before))
    finally:
        for e in eps.values():
            await e.close()


@pytest.mark.parametrize("op", ["sum", "mean"])
async def test_a_result_is_independent_of_the_input_and_of_later_operations(op):
    """Without sends in flight the working buffer itself is returned: it is still never the
    caller's input, and the next operation works on a buffer of its own."""
    async with memory(ring(4), piece_bytes=64) as cs:
        xs = [np.full(100, float(i + 1), np.float32) for i in range(4)]
        first = await asyncio.gather(*(cs[i].allreduce(xs[i], tag="a", op=op) for i in range(4)))
        second = await asyncio.gather(*(cs[i].allreduce(xs[i], tag="b", op=op) for i in range(4)))
    want = 10.0 / (4 if op == "mean" else 1)
    for i in range(4):
        assert not np.shares_memory(first[i], xs[i]) and not np.shares_memory(first[i], second[i])
        np.testing.assert_array_equal(xs[i], np.full(100, float(i + 1), np.float32))
        first[i][...] = 0.0
        np.testing.assert_array_equal(second[i], np.full(100, want, np.float32))


def test_refs_counts_views_of_the_working_buffer():
    buf = np.zeros(8, np.float32)
    alone = refs(buf)
    view = memoryview(buf[2:4])
    assert refs(buf) == alone + 1
    del view
    assert refs(buf) == alone


def test_refs_counts_views_of_a_view():
    """numpy files a view of a view under the owning array: still counted."""
    buf = np.zeros((2, 4), np.float32).reshape(-1)
    alone = refs(buf)
    view = buf[2:4].reshape(-1).data.cast("B")
    assert refs(buf) == alone + 1
    del view
    assert refs(buf) == alone


async def test_sends_done_waits_at_most_as_long_as_a_copy():
    """A result waits for its last sends while that is cheaper than copying the buffer."""
    loop = asyncio.get_running_loop()
    flips = loop.time() + 0.01
    assert await sends_done(lambda: loop.time() >= flips, int(1.0 * COPY_RATE))  # 1 s budget
    t0 = loop.time()
    assert not await sends_done(lambda: False, int(0.02 * COPY_RATE))  # gives up after 20 ms
    assert 0.018 <= loop.time() - t0 < 1.0  # up to the last whole poll within the budget
    looks = []
    assert not await sends_done(lambda: looks.append(1) or False, int(0.0039 * COPY_RATE))
    assert looks == [1]  # a buffer that copies in under 4 ms is copied at once


async def test_schedules_are_kept_per_plan_phases_and_check():
    """One plan, three operations with different schedules (review of stop 34): a lossless
    allreduce (partial sums sent straight on), a lossy one (never), then a reduce-scatter
    (no allgather: half the bytes). Each gets its own, and its results."""
    topo = ring(4)
    xs = {i: np.arange(64, dtype=np.float32) * (i + 1) for i in topo.ids}
    want = sum(xs.values())
    async with memory(topo, timeout=5) as cs:
        for r, codec in enumerate(["none", "fp16", "none"]):
            outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag=f"t{r}", codec=codec) for i in topo.ids))
            for o in outs:
                np.testing.assert_allclose(o, want, rtol=1e-2 if codec == "fp16" else 0)
        full = cs[0].history[-1].wire_bytes
        parts = await asyncio.gather(*(cs[i].reduce_scatter(xs[i], tag="rs") for i in topo.ids))
        assert cs[0].history[-1].wire_bytes * 2 == full
        got = np.zeros(64, np.float32)
        for p in parts:
            for (lo, hi), v in p.items():
                got[lo:hi] = v
        np.testing.assert_array_equal(got, want)
        assert all(len(c._schedules) == 3 for c in cs.values())


async def test_nodes_over_one_topology_share_each_plan():
    """Every node's collectives over the same topology object read one copy of each plan (a
    process that simulates N nodes keeps one ring plan, not N); another topology object, even
    an equal one, gets its own plans. Results are unchanged."""
    topo = ring(6)
    xs = {i: np.arange(96, dtype=np.float32) * (i + 1) for i in topo.ids}
    async with memory(topo, timeout=5) as cs:
        outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag="t") for i in topo.ids))
        rows = await asyncio.gather(*(cs[i].allgather(xs[i][:5], tag="g") for i in topo.ids))
        got = await asyncio.gather(*(cs[i].broadcast(xs[i].copy(), 2, tag="b") for i in topo.ids))
        for o in outs:
            np.testing.assert_array_equal(o, sum(xs.values()))
        for r in rows:
            assert [list(x) for x in r] == [list(xs[i][:5]) for i in topo.ids]
        for b in got:
            np.testing.assert_array_equal(b, xs[2])
        assert len(cs[0]._plans) == 3  # the allreduce's ring, the small allgather's (one piece), the tree
        for c in cs.values():
            assert c._plans is cs[0]._plans
    other = ring(6)
    async with memory(other, timeout=5) as cs2:
        assert cs2[0]._plans is not cs[0]._plans and not cs2[0]._plans


def test_schedule_walks_the_rounds_a_node_is_in():
    """``Plan.by_node``: on a ring a node sends once and receives once in every round, listed
    in round order; each piece's steps built from them keep that order (``rs`` before ``ag``)."""
    from p2psync.collectives.plan import make_plan
    from p2psync.collectives.schedule import schedule

    topo = ring(5)
    plan = make_plan(topo, topo.ids, 10, "ring")
    ts, rounds = plan.by_node[2]
    assert list(rounds) == sorted(rounds) and all(2 in (t.src, t.dst) for t in ts)
    assert len(ts) == 2 * (len(plan.rs) + len(plan.ag))  # one send, one receive per ring round
    sched = schedule(plan, 2, 10, ("rs", "ag"), True)
    for steps in sched.pieces:
        order = [(s.phase[:2], int(s.phase[2:])) for s in steps]
        assert order == sorted(order, key=lambda p: (p[0] == "ag", p[1]))
        assert sum(len(s.sends) for s in steps) + sum(len(s.expects) for s in steps) > 0


@pytest.mark.parametrize("row", [
    np.array([-0.0, np.nan, np.inf, 1e-45], np.float32),
    np.array([[1, -2], [3, 2**62]], np.int64),
    np.array([True, False, True]),
    np.array(-0.0),
])
async def test_a_small_allgather_is_a_sum_of_bytes_bit_for_bit_in_fewer_messages(row: Any):
    """Small rows are gathered as a sum allreduce of their bytes: every member gets every row
    bit for bit (negative zero, NaN and infinity: bytes, not numbers, so no divergence check;
    integers, booleans, 0-d), each node sending O(1) messages on a ring instead of the slot
    allgather's N - 1."""
    topo = ring(16)
    mine = {i: np.asarray(row) if i % 3 else np.zeros_like(row) for i in topo.ids}
    mine[5] = np.asarray(row).copy()
    async with memory(topo, timeout=5) as cs:
        sent = lambda: sum(st.msgs_sent for c in cs.values() for st in c.transport.nic_stats.values())  # noqa: E731
        before = sent()
        got = await asyncio.gather(*(cs[i].allgather(mine[i], tag="g") for i in topo.ids))
        small = sent() - before
        before = sent()
        await asyncio.gather(*(cs[i]._gather(np.zeros_like(mine[i]), cs[i]._group(None), "s") for i in topo.ids))
        slots = sent() - before
    for rows in got:
        assert [r.tobytes() for r in rows] == [mine[i].tobytes() for i in topo.ids]
        assert all(r.dtype == np.asarray(row).dtype and r.shape == np.shape(row) for r in rows)
    assert small == 2 * 15 and slots == 16 * 15

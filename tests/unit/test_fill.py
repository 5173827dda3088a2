"""Frames computed where they are sent from (:class:`p2psync.wire.Fill`, issue 17): computed
into a slot of the shared-memory ring, or into their own array (once) on any other path; the
same bytes either way; a Fill that raises stores nothing; the wire header describes it like the
array it stands for."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from p2psync.collectives.plan import Transfer, make_plan
from p2psync.collectives.schedule import deferrable, schedule
from p2psync.errors import Diverged
from p2psync.topology import bcube, ring
from p2psync.transport import all_finite, shm
from p2psync.transport.memory import MemoryHub
from p2psync.wire import Fill, decode, encode, placed

KIB = 1 << 10


def _sum_fill(a: np.ndarray, b: np.ndarray, like: np.ndarray | None = None) -> tuple[Fill, list[int]]:
    calls: list[int] = []

    def fill(out: np.ndarray) -> None:
        calls.append(1)
        np.add(a, b, out=out)
    return Fill(np.empty_like(a) if like is None else like, fill), calls


def test_into_computes_each_time_and_own_once_then_into_copies():
    a, b = np.arange(8, dtype=np.float32), np.full(8, 2, np.float32)
    f, calls = _sum_fill(a, b)
    out = np.zeros(8, np.float32)
    f.into(out)
    f.into(out)  # a retried send places it again: same values
    assert out.tolist() == (a + b).tolist() and len(calls) == 2 and not f.owned
    assert f.own() is f.like and f.own() is f.like and len(calls) == 3 and f.owned
    out[...] = 0
    f.into(out)
    assert out.tolist() == (a + b).tolist() and len(calls) == 3  # copied from ``like``


def test_an_add_in_place_is_owned_once():
    """``own`` with ``like`` as an input of the add (a piece of the working buffer): added once,
    however often it is then placed."""
    piece, vals = np.ones(4, np.float32), np.full(4, 3, np.float32)
    f, calls = _sum_fill(piece, vals, like=piece)
    f.own()
    f.own()
    out = np.zeros(4, np.float32)
    f.into(out)
    assert piece.tolist() == out.tolist() == [4.0] * 4 and len(calls) == 1


def test_a_fill_needs_a_contiguous_writable_array():
    with pytest.raises(ValueError):
        Fill(np.zeros(8, np.float32)[::2], lambda out: None)
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        Fill(ro, lambda out: None)


def test_the_header_describes_a_fill_like_its_array_and_placed_gives_its_bytes():
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)
    f, _ = _sum_fill(a, b)
    frames = encode(kind="data", src=0, tag="t", arrays=[f])
    assert frames[1] is f and len(frames[1]) == a.nbytes
    msg = decode(placed(frames))
    assert msg.arrays[0].shape == (2, 3) and msg.arrays[0].tolist() == (a + b).tolist()
    with pytest.raises(ValueError):  # the wire is little-endian: a Fill cannot be converted
        encode(kind="data", src=0, tag="t", arrays=[Fill(np.zeros(3, ">f4"), lambda out: None)])
    assert placed([b"x", f])[0] == b"x"


def test_all_finite_looks_at_what_a_fill_computes():
    ok, _ = _sum_fill(np.ones(4, np.float32), np.ones(4, np.float32))
    bad, _ = _sum_fill(np.ones(4, np.float32), np.array([1, np.inf, 1, 1], np.float32))
    assert all_finite(ok) and not all_finite(bad)


@pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="no /dev/shm")
def test_the_ring_computes_a_fill_into_its_slot_and_stores_nothing_when_it_raises():
    out, inn = shm.Outbound(0, capacity=256 * KIB), shm.Inbound(1)
    try:
        a = np.arange(32 * KIB, dtype=np.float32)  # 128 KiB: big enough for the ring
        f, calls = _sum_fill(a, a)
        staged, seg, _, count = out.stage(1, "l0", [b"header", f])
        assert seg is not None and count == 1 and out.filled == 1 and len(calls) == 1 and not f.owned
        got, lease = inn.take(0, staged)
        assert np.frombuffer(got[1], np.float32).tolist() == (2 * a).tolist()
        lease.release()

        def boom(o: np.ndarray) -> None:
            o[...] = 7  # written into the slot, then it fails: the head must not move
            raise ZeroDivisionError
        head = seg.head
        with pytest.raises(ZeroDivisionError):
            out.stage(1, "l0", [b"header", Fill(np.empty_like(a), boom)])
        assert seg.head == head and out.frames == 1 and out.filled == 1
        small = Fill(np.empty(8, np.float32), boom)  # too small for the ring, after a big frame it took
        with pytest.raises(ZeroDivisionError):
            out.stage(1, "l0", [b"header", np.ones(64 * KIB, np.uint8), small])
        assert seg.head == head and out.frames == 1 and out.filled == 1  # given back
        f3, _ = _sum_fill(a, a)
        _, seg3, head3, count3 = out.stage(1, "l0", [b"header", f3])
        out.rollback(seg3, head3, count3)  # not sent (EAGAIN): the retry stages it again
        assert seg.head == head and out.frames == 1 and out.filled == 1
        f2, _ = _sum_fill(a, np.ones_like(a))
        staged, _, _, _ = out.stage(1, "l0", [b"header", f2])  # the next frame takes that space
        got, lease = inn.take(0, staged)
        assert np.frombuffer(got[1], np.float32).tolist() == (a + 1).tolist()
        lease.release()
    finally:
        out.close()
        inn.close()


async def test_the_memory_transport_sends_what_a_fill_computes():
    hub = MemoryHub(ring(2))
    eps = [hub.endpoint(i) for i in range(2)]
    for e in eps:
        await e.start()
    try:
        a = np.arange(10, dtype=np.float32)
        f, calls = _sum_fill(a, a)
        await eps[0].send(1, "p.0", [f], checked=True)
        msg = await asyncio.wait_for(eps[1].recv("p.0"), 5)
        assert msg.arrays[0].tolist() == (2 * a).tolist() and f.owned and len(calls) == 1
        bad, _ = _sum_fill(a, np.full(10, np.nan, np.float32))
        with pytest.raises(Diverged, match="NaN or infinity"):  # unchecked: scanned, Diverged
            await eps[0].send(1, "p.1", [bad])
    finally:
        for e in eps:
            await e.close()


def _t(src: int, dst: int, reduce: bool) -> Transfer:
    return Transfer(src=src, dst=dst, nic="n", lo=0, hi=1, reduce=reduce)


@pytest.mark.parametrize("steps, j, want", [
    # ring: a partial sum in, sent on, the final value back in the allgather
    ([("rs0", [_t(2, 0, True)]), ("rs1", [_t(0, 1, True)]), ("ag0", [_t(2, 0, False)])], 0, True),
    ([("rs0", [_t(2, 0, True)]), ("rs1", [_t(0, 1, True)])], 0, True),  # reduce-scatter only
    ([("rs0", [_t(2, 0, True)]), ("rs1", [_t(0, 1, True)]), ("rs2", [_t(3, 0, True)])], 0, False),  # added to again
    ([("rs0", [_t(2, 0, True)]), ("rs1", [_t(0, 1, True)]), ("rs2", [_t(0, 3, True)])], 0, False),  # sent again
    ([("rs0", [_t(2, 0, True)]), ("rs1", [_t(0, 1, True)]), ("ag0", [_t(2, 0, False), _t(0, 3, False)])], 0,
     False),  # sent while the final value comes in
    ([("rs0", [_t(2, 0, True)]), ("ag0", [_t(0, 1, False)])], 0, False),  # the owner's final sum: kept
    ([("rs0", [_t(2, 0, True)]), ("rs1", [_t(0, 1, True), _t(0, 3, True)])], 0, False),  # sent twice
    ([("rs0", [_t(2, 0, True), _t(3, 0, True)]), ("rs1", [_t(0, 1, True)])], 0, False),  # two partial sums in
    ([("rs0", [_t(2, 0, True), _t(0, 2, True)]), ("rs1", [_t(0, 1, True)])], 0, False),  # sends while receiving
    ([("ag0", [_t(2, 0, False)]), ("ag1", [_t(0, 1, False)])], 0, False),  # a final value: kept
    ([("rs0", [_t(2, 0, True)])], 0, False),  # nothing after it
])
def test_a_partial_sum_is_sent_on_without_the_buffer_only_when_nothing_else_reads_it(steps, j, want):
    assert deferrable(0, steps, j) is want


@pytest.mark.parametrize("algo", ["ring", "bcube"])
def test_the_schedule_sends_partial_sums_on_only_when_the_run_checks_them_itself(algo):
    """Lossy codecs and extra checks read the working buffer: no step defers then. With the
    fused check the ring's and BCube's reduce-scatter do, never the allgather, and every
    deferring step is followed by a single send of the piece."""
    topo = ring(4) if algo == "ring" else bcube(2, 2)
    plan = make_plan(topo, tuple(topo.ids), 8, algo)
    for me in topo.ids:
        assert not any(s.defer for steps in schedule(plan, me, 8, ("rs", "ag"), False).pieces for s in steps)
        fused = schedule(plan, me, 8, ("rs", "ag"), True)
        deferring = [(steps, j) for steps in fused.pieces for j, s in enumerate(steps) if s.defer]
        assert deferring
        for steps, j in deferring:
            assert steps[j].phase.startswith("rs") and len(steps[j].incoming) == 1 and not steps[j].sends
            assert steps[j + 1].phase.startswith("rs") and len(steps[j + 1].sends) == 1

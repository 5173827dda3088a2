"""A lossless allreduce reads the caller's tensor where it stands instead of copying it first
(``Collectives.allreduce``; executor ``src`` / ``fresh``): the sums are exact on every plan, the
caller's tensor is never written (a read-only one works), the result never shares its memory,
what is sent never views it (a failed operation must not leave the caller's memory in a frame
ZeroMQ still holds), and every other case still works on a copy."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from p2psync.collectives import piece_run
from p2psync.topology import bcube, mesh, ring, star
from p2psync.wire import Fill
from tests.helpers import memory_collectives

TOPOS = {"ring": lambda: ring(4), "mesh": lambda: mesh(3), "bcube": lambda: bcube(2, 2), "star": lambda: star(4)}


def _inputs(ids, n: int = 5000) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(1)
    out = {}
    for i in ids:
        x = rng.integers(-100, 100, n).astype(np.float32)
        x.flags.writeable = False  # the collective must never write into it
        out[i] = x
    return out


@pytest.mark.parametrize("topo", list(TOPOS))
@pytest.mark.parametrize("op", ["sum", "mean"])
async def test_the_callers_tensor_is_read_in_place_and_never_written(monkeypatch, topo, op):
    reads = _count_reads(monkeypatch)
    t = TOPOS[topo]()
    xs = _inputs(t.ids)
    before = {i: x.tobytes() for i, x in xs.items()}
    sent: list[np.ndarray] = []
    async with memory_collectives(t, piece_bytes=4096) as cs:
        for c in cs.values():
            send = c.transport.send

            async def spy(peer, tag, arrays=(), *, _send=send, **kw):
                sent.extend(a.like if isinstance(a, Fill) else a for a in arrays if isinstance(a, (np.ndarray, Fill)))
                return await _send(peer, tag, arrays, **kw)

            monkeypatch.setattr(c.transport, "send", spy)
        outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag="in", op=op) for i in t.ids))
    want = sum(x.astype(np.float64) for x in xs.values())
    if op == "mean":
        want = want / len(xs)
    for i, o in zip(t.ids, outs):
        assert np.array_equal(o, want.astype(np.float32)) and o.flags.writeable
        assert not any(np.shares_memory(o, x) for x in xs.values())
        assert xs[i].tobytes() == before[i]
    assert sent and not any(np.shares_memory(a, x) for a in sent for x in xs.values())
    assert reads["mine"] > 0


async def test_one_member_gets_a_copy_of_its_own_tensor():
    t = ring(3)
    x = np.arange(100, dtype=np.float32)
    async with memory_collectives(t) as cs:
        out = await cs[0].allreduce(x, [0], tag="one")
    assert np.array_equal(out, x) and not np.shares_memory(out, x)


def _count_reads(monkeypatch) -> dict[str, int]:
    """Counts reads of the caller's tensor in place (``Run.mine``: only on that path)."""
    n = {"mine": 0}
    mine = piece_run.Run.mine

    def spy(self, k):
        n["mine"] += 1
        return mine(self, k)

    monkeypatch.setattr(piece_run.Run, "mine", spy)
    return n


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix
@pytest.mark.parametrize("kind, in_place", [("torch", True), ("strided", False), ("float16", False),
                                            ("weighted", False), ("lossy", False), ("matrix", False),
                                            ("torch-strided", False), ("torch-float16", False),
                                            ("torch-bfloat16", False)])
async def test_the_other_inputs_still_work_on_a_copy(monkeypatch, kind, in_place):
    """A contiguous CPU torch tensor is read in place too; the rest work on a copy."""
    reads = _count_reads(monkeypatch)
    t = ring(4)
    base = {i: np.arange(4000, dtype=np.float32) * (i + 1) for i in t.ids}
    want = np.arange(4000, dtype=np.float32) * 10
    kw: dict = {}
    xs: dict = dict(base)
    if kind == "torch":
        xs = {i: torch.from_numpy(x.copy()) for i, x in base.items()}
    elif kind == "strided":
        xs = {i: np.repeat(x, 2)[::2] for i, x in base.items()}
    elif kind == "matrix":  # an ndarray subclass: its result is a plain array
        xs = {i: np.asmatrix(x) for i, x in base.items()}
        want = want.reshape(1, -1)
    elif kind == "torch-strided":
        xs = {i: torch.from_numpy(np.repeat(x, 2))[::2] for i, x in base.items()}
    elif kind in ("torch-float16", "torch-bfloat16"):
        dt = torch.float16 if kind == "torch-float16" else torch.bfloat16
        xs = {i: torch.from_numpy(x[:100] // 100).to(dt) for i, x in base.items()}  # small integers: exact
        want = sum(x[:100] // 100 for x in base.values())
    elif kind == "float16":
        xs = {i: x[:100].astype(np.float16) for i, x in base.items()}
        want = want[:100].astype(np.float16)
    elif kind == "weighted":
        kw = {"op": "weighted", "weights": {i: 1.0 for i in t.ids}}
    else:
        kw = {"codec": "fp16"}
    before = {i: (x.float().clone().numpy() if isinstance(x, torch.Tensor) else np.array(x)) for i, x in xs.items()}
    async with memory_collectives(t, piece_bytes=4096) as cs:
        outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag="c", **kw) for i in t.ids))
    for i, o in zip(t.ids, outs):
        got = o.float().numpy() if isinstance(o, torch.Tensor) else np.asarray(o)
        if kind == "lossy":
            assert np.allclose(got, want, rtol=2e-3), kind
        else:
            assert np.array_equal(got, want), kind
        now = xs[i].float().numpy() if isinstance(xs[i], torch.Tensor) else np.asarray(xs[i])
        assert np.array_equal(now, before[i])  # the input is untouched
    assert (reads["mine"] > 0) == in_place


@pytest.mark.parametrize("topo", list(TOPOS))
@pytest.mark.parametrize("codec", ["none", "fp16", "topk:0.1"])
async def test_a_donated_tensor_is_reduced_in_place_to_the_same_result(topo, codec):
    """``donate=True``: the working buffer is the caller's array itself (no second buffer), the
    result is bitwise what the plain operation gives, and when ZeroMQ holds none of its frames
    (the in-memory transport) it is that very memory; topk (its residual keeps the buffer)
    works on a copy."""
    t = TOPOS[topo]()
    base = _inputs(t.ids)
    async with memory_collectives(t, piece_bytes=4096, error_feedback=True) as cs:
        plain = await asyncio.gather(*(cs[i].allreduce(base[i], tag="p", op="mean", codec=codec,
                                                       feedback="x") for i in t.ids))
    async with memory_collectives(t, piece_bytes=4096, error_feedback=True) as cs:
        mine = {i: np.array(x) for i, x in base.items()}
        donated = await asyncio.gather(*(cs[i].allreduce(mine[i], tag="d", op="mean", codec=codec, feedback="x",
                                                         donate=True) for i in t.ids))
    for i, p, d in zip(t.ids, plain, donated):
        assert p.tobytes() == d.tobytes()
        assert np.shares_memory(d, mine[i]) == (codec != "topk:0.1")


async def test_a_donated_tensor_is_reduced_in_place_when_other_references_to_it_go_away_meanwhile(monkeypatch):
    """Whether sends still hold the working buffer is judged by its references, counted before
    and after the operation; references to the caller's array that other code drops meanwhile
    (here a view dropped while the pieces travel, as a finished future that delivered the array
    from a thread is dropped by the loop under load) must not make the operation think that
    sends still hold it, and copy: the result is still the donated memory."""
    from p2psync.collectives import executor

    t = ring(3)
    base = _inputs(t.ids)
    counted, real = asyncio.Event(), executor.refs

    def counting(buf: np.ndarray) -> int:  # (one more reference to ``buf`` in every count: all alike)
        n = real(buf)
        counted.set()
        return n

    monkeypatch.setattr(executor, "refs", counting)
    async with memory_collectives(t, piece_bytes=4096) as cs:
        mine = {i: np.array(x) for i, x in base.items()}
        others = {i: [mine[i][:], mine[i][:]] for i in t.ids}  # held by "other code"
        ops = []
        for i in t.ids:  # each operation counts the references to its buffer before it sends
            counted.clear()
            ops.append(asyncio.ensure_future(cs[i].allreduce(mine[i], tag="d", op="mean", donate=True)))
            await asyncio.wait_for(counted.wait(), 10)
        assert not any(op.done() for op in ops)
        others.clear()
        donated = await asyncio.gather(*ops)
    assert not others
    for i, d in zip(t.ids, donated):
        assert np.shares_memory(d, mine[i])

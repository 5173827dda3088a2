"""The collectives' fused add-and-check kernels (:mod:`p2psync.collectives.kernels`) against
their numpy twins, on every kind of non-finite value at every position that matters (the
first, the last, inside a vector lane), sums that overflow, read-only input (what the wire and
shared memory deliver), and the executor taking them exactly for float32 pieces."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from p2psync.collectives import executor
from p2psync.collectives import kernels as K
from p2psync.topology import ring
from tests.helpers import memory_collectives


def _pair(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("n", [1, 7, 64, 1000, 1 << 18])
@pytest.mark.parametrize("kind", ["add", "copy"])
def test_the_kernels_equal_their_numpy_twins(n, kind):
    kern, twin = (K.add_checked, K.add_checked_np) if kind == "add" else (K.copy_checked, K.copy_checked_np)
    a, b = _pair(n)
    b.flags.writeable = False  # as received
    a2 = a.copy()
    assert kern(a, b) is True and twin(a2, b) is True
    assert a.tobytes() == a2.tobytes()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, np.float32("nan") * -1])
@pytest.mark.parametrize("at", [0, 5, 31, 999])
@pytest.mark.parametrize("kind", ["add", "copy"])
def test_every_non_finite_value_anywhere_is_found(bad, at, kind):
    kern, twin = (K.add_checked, K.add_checked_np) if kind == "add" else (K.copy_checked, K.copy_checked_np)
    a, b = _pair(1000, seed=at)
    b[at] = bad
    a2 = a.copy()
    assert kern(a, b) is False and twin(a2, b) is False
    assert np.array_equal(a, a2, equal_nan=True)


def test_a_sum_that_overflows_is_not_finite():
    big = np.float32(3e38)
    a, b = np.full(100, big, np.float32), np.full(100, big, np.float32)
    assert K.add_checked(a, b) is False and np.isinf(a).all()
    a = np.full(100, big, np.float32)
    b = np.full(100, -big, np.float32)
    assert K.add_checked(a, b) is True and (a == 0).all()


def test_the_kernels_take_only_float32_contiguous_pieces_of_one_size():
    a = np.zeros(10, np.float32)
    assert K.fits(a, np.zeros(10, np.float32))
    assert not K.fits(a, np.zeros(10, np.float64))
    assert not K.fits(a.astype(np.float64), np.zeros(10, np.float64))
    assert not K.fits(a, np.zeros(20, np.float32)[::2])
    assert not K.fits(a, np.zeros(11, np.float32))
    assert not K.fits(a.reshape(2, 5), np.zeros((2, 5), np.float32))


@pytest.mark.parametrize("dtype, fused", [(np.float32, True), (np.float64, False)])
async def test_the_executor_adds_float32_pieces_with_the_kernels(monkeypatch, dtype, fused):
    """Sums stay exact; the kernels ran for every received float32 piece, never for float64."""
    calls = {"add": 0, "copy": 0}

    def spy(name, fn):
        def run(out, vals):
            calls[name] += 1
            return fn(out, vals)
        return run

    monkeypatch.setattr(executor, "add_checked", spy("add", K.add_checked))
    monkeypatch.setattr(executor, "copy_checked", spy("copy", K.copy_checked))
    topo = ring(4)
    async with memory_collectives(topo, piece_bytes=4096) as cs:
        xs = {i: np.arange(5000, dtype=dtype) * (i + 1) for i in topo.ids}
        outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag="k") for i in topo.ids))
    assert all(o.tobytes() == (np.arange(5000, dtype=dtype) * 10).tobytes() for o in outs)
    if fused:  # 4 nodes x 3 reduce-scatter and 3 allgather steps, each piece received once per step
        assert calls["add"] > 0 and calls["add"] == calls["copy"]
    else:
        assert calls == {"add": 0, "copy": 0}

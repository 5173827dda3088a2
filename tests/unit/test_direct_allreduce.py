"""The ``direct`` allreduce plan with the 4-bit ``e3m0`` codec: every member's contribution is
encoded once and summed in float32 at the piece's owner, and the owner's sum is encoded once
for everyone (Streaming DiLoCo §2.4), where the ring re-encodes growing partial sums at every
hop. Bitwise against that reference, on every member (in-memory transport: logic only; the
ZeroMQ test is in tests/integration/test_direct_allreduce_zmq.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from p2psync.topology import bcube, ring
from tests.helpers import direct_reference, memory_collectives as memory

pytestmark = pytest.mark.timeout(60)


def inputs(n: int, members: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(members)]


async def allreduce(topo, xs: list[np.ndarray], algo: str, codec: str = "e3m0") -> list[np.ndarray]:
    async with memory(topo, codec=codec) as cs:
        return list(await asyncio.gather(*(cs[i].allreduce(xs[i], tag="d", algo=algo) for i in topo.ids)))


@pytest.mark.parametrize("topo", [ring(4), ring(6), bcube(2, 2)], ids=lambda t: f"{t.kind}{t.size}")
async def test_each_contribution_is_encoded_once_and_every_member_gets_the_same_bits(topo):
    n = topo.size * 256  # one piece per member: piece k is member k's
    xs = inputs(n, topo.size)
    outs = await allreduce(topo, xs, "direct")
    want = direct_reference(xs, topo.size, "e3m0")
    for out in outs:
        np.testing.assert_array_equal(out, want)


async def test_direct_is_closer_to_the_exact_sum_than_the_ring_on_eight_nodes():
    """The ring re-encodes partial sums 7 times on ring-8: its error is larger."""
    topo = ring(8)
    xs = inputs(8 * 1024, 8, seed=1)
    exact = np.sum(np.stack(xs).astype(np.float64), axis=0)

    def rel(out: np.ndarray) -> float:
        return float(np.linalg.norm(out - exact) / np.linalg.norm(exact))

    direct = rel((await allreduce(topo, xs, "direct"))[0])
    hop = rel((await allreduce(topo, xs, "ring"))[0])
    assert direct < 0.8 * hop, (direct, hop)


async def test_a_lossless_direct_allreduce_is_the_exact_sum():
    topo = ring(5)
    xs = [np.arange(1000, dtype=np.float32) * (i + 1) for i in range(5)]
    outs = await allreduce(topo, xs, "direct", codec="none")
    for out in outs:
        np.testing.assert_array_equal(out, np.arange(1000, dtype=np.float32) * 15)

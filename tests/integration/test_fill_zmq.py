"""Sums sent straight on (issue 17), over real ZeroMQ with shared memory: in a ring allreduce a
node adds the partial sum it receives to its own values straight into the ring it sends from,
and sends its own first piece from the caller's tensor straight into it (:class:`p2psync.wire.Fill`):
half of every node's shared-memory frames, with exact sums; a ring too small for them computes
them into the working buffer instead, still exact; a NaN a neighbour sends into such a sum is
blamed on that neighbour (with a shaper too: computed when the send is made, not when the
shaped message leaves), and a node's own NaN stops it (Diverged) before anything is sent."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from p2psync.collectives import Collectives
from p2psync.errors import Diverged, NonFinitePiece
from p2psync.topology import bcube, mesh, ring, star
from p2psync.transport import SocketOptions, shm
from p2psync.transport.shaping import InprocShaper, LinkSpec
from tests.helpers import forge_nan_sends, free_port, zmq_cluster

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="no /dev/shm")]


@pytest.mark.parametrize("small", [False, True])
async def test_sums_sent_on_are_computed_in_the_ring_and_stay_exact(monkeypatch, small):
    if small:  # 300 KiB rings hold one 256 KiB piece at a time
        monkeypatch.setattr(shm, "CAPACITY", 300 << 10)  # read when an endpoint starts
    topo = ring(4, base_port=free_port())
    rng = np.random.default_rng(5)
    xs = {i: rng.integers(-1000, 1000, 12 * 65536).astype(np.float32) for i in topo.ids}
    for x in xs.values():
        x.flags.writeable = False
    async with zmq_cluster(topo, options=SocketOptions(shm=True)) as eps:
        cs = {i: Collectives(e, timeout=30, piece_bytes=256 << 10) for i, e in eps.items()}
        for r in range(3):
            outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag=f"x.{r}", op="sum") for i in topo.ids))
            want = sum(x.astype(np.float64) for x in xs.values()).astype(np.float32)
            assert all(o.tobytes() == want.tobytes() for o in outs)
        filled = {i: e.shm_filled for i, e in eps.items()}
        if not small:
            # per node and operation: 9 pieces sent in the reduce-scatter (3 chunks of 3), of
            # which the first chunk is its own values and the other two partial sums, all Fills;
            # 9 more (final values) in the allgather, plain frames
            assert all(e.shm_frames == 3 * 18 and filled[i] == 3 * 9 for i, e in eps.items()), filled
        else:  # most do not fit: computed into the working buffer and sent over ZeroMQ
            assert all(f < 3 * 9 for f in filled.values()), filled


async def _forged(bad: int, *, forge: bool, shaped: bool = False,
                  at: int = -1) -> tuple[list[object], dict[int, dict[int, int]]]:
    topo = ring(3, base_port=free_port())
    async with zmq_cluster(topo, options=SocketOptions(shm=True)) as eps:
        if shaped:  # a shaped message leaves later: its Fill is computed when it is sent
            for i, e in eps.items():
                e.shaper = InprocShaper({p: LinkSpec(latency_s=0.02) for p in topo.ids if p != i})
        if forge:  # a modified node: a NaN in every piece it sends, after its own checks
            forge_nan_sends(eps[bad])
        cs = {i: Collectives(e, timeout=3, piece_bytes=128 << 10) for i, e in eps.items()}
        xs = {i: np.ones(6 * 32768, np.float32) for i in topo.ids}  # 2 pieces of 128 KiB per chunk
        if not forge:
            xs[bad][at] = np.inf
        res = await asyncio.gather(*(cs[i].allreduce(xs[i], tag="n") for i in topo.ids), return_exceptions=True)
        assert all(int(m.consumed[0]) == m.taken for e in eps.values() for m in e._shm_in._maps.values())
        return list(res), {i: dict(e.offences) for i, e in eps.items()}


@pytest.mark.parametrize("shaped", [False, True])
async def test_a_nan_added_into_a_sum_sent_on_is_blamed_on_its_sender(shaped):
    res, offences = await _forged(1, forge=True, shaped=shaped)
    assert isinstance(res[2], NonFinitePiece) and res[2].peers == (1,)  # node 2 sums what node 1 sends
    assert offences[2].get(1) and not any(o.get(0) or o.get(2) for o in offences.values())


@pytest.mark.parametrize("chunk", [0, 1, 2])
async def test_an_own_nan_sent_from_the_callers_tensor_raises_diverged(chunk):
    """Whichever chunk holds it: the one the node sends first from the caller's tensor (a
    Fill), the one it adds a partial sum to, or the one it owns."""
    res, offences = await _forged(2, forge=False, at=chunk * 2 * 32768 + 5)
    assert isinstance(res[2], Diverged) and not any(offences.values())


async def test_through_a_shaper_the_sums_stay_exact(monkeypatch):
    """A shaped send returns before its message leaves, and the piece it added is given back
    then: its Fill is computed at once (shared memory then carries plain frames), never later
    from memory the sender may have reused (rings of 300 KiB: reused by the very next piece)."""
    monkeypatch.setattr(shm, "CAPACITY", 300 << 10)  # read when an endpoint starts
    topo = ring(4, base_port=free_port())
    rng = np.random.default_rng(7)
    xs = {i: rng.integers(-1000, 1000, 8 * 65536).astype(np.float32) for i in topo.ids}
    async with zmq_cluster(topo, options=SocketOptions(shm=True)) as eps:
        for i, e in eps.items():
            e.shaper = InprocShaper({p: LinkSpec(latency_s=0.01) for p in topo.ids if p != i})
        cs = {i: Collectives(e, timeout=30, piece_bytes=256 << 10) for i, e in eps.items()}
        want = sum(x.astype(np.float64) for x in xs.values()).astype(np.float32)
        for r in range(4):
            outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag=f"s.{r}") for i in topo.ids))
            assert all(o.tobytes() == want.tobytes() for o in outs)
        assert all(e.shm_frames > 0 and e.shm_filled == 0 for e in eps.values())


@pytest.mark.parametrize("name", ["mesh", "bcube", "star"])
async def test_other_plans_through_shared_memory_stay_exact(name):
    """Each plan decides for itself which pieces are only sent on (BCube's reduce-scatter has
    them too, the mesh's and the star's have none): exact sums whatever it decided."""
    port = free_port()
    topo = {"mesh": lambda: mesh(4, base_port=port), "bcube": lambda: bcube(2, 2, base_port=port),
            "star": lambda: star(4, base_port=port)}[name]()
    rng = np.random.default_rng(11)
    xs = {i: rng.integers(-1000, 1000, 8 * 65536).astype(np.float32) for i in topo.ids}
    async with zmq_cluster(topo, options=SocketOptions(shm=True)) as eps:
        cs = {i: Collectives(e, timeout=30, piece_bytes=256 << 10) for i, e in eps.items()}
        want = sum(x.astype(np.float64) for x in xs.values()).astype(np.float32)
        for r in range(2):
            outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag=f"p.{r}") for i in topo.ids))
            assert all(o.tobytes() == want.tobytes() for o in outs)
        assert sum(e.shm_frames for e in eps.values()) > 0
        if name == "bcube":
            assert all(e.shm_filled > 0 for e in eps.values())

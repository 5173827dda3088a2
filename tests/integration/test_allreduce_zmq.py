"""Collectives over real ZeroMQ: exact results, bitwise-identical replicas, groups, failures."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import torch

from p2psync.collectives import Collectives
from p2psync.errors import PeerFailure
from p2psync.topology import bcube, mesh, ring, star
from p2psync.transport import SocketOptions
from tests.helpers import free_port, until, zmq_cluster

pytestmark = pytest.mark.timeout(120)

TOPOS = {"ring4": lambda p: ring(4, base_port=p), "star5": lambda p: star(5, base_port=p),
         "bcube2x2": lambda p: bcube(2, 2, base_port=p), "bcube3x2": lambda p: bcube(3, 2, base_port=p),
         "mesh3": lambda p: mesh(3, base_port=p)}


@contextlib.asynccontextmanager
async def cluster(make, **kw):
    topo = make(free_port())
    async with zmq_cluster(topo) as eps:
        yield topo, {i: Collectives(e, **kw) for i, e in eps.items()}


@pytest.mark.parametrize("name", sorted(TOPOS))
@pytest.mark.parametrize("size", [1, 3, 1001, 70_001])
async def test_allreduce_matches_numpy(name, size):
    async with cluster(TOPOS[name], piece_bytes=16 << 10) as (topo, cs):
        rng = np.random.default_rng(size)
        data = {i: rng.standard_normal(size).astype(np.float32) for i in topo.ids}
        outs = await asyncio.gather(*(cs[i].allreduce(data[i], tag="a") for i in topo.ids))
    ref = np.sum([data[i] for i in topo.ids], axis=0, dtype=np.float64)
    for o in outs:
        np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-5)
        assert o.tobytes() == outs[0].tobytes()  # bitwise identical everywhere


async def test_large_allreduce_ring():
    async with cluster(TOPOS["ring4"]) as (topo, cs):
        data = {i: np.full(10_000_000, float(i + 1), dtype=np.float32) for i in topo.ids}
        outs = await asyncio.gather(*(cs[i].allreduce(data[i], op="mean", tag="m") for i in topo.ids))
    for o in outs:
        assert o.shape == (10_000_000,) and (o == 2.5).all()


async def test_overwriting_a_result_at_once_never_changes_what_peers_receive():
    """A result may be the operation's working buffer (issue 17), but only once no zero-copy
    send still reads from it: each node poisons its result with NaN the moment it has it, while
    its last pieces may still sit in ZeroMQ's queues, and every node must still get the exact
    sum (a shared buffer would send NaN or a wrong value to a peer)."""
    topo = ring(4, base_port=free_port())
    small = SocketOptions(sndbuf=4096, rcvbuf=4096)  # a piece leaves only as fast as it is read
    async with zmq_cluster(topo, options=small) as eps:
        cs = {i: Collectives(e, piece_bytes=256 << 10) for i, e in eps.items()}
        data = {i: np.arange(1_000_000, dtype=np.float32) * (i + 1) for i in topo.ids}
        ref = sum(data.values())

        async def node(i: int, r: int) -> np.ndarray:
            out = await cs[i].allreduce(data[i], tag=f"p{r}")
            kept = out.copy()
            out[...] = np.nan
            return kept

        for r in range(5):
            outs = await asyncio.gather(*(node(i, r) for i in topo.ids))
            for o in outs:
                np.testing.assert_array_equal(o, ref)


async def test_group_subset_leaves_others_untouched():
    async with cluster(lambda p: mesh(5, base_port=p)) as (topo, cs):
        group = [4, 1, 3]
        xs = {i: np.full((2, 5), float(i), dtype=np.float32) for i in topo.ids}
        outs = await asyncio.gather(*(cs[i].allreduce(xs[i], group, op="mean", tag="g1") for i in group))
        for o in outs:
            np.testing.assert_allclose(o, np.full((2, 5), 8 / 3), rtol=1e-6)
        w = {1: 0.5, 3: 0.25, 4: 0.25}
        outs = await asyncio.gather(*(cs[i].allreduce(xs[i], group, op="weighted", weights=w, tag="g2") for i in group))
        np.testing.assert_allclose(outs[0], np.full((2, 5), 0.5 + 0.75 + 1.0), rtol=1e-6)
        for i in topo.ids:
            assert (xs[i] == i).all()  # nobody's input changed
        assert not cs[0].history and not cs[2].history  # non-members did nothing


async def test_torch_and_other_ops():
    async with cluster(TOPOS["bcube2x2"], piece_bytes=64) as (topo, cs):
        ts = {i: torch.arange(10, dtype=torch.float32) * (i + 1) for i in topo.ids}
        outs = await asyncio.gather(*(cs[i].allreduce(ts[i], tag="t") for i in topo.ids))
        assert isinstance(outs[0], torch.Tensor) and torch.equal(outs[0], torch.arange(10.0) * 10)
        gathered = await asyncio.gather(*(cs[i].allgather(np.full(3, i, np.int64), tag="ag") for i in topo.ids))
        for g in gathered:
            assert [int(a[0]) for a in g] == [0, 1, 2, 3]
        b = await asyncio.gather(*(cs[i].broadcast(np.full(7, float(i)), root=2, tag="bc") for i in topo.ids))
        assert all((x == 2.0).all() for x in b)
        shards = await asyncio.gather(*(cs[i].reduce_scatter(np.arange(40, dtype=np.float32), tag="rs") for i in topo.ids))
        covered = np.zeros(40, int)
        for sh in shards:
            for (lo, hi), vals in sh.items():
                np.testing.assert_array_equal(vals, 4 * np.arange(lo, hi, dtype=np.float32))
                covered[lo:hi] += 1
        assert (covered == 1).all()


@pytest.mark.parametrize("codec", ["fp16", "int8", "sketch8"])
async def test_lossy_codecs_keep_replicas_identical(codec):
    async with cluster(TOPOS["ring4"], piece_bytes=64 << 10, codec=codec) as (topo, cs):
        rng = np.random.default_rng(1)
        data = {i: (rng.standard_t(3, 100_000) * 1e-2).astype(np.float32) for i in topo.ids}
        outs = await asyncio.gather(*(cs[i].allreduce(data[i], tag="lossy") for i in topo.ids))
    ref = np.sum(list(data.values()), axis=0)
    assert all(o.tobytes() == outs[0].tobytes() for o in outs)
    assert np.linalg.norm(outs[0] - ref) / np.linalg.norm(ref) < 0.2
    assert cs[0].history[-1].compression > (1.9 if codec == "fp16" else 3.5)


async def test_bcube_nics_balanced():
    async with cluster(TOPOS["bcube3x2"], piece_bytes=32 << 10) as (topo, cs):
        data = np.ones(1_000_000, dtype=np.float32)
        await asyncio.gather(*(cs[i].allreduce(data, tag="bal") for i in topo.ids))
        for i in topo.ids:
            st = cs[i].history[-1].nic_bytes
            assert set(st) == {"l0", "l1"}
            assert max(st.values()) <= 1.1 * min(st.values()), st
            sent = cs[i].transport.stats()["nics"]
            assert all(v["bytes_sent"] > 0 and v["bytes_recv"] > 0 for v in sent.values())


async def test_killed_peer_raises_peer_failure_on_every_survivor():
    async with cluster(TOPOS["ring4"], timeout=1.5) as (topo, cs):
        await cs[3].transport.close()  # node 3 is gone before the collective
        x = np.ones(100_000, dtype=np.float32)
        results = await asyncio.gather(*(cs[i].allreduce(x, tag="k") for i in (0, 1, 2)), return_exceptions=True)
        for r in results:
            assert isinstance(r, PeerFailure), r
        assert (x == 1).all()


async def test_peer_killed_mid_allreduce():
    async with cluster(TOPOS["ring4"], timeout=2.0, piece_bytes=64 << 10) as (topo, cs):
        x = {i: np.ones(4_000_000, dtype=np.float32) for i in topo.ids}
        tasks = {i: asyncio.create_task(cs[i].allreduce(x[i], tag="mid")) for i in topo.ids}
        # pieces are in flight: node 3 has received some
        await until(lambda: sum(v["bytes_recv"] for v in cs[3].transport.stats()["nics"].values()) > 0, 5.0,
                    "node 3 receiving pieces")
        tasks[3].cancel()
        await cs[3].transport.close()
        t0 = asyncio.get_running_loop().time()
        results = await asyncio.gather(*(tasks[i] for i in (0, 1, 2)), return_exceptions=True)
        assert asyncio.get_running_loop().time() - t0 < 2.0 * 3  # bounded by the receive timeout
        for r in results:
            assert isinstance(r, PeerFailure), r
        assert all((x[i] == 1).all() for i in (0, 1, 2))  # never half-applied

"""The topk sparse allreduce over real ZeroMQ: bitwise-identical results equal to the exact sum
of every node's residual-compensated sparse vector, mean / weighted, torch tensors, bytes on the
wire against the dense allreduce, and malformed parts from a peer."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import torch

from p2psync.collectives import Collectives
from p2psync.collectives.sparse import gather_sum
from p2psync.compress import TopK
from p2psync.errors import NonFinitePiece, PeerFailure, ProtocolError
from p2psync.topology import bcube, mesh, ring
from p2psync.wire import parse_header
from tests.helpers import free_port, zmq_cluster

pytestmark = pytest.mark.timeout(120)

TOPOS = {"ring4": lambda p: ring(4, base_port=p), "mesh4": lambda p: mesh(4, base_port=p),
         "bcube2x2": lambda p: bcube(2, 2, base_port=p)}


@contextlib.asynccontextmanager
async def cluster(make, **kw):
    topo = make(free_port())
    async with zmq_cluster(topo) as eps:
        yield topo, {i: Collectives(e, **kw) for i, e in eps.items()}


def expected(cs, xs, codec: TopK, family: str, weights=None) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """The sum, in group order, of every node's sparsified (x * weight + residual), and the
    residuals that leaves (computed before the operation, from each node's current residual)."""
    n = next(iter(xs.values())).size
    out = np.zeros(n, np.float32)
    residuals = {}
    for i in sorted(cs):
        x = xs[i] * np.float32(weights[i]) if weights else xs[i].copy()
        r = cs[i].sparse_feedback.residual.get(("topk", family, n))
        x = x + r if r is not None else x
        idx, vals = codec.sparsify(x)
        out[idx] += vals
        x[idx] = 0
        residuals[i] = x
    return out, residuals


@pytest.mark.parametrize("name", sorted(TOPOS))
async def test_sparse_sum_is_exact_and_identical_everywhere(name):
    n, f = 50_000, 0.01
    codec = TopK(fraction=f)
    async with cluster(TOPOS[name], piece_bytes=16 << 10, codec=f"topk:{f}") as (topo, cs):
        rng = np.random.default_rng(7)
        for step in range(3):  # from the second step on the residuals take part
            xs = {i: (rng.standard_t(3, n) * 1e-2).astype(np.float32) for i in topo.ids}
            ref, residuals = expected(cs, xs, codec, "g")
            before = {i: cs[i].transport.stats()["nics"] for i in topo.ids}
            outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag=f"g.{step}", feedback="g") for i in topo.ids))
            for o in outs:
                assert o.dtype == np.float32 and o.shape == (n,)
                assert o.tobytes() == outs[0].tobytes()  # bitwise identical everywhere
            np.testing.assert_array_equal(outs[0], ref)
            for i in topo.ids:
                np.testing.assert_array_equal(cs[i].sparse_feedback.residual[("topk", "g", n)], residuals[i])
        sparse_sent = {i: sum(v["bytes_sent"] - before[i][nic]["bytes_sent"] for nic, v in cs[i].transport.stats()["nics"].items())
                       for i in topo.ids}
        st = cs[0].stats_for("g.2")
        # the same tensor through the dense allreduce, for the bytes it really sends
        before = {i: cs[i].transport.stats()["nics"] for i in topo.ids}
        await asyncio.gather(*(cs[i].allreduce(xs[i], tag="dense", codec="none") for i in topo.ids))
        dense_sent = {i: sum(v["bytes_sent"] - before[i][nic]["bytes_sent"] for nic, v in cs[i].transport.stats()["nics"].items())
                      for i in topo.ids}
        dense_st = cs[0].stats_for("dense")
    k, members = codec.k(n), 4
    assert st.op == "allreduce:sum" and st.codec == "topk:0.01" and st.algo.startswith("topk/")
    assert st.raw_bytes == dense_st.wire_bytes  # raw = what the dense plan sends
    # the sparse allgather moves (members - 1) parts of k * 8 bytes per node on a ring or mesh,
    # up to about twice that on the tree-based allgather that BCube uses
    assert st.wire_bytes <= 2 * members * k * 8, (st.wire_bytes, k)
    assert sum(st.nic_bytes.values()) == st.wire_bytes
    assert st.compression > 8, st.compression  # 1 / (f * N) = 25 on a ring
    for i in topo.ids:  # measured by the transport, headers included
        assert sparse_sent[i] < dense_sent[i] / 5, (i, sparse_sent[i], dense_sent[i])


async def test_mean_weighted_and_torch():
    n, f = 20_000, 0.02
    codec = TopK(fraction=f)
    async with cluster(TOPOS["ring4"], codec=f"topk:{f}") as (topo, cs):
        rng = np.random.default_rng(8)
        xs = {i: rng.standard_normal(n).astype(np.float32) for i in topo.ids}
        ref, _ = expected(cs, xs, codec, "mean")
        outs = await asyncio.gather(*(cs[i].allreduce(xs[i], op="mean", tag="mean.0", feedback="mean") for i in topo.ids))
        assert all(o.tobytes() == outs[0].tobytes() for o in outs)
        np.testing.assert_array_equal(outs[0], ref / np.float32(4))
        w = {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4}
        ref, _ = expected(cs, xs, codec, "w", weights=w)
        outs = await asyncio.gather(*(cs[i].allreduce(xs[i], op="weighted", weights=w, tag="w.0", feedback="w")
                                      for i in topo.ids))
        assert all(o.tobytes() == outs[0].tobytes() for o in outs)
        np.testing.assert_array_equal(outs[0], ref)
        for i in topo.ids:  # inputs untouched
            assert ("topk", "w", n) in cs[i].sparse_feedback.residual
        # torch tensors in, torch tensors of the same shape and dtype out
        ts = {i: torch.from_numpy(xs[i].reshape(100, 200).copy()) for i in topo.ids}
        copies = {i: ts[i].clone() for i in topo.ids}
        ref, _ = expected(cs, xs, codec, "t")
        outs = await asyncio.gather(*(cs[i].allreduce(ts[i], tag="t.0", feedback="t") for i in topo.ids))
        for o in outs:
            assert isinstance(o, torch.Tensor) and o.shape == (100, 200) and o.dtype == torch.float32
            assert torch.equal(o, outs[0])
        np.testing.assert_array_equal(outs[0].numpy().reshape(-1), ref)
        assert all(torch.equal(ts[i], copies[i]) for i in topo.ids)
        half = await asyncio.gather(*(cs[i].allreduce(ts[i].half(), tag="h.0") for i in topo.ids))
        assert half[0].dtype == torch.float16 and torch.equal(half[0], half[3])


@pytest.mark.parametrize("fault", ["out_of_range", "unsorted", "wrong_size"])
async def test_malformed_part_from_a_peer_is_rejected_everywhere(fault):
    n, k = 10_000, 25
    async with cluster(TOPOS["mesh4"], timeout=3.0) as (topo, cs):
        g = tuple(topo.ids)
        vals = np.ones(k, np.float32)
        idx = np.arange(k, dtype=np.int32) * 3
        bad_idx, bad_vals = {"out_of_range": (idx + n - 10, vals), "unsorted": (idx[::-1].copy(), vals),
                             "wrong_size": (np.arange(k + 1, dtype=np.int32), np.ones(k + 1, np.float32))}[fault]
        res = await asyncio.gather(gather_sum(cs[0], bad_idx, bad_vals, g, n, "bad"),
                                   *(gather_sum(cs[i], idx, vals, g, n, "bad") for i in g[1:]),
                                   return_exceptions=True)
        if fault == "wrong_size":
            # a part of another size is another allgather (its signature differs): whoever sees a
            # mismatched piece first fails with ProtocolError and stops sending, so a node may
            # instead time out waiting for it (PeerFailure); nobody crashes or sums it
            assert all(isinstance(r, (ProtocolError, PeerFailure)) for r in res), res
            assert any(isinstance(r, ProtocolError) and "signature" in str(r) for r in res), res
        else:
            # a part of the right size is sent everywhere (node 0's own check rejects it too);
            # a node that finds node 0's part malformed fails with a ProtocolError naming node 0
            # and stops sending, so a node still waiting for that node's part may instead time
            # out on it (PeerFailure, under load); nobody crashes or sums the part
            for r in res:
                assert (isinstance(r, ProtocolError) and "node 0" in str(r)) or isinstance(r, PeerFailure), r
            assert sum(isinstance(r, ProtocolError) for r in res) >= 2, res
        # the nodes still work afterwards
        x = np.arange(n, dtype=np.float32)
        outs = await asyncio.gather(*(cs[i].allreduce(x, tag="after", codec="topk:0.01") for i in g))
        assert outs[0].tobytes() == outs[3].tobytes() and np.count_nonzero(outs[0]) == 100


def _corrupt_forwarded_rows(ep) -> None:
    """Make ``ep`` a malicious relay: the sparse rows it passes on in the allgather (rounds
    after the first, which carry other members' rows) get NaN in their values half."""
    real = ep._transmit

    def transmit(peer, route, frames, *, bulk=False, unordered=False):
        h = parse_header(bytes(frames[0]))
        if h.kind == "data" and ".ag" in h.tag and ".ag0." not in h.tag:
            payload = bytearray(bytes(frames[1]))
            half = len(payload) // 2
            payload[half:] = np.full((len(payload) - half) // 4, np.nan, "<f4").tobytes()
            frames = [frames[0], bytes(payload)]
        real(peer, route, frames, bulk=bulk, unordered=unordered)

    ep._transmit = transmit


async def test_a_relay_corrupting_sparse_rows_is_blamed_not_their_origin():
    """On a ring, rows reach most members through other members. Node 1 poisons the rows it
    passes on (not its own): the node it hands them to rejects them at once and blames node 1,
    the neighbour that delivered them, never the rows' honest origin."""
    bad = 1
    async with cluster(TOPOS["ring4"], timeout=3.0) as (topo, cs):
        _corrupt_forwarded_rows(cs[bad].transport)
        x = np.arange(10_000, dtype=np.float32)
        res = await asyncio.gather(*(cs[i].allreduce(x, tag="sp", codec="topk:0.01") for i in topo.ids),
                                   return_exceptions=True)
        caught = [r for r in res if isinstance(r, NonFinitePiece)]
        assert caught and all(r.peers == (bad,) for r in caught), res
        offences = {i: dict(cs[i].transport.offences) for i in topo.ids}
        assert all(set(o) <= {bad} for o in offences.values()) and sum(o.get(bad, 0) for o in offences.values()), offences

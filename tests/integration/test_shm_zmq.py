"""Bulk frames through shared memory between endpoints on one host (``SocketOptions(shm=True)``,
:mod:`p2psync.transport.shm`), over real ZeroMQ: allreduces give the exact sums with the big
pieces carried by the segments (small messages and control still over ZeroMQ), a ring too small
for the traffic falls back to ZeroMQ without losing anything, a forged marker is rejected and
counted, a restarted peer gets new segments, a send that fails after staging gives its space
back, and no segment file is left in /dev/shm after the endpoints close."""

from __future__ import annotations

import asyncio
import os

import msgpack
import numpy as np
import pytest
import zmq

from p2psync.collectives import Collectives
from p2psync.topology import ring
from p2psync.transport import SocketOptions, ZmqEndpoint, local, shm, zmq_endpoint
from tests.helpers import free_port, until, zmq_cluster

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="no /dev/shm")]


def _segments(pid: int | None = None) -> list[str]:
    mine = f"-{os.getpid() if pid is None else pid}-"
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(shm.PREFIX) and mine in n]


@pytest.mark.parametrize("capacity", [shm.CAPACITY, 300 << 10])
async def test_allreduces_over_shared_memory_sum_exactly(monkeypatch, capacity):
    """Integer-valued float32 sums are exact whatever carried the pieces. 300 KiB rings hold
    one 256 KiB piece at a time: most pieces then fall back to ZeroMQ, in order with the rest."""
    monkeypatch.setattr(shm, "CAPACITY", capacity)  # read when an endpoint starts
    topo = ring(4, base_port=free_port())
    rng = np.random.default_rng(3)
    n = 3_000_000 // 4
    xs = {i: rng.integers(-1000, 1000, n).astype(np.float32) for i in topo.ids}
    async with zmq_cluster(topo, options=SocketOptions(shm=True)) as eps:
        cs = {i: Collectives(e, timeout=30, piece_bytes=256 << 10) for i, e in eps.items()}
        for r in range(3):
            outs = await asyncio.gather(*(cs[i].allreduce(xs[i] * (r + 1), tag=f"x.{r}") for i in topo.ids))
            want = sum(xs.values()) * (r + 1)
            for o in outs:
                assert o.tobytes() == want.tobytes()
        small = await asyncio.gather(*(cs[i].allreduce(np.full(3, i, np.float32), tag="s") for i in topo.ids))
        assert all(s.tolist() == [6.0, 6.0, 6.0] for s in small)
        used = {i: e.shm_frames for i, e in eps.items()}
        assert all(u > 0 for u in used.values()), used
        # the collectives borrowed every piece that came through shared memory (added straight
        # from the sender's ring) and gave all of them back
        assert all(e.lending.lent == e._shm_in.frames > 0 and e.lending.copied == 0 for e in eps.values())
        assert all(m.outstanding == 0 and int(m.consumed[0]) == m.taken
                   for e in eps.values() for m in e._shm_in._maps.values())
        if capacity < shm.CAPACITY:  # most pieces did not fit
            assert all(u < 3 * 2 * 3 * 3 for u in used.values()), used
    assert not _segments()  # every receiver unlinked what it mapped, every sender the rest


async def test_without_the_option_nothing_goes_through_shared_memory():
    topo = ring(3, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        cs = {i: Collectives(e, timeout=30) for i, e in eps.items()}
        x = np.ones(1 << 20, np.float32)
        await asyncio.gather(*(cs[i].allreduce(x, tag="x") for i in topo.ids))
        assert all(e.shm_frames == 0 for e in eps.values())
        assert not _segments()


async def test_a_forged_marker_is_rejected_and_counted():
    """Node 1 sends the node its ring pushes to markers naming node 0's segment, a position
    outside its own segment, and a frame index the message does not have: each rejected and
    counted (``shm``), and the endpoints go on."""
    topo = ring(3, base_port=free_port())
    async with zmq_cluster(topo, options=SocketOptions(shm=True)) as eps:
        c = {i: Collectives(e, timeout=30) for i, e in eps.items()}
        x = np.ones(1 << 18, np.float32)  # 1 MiB: the pieces go through shared memory
        await asyncio.gather(*(c[i].allreduce(x, tag="warm") for i in topo.ids))
        ep1 = eps[1]
        (dst, _, _), seg = next((k, v) for k, v in ep1._shm_out._segs.items() if v is not None)
        route = topo.routes(1, dst)[0]
        forged = seg.name.replace(f"{shm.PREFIX}1-", f"{shm.PREFIX}0-", 1)
        for name, entries in ((forged, [[1, 0, 4]]), (seg.name, [[1, 1 << 40, 4]]), (seg.name, [[5, 0, 4]])):
            # raw frames on the bulk pipe: nothing staged
            ep1._bulk_link.send(dst, route, [shm.MARKER + msgpack.packb([name, entries]), b""])
        await until(lambda: eps[dst].rejected["shm"] >= 3, 10, "the three forged markers rejected")
        assert eps[dst].rejected["shm"] == 3
        ok = await asyncio.gather(*(c[i].allreduce(x, tag="after") for i in topo.ids))
        assert all((o == 3).all() for o in ok)


async def test_a_restarted_peer_gets_new_segments_and_the_sums_stay_exact():
    """Node 1 closes and starts again (a new process would too): its peers drop the segments it
    had mapped (and unlinked) when its connections go down, so what they send it next goes
    through new ones, which it maps; nothing is rejected."""
    topo = ring(3, base_port=free_port())
    x = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    async with zmq_cluster(topo, options=SocketOptions(shm=True)) as eps:
        cs = {i: Collectives(e, timeout=30) for i, e in eps.items()}
        await asyncio.gather(*(cs[i].allreduce(x, tag="a") for i in topo.ids))
        before = eps[0].shm_frames
        await eps[1].close()
        assert await eps[0].wait_gone([1], 10)  # node 0 sends to node 1 in this ring: it sees it go
        eps[1] = ZmqEndpoint(topology=topo, node_id=1, default_timeout=10, options=SocketOptions(shm=True))
        await eps[1].start()
        cs[1] = Collectives(eps[1], timeout=30)
        outs = await asyncio.gather(*(cs[i].allreduce(x, tag="b") for i in topo.ids))
        assert all(o.tobytes() == (3 * x).tobytes() for o in outs)
        assert eps[0].shm_frames > before
        assert all(e.rejected["shm"] == 0 for e in eps.values())


async def test_a_send_that_fails_after_staging_gives_its_space_back(monkeypatch):
    """EAGAIN on a staged message: the sender rolls its ring back and the retry stages it again,
    so every frame the senders count was taken by a receiver exactly once. (Every datagram is
    refused here, so the pieces go over ZeroMQ after staging, as they do when the receiver's
    datagram queue is full: p2psync.transport.local.)"""
    topo = ring(3, base_port=free_port())
    monkeypatch.setattr(local.LocalOut, "send", lambda self, to, frames: False)
    fail = {"armed": False, "failed": 0}
    stage = shm.Outbound.stage
    send = zmq_endpoint._send

    def staged(self, *a):
        got = stage(self, *a)
        fail["armed"] = fail["armed"] or (got[1] is not None and fail["failed"] < 3)
        return got

    def flaky(sock, data, flags, copy=False):
        if fail["armed"]:
            fail["armed"] = False
            fail["failed"] += 1
            raise zmq.Again()
        return send(sock, data, flags, copy=copy)

    monkeypatch.setattr(shm.Outbound, "stage", staged)
    monkeypatch.setattr(zmq_endpoint, "_send", flaky)
    x = np.arange(1 << 18, dtype=np.float32)
    async with zmq_cluster(topo, options=SocketOptions(shm=True)) as eps:
        cs = {i: Collectives(e, timeout=30) for i, e in eps.items()}
        for r in range(2):
            outs = await asyncio.gather(*(cs[i].allreduce(x, tag=f"x{r}") for i in topo.ids))
            assert all(o.tobytes() == (3 * x).tobytes() for o in outs)
        assert fail["failed"] == 3
        sent = sum(e.shm_frames for e in eps.values())
        taken = sum(e._shm_in.frames for e in eps.values())
        assert sent == taken > 0


async def test_a_consumer_that_does_not_borrow_gets_arrays_of_its_own():
    """A tensor message through shared memory to a plain ``recv`` (no lend scope): the receiver
    copies it out and gives the ring space back on arrival; what it hands on owns its memory."""
    topo = ring(3, base_port=free_port())
    x = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: through shared memory
    async with zmq_cluster(topo, options=SocketOptions(shm=True)) as eps:
        dst = topo.neighbors(0)[0]
        for r in range(3):
            await eps[0].send(dst, f"plain.{r}", [x * r])
            msg = await eps[dst].recv(f"plain.{r}", timeout=10)
            assert msg.arrays[0].tobytes() == (x * r).tobytes() and msg.lease is None
        assert eps[0].shm_frames == 3 and eps[dst].lending.copied == 3 and eps[dst].lending.lent == 0
        (seg,) = eps[dst]._shm_in._maps.values()
        assert not np.shares_memory(msg.arrays[0], np.frombuffer(seg.mm, np.uint8))
        assert seg.outstanding == 0 and int(seg.consumed[0]) == seg.taken > 0


async def test_an_operation_that_fails_gives_back_every_piece_it_borrowed():
    """Node 2 runs a different operation under the same tag: its neighbours reject its pieces
    (ProtocolError) with other pieces already borrowed, queued or in flight. Once every
    operation has ended, nothing is lent any more, every ring is given back up to what was
    taken, and the next allreduce goes through shared memory again with exact sums."""
    topo = ring(3, base_port=free_port())
    x = np.arange(1 << 19, dtype=np.float32)  # 2 MiB: pieces of 1 MiB, through shared memory
    async with zmq_cluster(topo, options=SocketOptions(shm=True)) as eps:
        cs = {i: Collectives(e, timeout=3) for i, e in eps.items()}
        mine = {0: x, 1: x, 2: x[: x.size // 2]}  # node 2: another size, another signature
        got = await asyncio.gather(*(cs[i].allreduce(mine[i], tag="bad") for i in topo.ids),
                                   return_exceptions=True)
        assert all(isinstance(g, Exception) for g in got), got
        for e in eps.values():  # every lease given back: nothing stalls a ring
            assert all(m.outstanding == 0 and int(m.consumed[0]) == m.taken for m in e._shm_in._maps.values())
        before = {i: e.shm_frames for i, e in eps.items()}
        outs = await asyncio.gather(*(cs[i].allreduce(x, tag="good") for i in topo.ids))
        assert all(o.tobytes() == (3 * x).tobytes() for o in outs)
        assert all(e.shm_frames > before[i] for i, e in eps.items())

"""Lending received shared-memory frames (:mod:`p2psync.transport.lending`, ``Transport.lend``):
only a scope's own tags are lent, everything else gets arrays of its own and gives the space
back at once; a borrower's release gives it back; what a scope lent and nobody released is
copied and released when it closes; a message that is not delivered gives its space back. The
leases here stand in for the shared-memory ring's (tests/unit/test_shm.py has the ring's own);
the message path is the transport's real ``_ingest`` and mailbox."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from p2psync.errors import ConfigError
from p2psync.topology import ring
from p2psync.transport.lending import Lending
from p2psync.transport.memory import MemoryHub
from p2psync.wire import encode, placed


class FakeLease:
    """Stands in for the ring's lease. Given ``mem``, releasing poisons it (-1), as a sender
    reusing its ring would: any read after the release sees it."""

    def __init__(self, mem: np.ndarray | None = None) -> None:
        self.released = 0
        self.mem = mem

    def release(self) -> None:
        self.released += 1
        if self.mem is not None:
            self.mem[...] = -1


def _frames(tag: str, values: np.ndarray, kind: str = "data") -> tuple[list, np.ndarray]:
    """A message from node 1 whose payload frame is a read-only view of ``ring_mem`` (as a
    shared-memory frame is), and that memory."""
    ring_mem = np.array(values, dtype=np.float32)
    frames = encode(kind=kind, src=1, tag=tag, step=0, arrays=[ring_mem])
    frames = [bytes(frames[0]), memoryview(ring_mem).cast("B").toreadonly()]
    return frames, ring_mem


@pytest.fixture
async def tr():
    topo = ring(3)
    t = MemoryHub(topo).endpoint(0)
    await t.start()
    yield t
    await t.close()


def _nic(tr) -> str:
    return tr.node.nics[0].name


async def test_outside_a_scope_the_arrays_are_copied_and_the_space_given_back_at_once(tr):
    frames, mem = _frames("op.rs0.1.0", [1, 2, 3])
    lease = FakeLease(mem)  # copied before it is given back, or the values read -1
    tr._ingest(_nic(tr), 1, "1/n", frames, lease)
    assert lease.released == 1
    msg = tr.recv_nowait("op.rs0.1.0")
    assert msg.arrays[0].tolist() == [1, 2, 3] and not np.shares_memory(msg.arrays[0], mem)
    assert msg.lease is None and tr.lending.copied == 1 and tr.lending.lent == 0


async def test_a_scope_lends_its_own_tags_until_the_borrower_releases(tr):
    with tr.lend("op.", 3):
        frames, mem = _frames("op.rs0.1.0", [1, 2, 3])
        lease = FakeLease()
        tr._ingest(_nic(tr), 1, "1/n", frames, lease)
        msg = await tr.recv("op.rs0.1.0", timeout=1)
        assert np.shares_memory(msg.arrays[0], mem) and lease.released == 0
        assert not msg.arrays[0].flags.writeable  # a borrower cannot write into the sender's ring
        assert tr.lending.outstanding == 1
        msg.release()
        msg.release()  # idempotent
        assert lease.released == 1 and tr.lending.outstanding == 0 and tr.lending.lent == 1


@pytest.mark.parametrize("tag, kind", [
    ("op.flag.rs0.1.0", "data"),  # another operation nested under the prefix (one part more)
    ("op.rs0.1", "data"),  # one part less
    ("other.rs0.1.0", "data"),  # another prefix
    ("op.rs0.1.0", "event"),  # not a tensor message
])
async def test_a_scope_lends_nothing_but_its_own_data_tags(tr, tag, kind):
    with tr.lend("op.", 3):
        frames, mem = _frames(tag, [4, 5], kind)
        lease = FakeLease()
        tr._ingest(_nic(tr), 1, "1/n", frames, lease)
        assert lease.released == 1 and tr.lending.lent == 0
        msg = tr.recv_nowait(tag)
        assert msg is not None and not np.shares_memory(msg.arrays[0], mem)


async def test_what_a_scope_lent_and_nobody_released_is_copied_and_released_when_it_closes(tr):
    leases = []
    with tr.lend("op.", 3):
        for k in range(3):
            frames, mem = _frames(f"op.ag0.1.{k}", [k, k + 1])
            leases.append(FakeLease(mem))  # copied before given back, or the values read -1
            tr._ingest(_nic(tr), 1, "1/n", frames, leases[-1])
        taken = await tr.recv("op.ag0.1.0", timeout=1)  # taken, never released (its consumer failed)
        assert [x.released for x in leases] == [0, 0, 0]
    assert [x.released for x in leases] == [1, 1, 1] and tr.lending.outstanding == 0
    queued = [tr.recv_nowait(f"op.ag0.1.{k}") for k in (1, 2)]  # still in the mailbox
    assert [m.arrays[0].tolist() for m in (taken, *queued)] == [[0, 1], [1, 2], [2, 3]]


async def test_a_message_that_is_not_delivered_gives_its_space_back(tr):
    with tr.lend("op.", 3):
        lease = FakeLease()
        frames, _ = _frames("op.rs0.1.0", [np.nan, 1.0])  # rejected: non-finite (no defer here)
        tr._ingest(_nic(tr), 1, "1/n", frames, lease)
        assert lease.released == 1 and tr.rejected["non_finite"] == 1
        lease = FakeLease()
        tr._ingest(_nic(tr), 1, "1/n", [b"\x91garbage", frames[1]], lease)  # malformed header
        assert lease.released == 1 and tr.lending.outstanding == 0


def test_scopes_nest_by_prefix_and_refuse_a_second_depth():
    lend = Lending()
    with lend.scope("a.", 3):
        with lend.scope("a.", 3):
            pass
        assert lend._match("a.rs0.1.2") is not None  # still open: the outer one
        with pytest.raises(ConfigError, match="depth"):
            with lend.scope("a.", 2):
                pass
    assert lend._match("a.rs0.1.2") is None
    with pytest.raises(ConfigError):
        with lend.scope("b.", 0):
            pass


async def test_a_borrowed_message_the_mailbox_drops_gives_its_space_back_at_once(tr):
    """Dropped by the mailbox (here: its tag retired) before anyone took it: nobody will read
    it, so its space does not wait for the scope to close (it would stall the ring)."""
    with tr.lend("op.", 3):
        frames, mem = _frames("op.rs0.1.0", [1, 2])
        lease = FakeLease(mem)
        tr._ingest(_nic(tr), 1, "1/n", frames, lease)
        assert lease.released == 0
        tr.mailbox.retire("op.rs0.1.0", exact=True)
        assert lease.released == 1 and tr.lending.outstanding == 0
        frames, _ = _frames("op.rs0.1.0", [3, 4])  # arriving on a retired tag: dropped at once
        lease = FakeLease()
        tr._ingest(_nic(tr), 1, "1/n", frames, lease)
        assert lease.released == 1 and tr.lending.outstanding == 0


async def test_a_copy_that_fails_still_gives_the_space_back(tr, monkeypatch):
    def no_memory(*a, **k):
        raise MemoryError

    frames, mem = _frames("op.rs0.1.0", [1, 2])
    lease = FakeLease()
    monkeypatch.setattr("p2psync.transport.lending.np.array", no_memory)
    tr._ingest(_nic(tr), 1, "1/n", frames, lease)  # (counted as an internal rejection; never raises)
    assert lease.released == 1 and tr.recv_nowait("op.rs0.1.0") is None
    monkeypatch.undo()
    frames, mem = _frames("op.rs0.1.1", [1, 2])
    lease = FakeLease()
    with pytest.raises(MemoryError):
        with tr.lend("op.", 3):
            tr._ingest(_nic(tr), 1, "1/n", frames, lease)  # lent, never taken
            monkeypatch.setattr("p2psync.transport.lending.np.array", no_memory)  # the copy at close fails
    assert lease.released == 1
    msg = tr.recv_nowait("op.rs0.1.1")
    assert msg is not None and msg.arrays == []  # no view of given-back memory


async def test_the_collectives_read_a_borrowed_piece_before_giving_it_back(monkeypatch):
    """Every bulk message of an allreduce arrives as read-only views of a stand-in ring whose
    lease poisons it (NaN bytes) when given back: the sums are exact, so every piece was read
    before its release; and every release came from the collectives while their operation
    ran, none from the scope's close."""
    from p2psync.transport.memory import MemoryTransport
    from tests.helpers import memory_collectives

    releases: list[bool] = []
    plain = MemoryTransport._transmit

    def transmit(self, peer, route, frames, *, bulk=False, unordered=False):
        target = self.hub.endpoints.get(peer)
        if target is None or not bulk:
            return plain(self, peer, route, frames, bulk=bulk, unordered=unordered)
        ring = [np.frombuffer(bytes(f), np.uint8).copy() for f in placed(frames)]

        class Poison:
            def release(self_) -> None:
                releases.append(bool(target.lending._scopes))  # still inside the operation?
                for r in ring[1:]:
                    r[...] = 0xFF  # a NaN in every float32

        target._ingest(route.remote_nic, self.node_id, f"{self.node_id}/{route.local_nic}",
                       [memoryview(r).toreadonly() for r in ring], Poison())

    monkeypatch.setattr(MemoryTransport, "_transmit", transmit)
    topo = ring(4)
    xs = {i: np.arange(3000, dtype=np.float32) * (i + 1) for i in topo.ids}
    async with memory_collectives(topo, piece_bytes=2048) as cs:
        outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag="x") for i in topo.ids))
        assert all(c.transport.lending.lent > 0 and c.transport.lending.copied == 0 for c in cs.values())
    assert all(np.array_equal(o, np.arange(3000, dtype=np.float32) * 10) for o in outs)
    assert releases and all(releases)

"""Lending received shared-memory frames (:mod:`p2psync.transport.lending`, ``Transport.lend``):
only a scope's own tags are lent, everything else gets arrays of its own and gives the space
back at once; a borrower's release gives it back; what a scope lent and nobody released is
copied and released when it closes; a message that is not delivered gives its space back. The
leases here stand in for the shared-memory ring's (tests/unit/test_shm.py has the ring's own);
the message path is the transport's real ``_ingest`` and mailbox."""

from __future__ import annotations

import numpy as np
import pytest

from p2psync.errors import ConfigError
from p2psync.topology import ring
from p2psync.transport.lending import Lending
from p2psync.transport.memory import MemoryHub
from p2psync.wire import encode


class FakeLease:
    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


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
    lease = FakeLease()
    tr._ingest(_nic(tr), 1, "1/n", frames, lease)
    assert lease.released == 1
    msg = tr.recv_nowait("op.rs0.1.0")
    mem[:] = 9  # the sender reuses its ring
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
    leases = [FakeLease() for _ in range(3)]
    mems = []
    with tr.lend("op.", 3):
        for k, lease in enumerate(leases):
            frames, mem = _frames(f"op.ag0.1.{k}", [k, k + 1])
            mems.append(mem)
            tr._ingest(_nic(tr), 1, "1/n", frames, lease)
        taken = await tr.recv("op.ag0.1.0", timeout=1)  # taken, never released (its consumer failed)
        assert [x.released for x in leases] == [0, 0, 0]
    assert [x.released for x in leases] == [1, 1, 1] and tr.lending.outstanding == 0
    for mem in mems:
        mem[:] = -1  # the sender reuses its ring
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

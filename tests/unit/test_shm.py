"""The shared-memory ring of :mod:`p2psync.transport.shm`, sender and receiver in one process:
frames come out as they went in, across the ring's end, in order; a full ring refuses instead of
overwriting; a failed send gives its space back; the receiver takes only what a sender can have
written, only from the sender the routing id proved, and drops a restarted sender's old ring;
segments of dead processes are swept; no /dev/shm leaves the frames unchanged."""

from __future__ import annotations

import os
import subprocess
import sys

import msgpack
import numpy as np
import pytest

from p2psync.errors import ProtocolError
from p2psync.transport import shm

pytestmark = pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="no /dev/shm")

KIB = 1 << 10


def _frames(*sizes: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]


def _resolve(inn: shm.Inbound, src: int, frames: list) -> list[bytes]:
    """``take``, with the frames copied out and the space given back at once."""
    out, lease = inn.take(src, frames)
    try:
        return [bytes(f) for f in out]
    finally:
        lease.release()


def _send(out: shm.Outbound, frames: list, peer: int = 1, nic: str = "l0"):
    staged, seg, head, count = out.stage(peer, nic, [b"header", *frames])
    return staged, seg, head, count


@pytest.fixture
def pair():
    out, inn = shm.Outbound(0, capacity=256 * KIB), shm.Inbound(1)
    yield out, inn
    paths = [s.path for s in out._segs.values() if s is not None]
    out.close()
    inn.close()
    for p in paths:  # left by close() while frames waited (nobody mapped them)
        if os.path.exists(p):
            os.unlink(p)


def test_frames_come_out_as_they_went_in_across_the_end_of_the_ring(pair):
    out, inn = pair
    for k in range(12):  # 12 x 170 KiB through a 256 KiB ring: frames skip the end of it
        f = _frames(100 * KIB, 70 * KIB, seed=k)
        staged, seg, _, count = _send(out, f)
        assert seg is not None and count == 2 and staged[0].startswith(shm.MARKER)
        assert [len(x) for x in staged[1:]] == [6, 0, 0]  # the header stays, the big frames left
        got = _resolve(inn, 0, staged)
        assert bytes(got[0]) == b"header"
        assert [bytes(g) for g in got[1:]] == [x.tobytes() for x in f]
    assert out.frames == 24


def test_small_frames_stay_in_the_message(pair):
    out, _ = pair
    staged, seg, _, _ = _send(out, _frames(shm.MIN_FRAME - 1))
    assert seg is None and len(staged) == 2


def test_a_full_ring_refuses_and_a_failed_send_gives_its_space_back(pair):
    out, inn = pair
    first, seg, head, count = _send(out, _frames(200 * KIB))
    assert seg is not None
    second, seg2, _, _ = _send(out, _frames(100 * KIB))  # 200 + 100 > 256 KiB, nothing taken yet
    assert seg2 is None and len(second) == 2  # sent over ZeroMQ as it is
    out.rollback(seg, head, count)  # the first message was never sent
    again, seg3, _, _ = _send(out, _frames(200 * KIB, seed=5))
    assert seg3 is not None
    assert bytes(_resolve(inn, 0, again)[1]) == _frames(200 * KIB, seed=5)[0].tobytes()
    third, seg4, _, _ = _send(out, _frames(200 * KIB, seed=6))  # taken: room again
    assert seg4 is not None


def _marker(name: str, entries: list) -> bytes:
    return shm.MARKER + msgpack.packb([name, entries])


def test_the_receiver_takes_only_what_a_sender_can_have_written(pair):
    out, inn = pair
    inn.max_frame = 200 * KIB
    staged, seg, _, _ = _send(out, _frames(100 * KIB))
    name = seg.name
    with pytest.raises(ProtocolError, match="named segment"):
        _resolve(inn, 2, staged)  # node 2 cannot name node 0's segment
    with pytest.raises(ProtocolError, match="named segment"):  # no 4300-digit int() in a callback
        _resolve(inn, 0, [_marker(name.replace("-0-", "-" + "9" * 5000 + "-", 1), [[2, 0, 1]]), b"h", b""])
    bad = [  # for a message of two frames after the marker: b"h" and an empty one
        [[1, 0, 10]],  # frame 1 is not empty: it was not moved out
        [[3, 0, 10]],  # there is no frame 3
        [[0, 0, 10]],  # nor a frame 0 (the marker)
        [[2, 0, 10], [2, 10, 10]],  # the same frame twice
        [[2, 300 * KIB, 10]],  # more than a ring ahead of what was taken
        [[2, 0, 300 * KIB]],  # longer than the ring
        [[2, 250 * KIB, 10 * KIB]],  # across the end of the ring (a frame never wraps)
        [[2, 0, 210 * KIB]],  # over the receiver's frame limit (200 KiB here)
        [[2, 0, -1]],
        "nope",
    ]
    for entries in bad:
        with pytest.raises(ProtocolError):
            _resolve(inn, 0, [_marker(name, entries), b"h", b""])
    with pytest.raises(ProtocolError, match="unreadable"):
        _resolve(inn, 0, [shm.MARKER + b"\xc1", b"h"])
    with pytest.raises(ProtocolError, match="named segment"):
        _resolve(inn, 0, [_marker("../etc/passwd", [[1, 0, 1]]), b"h", b""])
    got = _resolve(inn, 0, staged)  # the real one still goes through
    assert bytes(got[1]) == _frames(100 * KIB)[0].tobytes()
    with pytest.raises(ProtocolError):  # positions never go back
        _resolve(inn, 0, [_marker(name, [[1, 0, 10]]), b"h", b""])


def test_the_receiver_maps_only_a_private_regular_file_of_its_user(tmp_path):
    inn = shm.Inbound(1)
    base = f"{shm.PREFIX}0-{b'l0'.hex()}-1-{os.getpid()}-"
    shared, link = base + "aaaaaaaa", base + "bbbbbbbb"
    path = os.path.join(shm.SHM_DIR, shared)
    try:
        with open(path, "wb") as f:
            f.truncate(4096)
        os.chmod(path, 0o644)  # readable by others: not one of ours
        with pytest.raises(ProtocolError, match="not a private file"):
            _resolve(inn, 0, [_marker(shared, [[2, 0, 1]]), b"h", b""])
        target = tmp_path / "elsewhere"
        target.write_bytes(b"x" * 4096)
        os.symlink(target, os.path.join(shm.SHM_DIR, link))
        with pytest.raises(ProtocolError, match="segment"):  # O_NOFOLLOW
            _resolve(inn, 0, [_marker(link, [[2, 0, 1]]), b"h", b""])
    finally:
        inn.close()
        for n in (shared, link):
            if os.path.lexists(os.path.join(shm.SHM_DIR, n)):
                os.unlink(os.path.join(shm.SHM_DIR, n))


def test_the_receiver_unlinks_what_it_mapped_and_drops_a_restarted_senders_ring():
    inn = shm.Inbound(1)
    a = shm.Outbound(0, capacity=256 * KIB)
    try:
        staged, seg, _, _ = _send(a, _frames(100 * KIB))
        _resolve(inn, 0, staged)
        assert not os.path.exists(seg.path)  # mapped on both sides: unlinked
        b = shm.Outbound(0, capacity=256 * KIB)  # node 0 again, a new ring
        staged2, seg2, _, _ = _send(b, _frames(100 * KIB, seed=1))
        _resolve(inn, 0, staged2)
        assert list(inn._maps) == [seg2.name]
        b.close()
    finally:
        a.close()
        inn.close()


def test_close_unlinks_a_segment_nobody_mapped_unless_frames_wait_in_it():
    out = shm.Outbound(0, capacity=256 * KIB)
    _, seg, _, _ = _send(out, _frames(100 * KIB))
    out.close()  # the frame was never taken: left for the receiver (or the next sweep)
    assert os.path.exists(seg.path)
    os.unlink(seg.path)
    out = shm.Outbound(0, capacity=256 * KIB)
    _, seg, head, count = _send(out, _frames(100 * KIB))
    out.rollback(seg, head, count)  # nothing waits
    out.close()
    assert not os.path.exists(seg.path)


def test_segments_of_dead_processes_are_swept_when_an_endpoint_starts():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    names = [f"{shm.PREFIX}7-{b'l0'.hex()}-1-{dead}-ab12ab12", f"{shm.PREFIX}7-{b'l0'.hex()}-1-{os.getpid()}-cd34cd34",
             f"{shm.PREFIX}8-{b'l0'.hex()}-1-{dead}-ef56ef56", f"{shm.PREFIX}not-ours-{dead}"]
    for n in names:
        open(os.path.join(shm.SHM_DIR, n), "wb").close()
    try:
        shm.Inbound(3).close()  # every endpoint (without keys) has one
        left = {n for n in names if os.path.exists(os.path.join(shm.SHM_DIR, n))}
        assert left == {names[1], names[3]}  # a live process's and a name that is not a segment's stay
    finally:
        for n in names:
            if os.path.exists(os.path.join(shm.SHM_DIR, n)):
                os.unlink(os.path.join(shm.SHM_DIR, n))


def test_without_shared_memory_the_frames_go_unchanged(monkeypatch, caplog):
    monkeypatch.setattr(shm, "SHM_DIR", "/nonexistent-p2psync")
    out = shm.Outbound(0)
    f = _frames(100 * KIB)
    for _ in range(2):
        staged, seg, _, _ = _send(out, f)
        assert seg is None and staged[1] is f[0]
    assert sum("no shared memory" in r.message for r in caplog.records) == 1  # logged once per peer
    out.close()


@pytest.mark.parametrize("addr,local", [("127.0.0.1", True), ("127.3.0.9", True), ("localhost", True),
                                        ("::1", True), ("198.18.0.1", False), ("198.19.7.1", False),
                                        ("host.example", False)])
def test_same_host_means_loopback(addr, local):
    assert shm.same_host(addr) is local


def test_taken_frames_are_views_whose_space_comes_back_in_order_once_released(pair):
    """``take`` lends views of the ring; the consumed counter moves only over leases given back
    with every lease before them, so the sender cannot overwrite a frame still being read."""
    out, inn = pair
    sent = [_frames(100 * KIB, seed=s)[0] for s in (1, 2)]
    (a, _, _, _), (b, _, _, _) = _send(out, [sent[0]]), _send(out, [sent[1]])
    (fa, la), (fb, lb) = inn.take(0, a), inn.take(0, b)
    assert bytes(fa[1]) == sent[0].tobytes() and bytes(fb[1]) == sent[1].tobytes()
    assert fa[1].readonly
    seg = next(iter(inn._maps.values()))
    assert int(seg.consumed[0]) == 0 and seg.outstanding == 2
    full, s, _, _ = _send(out, _frames(100 * KIB, seed=3))
    assert s is None  # 200 KiB lent of 256: no room until given back
    lb.release()  # the later one first: it waits for the earlier
    assert int(seg.consumed[0]) == 0 and seg.outstanding == 2
    la.release()
    la.release()  # idempotent
    assert int(seg.consumed[0]) == seg.taken and seg.outstanding == 0
    again, s, _, _ = _send(out, _frames(100 * KIB, seed=3))
    assert s is not None
    assert bytes(_resolve(inn, 0, again)[1]) == _frames(100 * KIB, seed=3)[0].tobytes()
    assert seg.outstanding == 0  # resolve copies and gives the space back at once


def test_closing_with_a_lent_view_leaves_the_view_readable(pair):
    out, inn = pair
    f = _frames(100 * KIB, seed=4)[0]
    staged, _, _, _ = _send(out, [f])
    frames, lease = inn.take(0, staged)
    view = np.frombuffer(frames[1], np.uint8)
    inn.close()  # the map cannot close under a view: it goes with the last one
    assert view.tobytes() == f.tobytes()
    lease.release()  # after close: nothing to advance, no error


def test_a_marker_cannot_reuse_space_still_lent_even_with_a_forged_counter(pair):
    """Frames taken and not given back: a marker naming a position inside them (before what
    was taken) is refused, also after the sender wrote the shared consumed counter past them:
    the receiver checks against its own record of what it gave back."""
    out, inn = pair
    staged, seg, _, _ = _send(out, [_frames(100 * KIB, seed=7)[0]])
    frames, lease = inn.take(0, staged)
    name = seg.name
    (received,) = inn._maps.values()
    assert received.given == 0 and received.taken == 100 * KIB
    # 300 KiB lies one ring (256 KiB) past 44 KiB: inside the frame still lent
    for forged_counter in (False, True):
        if forged_counter:
            received.consumed[0] = 200 * KIB  # the sender claims more was given back than was
        for pos in (10 * KIB, 300 * KIB):
            with pytest.raises(ProtocolError, match="outside"):
                _resolve(inn, 0, [_marker(name, [[2, pos, 10 * KIB]]), b"h", b""])
    assert bytes(frames[1]) == _frames(100 * KIB, seed=7)[0].tobytes()
    lease.release()
    assert received.given == int(received.consumed[0]) == 100 * KIB

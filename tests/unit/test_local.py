"""The datagram channel between processes of one host (issue 17, p2psync.transport.local), on
real Unix sockets: what is sent is what is received, frame by frame; a message too big for one
datagram is refused (the caller sends it over ZeroMQ), a missing or full receiver asks for a
send over ZeroMQ instead, and whatever is not a well-formed datagram of this user is rejected, never a crash."""

from __future__ import annotations

import os
import socket
import struct

import numpy as np
import pytest

from p2psync.errors import ProtocolError
from p2psync.transport import local

pytestmark = pytest.mark.skipif(not local.available(), reason="Linux only (abstract Unix addresses)")


@pytest.fixture
def pair():
    name = local.address(f"tcp://127.0.0.1:test-{os.getpid()}-{id(object())}")
    rx, tx = local.LocalIn(name), local.LocalOut(7)
    try:
        yield name, rx, tx
    finally:
        rx.close()
        tx.close()


def test_frames_arrive_as_they_were_sent(pair):
    name, rx, tx = pair
    payload = np.arange(100, dtype=np.float32)
    frames = [b"header", b"", memoryview(payload).cast("B"), bytearray(b"xyz")]
    assert tx.send(name, frames) is True
    src, got = rx.recv()
    assert src == 7 and [bytes(f) for f in got] == [bytes(f) for f in frames]
    assert np.frombuffer(got[2], np.float32).tolist() == payload.tolist()
    assert rx.recv() is None  # nothing more waits
    assert (tx.sent, rx.received) == (1, 1)


def test_received_frames_outlive_the_next_datagram(pair):
    name, rx, tx = pair
    tx.send(name, [b"first"])
    tx.send(name, [b"second!"])
    _, a = rx.recv()
    _, b = rx.recv()
    assert bytes(a[0]) == b"first" and bytes(b[0]) == b"second!"


def test_a_message_too_big_for_one_datagram_is_left_to_zeromq(pair):
    name, rx, tx = pair
    assert tx.send(name, [b"h", bytes(local.MAX_DATAGRAM)]) is False
    assert rx.recv() is None and tx.sent == 0


def test_nobody_bound_there_leaves_it_to_zeromq():
    tx = local.LocalOut(1)
    try:
        assert tx.send(local.address(f"tcp://127.0.0.1:nobody-{os.getpid()}"), [b"x"]) is False
        assert (tx.sent, tx.refused) == (0, 1)
    finally:
        tx.close()


def test_a_full_receiver_leaves_it_to_zeromq_and_loses_nothing(pair):
    name, rx, tx = pair
    sent = 0
    while tx.send(name, [struct.pack("<I", sent)]):  # the kernel queues a bounded number of datagrams
        sent += 1
        assert sent < 100_000
    assert tx.refused == 1
    got = []
    while (m := rx.recv()) is not None:
        got.append(struct.unpack("<I", bytes(m[1][0]))[0])
    assert got == list(range(sent))  # every one that went, in order; the refused one did not


def _raw(name: bytes, data: bytes) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.sendto(data, name)
    finally:
        s.close()


@pytest.mark.parametrize("data, reason", [
    (b"P2D", "local_datagram"),  # shorter than a prefix
    (b"XXXX" + struct.pack("<IH", 1, 0), "local_datagram"),  # not the magic
    (b"P2D1" + struct.pack("<IH", 1, 3) + struct.pack("<I", 4), "local_datagram"),  # lengths missing
    (b"P2D1" + struct.pack("<IH", 1, 1) + struct.pack("<I", 9) + b"abc", "local_datagram"),  # lengths lie
    (b"P2D1" + struct.pack("<IH", 1, 1) + struct.pack("<I", 1) + b"ab", "local_datagram"),  # bytes left over
])
def test_a_malformed_datagram_is_rejected_and_the_next_one_still_arrives(pair, data, reason):
    name, rx, tx = pair
    _raw(name, data)
    tx.send(name, [b"fine"])
    with pytest.raises(ProtocolError) as exc:
        rx.recv()
    assert exc.value.reason == reason
    assert bytes(rx.recv()[1][0]) == b"fine"


def test_a_datagram_longer_than_the_limit_is_rejected_not_cut(pair):
    name, rx, _ = pair
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    try:
        s.sendto(b"P2D1" + struct.pack("<IH", 1, 1) + struct.pack("<I", local.MAX_DATAGRAM) + bytes(local.MAX_DATAGRAM),
                 name)
    finally:
        s.close()
    with pytest.raises(ProtocolError, match="longer than"):
        rx.recv()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to send as another user")
def test_another_users_datagram_is_rejected(pair):
    name, rx, _ = pair
    pid = os.fork()
    if pid == 0:  # the child: another user sends a well-formed datagram, nothing else
        code = 1
        try:
            os.setuid(65534)
            _raw(name, b"P2D1" + struct.pack("<IHI", 1, 1, 1) + b"x")
            code = 0
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    with pytest.raises(ProtocolError) as exc:
        rx.recv()
    assert exc.value.reason == "local_user"


def test_a_second_receiver_cannot_take_the_same_address(pair):
    name, _, _ = pair
    with pytest.raises(OSError):
        local.LocalIn(name)

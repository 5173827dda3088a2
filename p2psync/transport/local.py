"""Datagrams between the processes of one host: tensor pieces without ZeroMQ's IO threads.

A ZeroMQ message between two processes of one host goes from the sender's loop thread to its
IO thread (an ``eventfd`` wake-up), through loopback TCP to the receiver's IO thread, and from
there to the receiver's loop thread (another wake-up), and each end reads the socket's
``EVENTS`` after every send and receive (the descriptor is edge-triggered). With the frames
themselves in shared memory (:mod:`p2psync.transport.shm`), what is left per message is a
header of about a hundred bytes, and most of the time went into moving it. Here it goes as one
Unix datagram (``AF_UNIX``, ``SOCK_DGRAM``) from the sender's loop thread straight into the
receiver's socket, which wakes the receiver's loop directly: one system call on each side
(``bench/`` and ``python -m bench.allreduce``: see the README for the figures).

* **Who uses it.** A sender with shared memory on (``SocketOptions.shm``, unkeyed) sends a bulk
  message this way to a peer whose NIC and its own are both loopback addresses, when the
  message is *unordered* (``Transport.send(..., unordered=True)``: the collectives' pieces,
  each under a tag of its own, so their order relative to other messages means nothing) and
  small enough (:data:`MAX_DATAGRAM`, the frames in shared memory not counted). Everything
  else goes over ZeroMQ as before, so the order of every other message between two nodes is
  still ZeroMQ's (first in, first out).
* **Who receives.** Every unkeyed endpoint on Linux binds one datagram socket per loopback NIC,
  at an abstract address (no file) named after that NIC's ZeroMQ endpoint and this user
  (:func:`address`), right after binding the TCP port. A message the receiver cannot take as a
  datagram (its queue is full, nobody is bound there: not started yet, or gone, or any other
  error of the socket) goes over ZeroMQ, which queues it or retries it as any other message:
  the datagram is only ever the faster way, never the only one.
* **The rings.** A datagram's big frames go through a shared-memory ring of their own
  (:data:`~p2psync.transport.shm.DATAGRAM`), never the one ZeroMQ's messages use: the receiver
  takes a ring's frames only in the order they were staged, and datagrams keep their order
  among themselves but not with ZeroMQ. One that does not go gives its ring space back, and
  the message is staged again for ZeroMQ (a Fill computed again).
* **What a datagram holds.** A prefix (``P2D1``, the sender's node id, the frame count, each
  frame's length), then the frames of the ZeroMQ message it replaces (a shared-memory marker
  first when there is one, the wire header, the payload frames). The receiver takes the
  frames exactly as from ZeroMQ (the marker, the strict decoder, the mailbox).
* **Checks.** The kernel tells the receiver the sender's user (``SO_PASSCRED``): only this
  user's processes are taken, as for shared memory (the nodes of one host run as one user).
  The node id in the prefix must be a neighbour on this host over that NIC; a malformed
  prefix, a truncated datagram or another user's is rejected and counted, like a malformed
  ZeroMQ message. Unkeyed clusters only: with keys every byte goes through CurveZMQ.
* **What it does not prove.** An abstract address has no permissions: any local process
  can bind a node's name first (that node's start then fails with a clear error) or after the
  node has exited (it then receives what is sent there until the peer is marked down), and
  the sender does not check who holds it. That is what an unkeyed cluster already allows
  anyone who can take a node's TCP port or claim its routing id; a cluster that must prove
  who is who runs with keys, where none of this is used.
* Failure detection stays ZeroMQ's: its connections (and heartbeats) to the peer are still
  there; a peer marked down gets nothing this way either.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import sys
from typing import Any, Callable, Sequence

from p2psync.errors import ProtocolError, TransportError
from p2psync.topology import Route, Topology
from p2psync.transport.shm import DATAGRAM, Outbound

log = logging.getLogger("p2psync.transport")

#: the largest datagram sent (bytes, the prefix included); a bigger message goes over ZeroMQ
MAX_DATAGRAM = 192 << 10
#: kernel buffer asked for on both ends (capped by ``net.core.[rw]mem_max``)
_BUFFER = 4 << 20
_MAGIC = b"P2D1"
_PREFIX = struct.Struct("<4sIH")  # magic, sender node, frame count; then a uint32 per frame
_CRED = struct.Struct("<iII")  # struct ucred: pid, uid, gid
_ANC = socket.CMSG_SPACE(_CRED.size) if hasattr(socket, "CMSG_SPACE") else 0
_MAX_FRAMES = 4096
# plain ints: the socket module's are enum members, and ``&`` on them runs Python code
_SOL_SOCKET, _SCM_CREDENTIALS = int(socket.SOL_SOCKET), int(getattr(socket, "SCM_CREDENTIALS", -1))
_MSG_TRUNC = int(socket.MSG_TRUNC)


def available() -> bool:
    """Whether this platform has what the channel needs (Linux: abstract Unix addresses and
    ``SCM_CREDENTIALS``)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_PASSCRED")


def address(endpoint: str) -> bytes:
    """The abstract Unix address of the datagram socket of the NIC whose ZeroMQ endpoint is
    ``endpoint`` (``tcp://127.0.0.1:5555``), for this user."""
    return b"\0p2psync-dg-%d-%s" % (os.geteuid(), endpoint.encode())


class LocalOut:
    """The sending side: one unbound datagram socket per endpoint."""

    def __init__(self, me: int) -> None:
        self.me = me
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER)
        self.sent = 0  # messages that went this way
        self.refused = 0  # datagrams the receiver could not take (they went over ZeroMQ)

    def send(self, to: bytes, frames: Sequence[Any]) -> bool:
        """Send ``frames`` (bytes-like) as one datagram to ``to``: whether it went. False when it
        is too big for one, or the receiver cannot take it now (its queue is full, nobody is
        bound there yet or any more, or any other error of the socket): the caller sends it
        over ZeroMQ, which queues it or retries as for any message."""
        sizes = [memoryview(f).nbytes for f in frames]
        n = len(sizes)
        if n > _MAX_FRAMES or _PREFIX.size + 4 * n + sum(sizes) > MAX_DATAGRAM:
            return False
        head = _PREFIX.pack(_MAGIC, self.me, n) + struct.pack(f"<{n}I", *sizes)
        try:
            self.sock.sendmsg([head, *frames], (), 0, to)
        except OSError:  # EAGAIN (queue full), ECONNREFUSED / ENOENT (nobody there), EMSGSIZE, ...
            self.refused += 1
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        self.sock.close()


class LocalIn:
    """The receiving side of one loopback NIC: a datagram socket bound at :func:`address`."""

    def __init__(self, name: bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER)
            self.sock.bind(name)
        except OSError:
            self.sock.close()
            raise
        self._buf = bytearray(MAX_DATAGRAM + 1)  # one byte more: a longer datagram shows as truncated
        self._view = memoryview(self._buf)
        self._uid = os.geteuid()
        self.received = 0  # messages taken this way

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv(self) -> tuple[int, list[memoryview]] | None:
        """The next datagram's sender (the node id it claims) and frames, or None when none is
        waiting. Raises :class:`ProtocolError` for a datagram it consumed and rejects."""
        try:
            n, anc, flags, _ = self.sock.recvmsg_into([self._buf], _ANC)
        except (BlockingIOError, InterruptedError):
            return None
        uid = None
        for level, kind, cred in anc:
            if level == _SOL_SOCKET and kind == _SCM_CREDENTIALS and len(cred) >= _CRED.size:
                uid = _CRED.unpack(cred[:_CRED.size])[1]
                break
        if uid != self._uid:
            raise ProtocolError("local_user", f"datagram from user {uid}, not this node's user")
        if flags & _MSG_TRUNC or n > MAX_DATAGRAM:
            raise ProtocolError("local_datagram", f"datagram longer than {MAX_DATAGRAM} bytes")
        data = memoryview(bytes(self._view[:n]))  # its own copy: the frames outlive the next receive
        if n < _PREFIX.size:
            raise ProtocolError("local_datagram", f"{n} bytes: no prefix")
        magic, src, count = _PREFIX.unpack_from(data)
        at = _PREFIX.size + 4 * count
        if magic != _MAGIC or at > n:
            raise ProtocolError("local_datagram", "bad prefix")
        sizes = struct.unpack_from(f"<{count}I", data, _PREFIX.size)
        if at + sum(sizes) != n:
            raise ProtocolError("local_datagram", f"frame lengths add up to {sum(sizes)}, not {n - at} bytes")
        frames = []
        for size in sizes:
            frames.append(data[at:at + size])
            at += size
        self.received += 1
        return src, frames

    def close(self) -> None:
        self.sock.close()


class LocalChannel:
    """The datagram channel of one endpoint (:class:`~p2psync.transport.zmq_endpoint.ZmqEndpoint`)
    to and from the peers on its host: one :class:`LocalIn` per loopback NIC, one
    :class:`LocalOut` when the endpoint sends through shared memory."""

    def __init__(self, *, node_id: int, topology: Topology, loopback: frozenset[str],
                 on_host: frozenset[tuple[int, str]], take_in: Callable[[str, int, str, list[Any]], None],
                 reject: Callable[[str, str, str, str], None]) -> None:
        """``loopback``: this node's NICs with loopback addresses; ``on_host``: the routes
        (peer, our NIC) whose both ends are loopback. ``take_in(nic, node, label, frames)``
        hands a received datagram's frames over (a shared-memory marker may come first);
        ``reject(nic, label, reason, detail)`` counts and logs a refused datagram (its label is
        the sender's word, so logged once per NIC and reason)."""
        self.node_id = node_id
        self.topology = topology
        self.node = topology.node(node_id)
        self.loopback = loopback
        self._take_in = take_in
        self._reject = reject
        #: the sending side (from :meth:`start` on, when this endpoint sends through shared memory)
        self.out: LocalOut | None = None
        #: the receiving side of each loopback NIC (from :meth:`start` on)
        self.inbound: dict[str, LocalIn] = {}
        self._to: dict[tuple[int, str], bytes] = {}
        #: per loopback NIC of ours, the neighbours on this host that reach us over it
        self._from = {nic: frozenset(p for p, n in on_host if n == nic) for nic in loopback}

    def start(self, loop: asyncio.AbstractEventLoop, *, send: bool) -> list[int]:
        """Bind the datagram socket of every loopback NIC (after its TCP port: see the module
        docstring) and watch it on ``loop``; ``send``: send unordered bulk messages to peers on
        this host as datagrams from now on. Returns the descriptors watched (the caller stops
        watching them before :meth:`close`). Nothing on a platform without the channel."""
        if not available():
            return []
        if send and self.out is None:
            self.out = LocalOut(self.node_id)
        fds = []
        for nic in self.node.nics:
            if nic.name not in self.loopback:
                continue
            try:
                ch = LocalIn(address(nic.endpoint))
            except OSError as exc:
                raise TransportError(f"node {self.node_id} NIC {nic.name}: cannot bind the local datagram "
                                     f"address of {nic.endpoint}: {exc.strerror}") from None
            self.inbound[nic.name] = ch
            fds.append(ch.fileno())
            loop.add_reader(ch.fileno(), self.drain, nic.name)
        return fds

    def send(self, shm: Outbound, peer: int, route: Route, frames: list[Any]) -> bool:
        """Send an unordered bulk message to ``peer`` as a datagram, its big frames through the
        datagram ring (:data:`~p2psync.transport.shm.DATAGRAM`; the receiver takes a ring's
        frames only in order, and datagrams keep their order among themselves, not with ZeroMQ):
        whether it went. When it did not, the ring space is given back and the caller sends the
        message over ZeroMQ, staged in ZeroMQ's own ring."""
        if self.out is None:
            return False
        key = (peer, route.remote_nic)
        to = self._to.get(key)
        if to is None:
            to = self._to[key] = address(self.topology.node(peer).nic(route.remote_nic).endpoint)
        staged, seg, head, count = shm.stage(peer, route.local_nic, frames, DATAGRAM)  # (computes Fills)
        went = False
        try:
            went = self.out.send(to, staged)
        finally:
            if not went and seg is not None:
                shm.rollback(seg, head, count)
        return went

    def drain(self, nic: str) -> None:
        """Take the next datagram waiting on ``nic``'s socket (loop callback; never raises). One
        per call: the loop watches the socket level-triggered, so it calls again while more
        wait, and looking for a second one would mostly find none (an exception, and a system
        call, per message)."""
        ch = self.inbound.get(nic)
        if ch is None or ch.sock.fileno() < 0:
            return
        try:
            got = ch.recv()
        except ProtocolError as exc:
            self._reject(nic, f"a datagram on {nic}", exc.reason, exc.detail)
            return
        except OSError as exc:
            log.warning("node %d NIC %s: datagram receive error %s", self.node_id, nic, exc)
            return
        if got is None:
            return
        src, frames = got
        if src not in self._from.get(nic, ()):
            self._reject(nic, f"a datagram on {nic}", "unknown_peer",
                         f"node {src} is not a neighbour on this host over NIC {nic}")
            return
        self._take_in(nic, src, f"{src}/datagram", frames)

    def close(self) -> None:
        for ch in self.inbound.values():
            ch.close()
        self.inbound.clear()
        if self.out is not None:
            self.out.close()
            self.out = None

    @property
    def sent(self) -> int:
        """Messages sent as datagrams."""
        return self.out.sent if self.out is not None else 0

    @property
    def received(self) -> int:
        """Messages taken as datagrams."""
        return sum(ch.received for ch in self.inbound.values())


__all__ = ["LocalChannel", "LocalIn", "LocalOut", "MAX_DATAGRAM", "address", "available"]

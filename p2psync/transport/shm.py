"""Shared memory for the bulk frames of peers on one host (opt-in: ``SocketOptions.shm``).

Over loopback TCP every byte of a frame is copied by the kernel twice and by ZeroMQ's IO
threads on both sides; ``bench.allreduce``'s ``floor-shm`` row measured a ring through shared
memory at 1.45-2.3x the bare-ZeroMQ tcp floor on 2 cores. With ``shm`` on, a frame of at least
:data:`MIN_FRAME` bytes to a peer whose NIC and ours are both loopback addresses is written into
a ring buffer in ``/dev/shm`` that this node owns for that peer and NIC (a :class:`Segment`), and
the ZeroMQ message carries an empty frame in its place and, first, a marker frame naming the
segment and each stored frame's position. The receiver maps the segment (:class:`Inbound`)
and takes the frames as read-only views of it, with a :class:`Lease` on their space. The
transport then either lends the views to a consumer that asked to borrow them (the collectives
add a piece straight from the sender's ring into their working buffer, then release it:
:meth:`Transport.lend <p2psync.transport.base.Transport.lend>`), or copies them out at once (so
what every other consumer gets owns its memory, as a received frame does) and releases the
lease. Released leases advance the segment's *consumed* counter, in order, which frees the
space for the sender. The message itself (order, flow control, failure detection, the shaper
before it) is ZeroMQ's as always, or, for an unordered message, a datagram's
(:mod:`p2psync.transport.local`). The receiver takes a ring's markers only in the order they
were staged, so each of the two ways has rings of its own (``Outbound.stage``'s ``channel``).

* The ring never blocks: a frame that does not fit (the receiver is slow, dead or has not
  mapped the segment yet) goes over ZeroMQ as usual. So does everything when ``/dev/shm`` is
  missing or full (logged once per peer and NIC).
* Every endpoint without keys takes marked messages, whatever its own ``shm``: sending through
  shared memory is each node's choice (``p2psync run --shm``), and a cluster may mix.
* Positions are absolute byte offsets that only grow (a frame never wraps: the rest of the ring
  is skipped), so the consumed counter is the end of the last frame given back (a lease given
  back early waits for the ones before it). A lease that is never given back only stalls the
  ring: the sender's next frames do not fit and go over ZeroMQ. One writer (the
  sender's loop thread) moves the head, one (the receiver's) the counter; 8-byte aligned.
* A :class:`~p2psync.wire.fill.Fill` frame (a sum the collectives send straight on) is
  computed into its slot of the ring, not into an array first and copied; one that does not fit
  is computed into its own array and goes over ZeroMQ.
* A send that fails after staging (``EAGAIN``, unreachable) gives the space back
  (:meth:`Outbound.rollback`), so the retry stages again.
* Names: ``p2psync-shm-<src>-<src nic and channel, hex>-<dst>-<pid>-<random>``, files of mode
  0600. The receiver resolves markers only on a peer's bulk pipe into a loopback NIC (or in a
  datagram from a neighbour on this host), only for names of the node the routing id (the
  datagram) names (with keys it is proven; shared memory is off then anyway) addressed to itself, and maps only a regular file of its own user, not readable by others,
  with one link and at most :data:`MAX_SEGMENT` bytes. It unlinks a segment once mapped (the
  memory lives while either side maps it) and drops the mapping when that sender, NIC and
  channel start a new one. The sender drops its segment for a peer whose connection went down (a restarted
  peer maps the next one; the old one may have been unlinked by the process that died) and
  unlinks its segments on close (unless frames are still to be taken: the receiver unlinks it
  when it maps it). Every endpoint start sweeps the segments of processes that no longer exist
  (a node killed before its peer mapped them).
* A malformed marker (unknown name, a file that fails the checks above, a position outside the
  ring, an index that is not an empty frame, a frame over the wire's frame limit) is a
  :class:`~p2psync.errors.ProtocolError`: the endpoint rejects the message.
* Not with keys (CurveZMQ): the bytes would bypass the encryption the cluster asked for.
* The nodes of one host must run as one user: a receiver that cannot open the named file
  rejects the message (counted under ``shm``), and its pieces are lost like a dropped message's
  (the collective then times out). Hence opt-in.
"""

from __future__ import annotations

import ipaddress
import logging
import mmap
import os
import re
import secrets
import stat
from collections import deque
from typing import Any, Sequence

import msgpack
import numpy as np

from p2psync.errors import ProtocolError
from p2psync.wire.fill import Fill, placed

log = logging.getLogger("p2psync.transport")

SHM_DIR = "/dev/shm"
PREFIX = "p2psync-shm-"
MARKER = b"\x00p2psync-shm1"  # never the start of a wire header (a msgpack map)
#: the channel name of the rings whose markers go as datagrams (:mod:`p2psync.transport.local`)
DATAGRAM = "/datagram"
#: frames smaller than this go over ZeroMQ (the marker and the copy cost more than they save)
MIN_FRAME = 64 << 10
#: ring bytes per (peer, NIC): the transport's per-peer window (8 MiB); reserved when the
#: segment is made (``posix_fallocate``: a full /dev/shm is an error then, not a SIGBUS later)
CAPACITY = 8 << 20
_HEADER = 64  # bytes 8-16: the consumed counter (uint64)
_NAME = re.compile(r"p2psync-shm-(\d{1,9})-([0-9a-f]{1,128})-(\d{1,9})-(\d{1,9})-([0-9a-f]{8})")
#: the largest segment a receiver maps (a sender's is _HEADER + CAPACITY)
MAX_SEGMENT = 1 << 30


def same_host(address: str) -> bool:
    """Whether a NIC's address is a loopback one (the peer then runs on this host)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _nbytes(frame: Any) -> int:
    return frame.nbytes if type(frame) is Fill else memoryview(frame).nbytes


class _Mapped:
    """An mmap of a segment file and its consumed counter."""

    def __init__(self, fd: int, size: int) -> None:
        self.mm = mmap.mmap(fd, size)
        self.capacity = size - _HEADER
        self.consumed = np.frombuffer(self.mm, np.uint64, count=1, offset=8)
        self.closed = False

    def close(self) -> None:
        """Unmap now, or, while views of it are still alive (frames lent out), when the last
        of them is garbage-collected."""
        if self.closed:
            return
        self.closed = True
        del self.consumed  # the view must go before the map can close
        try:
            self.mm.close()
        except BufferError:  # views of lent frames still exist: the map goes with the last
            pass


class Lease:
    """The ring space of one message's stored frames on the receiver's side: the sender may
    reuse it only once every lease taken before it, and it, are given back
    (:meth:`release`), so the consumed counter only moves over space nobody reads any more.
    Released leases wait for the ones before them (a queue per segment)."""

    __slots__ = ("_seg", "end", "done")

    def __init__(self, seg: "_Received", end: int) -> None:
        self._seg, self.end, self.done = seg, end, False

    def release(self) -> None:
        """Give the space back (idempotent). The frames' views must not be read after it: the
        sender may overwrite them at once."""
        if not self.done:
            self.done = True
            self._seg.advance()


class _Received(_Mapped):
    """A peer's segment this node mapped: what it took (``taken``, the end of the last frame
    handed out) and the leases not yet given back, oldest first."""

    def __init__(self, fd: int, size: int) -> None:
        super().__init__(fd, size)
        #: the end of what was given back: the counter as this node last wrote it (the sender
        #: could write the shared one too, so the checks never read that)
        self.given = self.taken = int(self.consumed[0])
        self.leases: deque[Lease] = deque()

    def lease(self, end: int) -> Lease:
        self.taken = end
        lease = Lease(self, end)
        self.leases.append(lease)
        return lease

    def advance(self) -> None:
        leases, end = self.leases, -1
        while leases and leases[0].done:
            end = leases.popleft().end
        if end >= 0:
            self.given = end
            if not self.closed:
                self.consumed[0] = end

    @property
    def outstanding(self) -> int:
        """Leases not yet given back (or waiting behind one that is not)."""
        return len(self.leases)


class Segment:
    """This node's ring buffer for one peer and NIC (sender side)."""

    def __init__(self, me: int, nic: str, peer: int, capacity: int = CAPACITY) -> None:
        self.name = f"{PREFIX}{me}-{nic.encode().hex()}-{peer}-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, _HEADER + capacity)
            self._m = _Mapped(fd, _HEADER + capacity)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.head = 0

    def put(self, frames: Sequence[Any]) -> tuple[list[tuple[int, int]], int] | None:
        """Store ``frames``; their (position, length) and the head to roll back to, or None
        (nothing stored) when they do not all fit now."""
        cap = self._m.capacity
        tail = int(self._m.consumed[0])
        head = self.head
        at: list[tuple[int, int]] = []
        for f in frames:
            n = _nbytes(f)
            off = head % cap
            if off + n > cap:  # a frame never wraps: skip the end of the ring
                head += cap - off
            if head + n - tail > cap:
                return None
            at.append((head, n))
            head += n
        mm = self._m.mm
        for (pos, n), f in zip(at, frames):
            o = _HEADER + pos % cap
            if type(f) is Fill:  # computed into its slot (if it raises, nothing was stored)
                f.into(np.frombuffer(mm, f.like.dtype, f.like.size, o).reshape(f.like.shape))
            else:
                mm[o:o + n] = memoryview(f).cast("B")
        old, self.head = self.head, head
        return at, old

    def close(self) -> None:
        """Unmap; unlink unless frames are still to be taken (a message ZeroMQ flushed at close
        may be the first the receiver maps: it unlinks the file then, or this node id's next
        start sweeps it)."""
        drained = int(self._m.consumed[0]) >= self.head
        self._m.close()
        if drained:
            try:
                os.unlink(self.path)
            except FileNotFoundError:  # the receiver unlinked it once mapped
                pass


def sweep() -> None:
    """Unlink the segments of processes that no longer exist."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(4)), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue  # someone else's live process
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass


class Outbound:
    """The segments of one endpoint (sender side), made on first use per (peer, NIC)."""

    def __init__(self, me: int, capacity: int | None = None) -> None:
        self.me, self.capacity = me, CAPACITY if capacity is None else capacity
        self._segs: dict[tuple[int, str, str], Segment | None] = {}  # None: shared memory failed there
        self.frames = 0  # frames sent through shared memory so far
        self.filled = 0  # of those, Fills computed straight into a ring
        self._fills = 0  # Fills the last stage put into a ring (a rollback takes them back)

    def forget(self, peer: int) -> None:
        """``peer``'s connection went down: its next frames go into new segments (a restarted
        peer cannot open the old ones: it unlinked them when it mapped them)."""
        for key in [k for k in self._segs if k[0] == peer]:
            seg = self._segs.pop(key)
            if seg is not None:
                seg.close()

    def stage(self, peer: int, nic: str, frames: list[Any],
              channel: str = "") -> tuple[list[Any], Segment | None, int, int]:
        """The frames to send to ``peer`` on ``nic`` (the big ones moved into the segment, a
        marker first; a :class:`~p2psync.wire.fill.Fill` it did not take computed into its own
        array), the segment used (None: the frames unchanged), the head to roll back to and
        how many frames it took. ``channel``: each way of sending to the peer has a ring of its
        own (``""`` ZeroMQ, :data:`DATAGRAM`): the receiver takes a ring's markers only in the
        order they were staged, and only one way keeps that order."""
        big: list[int] = []  # (one pass over the frames each time: this runs for every message)
        stored: list[Any] = []
        rest: list[Any] = []
        fills = 0
        for i, f in enumerate(frames):
            if _nbytes(f) >= MIN_FRAME:
                big.append(i)
                stored.append(f)
                rest.append(b"")
                fills += type(f) is Fill
            else:
                rest.append(f)
        seg = self._segment(peer, nic, channel) if big else None
        got = seg.put(stored) if seg is not None else None
        if seg is None or got is None:
            return placed(frames), None, 0, 0
        at, old = got
        self._fills = fills
        self.frames += len(big)
        self.filled += fills
        try:
            rest = placed(rest)
        except BaseException:  # a small Fill failed: nothing of this message goes
            self.rollback(seg, old, len(big))
            raise
        entries = []
        for i, (pos, n) in zip(big, at):
            entries.append([i + 1, pos, n])
        return [MARKER + msgpack.packb([seg.name, entries]), *rest], seg, old, len(big)

    def _segment(self, peer: int, nic: str, channel: str) -> Segment | None:
        key = (peer, nic, channel)
        if key not in self._segs:
            try:  # (the name carries the channel with the NIC: the receiver keeps one ring per both)
                self._segs[key] = Segment(self.me, nic + channel, peer, self.capacity)
            except OSError as exc:
                log.warning("node %d: no shared memory for node %d on NIC %s (%s): its frames go over ZeroMQ",
                            self.me, peer, nic, exc)
                self._segs[key] = None
        return self._segs[key]

    def rollback(self, seg: Segment, head: int, count: int) -> None:
        """The message the last :meth:`stage` put ``count`` frames of into ``seg`` from
        ``head`` on was not sent: free their space (the retry stages them again)."""
        seg.head = head
        self.frames -= count
        self.filled -= self._fills
        self._fills = 0

    def close(self) -> None:
        for s in self._segs.values():
            if s is not None:
                s.close()
        self._segs.clear()


class Inbound:
    """The peers' segments this endpoint mapped (receiver side)."""

    def __init__(self, me: int, max_frame: int = 1 << 30) -> None:
        self.me, self.max_frame = me, max_frame
        self._maps: dict[str, _Received] = {}
        self._latest: dict[tuple[int, str], str] = {}  # (sender, its NIC) -> its current segment
        self.frames = 0  # frames taken out of segments
        sweep()

    @staticmethod
    def marked(frames: Sequence[Any]) -> bool:
        """Whether a message starts with a marker (every bulk message on a loopback NIC is asked:
        a wire header's first byte is never 0, so one byte decides nearly always)."""
        return bool(frames) and len(frames[0]) > 0 and frames[0][0] == 0 and bytes(frames[0][:len(MARKER)]) == MARKER

    def take(self, src: int, frames: Sequence[Any]) -> tuple[list[Any], Lease]:
        """The message's frames with the stored ones as views of ``src``'s segment (no copy),
        the marker dropped, and the :class:`Lease` of their ring space: the caller releases it
        once nothing reads those views any more (the transport copies them out for every
        consumer that did not ask to borrow them: :meth:`Transport.lend
        <p2psync.transport.base.Transport.lend>`). ProtocolError when the marker is malformed
        (never anything else)."""
        try:
            return self._take(src, frames)
        except ProtocolError:
            raise
        except (OSError, ValueError, MemoryError, TypeError) as exc:
            raise ProtocolError("shm", f"node {src}: {type(exc).__name__}: {exc}") from None

    def _take(self, src: int, frames: Sequence[Any]) -> tuple[list[Any], Lease]:
        try:
            name, entries = msgpack.unpackb(bytes(frames[0][len(MARKER):]))
        except Exception as exc:
            raise ProtocolError("shm", f"unreadable marker: {exc}") from None
        m = _NAME.fullmatch(name) if isinstance(name, str) else None
        if m is None or int(m.group(1)) != src or int(m.group(3)) != self.me:
            raise ProtocolError("shm", f"node {src} named segment {name!r}")
        seg = self._open(name, (src, m.group(2)))
        out = list(frames[1:])
        if not isinstance(entries, list):
            raise ProtocolError("shm", "marker entries are not a list")
        base, end = seg.given, seg.taken
        cap = seg.capacity
        views: list[tuple[int, int, int]] = []
        seen: set[int] = set()
        for e in entries:
            if not (isinstance(e, list) and len(e) == 3):
                raise ProtocolError("shm", f"bad entry {e!r}")
            i, pos, n = e
            if not (type(i) is int and type(pos) is int and type(n) is int):
                raise ProtocolError("shm", f"bad entry {e!r}")
            # what a sender can have written: after what was taken, within one ring of what
            # was given back
            if not (1 <= i <= len(out) and _nbytes(out[i - 1]) == 0 and i not in seen and 0 <= n <= self.max_frame
                    and pos >= end and pos + n - base <= cap and pos % cap + n <= cap):
                raise ProtocolError("shm", f"entry {e!r} outside the message or the segment")
            views.append((i, pos, n))
            seen.add(i)
            end = pos + n
        for i, pos, n in views:
            out[i - 1] = memoryview(seg.mm)[_HEADER + pos % cap:_HEADER + pos % cap + n].toreadonly()
        self.frames += len(entries)
        return out, seg.lease(end)

    def _open(self, name: str, sender: tuple[int, str]) -> _Received:
        seg = self._maps.get(name)
        if seg is not None:
            return seg
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise ProtocolError("shm", f"segment {name}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077
                    and st.st_nlink == 1 and _HEADER < st.st_size <= MAX_SEGMENT):
                raise ProtocolError("shm", f"segment {name}: not a private file of this user, or its size "
                                           f"({st.st_size} bytes) is not a segment's")
            seg = _Received(fd, st.st_size)
        finally:
            os.close(fd)
        try:
            os.unlink(path)  # mapped on both sides now: nothing to leak if either dies
        except OSError:
            pass
        old = self._latest.get(sender)
        if old is not None and old in self._maps:  # the sender restarted: its old ring is done
            self._maps.pop(old).close()
        self._latest[sender] = name
        self._maps[name] = seg
        return seg

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()
        self._latest.clear()


__all__ = ["CAPACITY", "DATAGRAM", "Inbound", "Lease", "MARKER", "MAX_SEGMENT", "MIN_FRAME", "Outbound", "Segment", "same_host",
           "sweep"]

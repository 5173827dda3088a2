"""The bare-ZeroMQ floor of a ring allreduce: exactly p2psync's ring traffic, nothing else.

One process per node, plain pyzmq: a PUSH socket connected to the right neighbour, a PULL socket
bound for the left one. The tensor is cut into the same pieces as p2psync's collectives (about
``piece_bytes``, at most size / N elements) and the pieces into N chunks exactly as
``p2psync.collectives.plan.plan_ring`` does; reduce-scatter then allgather, 2(N-1) steps,
pipelined per piece: a piece is forwarded as soon as it has been received (and added in, for
the reduce-scatter), sent zero-copy from the working buffer with a 64-byte header frame. So each
node moves 2(N-1)/N of the tensor each way, in the same messages, with the same adds, as the
p2psync ring does — but with no header encoding or validation, no tags, no mailbox, no event
loop, no flow control: what ZeroMQ and numpy alone need. ``transport``: ``tcp`` (127.0.0.x, as
the p2psync rows) or ``ipc`` (Unix domain sockets).

``shm_floor_worker``: the same ring with the pieces in shared memory instead (files in
``/dev/shm`` mapped by both ends; each piece written into the sender's segment, read and added
in from there by the receiver) and a one-byte ZeroMQ notification per piece: what the ring
would cost with ZeroMQ's TCP path taken out, for peers on one host.

``curve``: the same with CurveZMQ on both sockets (:func:`floor_keys`; the PULL
socket a CURVE server, the PUSH socket a client that knows its right neighbour's public key),
so the floor pays ZeroMQ's own encryption and decryption, as a keyed p2psync cluster does. No
ZAP handler: p2psync's is asked once per handshake, nothing per message. ``io_threads``: the
ZeroMQ context's IO threads (they run the encryption).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

from bench._common import cpu_seconds
from p2psync.collectives.buffers import POLL, wait_budget


def _chunks(pieces: int, n: int) -> list[tuple[int, int]]:
    return [((pieces * j) // n, (pieces * (j + 1)) // n) for j in range(n)]


def _layout(elems: int, n: int, piece_bytes: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """p2psync's pieces (about ``piece_bytes``, at most elems / n elements) and their chunks."""
    per = max(1, min(piece_bytes // 4, -(-elems // n)))
    bounds = np.minimum(np.arange(-(-elems // per) + 1) * per, elems)
    return bounds, _chunks(len(bounds) - 1, n)


def _ring_chunk(rank: int, n: int, s: int) -> tuple[int, bool]:
    """The chunk a ring node receives at step ``s`` (of 2(n-1)), and whether it adds it in."""
    reduce = s < n - 1
    return ((rank - s - 2) % n if reduce else (rank - (s - (n - 1)) - 1) % n), reduce


def _ring(rank: int, n: int, buf: np.ndarray, bounds: np.ndarray, chunks: list[tuple[int, int]],
          send: Callable[[int, int, np.ndarray], None], recv: Callable[[int, int], np.ndarray]) -> None:
    """One ring allreduce of ``buf`` in place, pipelined per piece: ``send(slot, k, piece)``
    sends piece ``k`` (slot: the receiver's step), ``recv(step, k)`` returns piece ``k``'s
    arrival; reduce-scatter (added in, forwarded), then allgather (copied, forwarded)."""
    for k in range(*chunks[(rank - 1) % n]):
        send(0, k, buf[bounds[k]:bounds[k + 1]])
    steps = 2 * (n - 1)
    for s in range(steps):
        c, reduce = _ring_chunk(rank, n, s)
        for k in range(*chunks[c]):
            piece = buf[bounds[k]:bounds[k + 1]]
            got = recv(s, k)
            if reduce:
                np.add(piece, got, out=piece)
            else:
                piece[...] = got
            if s < steps - 1:
                send(s + 1, k, piece)


def _timed(allreduce: Callable[[int], np.ndarray], push: Any, pull: Any,
           reps: int) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Warm-up (``allreduce(-1)``) and ``reps`` timed operations (``allreduce(i)``) between
    barriers around the ring: (warm-up result, last result, seconds per operation, CPU
    seconds of this process per operation)."""
    def barrier() -> None:
        push.send(b"b")
        pull.recv()

    barrier()
    first = last = allreduce(-1)
    barrier()
    t0, c0 = time.perf_counter(), cpu_seconds()
    for i in range(reps):
        last = allreduce(i)
    took, cpu = (time.perf_counter() - t0) / reps, (cpu_seconds() - c0) / reps
    barrier()
    return first, last, took, cpu


def shm_segments(n: int, elems: int, piece_bytes: int = 1 << 20) -> list[str]:
    """One file per rank in a fresh folder of ``/dev/shm``, big enough for two allreduces' worth
    of outgoing pieces (the ring keeps a node at most one allreduce ahead of its right
    neighbour). The caller removes the folder."""
    bounds, chunks = _layout(elems, n, piece_bytes)
    size = 2 * 2 * (n - 1) * int(max(bounds[hi] - bounds[lo] for lo, hi in chunks)) * 4
    st = os.statvfs("/dev/shm")
    if st.f_bavail * st.f_frsize < n * size:  # a write past the free space would kill a worker (SIGBUS)
        raise SystemExit(f"floor-shm: /dev/shm has {st.f_bavail * st.f_frsize >> 20} MiB free, "
                         f"the segments need {n * size >> 20} MiB")
    d = tempfile.mkdtemp(prefix="p2pfloor", dir="/dev/shm")
    paths = [os.path.join(d, f"n{i}") for i in range(n)]
    for p in paths:
        with open(p, "wb") as f:
            f.truncate(max(size, 4))
    return paths


def _input(rank: int, elems: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(elems).astype(np.float32)


def shm_floor_worker(rank: int, n: int, elems: int, endpoints: list[str], segments: list[str], reps: int,
                     q: Any, piece_bytes: int = 1 << 20, verify: bool = False) -> None:
    """Puts ``(rank, seconds per allreduce, CPU seconds per allreduce)`` on ``q``; with
    ``verify``, ``(rank, seconds, CPU seconds, ok)``: whether the warm-up's and the last timed
    allreduce's results equal the sum of every rank's input (for tests, on small tensors)."""
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    pull.bind(endpoints[rank])
    push.connect(endpoints[(rank + 1) % n])
    x = _input(rank, elems)
    bounds, chunks = _layout(elems, n, piece_bytes)
    steps = 2 * (n - 1)
    width = int(max(bounds[hi] - bounds[lo] for lo, hi in chunks))
    out = np.memmap(segments[rank], np.float32, "r+", shape=(2, steps, width))
    inn = np.memmap(segments[(rank - 1) % n], np.float32, "r", shape=(2, steps, width))
    #: piece k's place in its chunk's slot
    at = np.concatenate([bounds[lo:hi] - bounds[lo] for lo, hi in chunks]).astype(int)
    par = 0  # the slot set of the allreduce under way (two alternate)

    def send(s: int, k: int, piece: np.ndarray) -> None:
        out[par, s, at[k]:at[k] + piece.size] = piece
        push.send(b"p", copy=True)

    def recv(s: int, k: int) -> np.ndarray:
        pull.recv()
        return inn[par, s, at[k]:at[k] + bounds[k + 1] - bounds[k]]

    def allreduce(i: int) -> np.ndarray:
        nonlocal par
        par = i % 2  # the warm-up (-1) uses set 1
        buf = x.copy()
        _ring(rank, n, buf, bounds, chunks, send, recv)
        return buf  # nothing of it is in flight: no frame holds a view

    first, last, took, cpu = _timed(allreduce, push, pull, reps)
    if verify:
        want = sum(_input(r, elems) for r in range(n))
        q.put((rank, took, cpu, all(np.allclose(got, want, rtol=1e-5, atol=1e-5) for got in (first, last))))
    else:
        q.put((rank, took, cpu))
    del out, inn
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()


def floor_endpoints(transport: str, n: int, port: int) -> list[str]:
    if transport == "ipc":
        d = tempfile.mkdtemp(prefix="p2pfloor")
        return [f"ipc://{os.path.join(d, f'n{i}')}" for i in range(n)]
    return [f"tcp://127.0.0.{i + 1}:{port + i}" for i in range(n)]


def floor_keys(n: int) -> list[tuple[bytes, bytes]]:
    """One CurveZMQ key pair (public, secret) per rank, for ``floor_worker(curve=...)``."""
    import zmq

    return [zmq.curve_keypair() for _ in range(n)]


def floor_worker(rank: int, n: int, elems: int, endpoints: list[str], reps: int, q: Any,
                 piece_bytes: int = 1 << 20, curve: list[tuple[bytes, bytes]] | None = None,
                 io_threads: int = 1) -> None:
    import zmq

    ctx = zmq.Context(io_threads=io_threads)
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    if curve is not None:
        pub, sec = curve[rank]
        for s in (pull, push):
            s.setsockopt(zmq.CURVE_PUBLICKEY, pub)
            s.setsockopt(zmq.CURVE_SECRETKEY, sec)
        pull.setsockopt(zmq.CURVE_SERVER, 1)
        push.setsockopt(zmq.CURVE_SERVERKEY, curve[(rank + 1) % n][0])
    pull.bind(endpoints[rank])
    push.setsockopt(zmq.SNDHWM, 64)
    push.connect(endpoints[(rank + 1) % n])
    x = _input(rank, elems)
    bounds, chunks = _layout(elems, n, piece_bytes)
    hdr = b"h" * 64

    def send(s: int, k: int, piece: np.ndarray) -> None:
        push.send_multipart([hdr, piece], copy=False)

    def recv(s: int, k: int) -> np.ndarray:
        return np.frombuffer(pull.recv_multipart(copy=False)[1].buffer, dtype=np.float32)

    def allreduce(i: int) -> np.ndarray:
        buf = x.copy()
        alone = sys.getrefcount(buf)  # before any piece (a view of ``buf``) is in flight
        _ring(rank, n, buf, bounds, chunks, send, recv)
        # as p2psync (collectives/buffers.py): the working buffer is the result once no
        # zero-copy frame holds a piece of it (waiting by the same rule), else a fresh copy
        end = time.perf_counter() + wait_budget(buf.nbytes)
        while sys.getrefcount(buf) != alone and end - time.perf_counter() >= POLL:
            time.sleep(POLL)
        return buf if sys.getrefcount(buf) == alone else buf.copy()

    q.put((rank, *_timed(allreduce, push, pull, reps)[2:]))
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()

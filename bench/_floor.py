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

``curve`` (issue 16): the same with CurveZMQ on both sockets (:func:`floor_keys`; the PULL
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
from typing import Any

import numpy as np

from p2psync.collectives.buffers import POLL, wait_budget


def _chunks(pieces: int, n: int) -> list[tuple[int, int]]:
    return [((pieces * j) // n, (pieces * (j + 1)) // n) for j in range(n)]


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
    x = np.random.default_rng(rank).standard_normal(elems).astype(np.float32)
    per = max(1, min(piece_bytes // 4, -(-elems // n)))
    bounds = np.minimum(np.arange(-(-elems // per) + 1) * per, elems)
    chunks = _chunks(len(bounds) - 1, n)
    hdr = b"h" * 64

    def allreduce(src: np.ndarray) -> np.ndarray:
        buf = src.copy()
        alone = sys.getrefcount(buf)  # before any piece (a view of ``buf``) is in flight
        lo, hi = chunks[(rank - 1) % n]
        for k in range(lo, hi):
            push.send_multipart([hdr, buf[bounds[k]:bounds[k + 1]]], copy=False)
        steps = 2 * (n - 1)
        for s in range(steps):
            reduce = s < n - 1
            c = (rank - s - 2) % n if reduce else (rank - (s - (n - 1)) - 1) % n
            lo, hi = chunks[c]
            for k in range(lo, hi):
                frames = pull.recv_multipart(copy=False)
                piece = buf[bounds[k]:bounds[k + 1]]
                got = np.frombuffer(frames[1].buffer, dtype=np.float32)
                if reduce:
                    np.add(piece, got, out=piece)
                else:
                    piece[...] = got
                if s < steps - 1:
                    push.send_multipart([hdr, piece], copy=False)
        # as p2psync (collectives/buffers.py): the working buffer is the result once no
        # zero-copy frame holds a piece of it (waiting by the same rule), else a fresh copy
        end = time.perf_counter() + wait_budget(buf.nbytes)
        while sys.getrefcount(buf) != alone and end - time.perf_counter() >= POLL:
            time.sleep(POLL)
        return buf if sys.getrefcount(buf) == alone else buf.copy()

    def barrier() -> None:
        push.send(b"b")
        pull.recv()

    barrier()
    allreduce(x)  # warm-up
    barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        allreduce(x)
    q.put((rank, (time.perf_counter() - t0) / reps))
    barrier()
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()

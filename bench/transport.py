"""Point-to-point throughput and small-message round trip of the p2psync ZeroMQ endpoint,
next to raw pyzmq PUSH/PULL (throughput) and raw DEALER/ROUTER (round trip) in the same run.

Throughput: both ends in one process on one event loop (uvloop when installed);
for throughput both ends share one ZeroMQ context (one IO thread) as the raw baseline does, so
the ratio compares software overhead, not thread scheduling on a 2-core machine. Round trip:
the responder runs in a second process, as a peer node would.

    python -m bench.transport [--total-mib 512] [--rtt-count 2000] [--rtt-turns 200] [--rtt-only]

The round-trip table has a full RPC row (RpcClient.call to an RpcServer handler in the peer
process) next to the endpoint's own send/recv ping-pong and raw pyzmq; the
three rows are measured in alternating turns (:func:`round_trips`), 200 by default: with 10
turns of a few hundred calls each, a burst of load on this VM could fall on one row's turn and
move the ratio by 0.1 either way between runs; with 200 turns of 10-20 calls every row sees the
same machine (three runs agreed within 0.04).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import time
from typing import Any, Awaitable, Callable

import numpy as np
import zmq
import zmq.asyncio

from bench._common import markdown_table, save_png
from p2psync.topology import mesh
from p2psync.transport import ZmqEndpoint

SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def p2psync_throughput(size: int, count: int) -> float:
    topo = mesh(2, base_port=_port())
    ctx = zmq.Context()  # one IO thread for both ends, exactly like the raw baseline below
    a, b = (ZmqEndpoint(topology=topo, node_id=i, default_timeout=60, context=ctx) for i in (0, 1))
    await a.start()
    await b.start()
    buf = np.ones(size // 4, dtype=np.float32)
    await a.send(1, "warm", [buf[:1]])
    await b.recv("warm")

    async def rx() -> None:
        for _ in range(count):
            await b.recv("t")

    t0 = time.perf_counter()
    r = asyncio.create_task(rx())
    for _ in range(count):
        await a.send(1, "t", [buf])
    await r
    dt = time.perf_counter() - t0
    await a.close()
    await b.close()
    ctx.term()
    return size * count / dt


async def raw_throughput(size: int, count: int) -> float:
    ctx = zmq.asyncio.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    addr = f"tcp://127.0.0.1:{_port()}"
    pull.bind(addr)
    push.connect(addr)
    buf = np.ones(size // 4, dtype=np.float32)
    await push.send(b"w")
    await pull.recv()

    async def rx() -> None:
        for _ in range(count):
            await pull.recv_multipart(copy=False)

    t0 = time.perf_counter()
    r = asyncio.create_task(rx())
    for _ in range(count):
        await push.send_multipart([b"h" * 64, memoryview(buf)], copy=False)
    await r
    dt = time.perf_counter() - t0
    push.close(0)
    pull.close(0)
    ctx.term()
    return size * count / dt


def _rtt_server(port: int, count: int) -> None:
    async def run() -> None:
        b = ZmqEndpoint(topology=mesh(2, base_port=port), node_id=1)
        await b.start()
        for _ in range(count):
            m = await b.recv("ping")
            await b.send(0, "pong", step=m.header.step)
        await asyncio.sleep(0.2)
        await b.close()

    _run(run())


def _rpc_server(port: int, seconds: float) -> None:
    from p2psync.coordinator import RpcServer

    async def run() -> None:
        b = ZmqEndpoint(topology=mesh(2, base_port=port), node_id=1)
        await b.start()
        srv = RpcServer(b)

        async def echo(_caller: int, args: Any, _arrays: Any) -> Any:
            return args

        srv.register("echo", echo)
        srv.start()
        await asyncio.sleep(seconds)  # the client is done long before; then leave
        await srv.close()
        await b.close()

    _run(run())


def _raw_rtt_server(addr: str, count: int) -> None:
    async def run() -> None:
        ctx = zmq.asyncio.Context()
        r = ctx.socket(zmq.ROUTER)
        r.bind(addr)
        for _ in range(count):
            await r.send_multipart(await r.recv_multipart())
        await asyncio.sleep(0.2)
        r.close(0)
        ctx.term()

    _run(run())


#: a round-trip row: one request/response (awaitable) and the teardown of client and server
Pair = tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]


async def p2psync_pair(count: int) -> Pair:
    """The endpoint's own send/recv ping-pong with node 1 in a child process (``count`` round
    trips in all)."""
    port = _port()
    proc = mp.get_context("spawn").Process(target=_rtt_server, args=(port, count))
    proc.start()
    a = ZmqEndpoint(topology=mesh(2, base_port=port), node_id=0)
    await a.start()
    small = np.zeros(16, dtype=np.float32)
    step = iter(range(count))

    async def once() -> None:
        await a.send(1, "ping", [small], step=next(step), timeout=30)
        await a.recv("pong")

    async def close() -> None:
        await a.close()
        proc.join()

    return once, close


async def rpc_pair(count: int) -> Pair:
    """Full RPC calls (RpcClient.call -> RpcServer handler -> reply) to a node in a second
    process: request ids, duplicate cache, RTT estimate, what the coordinator services pay."""
    from p2psync.coordinator import RpcClient

    port = _port()
    proc = mp.get_context("spawn").Process(target=_rpc_server, args=(port, 60 + count * 0.02))
    proc.start()
    a = ZmqEndpoint(topology=mesh(2, base_port=port), node_id=0)
    await a.start()
    cli = RpcClient(a)
    i = iter(range(count))

    async def once() -> None:
        await cli.call(1, "echo", {"i": next(i)}, timeout=30)

    async def close() -> None:
        await a.close()
        proc.kill()
        proc.join()

    return once, close


async def raw_pair(count: int) -> Pair:
    """Raw pyzmq DEALER here, ROUTER echo in a child process."""
    addr = f"tcp://127.0.0.1:{_port()}"
    proc = mp.get_context("spawn").Process(target=_raw_rtt_server, args=(addr, count))
    proc.start()
    ctx = zmq.asyncio.Context()
    d = ctx.socket(zmq.DEALER)
    d.connect(addr)

    async def once() -> None:
        await d.send_multipart([b"h" * 48, b"x" * 64])
        await d.recv_multipart()

    async def close() -> None:
        d.close(0)
        ctx.term()
        proc.join()

    return once, close


async def round_trips(count: int, rounds: int = 200, warm: int = 10) -> list[list[float]]:
    """Round-trip times (s) of raw pyzmq, the endpoint and RPC, ``count`` each after ``warm``
    unmeasured ones, taken in ``rounds`` alternating turns: the machine's speed drifts over a
    run (other jobs, CPU steal), and rows measured one after the other compared different
    machines (raw pyzmq's p50 moved 1.8x between runs on a loaded day)."""
    pairs = [await make(count + warm) for make in (raw_pair, p2psync_pair, rpc_pair)]
    out: list[list[float]] = [[] for _ in pairs]
    try:
        for once, _ in pairs:
            for _ in range(warm):
                await once()
        sizes = [count // rounds + (r < count % rounds) for r in range(rounds)]
        for n in sizes:
            for (once, _), times in zip(pairs, out):
                for _ in range(n):
                    t0 = time.perf_counter()
                    await once()
                    times.append(time.perf_counter() - t0)
    finally:
        for _, close in pairs:
            await close()
    return out


def _run(coro: Any) -> Any:
    try:
        import uvloop  # the runtime runs on uvloop; measure what users get
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) * 1e6


async def main_async(args: argparse.Namespace) -> None:
    if args.rtt_only:
        await rtt_table(args)
        return
    rows = []
    ours, raws = [], []
    for size in SIZES:
        count = max(4, (args.total_mib << 20) // size)
        best_o = max([await p2psync_throughput(size, count) for _ in range(args.repeat)])
        best_r = max([await raw_throughput(size, count) for _ in range(args.repeat)])
        ours.append(best_o / 1e9)
        raws.append(best_r / 1e9)
        rows.append([f"{size >> 10} KiB" if size < (1 << 20) else f"{size >> 20} MiB", count,
                     best_o / 1e9, best_r / 1e9, best_o / best_r])
    print("## Point-to-point throughput (loopback, one process, best of", args.repeat, ")\n")
    print(markdown_table(["message", "count", "p2psync GB/s", "raw pyzmq GB/s", "ratio"], rows))
    await rtt_table(args)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [s / (1 << 20) for s in SIZES]
    ax.plot(x, ours, "o-", label="p2psync endpoint")
    ax.plot(x, raws, "s--", label="raw pyzmq PUSH/PULL")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title("loopback point-to-point throughput")
    ax.legend()
    print("\nplot:", save_png(fig, "transport.png"))


async def rtt_table(args: argparse.Namespace) -> None:
    r, o, c = await round_trips(args.rtt_count, rounds=max(1, min(args.rtt_turns, args.rtt_count)))
    base = pct(r, 50)
    print("\n## Small-message round trip (request/response, loopback, two processes)\n")
    print(markdown_table(["", "p50 µs", "p99 µs", "mean µs", "p50 × raw"],
                         [["raw pyzmq (DEALER/ROUTER)", base, pct(r, 99), statistics.mean(r) * 1e6, 1.0],
                          ["p2psync endpoint send/recv", pct(o, 50), pct(o, 99), statistics.mean(o) * 1e6,
                           pct(o, 50) / base],
                          ["p2psync RPC call", pct(c, 50), pct(c, 99), statistics.mean(c) * 1e6, pct(c, 50) / base]]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--total-mib", type=int, default=512, help="bytes per throughput measurement")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rtt-count", type=int, default=2000)
    p.add_argument("--rtt-only", action="store_true", help="only the round-trip table (no plot)")
    p.add_argument("--rtt-turns", type=int, default=200, help="alternating turns of the three round-trip rows")
    _run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()

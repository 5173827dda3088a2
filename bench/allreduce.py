"""Allreduce bus bandwidth of p2psync next to torch.distributed (gloo), same processes, same run.

    python -m bench.allreduce [--nodes 4 8] [--mb 4 100] [--reps 3] [--rounds 1] [--rows ROW ...]
                              [--curve-only] [--piece-kib 1024] [--io-threads 1]
    python -m bench.allreduce --shaped [--nodes 4] [--mb 25] [--rate-mbit 1000]   # as root

Every configuration starts N fresh processes on this host (loopback). Time per allreduce is the
slowest node's mean over ``--reps`` timed operations after one warm-up; with ``--rounds R``
every row is measured R times, the rows taking turns (so a slow moment of the machine hits
every row of that round alike), and the table gives the medians, and each ratio as the median
of the R rounds' ratios with their range. CPU per operation per
node is the CPU time of a node's process over the same operations (every thread: ZeroMQ's IO
threads, gloo's), the nodes' mean: where it is about the time per operation, the nodes are
CPU-bound, and so is the row. Bus bandwidth = 2(N-1)/N * bytes / time (the traffic each node
must move in an optimal allreduce). For compressed runs the *effective* bus bandwidth counts the
uncompressed bytes.

The floor rows are bare pyzmq moving exactly the p2psync ring's traffic (same pieces,
same chunks, same adds; :mod:`bench._floor`), over ipc:// and over tcp:// on 127.0.0.x as the
p2psync rows: what ZeroMQ and numpy alone need. ``× floor`` is a row's bus bandwidth over the
tcp floor's in the same run. The shared-memory floor (``floor-shm``) moves the same pieces
through files in ``/dev/shm`` that both ends map, with a one-byte ZeroMQ notification per
piece: the ring with ZeroMQ's and the kernel's TCP path taken out, which only peers on one
host can do. ``ring+shm`` is the p2psync ring with that path (``SocketOptions(shm=True)``,
``p2psync run --shm``: :mod:`p2psync.transport.shm`).

``--shaped`` measures on kernel-shaped links instead (:mod:`bench._netns`): every
node in its own network namespace, veth pairs to one bridge per network, a ``tbf`` of
``--rate-mbit`` on every NIC, addresses from the benchmarking range 198.18.0.0/15. gloo, the
floor and the p2psync ring run on a one-NIC topology (all nodes on one network, as gloo needs
one interface); p2psync BCube(2, 2) stripes over two NICs per node. Link utilisation = bytes
each NIC must send / time / rate (the ring: busbw / rate; BCube: busbw / (2 rate)).

The CURVE rows: the plain p2psync ring again with a keyed cluster (every socket runs
CurveZMQ, encrypted and authenticated), and the tcp floor again with CurveZMQ on its sockets
(``bench._floor``, ``curve``). Their ratios to the plain rows of the same run, side by side,
separate what CURVE costs ZeroMQ itself on this machine from what p2psync adds on top;
``--curve-only`` measures just those four rows. ``--piece-kib`` sets the piece size of the
p2psync collectives and of the floor alike; ``--io-threads`` the ZeroMQ IO threads per node
(p2psync's ``SocketOptions.io_threads`` and the floor's context; CurveZMQ encrypts and decrypts
in those threads, one by default).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import time
from typing import Any

import numpy as np

from bench._common import cpu_seconds, markdown_table, save_png
from bench._floor import floor_endpoints, floor_keys, floor_worker, shm_floor_worker, shm_segments


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _topology(algo: str, n: int, port: int):
    from p2psync.topology import bcube, mesh, ring

    if algo == "bcube":
        beta = int(round(np.log2(n)))
        return bcube(2, beta, base_port=port)
    return ring(n, base_port=port) if algo == "ring" else mesh(n, base_port=port)


def p2psync_worker(rank: int, n: int, elems: int, algo: str, codec: str, port: int, reps: int,
                   q: Any, piece_kib: int = 1024, sockbuf: int = 0, keys: Any = None, topo: Any = None,
                   io_threads: int = 1, shm: bool = False) -> None:
    import uvloop

    from p2psync.collectives import Collectives
    from p2psync.transport import SocketOptions, ZmqEndpoint
    from p2psync.transport.keys import with_public_keys

    async def run() -> None:
        nonlocal topo
        topo = topo if topo is not None else _topology(algo, n, port)
        if keys is not None:  # a keyed cluster: CurveZMQ on every socket
            topo = with_public_keys(topo, keys)
        ep = ZmqEndpoint(topology=topo, node_id=rank, default_timeout=120,
                         options=SocketOptions(sndbuf=sockbuf, rcvbuf=sockbuf, io_threads=io_threads, shm=shm),
                         keys=keys[rank] if keys is not None else None)
        await ep.start()
        coll = Collectives(ep, timeout=120, codec=codec, algo=algo, piece_bytes=piece_kib << 10)
        x = np.random.default_rng(rank).standard_normal(elems).astype(np.float32)
        await coll.allreduce(np.zeros(1, np.float32), tag="b.0")  # barrier: everyone connected
        await coll.allreduce(x, tag="x.warm", feedback="x")  # warm-up
        await coll.allreduce(np.zeros(1, np.float32), tag="b.1")
        t0, c0 = time.perf_counter(), cpu_seconds()
        for r in range(reps):
            await coll.allreduce(x, tag=f"x.{r}", feedback="x")
        q.put((rank, (time.perf_counter() - t0) / reps, (cpu_seconds() - c0) / reps))
        await coll.allreduce(np.zeros(1, np.float32), tag="b.2")  # nobody leaves early
        await ep.close()

    uvloop.run(run())


def gloo_worker(rank: int, n: int, elems: int, port: int, reps: int, q: Any, addr: str = "127.0.0.1") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=n)
    x = torch.randn(elems)
    dist.all_reduce(x)
    dist.barrier()
    t0, c0 = time.perf_counter(), cpu_seconds()
    for _ in range(reps):
        dist.all_reduce(x)
    q.put((rank, (time.perf_counter() - t0) / reps, (cpu_seconds() - c0) / reps))
    dist.barrier()
    dist.destroy_process_group()


def measure(kind: str, n: int, mb: float, reps: int, algo: str = "ring", codec: str = "none",
            piece_kib: int = 1024, sockbuf: int = 0, curve: bool = False,
            io_threads: int = 1) -> tuple[float, float]:
    """Seconds per operation (the slowest node's mean) and CPU seconds per operation per node
    (the nodes' mean: every thread of the node's process, ZeroMQ's IO threads included)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    elems = int(mb * 1e6 / 4)
    port = _port()
    if kind == "gloo":
        procs = [ctx.Process(target=gloo_worker, args=(r, n, elems, port, reps, q)) for r in range(n)]
    elif kind == "floor-shm":
        eps = floor_endpoints("tcp", n, port)
        segs = shm_segments(n, elems, piece_kib << 10)
        procs = [ctx.Process(target=shm_floor_worker, args=(r, n, elems, eps, segs, reps, q, piece_kib << 10))
                 for r in range(n)]
    elif kind.startswith("floor"):
        eps = floor_endpoints(kind.partition("-")[2] or "tcp", n, port)
        fkeys = floor_keys(n) if curve else None
        procs = [ctx.Process(target=floor_worker, args=(r, n, elems, eps, reps, q, piece_kib << 10, fkeys, io_threads))
                 for r in range(n)]
    else:
        keys = None
        if curve:
            from p2psync.transport.keys import generate

            keys = generate(_topology(algo, n, port))
        procs = [ctx.Process(target=p2psync_worker,
                             args=(r, n, elems, algo, codec, port, reps, q, piece_kib, sockbuf, keys, None,
                                   io_threads, kind == "p2psync+shm"))
                 for r in range(n)]
    try:
        for p in procs:
            p.start()
        got = [q.get(timeout=900) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if kind == "floor-ipc":
            shutil.rmtree(os.path.dirname(eps[0].removeprefix("ipc://")), ignore_errors=True)
        if kind == "floor-shm":
            shutil.rmtree(os.path.dirname(segs[0]), ignore_errors=True)
    return max(g[1] for g in got), sum(g[2] for g in got) / len(got)


#: (row name for --rows, label, kind, algo, codec, curve)
CONFIGS = [("gloo", "gloo", "gloo", "ring", "none", False),
           ("floor-ipc", "zmq floor (ipc)", "floor-ipc", "ring", "none", False),
           ("floor-tcp", "zmq floor (tcp)", "floor-tcp", "ring", "none", False),
           ("floor-shm", "shared-memory floor", "floor-shm", "ring", "none", False),
           ("floor-tcp+curve", "zmq floor (tcp) + CURVE", "floor-tcp", "ring", "none", True),
           ("ring", "p2psync ring", "p2psync", "ring", "none", False),
           ("ring+shm", "p2psync ring, shared memory", "p2psync+shm", "ring", "none", False),
           ("mesh", "p2psync mesh", "p2psync", "mesh", "none", False),
           ("bcube", "p2psync bcube", "p2psync", "bcube", "none", False),
           ("ring+sketch8", "p2psync ring + sketch8", "p2psync", "ring", "sketch8", False),
           ("ring+curve", "p2psync ring + CURVE", "p2psync", "ring", "none", True)]


def measure_shaped(kind: str, topo: Any, net: Any, prefix: str, mb: float, reps: int, algo: str = "ring",
                   codec: str = "none") -> float:
    """One configuration with every node in its own network namespace (kernel-shaped NICs)."""
    from bench._netns import nic_device, run_in_netns

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    n = len(topo.nodes)
    elems = int(mb * 1e6 / 4)
    port = _port()
    addr = [node.nics[0].address for node in topo.nodes]
    procs = []
    for r in range(n):
        env = {"GLOO_SOCKET_IFNAME": nic_device(prefix, r, 0)}
        if kind == "gloo":
            target, args = gloo_worker, (r, n, elems, port, reps, q, addr[0])
        elif kind == "floor-tcp":
            eps = [f"tcp://{a}:{port + i}" for i, a in enumerate(addr)]
            target, args = floor_worker, (r, n, elems, eps, reps, q, 1 << 20)
        else:
            target, args = p2psync_worker, (r, n, elems, algo, codec, port, reps, q, 1024, 0, None, topo)
        procs.append(ctx.Process(target=run_in_netns, args=(net.namespaces[r], env, target, *args)))
    for p in procs:
        p.start()
    times = [q.get(timeout=900)[1] for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return max(times)


#: kernel-shaped rows: (label, kind, topology, algo, codec); "one" = mesh(N) (one NIC per node,
#: one network: what gloo needs), "bcube" = BCube(2, log2 N) (one NIC per level)
SHAPED = [("gloo (1 NIC)", "gloo", "one", "ring", "none"),
          ("zmq floor tcp (1 NIC)", "floor-tcp", "one", "ring", "none"),
          ("p2psync ring (1 NIC)", "p2psync", "one", "ring", "none"),
          ("p2psync ring + sketch8 (1 NIC)", "p2psync", "one", "ring", "sketch8"),
          ("p2psync bcube (2 NICs)", "p2psync", "bcube", "bcube", "none"),
          ("p2psync bcube + sketch8 (2 NICs)", "p2psync", "bcube", "bcube", "sketch8")]


def shaped(nodes: int, sizes: list[float], reps: int, rate_mbit: float) -> None:
    """Kernel-shaped links: veth pairs in network namespaces, tbf at ``rate_mbit`` per NIC."""
    from bench._netns import shaped_network
    from p2psync.topology import bcube, mesh

    rate = rate_mbit * 1e6
    topos = {"one": mesh(nodes, subnet="198.18.0.0/16"),
             "bcube": bcube(2, int(round(np.log2(nodes))), subnet="198.19.0.0/16")}
    rows, plot = [], {}
    for mb in sizes:
        base, plain = None, {}
        for which in ("one", "bcube"):
            topo = topos[which]
            nics = len(topo.nodes[0].nics)
            with shaped_network(topo, rate, prefix="bk") as net:
                for label, kind, t, algo, codec in SHAPED:
                    if t != which:
                        continue
                    secs = measure_shaped(kind, topo, net, "bk", mb, reps, algo, codec)
                    busbw = 2 * (nodes - 1) / nodes * mb * 1e6 / secs / 1e9
                    base = busbw if kind == "gloo" else base
                    if kind == "p2psync" and codec == "none":
                        plain[algo] = busbw
                    util = busbw * 8e9 / (nics * rate)
                    rows.append([f"{mb:g} MB", label, secs * 1e3, busbw, util if codec == "none" else "-",
                                 busbw / base if base else "-",
                                 busbw / plain[algo] if algo in plain and codec != "none" else "-"])
                    plot.setdefault(label, []).append((mb, busbw))
                    print(f"  shaped {mb:g} MB {label}: {secs * 1e3:.1f} ms, bus {busbw:.3f} GB/s", flush=True)
    print(f"\n## Allreduce over kernel-shaped links (N={nodes}; veth + tbf {rate_mbit:g} Mb/s per NIC, "
          "addresses from 198.18.0.0/15)\n")
    print(markdown_table(["size", "implementation", "ms / op", "(effective) bus GB/s", "link utilisation",
                          "× gloo", "× uncompressed (same algo)"], rows))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    for j, (label, vals) in enumerate(plot.items()):
        ax.bar(np.arange(len(vals)) + j * 0.8 / len(plot), [v for _, v in vals], 0.8 / len(plot), label=label)
    ax.set_xticks(np.arange(len(sizes)) + 0.4 - 0.4 / len(plot), [f"{mb:g} MB" for mb in sizes])
    ax.set_ylabel("(effective) bus bandwidth GB/s")
    ax.set_title(f"N={nodes}, tbf {rate_mbit:g} Mb/s per NIC")
    ax.legend(fontsize=7)
    print("\nplot:", save_png(fig, "allreduce_shaped.png"))


def _curve_cells(pair: dict[tuple[str, bool], float], kind: str) -> list[Any]:
    """Bus GB/s off, with CURVE, and their ratio ('-' where a row was not measured)."""
    off, on = pair.get((kind, False)), pair.get((kind, True))
    return [off if off is not None else "-", on if on is not None else "-",
            on / off if on is not None and off else "-"]


def _ratio(vals: list[float | None]) -> Any:
    """One round's ratio, or the median of several rounds' with their range ('-': none)."""
    xs = [v for v in vals if v is not None]
    if not xs:
        return "-"
    if len(xs) == 1:
        return xs[0]
    return f"{np.median(xs):.3g} ({min(xs):.3g}-{max(xs):.3g})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--mb", type=float, nargs="+", default=[4, 100])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every row this many times, interleaved (gloo, the next row, ..., gloo, ...); "
                         "report the medians, and each ratio's median and range over the rounds")
    ap.add_argument("--rows", nargs="+", choices=[c[0] for c in CONFIGS],
                    help="measure only these rows (default: all but the kernel-shaped ones)")
    ap.add_argument("--curve-only", action="store_true",
                    help="only the plain p2psync ring and tcp floor, and the same two with CURVE on every socket")
    ap.add_argument("--piece-kib", type=int, default=1024,
                    help="piece size of the collectives (and of the floor's messages), KiB")
    ap.add_argument("--io-threads", type=int, default=1,
                    help="ZeroMQ IO threads per node (they run CurveZMQ's encryption)")
    ap.add_argument("--shaped", action="store_true",
                    help="instead: kernel-shaped links (network namespaces, veth, tbf per NIC; needs root)")
    ap.add_argument("--rate-mbit", type=float, default=1000, help="--shaped: tbf rate per NIC (Mb/s)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.shaped:
        shaped(args.nodes[0], args.mb, args.reps, args.rate_mbit)
        return
    configs = [c for c in CONFIGS if args.rows is None or c[0] in args.rows]
    if args.curve_only:
        configs = [c for c in CONFIGS if c[0] in ("floor-tcp", "floor-tcp+curve", "ring", "ring+curve")]
    rows, plot, curve_rows = [], {}, []
    for n in args.nodes:
        for mb in args.mb:
            # every round measures every row, in order: a ratio compares rows of one round
            got: dict[str, list[tuple[float, float, float, float | None, float | None]]] = {}
            pair: dict[tuple[str, bool], float] = {}  # (kind, curve) -> bus GB/s: the CURVE table
            for rnd in range(args.rounds):
                base = floor = None
                for _name, label, kind, algo, codec, curve in configs:
                    secs, cpu = measure(kind, n, mb, args.reps, algo, codec, piece_kib=args.piece_kib,
                                        curve=curve, io_threads=args.io_threads)
                    busbw = 2 * (n - 1) / n * mb * 1e6 / secs / 1e9
                    if kind == "gloo":
                        base = busbw
                    if kind in ("floor-tcp", "p2psync") and algo == "ring" and codec == "none" and not rnd:
                        pair[kind, curve] = busbw  # (the CURVE table: the first round's)
                    if kind == "floor-tcp" and not curve:
                        floor = busbw  # the plain tcp floor of this round, once measured
                    got.setdefault(label, []).append((secs, cpu, busbw, busbw / base if base else None,
                                                      busbw / floor if floor else None))
                    print(f"  N={n} {mb:g} MB {label}: {secs * 1e3:.1f} ms, CPU {cpu * 1e3:.2f} ms per node, "
                          f"bus {busbw:.3f} GB/s", flush=True)
            for label, runs in got.items():
                med = [float(np.median([r[i] for r in runs])) for i in range(3)]
                rows.append([n, f"{mb:g} MB", label, med[0] * 1e3, med[1] * 1e3, med[2],
                             _ratio([r[3] for r in runs]), _ratio([r[4] for r in runs])])
                plot.setdefault(label, []).append(((n, mb), med[2]))
            if ("p2psync", True) in pair or ("floor-tcp", True) in pair:
                curve_rows.append([n, f"{mb:g} MB", *_curve_cells(pair, "p2psync"), *_curve_cells(pair, "floor-tcp")])
    rounds = f"; the median of {args.rounds} rounds, × its range over them" if args.rounds > 1 else ""
    print(f"\n## Allreduce bus bandwidth (loopback, {os.cpu_count()} cores; pieces {args.piece_kib} KiB, "
          f"{args.io_threads} ZeroMQ IO thread(s) per node{rounds})\n")
    print(markdown_table(["nodes", "size", "implementation", "ms / op", "CPU ms / op / node", "bus GB/s", "× gloo",
                          "× floor (tcp)"], rows))
    if curve_rows:
        print("\n## CURVE on every socket vs off (same run; target for p2psync >= 0.7x; the tcp floor's "
              "ratio is what CURVE costs ZeroMQ itself here)\n")
        print(markdown_table(["nodes", "size", "p2psync off: bus GB/s", "p2psync CURVE: bus GB/s",
                              "p2psync CURVE / off", "floor off: bus GB/s", "floor CURVE: bus GB/s",
                              "floor CURVE / off"], curve_rows))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    keys = [k for k, _ in next(iter(plot.values()))]
    x = np.arange(len(keys))
    w = 0.8 / len(plot)
    for j, (label, vals) in enumerate(plot.items()):
        ax.bar(x + j * w, [v for _, v in vals], w, label=label)
    ax.set_xticks(x + 0.4 - w / 2, [f"N={n}, {mb:g} MB" for n, mb in keys])
    ax.set_ylabel("bus bandwidth GB/s")
    ax.legend(fontsize=8)
    print("\nplot:", save_png(fig, "allreduce.png"))


if __name__ == "__main__":
    main()

"""How the real membership's costs grow with the number of nodes, in the deterministic simulator.

    python -m bench.scale [--sizes 16,64,256] [--kinds ring,mesh,bcube,groups] [--virtual-seconds 15]
                          [--kill-at 5] [--timeout 600]

Every (topology, N) runs in a fresh child process: ``p2psync.sim.cluster.SimCluster`` over
``ring:N``, ``mesh:N`` (one switch: every node adjacent to every other), BCube(4, k) with
4**k = N nodes (BCube(2, k) when N is a power of 2 only) or a mesh of groups ``groups:GxS``
(G sites of S nodes, G the largest divisor of N not above sqrt(N): 16x16 for 256, 32x32 for
1024; a LAN inside a site, the sites' gateways linked to each other), 1 ms links (the groups'
LAN/WAN attributes are not used: every family is timed over the same links), the default
membership settings (heartbeat 0.5 s, failure timeout 2 s), and one fault: node N/2 (in a mesh
of groups, the first member of its group that is not a gateway, whose death cuts no site off)
killed ``--kill-at`` virtual seconds after the rendezvous, and restarted halfway between then
and the end (its new process joins the run). Measured over the run after the rendezvous:

* **wall s / virtual s** and **CPU s / virtual s** (the whole simulation; CPU is the robust one
  on a loaded machine);
* **coordinator msgs / virtual s** (sent and received at the coordinator's transport, relayed
  ones included) and **coordinator CPU / virtual s** (the CPU time of the coordinator's own
  callbacks, :attr:`VirtualLoop.actor_cpu`, without the simulator's express relaying that its
  sends start: a real coordinator does not walk its replies' paths);
* **detection s**: from the kill until the coordinator's view drops the node, next to the
  simulator's bound (:func:`p2psync.sim.cluster.detection_bound`);
* **convergence s**: from the first node applying that view to the last live member applying
  it (the coordinator's own client, which learns it from its next local heartbeat reply, left
  out; the target: at most 1 s + the largest round trip);
* **convergence s after the join**: the same for the first view that holds the restarted node
  again (the new process included);
* **memory per node**: the child's peak RSS growth over its start, per simulated node.

Every log-log slope is fitted in the same run (least squares over the sizes measured); a
coordinator cost with an exponent of at most 1.2 grows at most about linearly.

``--allreduce-mb S`` adds, per (topology, N), one allreduce of S MB (float32 zeros) on every
node at once over links of 1 ms one way and ``--rate-mbps`` (1 Gb/s), every NIC sending at that
rate too (``--nic-mbps``: the links of a switch share their NIC), with the real collectives
(the topology's own plan, 1 MiB pieces) and the in-process shaper's token buckets, in a child
process of its own: the virtual seconds from the common start to the last node done, against
the bandwidth-optimal bound 2(N-1)/N * size / rate of a node with one NIC (a node of BCube(n, k)
has k NICs, which its plan sends on at once) and that bound plus the ring's 2(N-1) link
latencies. Every node holds the tensor and its working buffer, so the
memory is about 3 N S MB: the issue's 100 MB at N = 1024 (300 GB) does not fit one process;
S = 16 at N = 16 and 64 does.

"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import resource
import sys
import time
from typing import Any, Sequence

from bench._common import markdown_table, save_png

KINDS = ("ring", "mesh", "bcube", "groups")
#: the columns fitted against N: (key, label)
METRICS = (("wall_per_vs", "wall s / virtual s"), ("cpu_per_vs", "CPU s / virtual s"),
           ("coord_msgs_per_vs", "coordinator msgs / virtual s"), ("coord_cpu_per_vs", "coordinator CPU s / virtual s"),
           ("detection_s", "detection s"), ("convergence_s", "convergence s"),
           ("join_convergence_s", "convergence s after the join"), ("kb_per_node", "memory KiB / node"))


def group_shape(n: int) -> tuple[int, int]:
    """(G, S) of the mesh of groups with ``n`` nodes: G the largest divisor of ``n`` not above
    sqrt(n), S = n / G (32x32 for 1024, 2x4 for 8); ValueError when G would be 1 (``n`` prime
    or below 4)."""
    g = max(d for d in range(1, math.isqrt(max(n, 1)) + 1) if n % d == 0)
    if g < 2:
        raise ValueError(f"no mesh of at least 2 groups of at least 2 nodes has {n} nodes")
    return g, n // g


def victim(topo: Any) -> int:
    """The node killed: N/2, or in a mesh of groups the first member of N/2's group that is not
    a gateway (a gateway's death would cut its whole group off)."""
    from p2psync.topology import is_gateway

    n = topo.size // 2
    if topo.kind == "groups":
        size, gateways = topo.params["size"], topo.params["gateways"]
        if is_gateway(n, size, gateways):
            n = n - n % size + gateways
    return n


def topology(kind: str, n: int) -> Any:
    """``ring:n``, ``mesh:n``, ``groups:GxS`` (:func:`group_shape`), or BCube(4, k) / BCube(2, k)
    with ``n`` nodes."""
    from p2psync.topology import bcube, groups, mesh, ring

    if kind == "ring":
        return ring(n)
    if kind == "mesh":
        return mesh(n)
    if kind == "groups":
        return groups(*group_shape(n))
    for alpha in (4, 2):
        beta = round(math.log(n, alpha))
        if beta >= 1 and alpha**beta == n:
            return bcube(alpha, beta)
    raise ValueError(f"no BCube(4, k) or BCube(2, k) has {n} nodes")


def measure(kind: str, n: int, *, virtual_s: float = 15.0, kill_at: float = 5.0) -> dict[str, Any]:
    """One run (see the module docstring), in this process; its figures."""
    from p2psync.sim.cluster import SimCluster, SimOptions
    from p2psync.sim.faults import parse_faults
    from p2psync.sim.loop import VirtualLoop, quiet_logs, run, sparse_gc

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    topo = topology(kind, n)
    dead = victim(topo)
    restart_at = kill_at + (virtual_s - kill_at) / 2
    faults = parse_faults(f"kill:{dead}@{kill_at:g},restart:{dead}@{restart_at:g}", topo.ids)
    loop = VirtualLoop(trace=False, actor_cpu=True)
    coord = topo.coordinator

    async def main() -> dict[str, Any]:
        async with SimCluster(topo, opts=SimOptions(), faults=faults) as c:
            w0, c0 = time.perf_counter(), time.process_time()
            rendezvous = await c.start()
            w1, c1 = time.perf_counter(), time.process_time()
            assert loop.actor_cpu is not None
            stats = c.nodes[coord].transport.nic_stats.values()
            c.hub.flush()  # (the relays' counters of the express paths)
            m1 = sum(s.msgs_sent + s.msgs_recv for s in stats)
            k1 = loop.actor_cpu[coord]
            await asyncio.sleep(virtual_s)
            w2, c2 = time.perf_counter(), time.process_time()
            c.hub.flush()
            m2 = sum(s.msgs_sent + s.msgs_recv for s in stats)
            s = c.summary(virtual_seconds=virtual_s, rendezvous_s=rendezvous, wall_s=w2 - w0)
            after = [d["declared_after_s"] for d in s["detections"]][0]
            conv = _convergence(c.views, lambda v: dead not in v.members, [i for i in topo.ids if i != dead])
            rejoined = _convergence(c.views, lambda v: dead in v.members and v.t >= restart_at, topo.ids)
            return {
                "kind": kind, "n": n, "virtual_s": virtual_s, "rendezvous_vs": rendezvous,
                "rendezvous_wall_s": w1 - w0, "rendezvous_cpu_s": c1 - c0,
                "wall_per_vs": (w2 - w1) / virtual_s, "cpu_per_vs": (c2 - c1) / virtual_s,
                "coord_msgs_per_vs": (m2 - m1) / virtual_s, "coord_cpu_per_vs": (loop.actor_cpu[coord] - k1) / virtual_s,
                "detection_s": after.get(str(dead)), "bound_s": s["detection_bound_s"], "convergence_s": conv,
                "join_convergence_s": rejoined,
                "invariants": "held" if all(v == "held" for v in s["invariants"].values()) else
                              "; ".join(f"{k}: {v}" for k, v in s["invariants"].items() if v != "held"),
                "expressed": s["expressed"]["messages"],
            }

    with quiet_logs():
        with sparse_gc():
            out = run(main(), loop=loop)
    out["kb_per_node"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / n
    return out


def _convergence(views: Sequence[Any], first_of: Any, nodes: Sequence[int]) -> float | None:
    """From the first view (a :class:`~p2psync.sim.invariants.ViewSeen`) that ``first_of``
    picks to the last of ``nodes`` applying it or a newer one (the coordinator of that view left
    out: its own client learns it from its next local heartbeat); None when one never does."""
    picked = [v for v in views if first_of(v)]
    if not picked:
        return None
    first = min(picked, key=lambda v: v.t)
    key = (first.term, first.epoch)
    live = [i for i in nodes if i != first.coordinator]
    applied: dict[int, float] = {}
    for v in views:
        if v.node in live and v.node not in applied and (v.term, v.epoch) >= key and v.t >= first.t:
            applied[v.node] = v.t
    return max(applied.values(), default=first.t) - first.t if len(applied) == len(live) else None


def measure_allreduce(kind: str, n: int, mb: float, *, rate_mbps: float = 1000.0,
                      latency_ms: float = 1.0) -> dict[str, Any]:
    """One allreduce of ``mb`` MB on every node of ``kind``-``n`` at once (see the module
    docstring), in this process: its virtual seconds and the bounds."""
    from dataclasses import replace

    import numpy as np

    from p2psync.collectives import Collectives
    from p2psync.sim.cluster import SimCluster, SimOptions
    from p2psync.sim.loop import VirtualLoop, quiet_logs, run, sparse_gc
    from p2psync.topology import LinkAttrs

    topo = replace(topology(kind, n), default_link=LinkAttrs(latency_ms=latency_ms, bandwidth_mbps=rate_mbps))
    loop = VirtualLoop(trace=False)
    size = int(mb * 1e6) // 4 * 4
    rate = rate_mbps * 1e6 / 8  # bytes/s

    async def main() -> dict[str, Any]:
        async with SimCluster(topo, opts=SimOptions(latency_s=None, peer_timeout=3600.0, nic_mbps=rate_mbps)) as c:
            await c.start()
            done: dict[int, float] = {}
            t0 = loop.time()

            async def one(i: int) -> None:
                coll = Collectives(c.nodes[i].transport, timeout=3600.0)
                out = await coll.allreduce(np.zeros(size // 4, np.float32), tag="bench.allreduce")
                assert not out.any()
                done[i] = loop.time() - t0

            w, cpu = time.perf_counter(), time.process_time()
            await asyncio.gather(*(loop.spawn(one(i), actor=c.nodes[i].actor) for i in topo.ids))
            took = max(done.values())
            bound = 2 * (n - 1) / n * size / rate
            return {"kind": kind, "n": n, "mb": size / 1e6, "virtual_s": round(took, 4), "bound_s": round(bound, 4),
                    "bound_lat_s": round(bound + 2 * (n - 1) * latency_ms / 1e3, 4),
                    "ratio": round(took / bound, 3), "wall_s": round(time.perf_counter() - w, 2),
                    "cpu_s": round(time.process_time() - cpu, 2)}

    with quiet_logs(), sparse_gc():
        out = run(main(), loop=loop)
    out["rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return out


def _child(conn: Any, kind: str, n: int, virtual_s: float, kill_at: float, mb: float | None, rate: float) -> None:
    try:
        conn.send(measure(kind, n, virtual_s=virtual_s, kill_at=kill_at) if mb is None
                  else measure_allreduce(kind, n, mb, rate_mbps=rate))
    except BaseException as exc:  # reported by the parent
        conn.send({"kind": kind, "n": n, "error": repr(exc)[:300]})
    finally:
        conn.close()


def measure_apart(kind: str, n: int, *, virtual_s: float, kill_at: float, timeout: float,
                  allreduce_mb: float | None = None, rate_mbps: float = 1000.0) -> dict[str, Any]:
    """:func:`measure` (with ``allreduce_mb``: :func:`measure_allreduce`) in a fresh child
    process (its memory alone), bounded by ``timeout``."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(child, kind, n, virtual_s, kill_at, allreduce_mb, rate_mbps), daemon=True)
    p.start()
    child.close()
    try:
        if parent.poll(timeout):
            res: dict[str, Any] = parent.recv()
            return res
        return {"kind": kind, "n": n, "error": f"over {timeout:g} s wall"}
    except EOFError:
        return {"kind": kind, "n": n, "error": "the child died"}
    finally:
        if p.is_alive():
            p.kill()
        p.join()


def exponent(points: Sequence[tuple[float, float | None]]) -> float | None:
    """The least-squares slope of log(y) over log(x) (points with a positive y), or None."""
    pts = [(math.log(x), math.log(y)) for x, y in points if y is not None and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return None if sxx == 0 else sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def exponents(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """kind -> metric -> fitted exponent against N."""
    out: dict[str, dict[str, float | None]] = {}
    for kind in dict.fromkeys(r["kind"] for r in results):
        rows = [r for r in results if r["kind"] == kind and "error" not in r]
        out[kind] = {key: exponent([(r["n"], r.get(key)) for r in rows]) for key, _ in METRICS}
    return out


def _fmt(v: Any) -> Any:
    return "—" if v is None else v


def report(results: Sequence[dict[str, Any]]) -> str:
    """The markdown tables: one row per run, then the fitted exponents and the targets."""
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["kind"], r["n"], *(["—"] * 10), r["error"]])
            continue
        rows.append([r["kind"], r["n"], r["wall_per_vs"], r["cpu_per_vs"], r["coord_msgs_per_vs"],
                     r["coord_cpu_per_vs"], _fmt(r["detection_s"]), r["bound_s"], _fmt(r["convergence_s"]),
                     _fmt(r["join_convergence_s"]), r["kb_per_node"], r["rendezvous_wall_s"], r["invariants"]])
    lines = ["## Membership at scale (p2psync sim, one kill and its restart)\n",
             markdown_table(["topology", "N", "wall s/vs", "CPU s/vs", "coord msgs/vs", "coord CPU s/vs",
                             "detection s", "bound s", "convergence s", "convergence s after the join", "KiB/node",
                             "rendezvous wall s", "invariants"], rows)]
    fits = exponents(results)
    lines += ["\n### Fitted exponents (log-log slope against N)\n",
              markdown_table(["topology", *(label for _, label in METRICS)],
                             [[k, *(_fmt(None if v is None else round(v, 2)) for v in f.values())]
                              for k, f in fits.items()])]
    checks = []
    for kind, f in fits.items():
        e = f["coord_msgs_per_vs"]
        checks.append(f"- {kind}: coordinator messages grow as N^{_fmt(None if e is None else round(e, 2))}"
                      f" (target <= 1.2): {'PASS' if e is not None and e <= 1.2 else 'FAIL'}")
    for r in results:
        if "error" in r:
            continue
        hops = {"ring": r["n"] // 2, "mesh": 1, "groups": 3}.get(r["kind"], round(math.log(r["n"], 4)) or 1)
        rtt = 2 * 0.001 * hops
        conv, join, det = r["convergence_s"], r["join_convergence_s"], r["detection_s"]
        ok = all(c is not None and c <= 1 + rtt for c in (conv, join)) and det is not None and det <= r["bound_s"]
        if not ok:
            checks.append(f"- {r['kind']}-{r['n']}: convergence {_fmt(conv)} s after the kill and {_fmt(join)} s "
                          f"after the join (target <= {1 + rtt:.3g}), detection {_fmt(det)} s "
                          f"(bound {r['bound_s']:.3g}): FAIL")
    lines += ["\n### Targets\n", *checks,
              "- convergence (after the kill and after the join) <= 1 s + the largest RTT and detection within "
              "the bound: "
              + ("PASS at every N" if not any("FAIL" in c and "convergence" in c for c in checks) else "see above"),
              ]
    return "\n".join(lines)


def allreduce_report(results: Sequence[dict[str, Any]]) -> str:
    """The markdown table of :func:`measure_allreduce`'s runs."""
    rows = [[r["kind"], r["n"], "—", "—", "—", "—", "—", "—", "—", r["error"]] if "error" in r else
            [r["kind"], r["n"], r["mb"], r["virtual_s"], r["bound_s"], r["bound_lat_s"], r["ratio"], r["wall_s"],
             r["rss_mb"], ""] for r in results]
    return "## Allreduce in virtual time against the bandwidth bound\n\n" + markdown_table(
        ["topology", "N", "MB", "virtual s", "bound 2(N-1)/N*S/rate", "bound + 2(N-1) latencies", "virtual / bound",
         "wall s", "peak RSS MB", "error"], rows)


def plot(results: Sequence[dict[str, Any]], name: str = "scale.png") -> Any:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fits = exponents(results)
    sizes = sorted({r["n"] for r in results})
    colors = {k: f"C{i}" for i, k in enumerate(KINDS)}
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    for ax, (key, label) in zip(axes.flat, METRICS):
        for kind in fits:
            pts = [(r["n"], r.get(key)) for r in results if r["kind"] == kind and "error" not in r
                   and r.get(key) is not None and r.get(key) > 0]
            if not pts:
                continue
            e = fits[kind][key]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors.get(kind),
                    label=f"{kind} (N^{e:.2f})" if e is not None else kind)
        ax.set(xscale="log", yscale="log", xlabel="nodes", title=label)
        ax.set_xticks(sizes)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig, name)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16,64,256", help="comma list of N (default 16,64,256; 1024 takes minutes)")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma list of ring, mesh, bcube, groups")
    p.add_argument("--virtual-seconds", type=float, default=15.0)
    p.add_argument("--kill-at", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=600.0, help="wall seconds per run at most (default 600)")
    p.add_argument("--in-process", action="store_true", help="no child processes (memory per node is then "
                                                             "the growth of this process)")
    p.add_argument("--png", default="scale.png", help="the plot's name under bench/out/")
    p.add_argument("--allreduce-mb", type=float, default=None,
                   help="also time one allreduce of this many MB per (topology, N) (see the module docstring)")
    p.add_argument("--rate-mbps", type=float, default=1000.0, help="the links' rate for --allreduce-mb")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        p.error(f"unknown kinds {sorted(unknown)}")
    results = []
    for kind in kinds:
        for n in sizes:
            t = time.perf_counter()
            if args.in_process:
                r = measure(kind, n, virtual_s=args.virtual_seconds, kill_at=args.kill_at)
            else:
                r = measure_apart(kind, n, virtual_s=args.virtual_seconds, kill_at=args.kill_at,
                                  timeout=args.timeout)
            print(f"{kind}-{n}: {time.perf_counter() - t:.1f} s wall", file=sys.stderr, flush=True)
            results.append(r)
    print(report(results))
    png = plot(results, args.png)
    print("\nplot:", png if png is not None else "(no matplotlib: no plot)")
    if args.allreduce_mb is not None:
        reduced = []
        for kind in kinds:
            for n in sizes:
                t = time.perf_counter()
                if args.in_process:
                    r = measure_allreduce(kind, n, args.allreduce_mb, rate_mbps=args.rate_mbps)
                else:
                    r = measure_apart(kind, n, virtual_s=0.0, kill_at=0.0, timeout=args.timeout,
                                      allreduce_mb=args.allreduce_mb, rate_mbps=args.rate_mbps)
                print(f"{kind}-{n} allreduce: {time.perf_counter() - t:.1f} s wall", file=sys.stderr, flush=True)
                reduced.append(r)
        print("\n" + allreduce_report(reduced))
        results += reduced
    return results


if __name__ == "__main__":
    main()

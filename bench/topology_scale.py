"""Topology load and validation time against the number of nodes (rings of 1k, 4k, 30k nodes).

    python -m bench.topology_scale [--sizes 1000 4000 30000] [--reps 3]

Each size: a ring built by the builder, written as JSON text once, then parsed and validated
(``p2psync.topology.loads``, what ``p2psync run`` does with the file) ``--reps`` times; the best
time is reported. Linear validation keeps seconds per node flat as the ring grows.
"""

from __future__ import annotations

import argparse
import time

from bench._common import markdown_table, save_png
from p2psync.topology import dumps, loads, ring


def load_seconds(n: int, reps: int) -> float:
    text = dumps(ring(n, base_port=1024))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        loads(text)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 4000, 30000])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    times = {n: load_seconds(n, args.reps) for n in args.sizes}
    print("## Topology load + validate (ring, best of %d)\n" % args.reps)
    print(markdown_table(["nodes", "seconds", "µs per node"], [[n, t, t / n * 1e6] for n, t in times.items()]))
    try:
        import matplotlib
    except ImportError:
        print("\n(no matplotlib: no plot)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(list(times), list(times.values()), "o-")
    ax.set(xscale="log", yscale="log", xlabel="nodes (ring)", ylabel="load + validate, s")
    ax.grid(True, which="both", alpha=0.3)
    print("\nplot:", save_png(fig, "topology_scale.png"))


if __name__ == "__main__":
    main()

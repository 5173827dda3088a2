"""ElasticBSP barrier search: the thesis' Tables 6.3 (d_Z*, success rate) and 6.4 (time).

    python -m bench.zipline [--runs 10]

Setting of §6.6: every worker's iteration interval uniform in 1000-1500 ms (and a random
phase), n in {10, 50, 100, 500, 1000}, R in {15, 150}, averages over ``--runs`` random
instances. The exact reference is ZipLineOptBS (checked against naive search in the tests).
FullGridScan is O(R^2 n^2): it is skipped where one call would take minutes.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench._common import markdown_table, save_png
from p2psync.coordinator.zipline import (full_grid_scan, grid_scan, predict, zipline, zipline_opt,
                                         zipline_opt_bs)

ALGOS = {"ZipLine": zipline, "ZipLineOpt": zipline_opt, "ZipLineOptBS": zipline_opt_bs,
         "FullGridScan": full_grid_scan, "GridScan": grid_scan}
# Table 6.4 of the thesis (C++, microseconds): (n, R) -> value
THESIS_US = {
    "ZipLine": {(10, 15): 1.49e2, (10, 150): 1.32e3, (100, 15): 6.37e3, (100, 150): 4.99e4,
                (1000, 15): 2.53e5, (1000, 150): 2.38e6},
    "ZipLineOpt": {(10, 15): 0.90e2, (10, 150): 8.08e2, (100, 15): 2.46e3, (100, 150): 1.93e4,
                   (1000, 15): 9.39e4, (1000, 150): 7.78e5},
    "ZipLineOptBS": {(10, 15): 1.24e2, (10, 150): 1.15e3, (100, 15): 2.65e3, (100, 150): 2.30e4,
                     (1000, 15): 7.68e4, (1000, 150): 5.66e5},
    "FullGridScan": {(10, 15): 1.54e3, (10, 150): 4.67e4, (100, 15): 8.13e4, (100, 150): 2.15e6,
                     (1000, 15): 4.04e6, (1000, 150): 2.07e8},
    "GridScan": {(10, 15): 1.68e2, (10, 150): 5.50e3, (100, 15): 1.11e3, (100, 150): 4.38e4,
                 (1000, 15): 7.45e3, (1000, 150): 2.57e5},
}


def instance(rng: np.random.Generator, n: int, R: int) -> np.ndarray:
    last = rng.uniform(0, 1500, n)
    return predict(np.stack([last - rng.uniform(1000, 1500, n), last], axis=1).tolist(), R)


def skip(name: str, n: int, R: int) -> bool:
    return name == "FullGridScan" and R * R * n * n > 3e8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--workers", type=int, nargs="+", default=[10, 50, 100, 500, 1000])
    args = ap.parse_args()
    small = instance(np.random.default_rng(1), 5, 4)
    for f in ALGOS.values():  # compile the numba kernels outside the timing
        f(small)
    rng = np.random.default_rng(0)
    cells = [(n, R) for R in (15, 150) for n in args.workers]
    d = {a: {} for a in ALGOS}
    us = {a: {} for a in ALGOS}
    success = {a: [0, 0] for a in ALGOS}
    for n, R in cells:
        ds = {a: [] for a in ALGOS}
        ts = {a: [] for a in ALGOS}
        for _ in range(args.runs):
            M = instance(rng, n, R)
            exact = zipline_opt_bs(M).d
            for a, f in ALGOS.items():
                if skip(a, n, R):
                    continue
                t0 = time.perf_counter()
                res = f(M)
                ts[a].append(time.perf_counter() - t0)
                ds[a].append(res.d)
                success[a][0] += res.d == exact
                success[a][1] += 1
        for a in ALGOS:
            d[a][(n, R)] = np.mean(ds[a]) if ds[a] else None
            us[a][(n, R)] = np.mean(ts[a]) * 1e6 if ts[a] else None
        print(f"  n={n} R={R}: " + ", ".join(f"{a} {us[a][(n, R)] or float('nan'):.0f} µs" for a in ALGOS),
              flush=True)

    def fmt(v: float | None, digits: str = ".0f") -> str:
        return "skipped" if v is None else format(v, digits)

    head = ["algorithm", *[f"n={n} R={R}" for n, R in cells], "success"]
    print(f"\n## d_Z* in ms (mean of {args.runs} runs), cf. thesis Table 6.3\n")
    print(markdown_table(head, [[a, *[fmt(d[a][c]) for c in cells],
                                 f"{100 * success[a][0] / max(1, success[a][1]):.0f}%"] for a in ALGOS]))
    print(f"\n## Time per search in µs (mean of {args.runs} runs; thesis C++ Table 6.4 in brackets)\n")
    rows = []
    for a in ALGOS:
        rows.append([a, *[fmt(us[a][c], ".3g") + (f" [{THESIS_US[a][c]:.3g}]" if c in THESIS_US[a] else "")
                          for c in cells]])
    print(markdown_table(head[:-1], rows))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, R in zip(axes, (15, 150)):
        for a in ALGOS:
            xs = [n for n in args.workers if us[a][(n, R)] is not None]
            ax.plot(xs, [us[a][(n, R)] for n in xs], "o-", label=a)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"R = {R}")
        ax.set_xlabel("workers n")
    axes[0].set_ylabel("µs per search")
    axes[0].legend(fontsize=8)
    print("\nplot:", save_png(fig, "zipline.png"))


if __name__ == "__main__":
    main()

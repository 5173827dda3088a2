"""SSGD vs ASGD vs ESync on a heterogeneous 4-node cluster, same data, model and budget.

    python -m bench.hetero [--seconds 40] [--target 0.9] [--base 0.02] [--modes wait compute]
    python -m bench.hetero --model lm-tiny --modes compute --seconds 300   # a language model

Every run goes through the CLI (``p2psync run``: one process per node). Devices are emulated
with fixed step times in the ratio 1 : 1 : 2 : 8 (``--step-time``; base ``--base`` seconds),
so compute dominates as on real heterogeneous GPUs and runs are repeatable. Each configuration
runs in both ``--slowdown-mode``s: ``wait`` (the slow device's extra time is idle, CPU free)
and ``compute`` (the extra time is real matrix products on the node's compute thread, so slow
devices also cost CPU on this machine's shared cores, and an iteration that is abandoned
really has to be cut short); ``--modes quota`` (root) runs the same 1 : 1 : 2 : 8 devices as
``--slowdown`` factors with each node's process capped at its device's share of the cores, so
a step is the real compute at that rate (the base step time is then what the fast device's
share takes, not ``--base``) and a waiting node frees no CPU for the others. Each strategy is
run on loopback and again with the four-region WAN profile (in-process shaper). Reported: time
to ``--target`` test accuracy (every node there), final accuracy, samples/s, bytes sent, and
blocking time at the barrier per round (ESync) / per step (SSGD).

``--model lm-tiny`` (or ``lm-small``/``lm-base``; ``--data pysource``) runs the byte-level
language model with its own defaults (AdamW, warm-up + cosine over no fixed length: the
learning rate stays at its peak under ``--time``) and reports validation bits per byte instead
of accuracy: time to ``--target`` bpb (default 3.9; lower is better) and the final bpb. Its
real compute per step is far longer than the MLP's, so its emulated base step time defaults to
1 s (the slowest device: 8 s) and the budget should be minutes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import (LM_MODELS, ROOT, accuracy_curve, final_accuracy, first_reach, markdown_table, metric_key,
                           run_nodes, save_png)
from p2psync.training.hetero import SLOWDOWN_MODES
from p2psync.training.metrics import bytes_sent


def run(strategy: str, out: Path, args: argparse.Namespace, wan: bool, mode: str) -> dict[str, Any]:
    run_id = f"{strategy}-{'wan' if wan else 'lan'}-{mode}"
    b = args.base
    # quota: the real step at each device's share of the cores; else padded to fixed step times
    devices = (["--slowdown", "0:1,1:1,2:2,3:8"] if mode == "quota"
               else ["--step-time", f"0:{b},1:{b},2:{2 * b},3:{8 * b}"])
    cmd = [sys.executable, "-m", "p2psync", "run", str(ROOT / "topologies" / "ring-4.json"),
           "--strategy", strategy, "--time", str(args.seconds), "--out", str(out), "--run-id", run_id,
           *devices, "--model", args.model,
           "--eval-every", "1" if strategy == "esync" else "5", "--no-progress", "--slowdown-mode", mode]
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    if wan:
        cmd += ["--shaper", "inproc", "--wan", str(ROOT / "topologies" / "wan-4-regions.json")]
    nodes = run_nodes(cmd, out, run_id, 4, timeout=args.seconds * 4 + 120)
    key = metric_key(args.model)
    reach = [first_reach(recs, args.target, key) for recs in nodes]
    last = [recs[-1] for recs in nodes]
    block: list[Any] = [x.get("blocking_s", x.get("comm_s_step", None)) for x in nodes[0]]
    if strategy == "ssgd":  # per-step communication of the slowest-gated allreduce
        comm = np.diff([0.0] + [x["comm_s"] for x in nodes[0]])
        block = list(comm)
    block = [v for v in block if v is not None]
    return {
        "strategy": strategy, "net": "WAN" if wan else "loopback", "mode": mode, "to_target": max(reach),
        "final_acc": final_accuracy(nodes, key),
        "samples_per_s": sum(x["samples_per_s"] for x in last),
        "bytes_sent": sum(bytes_sent(x) for x in last),
        "blocking_s": float(np.mean(block)) if block else 0.0,
        "n_local": [float(np.mean([x.get("n_local", 1) for x in recs])) for recs in nodes],
        "curve": accuracy_curve(nodes[0], key),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--model", default="mlp", help="the built-in job's --model (lm-tiny: the language model)")
    ap.add_argument("--target", type=float, help="test accuracy to reach (default 0.9); a language model: "
                                                 "validation bpb (default 3.9)")
    ap.add_argument("--base", type=float, help="fast device step time (s; default 0.02, a language model 1.0)")
    ap.add_argument("--lr", type=float, help="default 0.05; a language model: its own")
    ap.add_argument("--strategies", nargs="+", default=["ssgd", "asgd", "esync"])
    ap.add_argument("--modes", nargs="+", default=["wait", "compute"], choices=SLOWDOWN_MODES)
    ap.add_argument("--nets", nargs="+", default=["loopback", "WAN"], choices=["loopback", "WAN"])
    args = ap.parse_args()
    lm = args.model in LM_MODELS
    args.target = args.target if args.target is not None else (3.9 if lm else 0.9)
    args.base = args.base if args.base is not None else (1.0 if lm else 0.02)
    args.lr = args.lr if args.lr is not None or lm else 0.05
    what = "validation bpb" if lm else "accuracy"
    out = Path(tempfile.mkdtemp(prefix="p2psync-hetero-"))
    results = []
    try:
        for mode in args.modes:
            for net in args.nets:
                for s in args.strategies:
                    res = run(s, out, args, net == "WAN", mode)
                    results.append(res)
                    print(f"  {mode} {res['net']} {s}: target at {res['to_target']:.1f}s, "
                          f"final {what} {res['final_acc']:.4f}", flush=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    rows = []
    for r in results:
        base = next((x for x in results if x["net"] == r["net"] and x["mode"] == r["mode"]
                     and x["strategy"] == "ssgd"), None)
        speed = base["to_target"] / r["to_target"] if base and np.isfinite(r["to_target"]) else 0.0
        rows.append([r["mode"], r["net"], r["strategy"], f"{r['to_target']:.1f}", f"{speed:.2f}x", f"{r['final_acc']:.4f}",
                     f"{r['samples_per_s']:.0f}", f"{r['bytes_sent'] / 1e6:.1f}", f"{r['blocking_s'] * 1e3:.1f}",
                     "/".join(f"{v:.1f}" for v in r["n_local"])])
    print(f"\n## Heterogeneous cluster, {args.model} (step times 1:1:2:8 x {args.base}s), {args.seconds:g}s budget, "
          f"target {what} {args.target}\n")
    print(markdown_table(["slowdown", "network", "strategy", f"s to {args.target}", "speed-up vs ssgd",
                          "final bpb" if lm else "final acc",
                          "samples/s", "MB sent", "blocking ms", "local iters/round"], rows))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(args.modes), len(args.nets), figsize=(5.5 * len(args.nets), 4 * len(args.modes)),
                             sharey=True, squeeze=False)
    for row, mode in zip(axes, args.modes):
        for ax, net in zip(row, args.nets):
            for r in results:
                if r["net"] == net and r["mode"] == mode:
                    t, a = zip(*r["curve"]) if r["curve"] else ((), ())
                    ax.plot(t, a, label=r["strategy"])
            ax.axhline(args.target, color="grey", lw=0.5, ls="--")
            ax.set_title(f"{net}, slowdown by {mode}: 1,1,2,8")
            ax.set_xlabel("wall time (s)")
        row[0].set_ylabel(f"{'validation bpb' if lm else 'test accuracy'} (node 0)")
    axes[0][0].legend()
    print("\nplot:", save_png(fig, "hetero.png" if not lm else f"hetero-{args.model}.png"))


if __name__ == "__main__":
    main()

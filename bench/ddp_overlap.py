"""SSGD's gradients averaged during backward (as DDP) against averaged at ``optimizer.step()``.

    python -m bench.ddp_overlap [--nodes 2] [--width 2048] [--depth 3] [--steps 40] [--rounds 3]
                                [--run-args "--shaper inproc --nic-mbps 1000"]

Each row is one ``p2psync run TOPOLOGY --strategy ssgd --opt sync=... -- python SCRIPT`` on a
ring of ``--nodes`` processes on this host: the script trains an MLP of ``--depth`` hidden layers
of ``--width`` (2048 x 3: about 9 M parameters, 34 MiB of gradient) with AdamW and gradient
clipping on synthetic data, and times its own steps after a warm-up (no start-up, no
evaluation). ``--run-args`` go to every ``p2psync run`` (a shaped link: ``--shaper inproc
--nic-mbps 1000``). Rows:

* ``step``: the gradient is averaged once backward is over, at ``optimizer.step()`` (the
  baseline: no overlap; clipping saw the local gradient);
* ``backward``: buckets of ``--bucket-kib`` leave while backward goes on, and backward returns
  with the mean (DDP's semantics and its overlap);
* ``backward-1m``: the same with 1 MiB buckets (more, smaller operations).

Rows alternate for ``--rounds`` rounds; the table gives the median samples/s of each row, the
ratio to ``step`` in the same round (median and range), and the seconds per step that the
overlap hid (step's minus the row's). Saves bench/out/ddp_overlap.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from bench._common import markdown_table, save_png, write_topology

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch
    from torch import nn
    import p2psync

    width, depth, steps, batch = (int(a) for a in sys.argv[1:5])
    torch.manual_seed(0)
    layers = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    opt = p2psync.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(int(os.environ.get("P2PSYNC_NODE", "0")))
    x, y = torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)
    warm = 5
    for k in range(steps + warm):
        if k == warm:
            t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if p2psync.should_stop():
            break
    dt = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    out = os.environ.get("P2PSYNC_RUN_DIR", ".")
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump({"samples_per_s": steps * batch / dt, "step_s": dt / steps, "params": params}, f)
""")

ROWS = {"step": ("--opt", "sync=step"), "backward": ("--opt", "sync=backward"),
        "backward-1m": ("--opt", "sync=backward", "--opt", "bucket_kib=1024")}


def run_row(topo: Path, tmp: Path, script: Path, row: str, args: argparse.Namespace, run_id: str,
            bucket_kib: int) -> dict[str, Any]:
    opts = list(ROWS[row])
    if row == "backward":
        opts += ["--opt", f"bucket_kib={bucket_kib}"]
    cmd = [sys.executable, "-m", "p2psync", "run", str(topo), "--strategy", "ssgd", *opts, "--out", str(tmp),
           "--run-id", run_id, "--no-progress", "--steps", str(args.steps + 5), *args.run_args.split(), "--",
           sys.executable, str(script),
           str(args.width), str(args.depth), str(args.steps), str(args.batch)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"{run_id} failed:\n{r.stderr[-3000:]}")
    per = [json.loads((tmp / run_id / f"node-{i}" / "bench.json").read_text()) for i in range(args.nodes)]
    return {"samples_per_s": sum(p["samples_per_s"] for p in per) / len(per),
            "step_s": statistics.mean(p["step_s"] for p in per), "params": per[0]["params"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--bucket-kib", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--run-args", default="", help="more options for every p2psync run (e.g. a shaped link)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        topo = write_topology(tmp / "ring.json", "ring", "-n", str(args.nodes))
        script = tmp / "mlp.py"
        script.write_text(SCRIPT)
        results: dict[str, list[dict[str, Any]]] = {r: [] for r in args.rows}
        for k in range(args.rounds):
            for row in args.rows:
                res = run_row(topo, tmp, script, row, args, f"{row}-{k}", args.bucket_kib)
                results[row].append(res)
                print(f"round {k} {row}: {res['samples_per_s']:.1f} samples/s, {1000 * res['step_s']:.1f} ms/step",
                      flush=True)
    params = next(iter(results.values()))[0]["params"]
    base = results.get("step")
    table = []
    for row, rs in results.items():
        sps = statistics.median(r["samples_per_s"] for r in rs)
        ms = statistics.median(1000 * r["step_s"] for r in rs)
        if base is not None:
            ratios = [r["samples_per_s"] / b["samples_per_s"] for r, b in zip(rs, base)]
            hidden = statistics.median(1000 * (b["step_s"] - r["step_s"]) for r, b in zip(rs, base))
            ratio = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        else:
            ratio, hidden = "-", float("nan")
        table.append([row, f"{sps:.1f}", f"{ms:.1f}", ratio, f"{hidden:.1f}"])
    print(f"\nSSGD on a ring of {args.nodes} processes, MLP {args.depth}x{args.width} ({params / 1e6:.1f} M parameters, "
          f"{4 * params / 2**20:.0f} MiB of gradient), batch {args.batch} per node, {args.steps} timed steps, "
          f"{args.rounds} alternating rounds{', ' + args.run_args if args.run_args else ''}\n")
    print(markdown_table(["averaged", "samples/s (median)", "ms/step", "x step (median, range)", "ms hidden/step"],
                         table))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(results)
    ax.bar(names, [statistics.median(r["samples_per_s"] for r in results[n]) for n in names])
    for i, n in enumerate(names):
        ax.scatter([i] * len(results[n]), [r["samples_per_s"] for r in results[n]], color="black", s=10, zorder=3)
    ax.set_ylabel("samples/s per node")
    ax.set_title(f"SSGD, {params / 1e6:.1f} M parameters, {args.nodes} nodes: averaging during backward vs at step")
    print(f"\nsaved {save_png(fig, 'ddp_overlap.png')}")


if __name__ == "__main__":
    main()

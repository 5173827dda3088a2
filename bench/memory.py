"""Peak memory per node for the language models under every strategy, against the plain script.

    python -m bench.memory [--models lm-tiny lm-small] [--strategies ssgd diloco ...] [--steps 12]

What a node holds beyond the ordinary PyTorch script it runs: for each model ``examples/lm.py``
(AdamW, 8 sequences of the model's context per step, the model's shape from
``--width/--layers/--heads/--context``) first runs alone in a fresh process (``attach`` is a
no-op outside a p2psync run) and reports its peak resident memory (``ru_maxrss``); then every
strategy runs the same script on every node of ``topologies/ring-4.json``
(``p2psync run ... --strategy S -- python examples/lm.py ...``: fresh processes too), and each
node's record in ``summary.json`` gives its peak RSS and the model's flat size
(``peak_rss_bytes``, ``model_bytes``). Reported per strategy: the largest node's peak RSS,
what it holds beyond the script alone, and that excess in flat copies of the model (float32
parameters). The target is at most 3 extra flat copies for ``ssgd``. Every process runs
``--threads`` OpenMP threads (default 1, as four nodes on two cores get).

A strategy that refuses the script's AdamW (``dts``: plain SGD only) reports its refusal. The
excess counts the runtime's own memory too (ZeroMQ, the pieces in flight, the interpreter's
modules, allocator slack), which is what a user pays; it varies by a few MB between runs, so
the copies mean something for ``lm-small`` (40 MB per copy), hardly for ``lm-tiny`` (4 MB).
Memory does not depend on the machine's load: this benchmark can share the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from bench._common import ROOT, markdown_table, save_png
from p2psync.strategies import REGISTRY
from p2psync.topology import ring, save
from p2psync.training.config import LM_SPECS
from tests.helpers import free_port

#: the default strategies: one of each family (the parameter store's five share their memory)
STRATEGIES = ("ssgd", "asgd", "esync", "dts", "preduce", "canary", "diloco", "bsp", "ssp")
#: examples/lm.py alone, reporting its peak RSS (``attach`` is a no-op outside a p2psync run)
_BASELINE = (
    "import runpy, sys\n"
    "from p2psync.training.metrics import peak_rss_bytes\n"
    "sys.argv = ['examples/lm.py', *sys.argv[1:]]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "print('PEAK_RSS_BYTES', peak_rss_bytes())\n")

MiB = 1024 * 1024


def script_argv(model: str, steps: int) -> list[str]:
    """examples/lm.py's options for ``model``'s shape, 8 sequences per step, no evaluation but
    a small one at the end."""
    spec = LM_SPECS[model]
    return ["--steps", str(steps), "--batch-size", str(spec.batch_size), "--context", str(spec.context),
            "--width", str(spec.width), "--layers", str(spec.layers), "--heads", str(spec.heads),
            "--eval-every", str(steps), "--eval-windows", "8", "--device", "cpu"]


def baseline_bytes(model: str, steps: int, threads: int) -> int:
    """Peak RSS of examples/lm.py alone with ``model``'s shape."""
    r = subprocess.run([sys.executable, "-c", _BASELINE, *script_argv(model, steps)], capture_output=True,
                       text=True, cwd=ROOT, timeout=1800, env=_env(threads))
    if r.returncode != 0:
        raise SystemExit(f"examples/lm.py ({model}) failed:\n{r.stderr[-3000:]}")
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("PEAK_RSS_BYTES"))
    return int(line.split()[1])


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}


def run_strategy(strategy: str, model: str, steps: int, threads: int, out: Path) -> dict[str, Any] | str:
    """Every node's record in ``summary.json``, or why the run did not finish."""
    run_id = f"{model}-{strategy}"
    topo = out / f"ring-4-{run_id}.json"
    save(ring(4, base_port=free_port()), topo)  # ports of its own: other runs may hold the defaults
    cmd = [sys.executable, "-m", "p2psync", "run", str(topo), "--strategy", strategy, "--out", str(out),
           "--run-id", run_id, "--no-progress", "--", sys.executable, "examples/lm.py", *script_argv(model, steps)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT, env=_env(threads))
    summary = out / run_id / "summary.json"
    if r.returncode != 0 or not summary.exists():
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"failed: {tail[0][:120]}"
    nodes: dict[str, Any] = json.loads(summary.read_text())["nodes"]
    return nodes


def row(strategy: str, nodes: dict[str, Any] | str, base: int) -> list[str]:
    if isinstance(nodes, str):
        return [strategy, nodes, "", "", ""]
    peaks = [int(n["peak_rss_bytes"]) for n in nodes.values()]
    flat = max(int(n["model_bytes"]) for n in nodes.values())
    peak = max(peaks)
    extra = peak - base
    return [strategy, f"{peak / MiB:.0f} ({min(peaks) / MiB:.0f}-{peak / MiB:.0f})", f"{extra / MiB:+.0f}",
            f"{extra / flat:+.1f}", f"{flat / MiB:.1f}"]


def plot(results: dict[str, dict[str, Any]]) -> Path:
    """Bars: extra flat copies per strategy, one group per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / max(1, len(results))
    for k, (model, r) in enumerate(results.items()):
        rows = [x for x in r["rows"] if x[3]]
        ax.bar([i + k * width for i in range(len(rows))], [float(x[3]) for x in rows], width, label=model)
        ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(rows))], [x[0] for x in rows])
    ax.axhline(3, color="grey", linestyle="--", linewidth=1, label="ssgd target (3)")
    ax.set_ylabel("flat model copies beyond the script")
    ax.legend()
    return save_png(fig, "memory.png")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["lm-tiny", "lm-small"], choices=sorted(LM_SPECS))
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=sorted(REGISTRY))
    ap.add_argument("--steps", type=int, default=12, help="steps per run (peak memory is reached in the first few)")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads of every node and of the script alone")
    ap.add_argument("--out", type=Path, help="keep the run folders here (default: a temporary folder)")
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="p2psync-memory-"))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    try:
        for model in args.models:
            base = baseline_bytes(model, args.steps, args.threads)
            print(f"  {model}: the script alone {base / MiB:.0f} MiB", flush=True)
            rows = []
            for s in args.strategies:
                nodes = run_strategy(s, model, args.steps, args.threads, out)
                rows.append(row(s, nodes, base))
                print("  " + " | ".join(rows[-1]), flush=True)
            results[model] = {"base": base, "rows": rows}
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    for model, r in results.items():
        print(f"\n## Peak memory per node, {model}, ring-4, {args.steps} steps, {args.threads} torch thread(s); "
              f"examples/lm.py alone: {r['base'] / MiB:.0f} MiB\n")
        print(markdown_table(["strategy", "peak RSS MiB, largest node (range)", "beyond the script alone MiB",
                              "extra flat copies", "flat model MiB"], r["rows"]))
        ssgd = next((x for x in r["rows"] if x[0] == "ssgd" and x[3]), None)
        if ssgd is not None:
            print(f"\nTarget: ssgd at most 3 extra flat copies: {ssgd[3]} "
                  f"({'PASS' if float(ssgd[3]) <= 3 else 'FAIL'})")
    if results:
        print("\nplot:", plot(results))


if __name__ == "__main__":
    main()

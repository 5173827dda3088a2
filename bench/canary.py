"""Canary vs BSP on multi-NIC BCube with bandwidth-limited NICs (Zhou et al.,
*Canary*, §6.4 Fig. 21: traffic, peak utilisation; §6.6 Fig. 23: convergence time).

    python -m bench.canary [--cubes 2x2 3x2] [--seconds 30] [--nic-mbps 1000] [--hidden 4096]
                           [--speeds 1,1,2,3] [--base 0.1] [--lr 0.02] [--target 0.95] [--repeats 1]
                           [--colayers 0|1|2] [--p P] [--mode wait|compute] [--quick]
                           [--only TEXT ...] [--model mlp] [--data DATA]
    python -m bench.canary --model lm-tiny [--data pysource] [--seconds 300] ...   # a language model

Every run goes through the CLI (``p2psync run``: one process per node) on a BCube(α, 2)
topology (2 NICs per node), the in-process shaper capping every NIC at ``--nic-mbps`` (one
token bucket per NIC, shared by its links), the digits data with a wide MLP (``--hidden``: the
model's size makes the links matter: 4096 -> 0.3 M parameters, 1.2 MB per gradient),
heterogeneous emulated step times (node i: ``base x speeds[i mod len]``, +-``--jitter``),
momentum SGD, the same seeds for every configuration. The defaults (0.1 s for the fastest
device, lr 0.02, target 95 %) put the runs in the regime the paper measures — time to accuracy
bound by how many gradients the cluster turns out per second — rather than in the first few
seconds where any method reaches an easy target: at lr 0.05 every configuration passes 93 %
within 3-4 s and the ratios are noise; at 0.05 s per step nine node processes saturate this
machine's 2 cores (Canary then measures the CPU, not the exchange). Configurations:

* **BSP**: synchronous SGD, ring allreduce, no compression (``ssgd --collective ring``: one
  NIC per node busy, as the paper's BSP baselines);
* **Canary**: ``canary`` (asynchronous, §6.3 BCube schedule over both NICs, colayers pipelined
  during backward) with the sketch (its default: sketch8 at 5 bits per value, §4.3.1's
  "fewer and flexible bits"), without (``--opt sketch=false``), with the sketch at the
  paper's 8 bits (``--opt sketch_bits=8``) or 6 bits per value (``--opt sketch_bits=6``) or
  at a width chosen per piece (``--opt sketch_bits=0``: the fewest bits within a relative
  error of 0.1), with the
  sketch exactly as the paper gives it (``--codec sketch8p``: 8 bits, quantile buckets and
  midpoints, spec §2; p2psync's sketch8 merges evenly spaced levels into the quantiles and
  sends bucket means), and with §4.4.2's empty packets read literally
  (``--opt replies=round``: outside its own round of that colayer a node answers every push
  with an empty packet and what it relays leaves with its own next push, summed: fewer bytes,
  later data; the default ``held`` answers with whatever it holds for the pusher).

Colayers (``--colayers``, ``--p``): the MLP has two layers with parameters (input -> hidden,
hidden -> output; 1.07 MB and 0.16 MB), and a colayer holds whole layers, so it has at most
two colayers. Canary's automatic rule (the default, ``--colayers 0``) puts both into one (same
type, under its 4 MiB cap): one round per iteration, nothing to pipeline and ``p`` in {0, 1}.
That is what a user of ``--strategy canary`` gets, so it is what the Canary rows measure. The
last row, **Canary (sketch, 2 colayers)**, splits the model (``--opt colayers=2``): ``c^[0]``
(the output layer) is produced first in backward and its exchange starts while the input
layer's gradient is still being computed, and the two rounds complete, and count for ``p``,
separately. It doubles the messages per iteration, and on 2 cores nine node processes are
CPU-bound by per-message work (measured, BCube(3,2) sketch8 in 30 s runs: 1335-1482
iterations and 1.48-1.88x sooner than BSP with one colayer, 960-1139 iterations and 1.11-1.50x
with two), so the row shows what the split costs here; it always takes its own default p.
``--colayers 2`` runs every Canary row split. ``p`` defaults to ``round(0.6 k)`` within
[1, k] (the paper's 6 of 10; 1 of 2 here); Canary's own default,
ceil(0.6 k) = 2 = k, would make a stale iteration with any incomplete colayer an overtime.
``p`` decides for an iteration that became stale during its round (ζ passed ``t + s`` while
its colayers were out): with one colayer complete the node applies what it got (branch B),
else it is reset (branch C). (A node already beyond ``s`` when its round starts sends no
gradient, so its colayers lack its own bit and it is reset whatever ``p``.) The table's last
column counts the end-of-iteration decisions (A within ``s``, B, C) over all nodes, from the
runs' records.
What the pipelining saves is small on this model: the whole backward takes about a
millisecond (measured, batch 32, one thread), and the emulated device time (``--base`` x
speeds, spent after backward) overlaps every colayer's exchange anyway. The built-in models
offer no deeper one that fits these runs (``cnn``: ~6 k parameters, the network would not
matter; ``resnet18``: 11 M, too slow for 4-9 processes on 2 cores).

Measured per run (every node's node-*.jsonl):

* **bytes per iteration**: every NIC's sent bytes per iteration in the steady state: from each
  node's first step record to its last but one, summed over the nodes, over their iterations
  in that span. The first and last steps are left out and shown apart (**first + last step**,
  MB per node): they hold one-offs of the run, not of its iterations — the start's parameter
  broadcast (every configuration) and Canary's stop, where the members average their whole
  state once (parameters and momentum, exact: 2(n−1)/n x 2.5 MB per node, 3-5 % of the
  sketch's traffic over a 30 s run). Everything else counts: Canary's replies, empty packets,
  headers and the overtime model pulls (branch C);
* **peak NIC utilisation**: the largest rate any NIC sent at over any window of >= 1 s (from
  the cumulative per-NIC byte counts of the step records), over the NIC's capacity;
* **time to target**: the lower median over the nodes of the first evaluation (every
  ``--eval-every`` steps) at >= ``--target`` (half the workers hold a model that good);
* **final accuracy**: the mean of the nodes' last evaluations (every node ends with the same
  model: Canary averages at the stop, BSP replicas are identical).

Targets: Canary's traffic >= 70 % below BSP's (paper: -56 %, "up to" and "on
average"), time to target >= 1.5x sooner than BSP at 1 Gb/s per NIC, accuracy within 1 point.
Output: a markdown table and the target lines on stdout, bench/out/canary.png.

``--model lm-tiny`` (or ``lm-small``/``lm-base``; ``--data`` defaults to ``pysource``) runs the
byte-level language model with its own defaults (AdamW at its peak learning rate unless
``--lr``; ``--hidden`` does not apply) and judges it by validation bits per byte instead of
accuracy: time to ``--target`` bpb (default 3.9; lower is better), the final bpb, and a final
bpb at most 1 % above BSP's as the quality target. Its real compute per step is far longer than
the MLP's, so the fastest device's emulated step defaults to 1 s (``--base``), the slow devices'
extra time is real compute (``--mode compute``, as bench/hetero.py) and a run lasts 300 s
(``--quick``: 120 s). The colayer discussion above is the MLP's: on the transformer Canary's
automatic rule starts a colayer where the layer type changes or the 4 MiB cap is reached, and
``--colayers`` takes any count. Output: bench/out/canary-MODEL.png.

Run time: per BCube, 9 configurations x ``--repeats`` runs of ``--seconds`` plus the start of
the node processes (4: ~10 s, 9: ~30-60 s on 2 cores): about 11-14 minutes at the defaults.
``--quick``: BCube(2,2) only, 20 s runs. ``--only TEXT ...``: only the rows whose label
contains one of the texts (and BSP, the baseline).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from bench._common import (INF, Bars, Metric, Panel, accuracy_curve, add_model_args, cell, final_accuracy, first_reach,
                           lower_median, markdown_table, median, model_argv, model_title, plot_panels, png_name, repeat,
                           resolve_model, run_nodes, speedup, verdict, write_topology)
from p2psync.training.hetero import SLOWDOWN_MODES
from p2psync.training.metrics import bytes_sent


@dataclass(frozen=True)
class Config:
    label: str
    argv: tuple[str, ...]
    #: Canary's colayers for this configuration (None: ``--colayers``)
    colayers: int | None = None


CANARY = ("--strategy", "canary")
CONFIGS = (Config("BSP (ring, fp32)", ("--strategy", "ssgd", "--collective", "ring")),
           Config("Canary (sketch)", CANARY),
           Config("Canary (fp32)", (*CANARY, "--opt", "sketch=false")),
           Config("Canary (8-bit sketch)", (*CANARY, "--opt", "sketch_bits=8")),
           Config("Canary (6-bit sketch)", (*CANARY, "--opt", "sketch_bits=6")),
           Config("Canary (auto-width sketch)", (*CANARY, "--opt", "sketch_bits=0")),
           Config("Canary (paper's sketch)", (*CANARY, "--codec", "sketch8p")),
           Config("Canary (sketch, replies=round)", (*CANARY, "--opt", "replies=round")),
           Config("Canary (sketch, 2 colayers)", CANARY, colayers=2))
#: the MLP's layers with parameters: the most colayers it can have
MLP_LAYERS = 2
#: a final value at most this far behind BSP's: accuracy points, or percent of a language model's bpb
TARGET_QUALITY = 1.0


def colayer_opts(colayers: int, p: int | None) -> list[str]:
    """The Canary options for ``colayers`` colayers (0: Canary's automatic rule and default p)
    and ``p`` (None: round(0.6 k) within [1, k], the paper's 6 of 10)."""
    if colayers == 0:
        return [] if p is None else ["--opt", f"p={p}"]
    if p is None:
        p = min(colayers, max(1, round(0.6 * colayers)))
    return ["--opt", f"colayers={colayers}", "--opt", f"p={p}"]


def config_opts(cfg: Config, colayers: int, p: int | None) -> list[str]:
    """The colayer options of ``cfg``'s runs: none for BSP; a configuration with colayers of
    its own takes them with their default p, the others ``--colayers`` and ``--p``."""
    if cfg.argv[:len(CANARY)] != CANARY:
        return []
    return colayer_opts(cfg.colayers, None) if cfg.colayers is not None else colayer_opts(colayers, p)


@dataclass
class Outcome:
    config: Config
    cube: str
    to_target: float
    final_acc: float
    bytes_per_iter: float
    peak_util: float
    iterations: int
    curve: list[tuple[float, float]] = field(default_factory=list)
    #: Canary: colayers per node, and its end-of-iteration decisions (A, B, C) over all nodes
    colayers: int | None = None
    branches: dict[str, int] = field(default_factory=dict)
    #: bytes each node sent in its first and last steps (the run's one-offs), mean over nodes
    ends_bytes: float = 0.0


def peak_rate(recs: Sequence[dict[str, Any]], window: float = 1.0) -> float:
    """The highest bytes/s any NIC of one node sent over a window of at least ``window`` s."""
    best = 0.0
    pts = [(float(r["time"]), {k: int(v.get("sent", 0)) for k, v in r.get("nics", {}).items()}) for r in recs]
    j = 0
    for i in range(len(pts)):
        while j < i and pts[i][0] - pts[j + 1][0] >= window:
            j += 1
        dt = pts[i][0] - pts[j][0]
        if dt >= window:
            for nic, b in pts[i][1].items():
                best = max(best, (b - pts[j][1].get(nic, 0)) / dt)
    return best


def steady(recs: Sequence[Mapping[str, Any]]) -> tuple[int, int, int]:
    """One node's (bytes, iterations) from its first step record to its last but one, and the
    bytes of its first and last steps (the start's broadcast, a stop's averaging). Fewer than
    three records: everything counts as steady."""
    if len(recs) < 3:
        return (bytes_sent(recs[-1]), int(recs[-1]["step"]) + 1, 0) if recs else (0, 0, 0)
    a, b = recs[0], recs[-2]
    span = bytes_sent(b) - bytes_sent(a)
    return span, int(b["step"]) - int(a["step"]), bytes_sent(recs[-1]) - span


def analyse(cfg: Config, cube: str, nodes: Sequence[Sequence[dict[str, Any]]], target: float,
            nic_mbps: float, metric: Metric = Metric("accuracy")) -> Outcome:
    lasts = [recs[-1] for recs in nodes if recs]
    parts = [steady(recs) for recs in nodes]
    span, span_iters = sum(p[0] for p in parts), sum(p[1] for p in parts)
    iters = sum(int(r["step"]) + 1 for r in lasts)
    peak = max(peak_rate(recs) for recs in nodes) * 8 / (nic_mbps * 1e6)
    key = metric.key
    return Outcome(cfg, cube, lower_median(first_reach(recs, target, key) for recs in nodes),
                   final_accuracy(nodes, key), span / max(1, span_iters), peak, iters, accuracy_curve(nodes[0], key),
                   max((int(r["colayers"]) for r in lasts if "colayers" in r), default=None),
                   add_counts(r.get("branches", {}) for r in lasts), statistics.mean(p[2] for p in parts))


def add_counts(counts: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Counts by key (Canary's decisions per branch), summed."""
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + int(v)
    return out


def combine(runs: Sequence[Outcome]) -> Outcome:
    """The median over repeated runs of one configuration (the curve of the first)."""
    return Outcome(runs[0].config, runs[0].cube, median([o.to_target for o in runs]),
                   median([o.final_acc for o in runs]), median([o.bytes_per_iter for o in runs]),
                   median([o.peak_util for o in runs]), round(median([o.iterations for o in runs])), runs[0].curve,
                   runs[0].colayers, add_counts(o.branches for o in runs), median([o.ends_bytes for o in runs]))


def step_times(n: int, speeds: Sequence[float], base: float) -> str:
    return ",".join(f"{i}:{base * speeds[i % len(speeds)]:g}" for i in range(n))


def run_one(cfg: Config, cube: str, args: argparse.Namespace, topo: Path, n: int, out: Path, rep: int) -> Outcome:
    run_id = "".join(c for c in cfg.label if c.isalnum()) + f"-{cube}-r{rep}"
    canary = config_opts(cfg, args.colayers, args.p)
    strategy = cfg.argv[cfg.argv.index("--strategy") + 1]
    cmd = [sys.executable, "-m", "p2psync", "run", str(topo), *cfg.argv, *canary, "--time", str(args.seconds),
           "--shaper", "inproc", "--nic-mbps", str(args.nic_mbps),
           *model_argv(args.model, args.data, args.lr, strategy),
           *(["--hidden", str(args.hidden)] if args.model == "mlp" else []),
           "--step-time", step_times(n, args.speeds, args.base), "--step-jitter", str(args.jitter),
           "--slowdown-mode", args.mode, "--momentum", "0.9", "--eval-every",
           str(args.eval_every), "--seed", str(1 + rep), "--out", str(out), "--run-id", run_id, "--no-progress",
           "--start-timeout", "180"]
    return analyse(cfg, cube, run_nodes(cmd, out, run_id, n, timeout=args.seconds * 4 + 300), args.target,
                   args.nic_mbps, Metric.of(args.model))


def report(res: Sequence[Outcome], target: float, metric: Metric = Metric("accuracy")) -> str:
    base = {o.cube: o for o in res if o.config is CONFIGS[0]}
    rows = []
    for o in res:
        b = base.get(o.cube)
        speed = speedup(b.to_target, o.to_target) if b else None
        traffic = o.bytes_per_iter / b.bytes_per_iter if b and b.bytes_per_iter else None
        decisions = "/".join(str(o.branches.get(b, 0)) for b in "ABC") if o.branches else "-"
        rows.append([f"BCube({o.cube})", o.config.label, f"{o.bytes_per_iter / 1e6:.2f}",
                     cell(traffic, "{:.2f}"), f"{o.ends_bytes / 1e6:.1f}", f"{o.peak_util:.0%}",
                     cell(o.to_target, "{:.1f}"), cell(speed, "{:.2f}x"), f"{o.final_acc:.3f}", o.iterations,
                     "-" if o.colayers is None else o.colayers, decisions])
    return markdown_table(["topology", "config", "MB sent per iteration", "traffic vs BSP",
                           "first + last step (MB per node)", "peak NIC utilisation",
                           f"time to {metric.target(target)} (s)", "speed-up vs BSP", f"final {metric.short}",
                           "iterations (all nodes)",
                           "colayers", "decisions A/B/C"], rows)


def targets(res: Sequence[Outcome], metric: Metric = Metric("accuracy")) -> list[str]:
    out = []
    for cube in dict.fromkeys(o.cube for o in res):
        by = {o.config.label: o for o in res if o.cube == cube}
        bsp = by.get(CONFIGS[0].label)
        for cfg in CONFIGS[1:]:
            can = by.get(cfg.label)
            if bsp is None or can is None:
                continue
            name = f"BCube({cube}) {cfg.label}"
            cut = 1 - can.bytes_per_iter / bsp.bytes_per_iter if bsp.bytes_per_iter else 0.0
            amount = f"{cut:.0%} below" if cut >= 0 else f"{-cut:.0%} above"
            out.append(f"- {name}: traffic per iteration {amount} BSP's (target >= 70 % below; paper 56 %): "
                       f"{verdict(cut >= 0.7)}")
            if can.to_target < INF and bsp.to_target < INF:
                sp = bsp.to_target / can.to_target
                out.append(f"- {name}: {sp:.2f}x sooner to the target than BSP (target >= 1.5x): {verdict(sp >= 1.5)}")
            else:
                out.append(f"- {name}: the target was not reached by "
                           f"{'BSP' if bsp.to_target == INF else 'Canary'}")
            gap = metric.worse_by(can.final_acc, bsp.final_acc)  # accuracy points below, or bpb % above
            worse, better, unit, what = (("above", "below", " %", "validation bpb") if metric.lower_is_better
                                         else ("below", "above", " points", "accuracy"))
            side = (f"{gap:.1f}{unit} {worse}" if gap >= 0.05 else f"{-gap:.1f}{unit} {better}" if gap <= -0.05
                    else "level with")
            goal = f"{TARGET_QUALITY:g} %" if metric.lower_is_better else f"{TARGET_QUALITY:g} point"
            out.append(f"- {name}: final {what} {can.final_acc:.3f} vs {bsp.final_acc:.3f} ({side} BSP; "
                       f"target: at most {goal} {worse}): {verdict(gap <= TARGET_QUALITY)}")
    return out


def plot(res: Sequence[Outcome], target: float, metric: Metric = Metric("accuracy"), model: str = "mlp") -> Path:
    panels = [Panel(f"BCube({cube}), {model}: {metric.name} (node 0)",
                    [(o.config.label, o.curve) for o in res if o.cube == cube and o.curve])
              for cube in dict.fromkeys(o.cube for o in res)]
    bars = Bars("traffic", [f"{o.config.label}\n{o.cube}" for o in res], [o.bytes_per_iter / 1e6 for o in res],
                "MB sent per iteration", [100 * o.peak_util for o in res], "peak NIC utilisation (%)")
    return plot_panels(png_name("canary", model), panels, bars, target=target, ylabel=metric.name, width=5.5,
                       ylim=metric.ylim)


def progress(o: Outcome, metric: Metric = Metric("accuracy")) -> str:
    """A run's line on stderr."""
    return (f"{cell(o.to_target, '{:.1f} s')} to target, final {metric.short} {o.final_acc:.3f}, "
            f"{o.bytes_per_iter / 1e6:.2f} "
            f"MB/iteration, peak NIC {o.peak_util:.0%}, {o.iterations} iterations")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cubes", nargs="+", default=["2x2", "3x2"], help="BCube sizes ALPHAxBETA")
    ap.add_argument("--seconds", type=float, help="training time per run (default 30; --quick: 20; a language "
                                                  "model: 300, --quick 120)")
    ap.add_argument("--nic-mbps", type=float, default=1000.0)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--speeds", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 1.0, 2.0, 3.0])
    ap.add_argument("--base", type=float, help="step time of the fastest device (s; default 0.1, a language model 1.0)")
    ap.add_argument("--jitter", type=float, default=0.2)
    ap.add_argument("--lr", type=float, help="default 0.02; a language model: its own")
    ap.add_argument("--target", type=float, help="test accuracy to reach (default 0.95); a language model: "
                                                 "validation bpb (default 3.9)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--colayers", type=int, default=0,
                    help=f"Canary's colayers (0: its automatic rule, one colayer for this MLP, at most {MLP_LAYERS} "
                         "for it; the last configuration always runs 2)")
    ap.add_argument("--p", type=int, default=None,
                    help="Canary's p: colayers complete for a stale iteration to count (default round(0.6 k), >= 1)")
    ap.add_argument("--mode", choices=SLOWDOWN_MODES, help="--slowdown-mode (default wait; a language model: compute)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                    help="run only the configurations whose label contains one of these (BSP always runs)")
    add_model_args(ap)
    args = ap.parse_args(argv)
    metric = resolve_model(args, target=(0.95, 3.9), base=(0.1, 1.0), lr=(0.02, None), mode=("wait", "compute"),
                           seconds=((20.0, 120.0) if args.quick else (30.0, 300.0)))
    if args.colayers < 0 or (args.model == "mlp" and args.colayers > MLP_LAYERS):
        ap.error(f"--colayers {args.colayers}: between 0 and {MLP_LAYERS} for the MLP (0 or more for another model)")
    if args.p is not None and not 0 <= args.p <= (args.colayers or 1):
        ap.error(f"--p {args.p}: between 0 and the {args.colayers or 1} colayer(s)")
    if args.quick:
        args.cubes = ["2x2"]
    res = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs"
        for cube in args.cubes:
            alpha, beta = (int(x) for x in cube.split("x"))
            topo = write_topology(Path(tmp) / f"bcube-{cube}.json", "bcube", "--alpha", str(alpha), "--beta", str(beta))
            for cfg in CONFIGS:
                if args.only and cfg is not CONFIGS[0] and not any(t in cfg.label for t in args.only):
                    continue
                res.append(repeat(f"BCube({cube}) {cfg.label}", args.repeats,
                                  lambda rep: run_one(cfg, cube, args, topo, alpha**beta, out, rep),
                                  lambda o: progress(o, metric), combine))
    model = f"MLP hidden {args.hidden}" if args.model == "mlp" else model_title(args.model, args.data)
    print(f"\nCanary vs BSP, {model}: every NIC capped at {args.nic_mbps:g} Mb/s (inproc shaper), "
          f"step times base {args.base:g} s x {args.speeds} (+-{args.jitter:.0%}, {args.mode} mode), "
          f"{args.seconds:g} s runs, target {metric.target(args.target)}, medians of {args.repeats} "
          "run(s); Canary options "
          f"{' '.join(colayer_opts(args.colayers, args.p)[1::2]) or 'default'} (the 2-colayer row: "
          f"{' '.join(config_opts(CONFIGS[-1], args.colayers, args.p)[1::2])})\n")
    print(report(res, args.target, metric))
    print("\n" + "\n".join(targets(res, metric)))
    print(f"\nplot: {plot(res, args.target, metric, args.model)}")


if __name__ == "__main__":
    main()

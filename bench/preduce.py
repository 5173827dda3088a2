"""P-Reduce vs all-reduce on a heterogeneous 8-node cluster (Sec. 5.2 / Table 1 and
Fig. 8 of Miao et al., *Heterogeneity-Aware Distributed Machine Learning Training via Partial Reduce*).

    python -m bench.preduce [--nodes 8] [--seconds 30] [--target 0.93] [--repeats 2] [--base 0.05]
                            [--quick] [--mode wait|compute] [--out DIR] [--model mlp] [--data DATA]
    python -m bench.preduce --model lm-tiny [--data pysource] [--seconds 300] ...   # a language model

Every run goes through the CLI (``p2psync run``: one process per node) on an N-node mesh
(written to a temporary folder), momentum SGD 0.9, the default digits data and MLP, the same
seeds for every configuration. Configurations: AR (all-reduce: ``ssgd``), P-Reduce CON (constant weights 1/P) and DYN
(dynamic weights, alpha = 0.5, the paper's conservative rule) at P = 3 and 5; ``--configs``
adds DYNn (dynamic, ``approx=nearest``: the monotone reading of spec B7). Heterogeneity as in the paper's Sec. 5.2: HL
of the N workers share one device, so their step time is ``base x HL`` (emulated with
``--step-time``, ``--mode wait`` by default: fixed step times make runs repeatable; ``compute``
makes the extra time real matrix products); HL = 1 is homogeneous. Each run lasts
``--seconds`` of training (``--time``), ``--repeats`` times with seeds 1, 2, ...; a row
reports the medians.

Measured (per run, from every node's node-*.jsonl):

* **time to target**: each node's first evaluation (every ``--eval-every`` local steps) with
  test accuracy >= ``--target``; the run's time is the median over the nodes (half of the
  workers hold a model that good; the paper measures the time to its convergence threshold),
  and the time when every node got there is printed too. Slow workers evaluate less often per
  second, which delays "every node" for them.
* **updates to target**: AR: the step count at that time (one allreduce per step); P-Reduce: the
  controller's P-reduce count at that time (the largest group number any node joined by then,
  the paper's "#update": one P-reduce = one update, Sec. 3.1.2).
* **per-update time** = time to target / updates to target (the paper's Table 1 column).

Targets: at HL = 3 the best P-Reduce reaches the target >= 1.5x sooner than AR
(paper: 1.48-2.01x); DYN needs no more updates than CON at P = 3; Fig. 8's shape (per-update
time rises from P = 3 to P = 5, updates fall). Output: a markdown table and the target lines on
stdout, bench/out/preduce.png (accuracy against time per HL; per-update time and updates).

``--model lm-tiny`` (or ``lm-small``/``lm-base``; ``--data`` defaults to ``pysource``) runs the
byte-level language model with its own defaults (AdamW at its peak learning rate unless
``--lr``) and judges it by validation bits per byte instead of accuracy: time to ``--target``
bpb (default 3.9; lower is better) and the final bpb. Its real compute per step is far longer
than the MLP's, so a device of its own steps in 1 s by default (``--base``), the shared devices'
extra time is real compute (``--mode compute``, as bench/hetero.py) and a run lasts 300 s
(``--quick``: 120 s). Output: bench/out/preduce-MODEL.png.

Run time: 10 configurations x ``--repeats`` runs of ``--seconds`` plus the start of 8 Python +
torch processes each: ~10-20 s on an idle 2-core machine (about 15 minutes at the defaults), but
~60-90 s measured while other tests kept the 2 cores busy (load 3-9): then 30-40 minutes.
``--quick``: HL = 3 only, AR, CON and DYN at P = 3, one run each of 25 s (or ``--seconds``): 2-6
minutes depending on the load.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from bench._common import (INF, Bars, Metric, Panel, accuracy_curve, add_model_args, cell, final_accuracy, first_reach,
                           lower_median, markdown_table, median, model_argv, model_title, plot_panels, png_name, repeat,
                           resolve_model, run_nodes, speedup, verdict, write_topology)
from p2psync.training.hetero import SLOWDOWN_MODES


@dataclass(frozen=True)
class Config:
    label: str
    strategy: str
    p: int = 0
    weights: str = ""
    approx: str = "conservative"

    def argv(self) -> list[str]:
        if self.strategy != "preduce":
            return ["--strategy", self.strategy]
        return ["--strategy", "preduce", "--opt", f"P={self.p}", "--opt", f"weights={self.weights}",
                "--opt", f"approx={self.approx}"]


CONFIGS = (Config("AR", "ssgd"), Config("CON P=3", "preduce", 3, "constant"),
           Config("DYN P=3", "preduce", 3, "dynamic"), Config("CON P=5", "preduce", 5, "constant"),
           Config("DYN P=5", "preduce", 5, "dynamic"))
#: the monotone reading of the dynamic weights (spec B7), run on request (``--configs``)
EXTRA = (Config("DYNn P=3", "preduce", 3, "dynamic", "nearest"), Config("DYNn P=5", "preduce", 5, "dynamic", "nearest"))


@dataclass
class Outcome:
    config: Config
    hl: int
    to_target: float  # median over the nodes
    all_target: float  # every node
    updates: int | None  # at the median time
    final_acc: float
    curve: list[tuple[float, float]] = field(default_factory=list)

    @property
    def per_update_s(self) -> float | None:
        if self.updates is None or self.updates <= 0 or self.to_target == INF:
            return None
        return self.to_target / self.updates


def updates_at(nodes: Sequence[Sequence[dict[str, Any]]], t: float, preduce: bool) -> int | None:
    """Updates done by time ``t``: the largest P-reduce number joined by any node (P-Reduce),
    or the largest step (AR: one allreduce per step)."""
    if t == INF:
        return None
    keys = ("op", "last_op") if preduce else ("step",)
    seen = [int(r[k]) for recs in nodes for r in recs if r["time"] <= t for k in keys if r.get(k) is not None]
    return max(seen) if seen else 0


def analyse(cfg: Config, hl: int, nodes: Sequence[Sequence[dict[str, Any]]], target: float,
            metric: Metric = Metric("accuracy")) -> Outcome:
    reach = [first_reach(recs, target, metric.key) for recs in nodes]
    med = lower_median(reach)  # at least half of the nodes got there
    return Outcome(config=cfg, hl=hl, to_target=med, all_target=max(reach),
                   updates=updates_at(nodes, med, cfg.strategy == "preduce"),
                   final_acc=final_accuracy(nodes, metric.key), curve=accuracy_curve(nodes[-1], metric.key))


def step_times(n: int, hl: int, base: float) -> str:
    """HL of the N workers share one device (the last HL ids): base x HL each."""
    return ",".join(f"{i}:{base * (hl if i >= n - hl else 1):g}" for i in range(n))


def combine(runs: Sequence[Outcome]) -> Outcome:
    """The median over repeated runs of one configuration (the curve of the first)."""
    ups = [o.updates for o in runs if o.updates is not None]
    return Outcome(config=runs[0].config, hl=runs[0].hl, to_target=median([o.to_target for o in runs]),
                   all_target=median([o.all_target for o in runs]),
                   updates=round(median(ups)) if len(ups) == len(runs) else None,
                   final_acc=median([o.final_acc for o in runs]), curve=runs[0].curve)


def run_one(cfg: Config, hl: int, args: argparse.Namespace, topo: Path, out: Path, rep: int) -> Outcome:
    run_id = f"{cfg.label.replace(' ', '').replace('=', '')}-hl{hl}-r{rep}"
    cmd = [sys.executable, "-m", "p2psync", "run", str(topo), *cfg.argv(), "--time", str(args.seconds),
           "--step-time", step_times(args.nodes, hl, args.base), "--slowdown-mode", args.mode,
           *model_argv(args.model, args.data, args.lr, cfg.strategy), "--momentum", "0.9",
           "--eval-every", str(args.eval_every),
           "--seed", str(1 + rep), "--out", str(out), "--run-id", run_id, "--no-progress"]
    nodes = run_nodes(cmd, out, run_id, args.nodes, timeout=args.seconds * 4 + 180)
    return analyse(cfg, hl, nodes, args.target, Metric.of(args.model))


def report(res: Sequence[Outcome], target: float, metric: Metric = Metric("accuracy")) -> str:
    ar = {o.hl: o.to_target for o in res if o.config.strategy == "ssgd"}
    rows = []
    for o in res:
        base = ar.get(o.hl, INF)
        speed = speedup(base, o.to_target)
        rows.append([o.hl, o.config.label, cell(o.to_target, "{:.1f}"), cell(o.all_target, "{:.1f}"),
                     cell(speed, "{:.2f}x") if o.hl in ar else "no AR run", o.updates if o.updates is not None else "-",
                     cell(None if o.per_update_s is None else o.per_update_s * 1e3, "{:.0f}"), f"{o.final_acc:.3f}"])
    return markdown_table(["HL", "config", f"time to {metric.target(target)} (s, median node)", "every node (s)",
                           "speed-up vs AR", "updates", "per-update (ms)", f"final {metric.short}"], rows)


def targets(res: Sequence[Outcome]) -> list[str]:
    """The issue's target lines, PASS/FAIL with the figures."""
    by = {(o.hl, o.config.label): o for o in res}
    out = []
    for hl in sorted({o.hl for o in res}):
        ar = by.get((hl, "AR"))
        pr = [o for o in res if o.hl == hl and o.config.strategy == "preduce" and o.to_target < INF]
        if ar is None or not pr:
            continue
        best = min(pr, key=lambda o: o.to_target)
        sp = ar.to_target / best.to_target if ar.to_target < INF else INF
        if hl > 1:
            out.append(f"- HL={hl}: best P-Reduce ({best.config.label}) {sp:.2f}x faster than AR to the target "
                       f"(target >= 1.5x; paper 1.48-2.01x): {verdict(sp >= 1.5)}")
        else:
            out.append(f"- HL=1: best P-Reduce ({best.config.label}) {sp:.2f}x vs AR (paper ~1.2-1.5x)")
        con, dyn = by.get((hl, "CON P=3")), by.get((hl, "DYN P=3"))
        if con and dyn and con.updates and dyn.updates:
            out.append(f"- HL={hl}: updates DYN P=3 {dyn.updates} vs CON P=3 {con.updates} (DYN <= CON): "
                       f"{verdict(dyn.updates <= con.updates)}")
        near = by.get((hl, "DYNn P=3"))
        if con and near and con.updates and near.updates:
            out.append(f"- HL={hl}: updates DYNn P=3 (approx=nearest) {near.updates} vs CON P=3 {con.updates} "
                       f"(DYNn <= CON): {verdict(near.updates <= con.updates)}")
        c5 = by.get((hl, "CON P=5"))
        if con and c5 and con.per_update_s and c5.per_update_s and con.updates and c5.updates:
            shape = c5.per_update_s > con.per_update_s and c5.updates < con.updates
            out.append(f"- HL={hl}: Fig. 8 shape, CON P=3 -> P=5: per-update {con.per_update_s * 1e3:.0f} -> "
                       f"{c5.per_update_s * 1e3:.0f} ms (rises), updates {con.updates} -> {c5.updates} (fall): "
                       f"{verdict(shape)}")
    return out


def plot(res: Sequence[Outcome], target: float, metric: Metric = Metric("accuracy"), model: str = "mlp") -> Path:
    panels = [Panel(f"HL={hl}, {model}: {metric.name} (last node)",
                    [(o.config.label, o.curve) for o in res if o.hl == hl and o.curve])
              for hl in sorted({o.hl for o in res})]
    bars = Bars("per-update time and updates (Table 1 / Fig. 8)", [f"{o.config.label}\nHL={o.hl}" for o in res],
                [(o.per_update_s or 0.0) * 1e3 for o in res], "per-update time (ms)", [o.updates or 0 for o in res],
                "updates to target")
    return plot_panels(png_name("preduce", model), panels, bars, target=target, ylabel=metric.name, width=5,
                       ylim=metric.ylim)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=None, help="training time per run (default 30; --quick: 25; "
                                                                "a language model: 300, --quick 120)")
    ap.add_argument("--target", type=float, help="test accuracy to reach (default 0.93); a language model: "
                                                 "validation bpb (default 3.9)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration (seeds 1, 2, ...; medians)")
    ap.add_argument("--base", type=float, help="step time of a device of its own (s; default 0.05, a language "
                                               "model 1.0)")
    ap.add_argument("--lr", type=float, help="default 0.05; a language model: its own")
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--hl", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--mode", choices=SLOWDOWN_MODES, help="--slowdown-mode (default wait; a language model: compute)")
    ap.add_argument("--configs", nargs="+", metavar="LABEL",
                    help=f"run only these (default: {', '.join(c.label for c in CONFIGS)}; also "
                         f"{', '.join(c.label for c in EXTRA)}: dynamic weights with approx=nearest)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="keep the run folders here")
    add_model_args(ap)
    args = ap.parse_args(argv)
    metric = resolve_model(args, target=(0.93, 3.9), base=(0.05, 1.0), lr=(0.05, None), mode=("wait", "compute"),
                           seconds=((25.0, 120.0) if args.quick else (30.0, 300.0)))
    configs = list(CONFIGS)
    if args.configs:
        known = {c.label: c for c in (*CONFIGS, *EXTRA)}
        bad = [c for c in args.configs if c not in known]
        if bad:
            ap.error(f"unknown --configs {bad}: choose from {', '.join(known)}")
        configs = [known[c] for c in args.configs]
    if args.quick:
        args.hl, args.repeats, configs = [3], 1, configs[:3]
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "runs"
        topo = write_topology(Path(tmp) / f"mesh-{args.nodes}.json", "mesh", "-n", str(args.nodes))
        res = [repeat(f"HL={hl} {cfg.label}", args.repeats, lambda rep: run_one(cfg, hl, args, topo, out, rep),
                      lambda o: f"{cell(o.to_target, '{:.1f} s')} to target, updates {o.updates}, final "
                                f"{metric.short} {o.final_acc:.3f}", combine)
               for hl in args.hl for cfg in configs]
    print(f"\nP-Reduce vs all-reduce, {model_title(args.model, args.data)}: N={args.nodes}, "
          f"base step {args.base * 1e3:.0f} ms (x HL on HL workers, "
          f"{args.mode} mode), {args.seconds:g} s runs, target {metric.target(args.target)}, medians "
          f"of {args.repeats} run(s) per row\n")
    print(report(res, args.target, metric))
    print("\n" + "\n".join(targets(res)))
    print(f"\nplot: {plot(res, args.target, metric, args.model)}")


if __name__ == "__main__":
    main()

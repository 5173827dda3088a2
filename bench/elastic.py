"""BSP, ASP, SSP, DSSP and ElasticBSP on the sharded parameter store, heterogeneous cluster
(the thesis *Elastic Synchronization for Efficient and Effective Distributed Deep Learning*,
§5.4 / Table 5.1 and §6.6 / Fig. 6.13).

    python -m bench.elastic [--nodes 4] [--seconds 20] [--target 0.93] [--repeats 2]
                            [--speeds 1,1,2,3] [--base 0.04] [--jitter 0.2] [--mode wait|compute]
                            [--quick] [--out DIR] [--model mlp] [--data DATA]
    python -m bench.elastic --model lm-tiny [--data pysource] [--seconds 300] ...   # a language model

Every run goes through the CLI (``p2psync run``: one process per node) on an N-node mesh, plain
SGD on the parameter store (the owners apply lr/N per push), the default digits data and MLP,
the same seeds for every configuration. Configurations: BSP, ASP, SSP (s = 3), DSSP ([3, 15]),
ElasticBSP (R = 15 and 150; ZipLineOptBS). Two kinds of heterogeneity (``--scenarios``), each
step varied by +-``--jitter`` (uniform, seeded; ``p2psync run --step-jitter``):

* ``mixed`` devices (the thesis' DSSP cluster mixes device generations): node i has the step
  time ``base x speeds[i mod len]`` (``--speeds``, default 1, 1, 2, 3: two fast devices, one 2x
  and one 3x slower). Under a *persistent* speed ratio every bounded-staleness scheme (SSP,
  DSSP) runs at the slowest worker's pace once the fast ones are s ahead, like BSP;
* ``rotating`` slowness (equal devices, one at a time ``max(speeds)`` times slower for
  ``--period`` s, in turn; contention from other jobs): every worker has the same long-run
  pace, the gaps oscillate, and a larger staleness bound absorbs them: where DSSP's s_U pays.

``--mode wait`` (default) idles for the emulated device time, ``compute`` fills it with real
matrix products.

Measured (per run, from every node's node-*.jsonl):

* **time to target**: each node's first evaluation (every ``--eval-every`` local pushes) with
  test accuracy >= ``--target``; the run's time is the lower median over the nodes (half of the
  workers hold a model that good), as in bench/preduce.py;
* **final accuracy**: the mean of the nodes' last evaluations (at the end every node pulls the
  same weights);
* **wait per iteration**: a node's time between its push and the weights of its next iteration
  (the scheduler's hold plus the pull), mean over the nodes, in ms;
* **pushes**: all the gradients the store applied (updates), and **traffic**: MB sent by all the
  nodes per second of training.

Targets: ElasticBSP (the faster R) reaches the target >= 1.5x sooner than BSP (thesis
1.77x, VGG-16/ImageNet); DSSP reaches it sooner than SSP (thesis 1.84-1.88x, Table 5.1).
Output: a markdown table and the target lines on stdout, bench/out/elastic.png (accuracy against
time; wait per iteration and pushes per configuration).

``--model lm-tiny`` (or ``lm-small``/``lm-base``; ``--data`` defaults to ``pysource``) runs the
byte-level language model with its own defaults (AdamW, which the owners apply elementwise on
their shards, at its peak learning rate unless ``--lr``) and judges it by validation bits per
byte instead of accuracy: time to ``--target`` bpb (default 3.9; lower is better) and the final
bpb. Its real compute per step is far longer than the MLP's, so the fastest device's emulated
step defaults to 1 s (``--base``), the slow devices' extra time is real compute (``--mode
compute``, as bench/hetero.py), the rotating slowness changes every 10 s (``--period``) and a run
lasts 300 s. Output: bench/out/elastic-MODEL.png.

Run time: 2 scenarios x 6 configurations x ``--repeats`` runs of ``--seconds`` plus ~10 s of
process start each: about 13 minutes at the defaults on an idle 2-core machine. ``--quick``: BSP,
SSP, DSSP and ElasticBSP R=15, one run each (about 5 minutes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from bench._common import (INF, Bars, Metric, Panel, accuracy_curve, add_model_args, cell, final_accuracy, first_reach,
                           lower_median, markdown_table, median, model_argv, model_title, plot_panels, png_name, repeat,
                           resolve_model, run_nodes, speedup, verdict, write_topology)
from p2psync.training.hetero import SLOWDOWN_MODES
from p2psync.training.metrics import bytes_sent


@dataclass(frozen=True)
class Config:
    label: str
    strategy: str
    opts: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        out = ["--strategy", self.strategy]
        for o in self.opts:
            out += ["--opt", o]
        return out


CONFIGS = (Config("BSP", "bsp"), Config("ASP", "asp"), Config("SSP s=3", "ssp", ("s=3",)),
           Config("DSSP [3,15]", "dssp", ("s_lower=3", "s_upper=15")),
           Config("EBSP R=15", "elastic_bsp", ("R=15",)), Config("EBSP R=150", "elastic_bsp", ("R=150",)))


#: mixed: devices of fixed different speeds; rotating: equal devices, one at a time slowed down
SCENARIOS = ("mixed", "rotating")


@dataclass
class Outcome:
    config: Config
    scenario: str
    to_target: float  # lower median over the nodes
    final_acc: float
    wait_ms: float  # per iteration, mean over the nodes
    pushes: int
    mb_per_s: float
    curve: list[tuple[float, float]] = field(default_factory=list)


def analyse(cfg: Config, scenario: str, nodes: Sequence[Sequence[dict[str, Any]]], target: float,
            metric: Metric = Metric("accuracy")) -> Outcome:
    lasts = [recs[-1] for recs in nodes if recs]
    waits = [1e3 * float(r.get("wait_s", 0.0)) / max(1, int(r["step"])) for r in lasts]
    seconds = max(float(r["time"]) for r in lasts) if lasts else 0.0
    sent = sum(bytes_sent(r) for r in lasts)
    key = metric.key
    return Outcome(config=cfg, scenario=scenario,
                   to_target=lower_median(first_reach(recs, target, key) for recs in nodes),
                   final_acc=final_accuracy(nodes, key), wait_ms=statistics.mean(waits) if waits else 0.0,
                   pushes=sum(int(r["step"]) for r in lasts), mb_per_s=sent / 1e6 / seconds if seconds else 0.0,
                   curve=accuracy_curve(nodes[0], key))


def combine(runs: Sequence[Outcome]) -> Outcome:
    """The median over repeated runs of one configuration (the curve of the first)."""
    return Outcome(config=runs[0].config, scenario=runs[0].scenario, to_target=median([o.to_target for o in runs]),
                   final_acc=median([o.final_acc for o in runs]), wait_ms=median([o.wait_ms for o in runs]),
                   pushes=round(median([o.pushes for o in runs])), mb_per_s=median([o.mb_per_s for o in runs]),
                   curve=runs[0].curve)


def step_times(n: int, speeds: Sequence[float], base: float) -> str:
    """Node i's emulated step time: base x speeds[i mod len(speeds)]."""
    return ",".join(f"{i}:{base * speeds[i % len(speeds)]:g}" for i in range(n))


def rotation(n: int, factor: float, period: float, seconds: float) -> str:
    """``--slowdown-schedule`` where the slow role rotates: node i is ``factor`` times slower in
    the periods k with k mod n == i (k = 0, 1, ... of ``period`` seconds), its own speed otherwise."""
    entries = []
    for k in range(int(seconds / period) + 2):
        for i in range(n):
            entries.append(f"{i}:{k * period:g}:{factor if k % n == i else 1:g}")
    return ",".join(entries)


def heterogeneity(scenario: str, args: argparse.Namespace) -> list[str]:
    """The CLI options that emulate a scenario's devices."""
    if scenario == "mixed":
        return ["--step-time", step_times(args.nodes, args.speeds, args.base), "--step-jitter", str(args.jitter)]
    return ["--step-time", step_times(args.nodes, [1.0], args.base), "--step-jitter", str(args.jitter),
            "--slowdown-schedule", rotation(args.nodes, max(args.speeds), args.period, args.seconds + 30)]


def run_one(cfg: Config, scenario: str, args: argparse.Namespace, topo: Path, out: Path, rep: int) -> Outcome:
    run_id = "".join(c for c in cfg.label if c.isalnum()) + f"-{scenario}-r{rep}"
    cmd = [sys.executable, "-m", "p2psync", "run", str(topo), *cfg.argv(), "--time", str(args.seconds),
           *heterogeneity(scenario, args), "--slowdown-mode", args.mode,
           *model_argv(args.model, args.data, args.lr, cfg.strategy), "--momentum", "0", "--eval-every",
           str(args.eval_every), "--seed", str(1 + rep), "--out", str(out), "--run-id", run_id, "--no-progress"]
    return analyse(cfg, scenario, run_nodes(cmd, out, run_id, args.nodes, timeout=args.seconds * 4 + 180),
                   args.target, Metric.of(args.model))


def report(res: Sequence[Outcome], target: float, metric: Metric = Metric("accuracy")) -> str:
    bsp = {o.scenario: o.to_target for o in res if o.config.strategy == "bsp"}
    rows = []
    for o in res:
        b = bsp.get(o.scenario, INF)
        speed = speedup(b, o.to_target)
        rows.append([o.scenario, o.config.label, cell(o.to_target, "{:.1f}"), cell(speed, "{:.2f}x"), f"{o.final_acc:.3f}",
                     f"{o.wait_ms:.1f}", o.pushes, f"{o.mb_per_s:.2f}"])
    return markdown_table(["devices", "config", f"time to {metric.target(target)} (s, median node)", "speed-up vs BSP",
                           f"final {metric.short}",
                           "wait / iteration (ms)", "pushes", "traffic (MB/s, all nodes)"], rows)


def targets(res: Sequence[Outcome]) -> list[str]:
    """The issue's target lines, PASS/FAIL with the figures."""
    out = []
    for sc in dict.fromkeys(o.scenario for o in res):
        by = {o.config.label: o for o in res if o.scenario == sc}
        bsp = by.get("BSP")
        eb = [o for o in by.values() if o.config.strategy == "elastic_bsp" and o.to_target < INF]
        if bsp is not None and eb:
            best = min(eb, key=lambda o: o.to_target)
            sp = bsp.to_target / best.to_target
            out.append(f"- {sc}: {best.config.label} {sp:.2f}x faster than BSP to the target (target >= 1.5x; "
                       f"thesis 1.77x): {verdict(sp >= 1.5)}")
        ssp, dssp = by.get("SSP s=3"), by.get("DSSP [3,15]")
        if ssp is not None and dssp is not None and dssp.to_target < INF:
            sp = ssp.to_target / dssp.to_target
            out.append(f"- {sc}: DSSP [3,15] {sp:.2f}x vs SSP s=3 to the target (DSSP faster; thesis 1.84-1.88x): "
                       f"{verdict(sp > 1.0)}")
    return out


def plot(res: Sequence[Outcome], target: float, metric: Metric = Metric("accuracy"), model: str = "mlp") -> Path:
    panels = [Panel(f"{sc} devices, {model}: {metric.name} (node 0)",
                    [(o.config.label, o.curve) for o in res if o.curve and o.scenario == sc])
              for sc in dict.fromkeys(o.scenario for o in res)]
    bars = Bars("waiting and updates", [f"{o.config.label}\n{o.scenario}" for o in res], [o.wait_ms for o in res],
                "wait per iteration (ms)", [o.pushes for o in res], "pushes in the run")
    return plot_panels(png_name("elastic", model), panels, bars, target=target, ylabel=metric.name, width=5.5,
                       ylim=metric.ylim)


def progress(o: Outcome, metric: Metric = Metric("accuracy")) -> str:
    """A run's line on stderr."""
    return (f"{cell(o.to_target, '{:.1f} s')} to target, final {metric.short} {o.final_acc:.3f}, "
            f"wait {o.wait_ms:.0f} ms/it, "
            f"{o.pushes} pushes")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--seconds", type=float, help="training time per run (default 20; a language model: 300)")
    ap.add_argument("--target", type=float, help="test accuracy to reach (default 0.93); a language model: "
                                                 "validation bpb (default 3.9)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration (seeds 1, 2, ...; medians)")
    ap.add_argument("--speeds", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 1.0, 2.0, 3.0],
                    help="step-time multiples of the devices, cycled over the nodes (default 1,1,2,3)")
    ap.add_argument("--base", type=float,
                    help="step time of the fastest device (s; default 0.04, a language model 1.0)")
    ap.add_argument("--jitter", type=float, default=0.2, help="per-step variation (+-fraction)")
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--period", type=float, help="rotating: seconds each node stays slow (default 1; a language "
                                                 "model: 10)")
    ap.add_argument("--lr", type=float, help="the owners apply lr/N per push (default 0.2; a language model: its own)")
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--mode", choices=SLOWDOWN_MODES, help="--slowdown-mode (default wait; a language model: compute)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="keep the run folders here")
    add_model_args(ap)
    args = ap.parse_args(argv)
    metric = resolve_model(args, seconds=(20.0, 300.0), target=(0.93, 3.9), base=(0.04, 1.0), period=(1.0, 10.0),
                           lr=(0.2, None), mode=("wait", "compute"))
    configs = list(CONFIGS)
    if args.quick:
        args.repeats = 1
        configs = [c for c in configs if c.label in ("BSP", "SSP s=3", "DSSP [3,15]", "EBSP R=15")]
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "runs"
        topo = write_topology(Path(tmp) / f"mesh-{args.nodes}.json", "mesh", "-n", str(args.nodes))
        res = [repeat(f"{sc} {cfg.label}", args.repeats, lambda rep: run_one(cfg, sc, args, topo, out, rep),
                      lambda o: progress(o, metric), combine)
               for sc in args.scenarios for cfg in configs]
    print(f"\nParameter-store family, {model_title(args.model, args.data)}: N={args.nodes}; "
          "mixed devices: step times "
          f"{step_times(args.nodes, args.speeds, args.base)} s; rotating: {args.base:g} s, one node at a time "
          f"{max(args.speeds):g}x slower for {args.period:g} s; +-{args.jitter:.0%} jitter per step ({args.mode} "
          f"mode), {args.seconds:g} s runs, target {metric.target(args.target)}, medians of "
          f"{args.repeats} run(s) per row\n")
    print(report(res, args.target, metric))
    print("\n" + "\n".join(targets(res)))
    print(f"\nplot: {plot(res, args.target, metric, args.model)}")


if __name__ == "__main__":
    main()

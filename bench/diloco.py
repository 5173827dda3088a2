"""DiLoCo against SSGD and DTS on an emulated WAN: bytes per inner step, model quality at equal
steps, time to SSGD's final quality, steps that waited on the network.

    python -m bench.diloco [--model lm-tiny|mlp] [--quick] [--steps N] [--nodes 4] [--latencies 0 50 200]
                           [--configs ssgd diloco ...] [--pretrain-steps N] [--out DIR]

Checks the claims of the DiLoCo family (DiLoCo 2311.08105, Streaming DiLoCo 2501.18512, Async
Local-SGD 2401.09135) at small scale, every run through the CLI
(``p2psync run``: one process per node) on a ring of ``--nodes`` nodes with the in-process
shaper: uniform one-way latency (``--latencies``, ms) and ``--nic-mbps`` (100) per NIC. The
workload is the built-in job's ``--model``: by default ``lm-tiny``, the byte-level transformer on
the Python standard library's source with real compute (``mlp``: the digits MLP, a small proxy
that takes a few minutes instead of about an hour). The options left unset take their
workload's defaults (:data:`DEFAULTS`): for a language model 150 SSGD steps from a 300-step
SSGD model (``--pretrain-steps``), every other configuration 300 (``--steps-factor 2``), H = 20,
tau = 8, lr 0.002, and slowness that really computes for the slower devices; for ``mlp`` 400
steps from scratch, H = 50, tau = 1, lr 0.003, waiting for the slower devices. Quality is the
evaluations' ``val_bpb`` (validation bits per byte, lower is better) where the job reports it
(a language model), else test ``accuracy``; at equal tokens it is read at SSGD's last
evaluated step. Configurations:

* ``ssgd`` — data parallel, one gradient allreduce per step (the baseline of every ratio);
* ``dts`` — t=4, p=4 with plain momentum SGD (the only optimizer its compensation is defined for);
* ``diloco`` — H = ``--inner-steps``, codec none; ``diloco-e3m0`` — the same with 4-bit outer
  gradients, each node's Δ encoded once (the ``direct`` plan; ``diloco-e3m0-ring``: partial sums
  re-encoded at every hop of the ring, fewer bytes; ``diloco-e3m0-sr``: rounded stochastically;
  these two run only when ``--configs`` names them); ``streaming`` — 2 fragments, tau = ``--tau``, alpha = 0.5, e3m0, outer lr 0.4;
* ``hetero`` / ``hetero-dylu`` — devices 1:1:2:4 (``--slowdown``, emulated as ``--slowdown-mode``:
  ``wait`` by default, ``compute`` for slowness that really computes, ``quota`` for devices that
  really compute at their own rates, as separate devices would, root), diloco with fixed H, and
  with ``dylu=true`` (only at the first latency);
* ``async`` / ``hetero-async`` — ``diloco-async`` (Delayed Nesterov with DyLU, e3m0, every node's
  updates applied in one order as they come, no round), on equal and on 1:1:2:4 devices (run
  only when ``--configs`` names them).

"Steps waited": SSGD's steps are its blocking allreduce (``comm_s``); DTS and DiLoCo report only
the time a step was blocked on an exchange that had not arrived (``wait_s``).

Inner optimizer: AdamW (lr ``--lr``) for SSGD and DiLoCo, as the papers keep the data-parallel
baseline's optimizer; SGD lr 0.1 momentum 0.9 for DTS.

Per row: bytes sent per node per inner step (NIC counters) and SSGD's / this, the final quality
(mean over nodes) at equal steps, wall seconds, the time until the run's evaluations reach
SSGD's final quality (lower median over nodes) and the speed-up against SSGD, and the
fraction of steps whose wait on peers exceeded ``--waited-ms`` (20 ms; the last step of a DiLoCo or
DTS run, which ends with the final full sync every node awaits, is not counted), and the peak:
the most bytes a node sent in one step in the steady state (the rate a link must carry at its
busiest; Streaming's fragments spread a sync over several steps). Bytes in flight at an
instant are not measured. Targets (ratios in the same run): >= 300x fewer bytes per inner step
than SSGD with e3m0 at H = 50; final quality within 3 % of SSGD's; >= 3x sooner to SSGD's final
quality at the largest latency; Streaming with tau >= 1: no step waited at the largest latency;
dylu >= 1.3x sooner than fixed H on 1:1:2:4. The targets are stated for a language model
(validation bits per byte): with ``--model mlp`` read the verdicts as a proxy's.

``--pretrain-steps N``: every configuration starts from the model of an SSGD run of N steps
(its checkpoint, ``--init-from``; fresh optimizers and schedules), as DiLoCo's main comparison
starts from a pretrained model.

Output: markdown tables on stdout, bench/out/diloco.png (per latency, quality against wall time
and against inner steps, that is tokens; bytes per inner step as bars). ``--quick``: latency 0, 60 steps, H = 10, tau = 1, no pretraining, three configurations
(about 3 minutes on a 2-core machine with lm-tiny, 1 with mlp).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from bench._common import LM_MODELS, ROOT, cell, first_reach, lower_median, markdown_table, save_png, speedup, verdict
from bench.wan import uniform_profile
from p2psync.topology import ring, save
from p2psync.training.hetero import SLOWDOWN_MODES
from p2psync.training.metrics import bytes_sent
from tests.helpers import free_port

HETERO = "0:1,1:1,2:2,3:4"


@dataclass(frozen=True)
class Config:
    key: str
    args: tuple[str, ...]
    hetero: bool = False


def configs(inner_steps: int, lr: float, tau: int = 1) -> list[Config]:
    adamw = ("--optimizer", "adamw", "--lr", str(lr))
    h = ("--opt", f"inner_steps={inner_steps}")
    dl = ("--strategy", "diloco", *h, *adamw)
    return [Config("ssgd", ("--strategy", "ssgd", *adamw)),
            Config("dts", ("--strategy", "dts", "--opt", "t=4", "--opt", "p=4", "--optimizer", "sgd", "--lr", "0.1",
                           "--momentum", "0.9")),
            Config("diloco", dl),
            Config("diloco-e3m0", (*dl, "--opt", "outer_codec=e3m0")),
            Config("diloco-e3m0-sr", (*dl, "--opt", "outer_codec=e3m0:sr")),
            Config("diloco-e3m0-ring", (*dl, "--opt", "outer_codec=e3m0", "--opt", "outer_collective=ring")),
            Config("streaming", (*dl, "--opt", "fragments=2", "--opt", "fragment_by=flat", "--opt", f"tau={tau}",
                                 "--opt", "outer_codec=e3m0", "--opt", "outer_lr=0.4")),
            Config("hetero", (*dl, "--slowdown", HETERO), hetero=True),
            Config("hetero-dylu", (*dl, "--opt", "dylu=true", "--slowdown", HETERO), hetero=True),
            Config("async", ("--strategy", "diloco-async", *h, *adamw, "--opt", "outer_codec=e3m0")),
            Config("hetero-async", ("--strategy", "diloco-async", *h, *adamw, "--opt", "outer_codec=e3m0",
                                    "--slowdown", HETERO), hetero=True)]


@dataclass(frozen=True)
class Row:
    key: str
    latency_ms: float
    steps: float
    bytes_per_step: float
    #: bytes per step between the middles of the second and of the last whole sync interval
    #: (:func:`steady_window`): without the start (the first broadcast of the model) and the stop
    #: (the final full sync, the closing checks); None when the run is too short for one
    steady_per_step: float | None
    #: the most bytes a node sent in one step within that window (mean over nodes): the peak
    #: rate a link must carry, which Streaming DiLoCo's fragments lower; None as above
    peak_per_step: float | None
    #: the final quality: val_bpb (lower is better) where the job reports it, else accuracy
    quality: float
    metric: str
    wall_s: float
    waited: float
    nodes: list[list[dict[str, Any]]]


def steady_window(last: int, interval: int) -> tuple[float, float] | None:
    """Pure: the steps (a, b] over which steady-state bytes are counted, for a run whose last
    step is ``last`` and whose sync interval is ``interval`` steps: from the middle of the
    second interval to the middle of the last whole interval before the final step, so the
    window holds whole intervals (each with one sync, whether it is applied at once or a few
    steps later) and neither the start nor the stop. None when that is not at least one
    interval."""
    a = 1.5 * interval
    k = int((last - 1 - 0.5 * interval) // interval)
    b = (k + 0.5) * interval
    return (a, b) if b - a >= interval else None


def _sent_in_window(recs: Sequence[dict[str, Any]], interval: int) -> tuple[dict[int, int], int, int] | None:
    """One node's bytes sent so far by step, and the steps (a, b] of :func:`steady_window` (pure);
    None when the run is too short for one."""
    by = {int(r["step"]): bytes_sent(r) for r in recs if "step" in r and isinstance(r.get("nics"), dict)}
    w = steady_window(max(by), interval) if by else None
    return None if w is None else (by, int(math.floor(w[0])), int(math.floor(w[1])))


def steady_bytes(recs: Sequence[dict[str, Any]], interval: int) -> float | None:
    """Bytes per step over :func:`steady_window` of one node's records (pure)."""
    got = _sent_in_window(recs, interval)
    if got is None or got[1] not in got[0] or got[2] not in got[0]:
        return None
    by, a, b = got
    return (by[b] - by[a]) / (b - a)


def peak_bytes(recs: Sequence[dict[str, Any]], interval: int) -> float | None:
    """The most bytes sent in one step over :func:`steady_window` of one node's records (pure)."""
    got = _sent_in_window(recs, interval)
    if got is None:
        return None
    by, a, b = got
    diffs = [by[k] - by[k - 1] for k in range(a + 1, b + 1) if k in by and k - 1 in by]
    return float(max(diffs)) if diffs else None


def reduce(key: str, latency: float, nodes: list[list[dict[str, Any]]], waited_s: float,
           interval: int = 50) -> Row:
    """A row from every node's records (pure); ``interval``: the sync interval in steps (the
    steady-state window's unit)."""
    steps, per_step, walls, waits, accs = [], [], [], [], []
    steady = [steady_bytes(recs, interval) for recs in nodes]
    peaks = [peak_bytes(recs, interval) for recs in nodes]
    metric = "val_bpb" if any(r.get("val_bpb") is not None for recs in nodes for r in recs) else "accuracy"
    for recs in nodes:
        last = recs[-1]
        n = max(1, int(last.get("step", len(recs))))
        steps.append(n)
        per_step.append(bytes_sent(last) / n)
        walls.append(float(last["time"]))
        # SSGD reports its blocking allreduce as comm_s; the others report only blocked time as wait_s
        cum = [float(r.get("comm_s" if key == "ssgd" else "wait_s", 0.0)) for r in recs]
        diffs = [b - a for a, b in zip([0.0, *cum], cum)]
        if key != "ssgd" and len(diffs) > 1:
            diffs = diffs[:-1]  # the last step ends with the final full sync, which every node awaits
        waits.append(sum(d > waited_s for d in diffs) / max(1, len(diffs)))
        evald = [r[metric] for r in recs if r.get(metric) is not None]
        if evald:
            accs.append(float(evald[-1]))
    known = [v for v in steady if v is not None]
    return Row(key=key, latency_ms=latency, steps=statistics.mean(steps), bytes_per_step=statistics.mean(per_step),
               steady_per_step=statistics.mean(known) if len(known) == len(nodes) else None,
               peak_per_step=statistics.mean(p for p in peaks if p is not None)
               if all(p is not None for p in peaks) and peaks else None,
               quality=statistics.mean(accs) if accs else float("nan"), metric=metric, wall_s=max(walls),
               waited=statistics.mean(waits),
               nodes=nodes)


def run_one(cfg: Config, latency: float, args: argparse.Namespace, tmp: Path) -> Row:
    topo = tmp / f"ring-{args.nodes}-{cfg.key}-{latency:g}.json"
    save(ring(args.nodes, base_port=free_port()), topo)  # ports of its own: other runs may hold the defaults
    prof = tmp / f"wan-{latency:g}.json"
    prof.write_text(json.dumps(uniform_profile(latency, args.nodes)))
    run_id = f"{cfg.key}-{latency:g}ms"
    steps = args.steps if cfg.key == "ssgd" else round(args.steps * args.steps_factor)
    mode = ("--slowdown-mode", args.slowdown_mode) if cfg.hetero else ()
    cmd = [sys.executable, "-m", "p2psync", "run", str(topo), *cfg.args, *mode, "--model", args.model, "--steps",
           str(steps), "--eval-every", str(max(1, steps // 10)), "--shaper", "inproc", "--wan", str(prof),
           "--nic-mbps", str(args.nic_mbps), "--out", str(tmp), "--run-id", run_id, "--no-progress",
           *(("--init-from", str(args.init_from)) if args.init_from is not None else ())]
    _run(cmd, run_id, args.timeout)
    nodes = [[json.loads(ln) for ln in (tmp / run_id / f"node-{i}.jsonl").read_text().splitlines() if ln.strip()]
             for i in range(args.nodes)]
    return reduce(cfg.key, latency, nodes, args.waited_ms / 1000, args.inner_steps)


def _run(cmd: Sequence[str], run_id: str, timeout: float) -> None:
    import subprocess

    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"{run_id} failed:\n{r.stderr[-3000:]}")


def pretrain(args: argparse.Namespace, tmp: Path) -> Path:
    """``--pretrain-steps``: SSGD (the ``ssgd`` config, unshaped) for that many steps; the
    checkpoint of its node 0, which every configuration then starts from (``--init-from``)."""
    topo = tmp / f"ring-{args.nodes}-pretrain.json"
    save(ring(args.nodes, base_port=free_port()), topo)
    ssgd = next(c for c in configs(args.inner_steps, args.lr) if c.key == "ssgd")
    n = args.pretrain_steps
    _run([sys.executable, "-m", "p2psync", "run", str(topo), *ssgd.args, "--model", args.model, "--steps", str(n),
          "--eval-every", str(n), "--checkpoint-every", str(n), "--out", str(tmp), "--run-id", "pretrain",
          "--no-progress"], "pretrain", args.timeout)
    return tmp / "pretrain" / "node-0" / "checkpoint.pt"


def steady_ratio(base: Row, row: Row) -> float | None:
    """SSGD's steady-state bytes per step over this row's (None when either is unknown)."""
    if base.steady_per_step is None or not row.steady_per_step:
        return None
    return base.steady_per_step / row.steady_per_step


def quality_at(nodes: Sequence[Sequence[dict[str, Any]]], metric: str, step: float) -> float | None:
    """The mean over nodes of each node's last evaluation at or before ``step`` (pure): the
    quality at equal steps (equal tokens) of a run that trained more steps than the baseline.
    None when a node has no evaluation by then."""
    got = []
    for recs in nodes:
        vals = [float(r[metric]) for r in recs if r.get(metric) is not None and int(r.get("step", 0)) <= step]
        if not vals:
            return None
        got.append(vals[-1])
    return statistics.mean(got)


def curve(recs: Sequence[dict[str, Any]], metric: str, x: str = "time") -> list[tuple[float, float]]:
    """(``x``, ``metric``) at every evaluation of one node (pure): ``x`` is ``time`` (seconds)
    or ``step`` (inner steps; every config takes the same tokens per step, so steps are tokens)."""
    return [(float(r[x]), float(r[metric])) for r in recs if r.get(metric) is not None and r.get(x) is not None]


def report(rows: Sequence[Row], inner_steps: int, tau: int = 1) -> tuple[str, list[str]]:
    """The table and the target lines (pure)."""
    out, lines = [], []
    base = {r.latency_ms: r for r in rows if r.key == "ssgd"}
    metric = rows[0].metric if rows else "accuracy"
    sooner: dict[tuple[str, float], float | None] = {}
    for r in rows:
        b = base.get(r.latency_ms)
        target = b.quality if b else None
        t_me = lower_median([first_reach(n, target, metric) for n in r.nodes]) if target is not None else float("inf")
        t_b = lower_median([first_reach(n, target, metric) for n in b.nodes]) if b is not None and target is not None \
            else float("inf")
        ratio = b.bytes_per_step / r.bytes_per_step if b and r.bytes_per_step else None
        steady = steady_ratio(b, r) if b else None
        sooner[(r.key, r.latency_ms)] = speedup(t_b, t_me)
        equal = r.quality if b is None or r.steps == b.steps else quality_at(r.nodes, metric, b.steps)
        out.append([r.key, f"{r.latency_ms:g}", f"{r.steps:.0f}", f"{r.bytes_per_step:,.0f}",
                    cell(ratio, "{:.0f}x"), cell(r.steady_per_step, "{:,.0f}"), cell(steady, "{:.0f}x"),
                    cell(r.peak_per_step, "{:,.0f}"),
                    f"{r.quality:.3f}", cell(equal, "{:.3f}"), f"{r.wall_s:.1f}", cell(t_me, "{:.1f}"),
                    cell(speedup(t_b, t_me), "{:.2f}x"), f"{r.waited:.2f}"])
    table = markdown_table(["config", "one-way ms", "steps", "bytes/step/node", "ssgd/this", "steady bytes/step",
                            "ssgd/this, steady", "peak bytes in a step",
                            f"final {metric}",
                            f"{metric} at ssgd's steps",
                            "wall s", f"s to ssgd's {metric}", "speed-up", "steps waited"], out)
    top = max(base) if base else 0.0
    by = {(r.key, r.latency_ms): r for r in rows}
    e3 = by.get(("diloco-e3m0", 0.0)) or by.get(("diloco-e3m0", top))
    if e3 is not None and base.get(e3.latency_ms):
        ratio = base[e3.latency_ms].bytes_per_step / e3.bytes_per_step
        steady = steady_ratio(base[e3.latency_ms], e3)
        judged = steady if steady is not None else ratio
        lines.append(f"bytes per inner step, e3m0 at H = {inner_steps}: {cell(steady, '{:.0f}x')} fewer than ssgd in "
                     f"the steady state, {ratio:.0f}x over the whole run with its start and stop (target >= 300x, "
                     f"at H = 50): {verdict(judged >= 300)}")
    for key in ("diloco", "diloco-e3m0", "streaming"):
        r = by.get((key, top))
        if r is not None and base.get(top):
            bq = base[top].quality
            q = r.quality if r.steps == base[top].steps else quality_at(r.nodes, metric, base[top].steps)
            if q is None:
                continue
            worse = (q - bq) / bq if metric == "val_bpb" else (bq - q) / max(bq, 1e-9)
            lines.append(f"{key} {metric} at ssgd's {base[top].steps:.0f} steps vs ssgd at {top:g} ms: "
                         f"{100 * worse:+.1f} % worse (target within 3 %): {verdict(worse <= 0.03)}")
    s = by.get(("streaming", top))
    if s is not None:
        lines.append(f"streaming (tau = {tau}) steps that waited at {top:g} ms: {100 * s.waited:.2f} % (target 0): "
                     f"{verdict(s.waited == 0)}")
    for key in ("diloco", "diloco-e3m0", "streaming"):
        if (key, top) in sooner and top in base:
            x = sooner[(key, top)]
            lines.append(f"{key} at {top:g} ms: {cell(x, '{:.2f}x')} sooner to ssgd's final {metric} (target >= 3x): "
                         f"{verdict(x is not None and x >= 3)}")
    low = min(base) if base else 0.0
    fixed, dylu = by.get(("hetero", low)), by.get(("hetero-dylu", low))
    if fixed is not None and dylu is not None:
        # dylu ends when the fastest node has taken its steps, the slower ones having taken fewer
        # (fewer tokens in all): judged by the time both runs take to the worse of their final
        # qualities, which both reach; the wall time of the whole run is shown beside it
        q = max(fixed.quality, dylu.quality) if metric == "val_bpb" else min(fixed.quality, dylu.quality)
        t_f = lower_median([first_reach(n, q, metric) for n in fixed.nodes])
        t_d = lower_median([first_reach(n, q, metric) for n in dylu.nodes])
        x = speedup(t_f, t_d)
        lines.append(f"1:1:2:4 devices: {cell(x, '{:.2f}x')} sooner with dylu to {metric} {q:.3f} ({t_f:.1f} s fixed H, "
                     f"{t_d:.1f} s dylu; whole runs {fixed.wall_s:.1f} s and {dylu.wall_s:.1f} s, "
                     f"{fixed.wall_s / dylu.wall_s:.2f}x; target >= 1.3x sooner): {verdict(x is not None and x >= 1.3)}")
    return table, lines


def plot(rows: Sequence[Row]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lats = sorted({r.latency_ms for r in rows})
    metric = rows[0].metric
    fig, grid = plt.subplots(2, len(lats) + 1, figsize=(4.5 * (len(lats) + 1), 8), squeeze=False)
    for row, (x, label) in zip(grid, (("time", "seconds"), ("step", "inner steps (equal tokens)"))):
        for ax, lat in zip(row, lats):
            for r in rows:
                pts = curve(r.nodes[0], metric, x) if r.latency_ms == lat else []
                if pts:
                    ax.plot(*zip(*pts), label=r.key)
            ax.set(title=f"{lat:g} ms one way", xlabel=label, ylabel=metric)
            ax.legend(fontsize=8)
    grid[1][-1].axis("off")
    first = [r for r in rows if r.latency_ms == lats[0]]
    ax = grid[0][-1]
    ax.bar(range(len(first)), [r.bytes_per_step for r in first], color="tab:blue")
    ax.set_xticks(range(len(first)), [r.key for r in first], fontsize=7, rotation=60)
    ax.set_yscale("log")
    ax.set(title="bytes per inner step per node (first latency)")
    return save_png(fig, "diloco.png")


#: configurations run only when ``--configs`` names them
OPTIONAL = ("diloco-e3m0-sr", "diloco-e3m0-ring", "async", "hetero-async")
#: the defaults of the options left unset, by workload: a language model (the real workload:
#: from a pretrained model, H = 20 so that a short run holds enough outer steps, tau sized to a
#: 200 ms ring's exchange, and real compute for the slower devices) or the digits MLP
DEFAULTS = {
    "lm": {"steps": 150, "inner_steps": 20, "lr": 0.002, "tau": 8, "steps_factor": 2.0, "pretrain_steps": 300,
           "slowdown_mode": "compute", "timeout": 1500.0},
    "mlp": {"steps": 400, "inner_steps": 50, "lr": 0.003, "tau": 1, "steps_factor": 1.0, "pretrain_steps": 0,
            "slowdown_mode": "wait", "timeout": 900.0},
}


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Pure: ``args`` with every option left unset given its workload's default
    (:data:`DEFAULTS`); ``--quick``: latency 0, 60 steps, H = 10, no pretraining, three
    configurations (H and tau fit 60 steps)."""
    args = argparse.Namespace(**vars(args))
    if args.quick:
        args.steps = args.steps or 60
        args.inner_steps = args.inner_steps or 10
        args.tau = args.tau if args.tau is not None else 1
        args.pretrain_steps = args.pretrain_steps or 0
        args.latencies = args.latencies or [0.0]
        args.configs = args.configs or ["ssgd", "diloco-e3m0", "streaming"]
    for k, v in DEFAULTS["lm" if args.model in LM_MODELS else "mlp"].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.latencies = args.latencies or [0.0, 50.0, 200.0]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="lm-tiny",
                    help="the built-in job's --model (passed through; mlp: the digits MLP, a small proxy)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="ssgd's steps (default: lm 150, mlp 400)")
    ap.add_argument("--inner-steps", type=int, default=None, help="H (default: lm 20, mlp 50)")
    ap.add_argument("--lr", type=float, default=None, help="AdamW's learning rate (ssgd, diloco; lm 0.002, mlp 0.003)")
    ap.add_argument("--latencies", type=float, nargs="+", default=None, help="one-way ms (default 0 50 200)")
    ap.add_argument("--nic-mbps", type=float, default=100.0)
    ap.add_argument("--configs", nargs="+", default=None)
    ap.add_argument("--outer-lr", type=float, default=None,
                    help="the outer learning rate of every DiLoCo config (default: each config's own)")
    ap.add_argument("--tau", type=int, default=None,
                    help="the streaming config's overlap in inner steps: size it so that tau inner steps cover one "
                         "fragment's exchange (about 2(N-1) one-way latencies on a ring; default: lm 8, mlp 1)")
    ap.add_argument("--steps-factor", type=float, default=None,
                    help="every config but ssgd trains this many times ssgd's --steps (its schedule spans them), "
                         "so that the time to ssgd's final quality is measured where it takes more steps "
                         "(default: lm 2, mlp 1)")
    ap.add_argument("--slowdown-mode", choices=SLOWDOWN_MODES, default=None,
                    help="how the hetero configs' slower devices are emulated (p2psync run --slowdown-mode; "
                         "default: lm compute, mlp wait)")
    ap.add_argument("--waited-ms", type=float, default=20.0)
    ap.add_argument("--timeout", type=float, default=None, help="per run, seconds (default: lm 1500, mlp 900)")
    ap.add_argument("--pretrain-steps", type=int, default=None,
                    help="first train SSGD this many steps and start every configuration from its model "
                         "(--init-from; a fresh optimizer and schedule): DiLoCo's comparison from a pretrained "
                         "model (default: lm 300, mlp 0)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="keep the run folders here")
    args = resolve(ap.parse_args(argv))
    cfgs = [c for c in configs(args.inner_steps, args.lr, args.tau)
            if (c.key in args.configs if args.configs is not None else c.key not in OPTIONAL)]
    if args.outer_lr is not None:  # (a later --opt overrides an earlier one)
        cfgs = [replace(c, args=(*c.args, "--opt", f"outer_lr={args.outer_lr:g}")) if "diloco" in c.args else c
                for c in cfgs]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as td:
        tmp = args.out or Path(td)
        tmp.mkdir(parents=True, exist_ok=True)
        args.init_from = pretrain(args, tmp) if args.pretrain_steps > 0 else None
        if args.init_from is not None:
            print(f"  pretrained: ssgd for {args.pretrain_steps} steps", file=sys.stderr)
        for lat in args.latencies:
            for cfg in cfgs:
                if cfg.hetero and lat != args.latencies[0]:
                    continue
                row = run_one(cfg, lat, args, tmp)
                print(f"  {cfg.key} at {lat:g} ms: {row.metric} {row.quality:.3f}, {row.bytes_per_step:,.0f} B/step, "
                      f"{row.wall_s:.1f} s", file=sys.stderr)
                rows.append(row)
    table, lines = report(rows, args.inner_steps, args.tau)
    print(table)
    print()
    for ln in lines:
        print(f"- {ln}")
    print(f"\nplot: {plot(rows)}")


if __name__ == "__main__":
    main()

"""Shared benchmark parts: markdown tables and PNG plots under bench/out/, and what the benchmarks
that run the CLI (bench/canary.py, bench/elastic.py, bench/preduce.py, bench/hetero.py) do alike:
write a topology with ``p2psync topo``, run ``p2psync run`` and read every node's records, reduce
them (time to a target, final accuracy, the accuracy curve), repeat a configuration and combine the
runs, draw the accuracy panels beside one bar chart."""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

#: the repository's root (the shipped topologies and WAN profiles are under ROOT / "topologies")
ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / "out"

#: one node's test accuracy against time: (seconds, accuracy) at its evaluations
Curve = list[tuple[float, float]]
R = TypeVar("R")


def cpu_seconds() -> float:
    """CPU time this process has used so far, every thread (ZeroMQ's IO threads too), user and
    system: a benchmark worker's CPU per operation is the difference over its timed loop."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def save_png(fig: Any, name: str) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


INF = float("inf")


def cell(v: float | None, fmt: str) -> str:
    """A table cell for a time that may not have been reached."""
    return "not reached" if v is None or v == INF else fmt.format(v)


def speedup(base: float, t: float) -> float | None:
    """How many times sooner than the baseline's time to a target ``base`` a configuration's ``t``
    is; None where either was not reached (or ``t`` is 0): ``cell(speedup(b, t), "{:.2f}x")``."""
    return base / t if t not in (0.0, INF) and base != INF else None


def verdict(ok: bool) -> str:
    """A target line's ending."""
    return "PASS" if ok else "FAIL"


def write_topology(path: Path, kind: str, *options: str) -> Path:
    """``path``, written by ``p2psync topo KIND OPTIONS -o PATH`` (as a user makes one), e.g.
    ``write_topology(tmp / "mesh-4.json", "mesh", "-n", "4")`` before the runs on it."""
    subprocess.run([sys.executable, "-m", "p2psync", "topo", kind, *options, "-o", str(path)],
                   check=True, capture_output=True)
    return path


def run_nodes(cmd: Sequence[str], out: Path, run_id: str, nodes: int, timeout: float) -> list[list[dict[str, Any]]]:
    """Run one ``p2psync run`` command line; every node's records (node-<i>.jsonl)."""
    import json

    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"{run_id} failed:\n{r.stderr[-3000:]}")
    return [[json.loads(ln) for ln in (out / run_id / f"node-{i}.jsonl").read_text().splitlines() if ln.strip()]
            for i in range(nodes)]


def first_reach(recs: Sequence[dict[str, Any]], target: float, key: str = "accuracy") -> float:
    """The time of a node's first evaluation at or above ``target`` (inf if none); ``key``
    ``val_bpb`` (a language model's validation bits per byte): at or below it."""
    for r in recs:
        v = r.get(key)
        if v is not None and (v <= target if key == "val_bpb" else v >= target):
            return float(r["time"])
    return INF


def lower_median(xs: Iterable[float]) -> float:
    """The lower median: over the nodes' times to a target, when at least half of them got there."""
    s = sorted(xs)
    return s[(len(s) - 1) // 2]


def median(xs: Sequence[float]) -> float:
    """The median of a figure over repeated runs (:func:`repeat`'s combine)."""
    return float(statistics.median(xs))


def final_accuracy(nodes: Sequence[Sequence[dict[str, Any]]], key: str = "accuracy") -> float:
    """The mean of the nodes' last evaluations of ``key`` (0.0 when no node evaluated)."""
    finals = [[r[key] for r in recs if r.get(key) is not None] for recs in nodes]
    return statistics.mean(f[-1] for f in finals if f) if any(finals) else 0.0


def accuracy_curve(recs: Sequence[dict[str, Any]], key: str = "accuracy") -> Curve:
    """One node's (time, test accuracy, or ``key``) at its evaluations, for the plot."""
    return [(float(r["time"]), float(r[key])) for r in recs if r.get(key) is not None]


#: the language models of ``p2psync run --model`` (their evaluations: ``val_bpb``, lower is better)
LM_MODELS = ("lm-tiny", "lm-small", "lm-base")


def metric_key(model: str) -> str:
    """What a benchmark's target and curves read for ``--model``: ``accuracy``, or a language
    model's ``val_bpb``."""
    return "val_bpb" if model in LM_MODELS else "accuracy"


def repeat(name: str, repeats: int, run: Callable[[int], R], line: Callable[[R], str],
           combine: Callable[[Sequence[R]], R]) -> R:
    """``run(rep)`` for rep = 0 .. repeats - 1, a progress line ``  NAME #rep: LINE`` on stderr for
    each, and the runs combined, e.g. in a benchmark's main::

        res.append(repeat(f"{sc} {cfg.label}", args.repeats, lambda rep: run_one(cfg, sc, ..., rep),
                          lambda o: f"{o.final_acc:.3f} final", combine))"""
    runs = []
    for rep in range(repeats):
        o = run(rep)
        print(f"  {name} #{rep}: {line(o)}", file=sys.stderr)
        runs.append(o)
    return combine(runs)


@dataclass(frozen=True)
class Panel:
    """One accuracy panel: its title and its (label, curve) lines."""
    title: str
    curves: Sequence[tuple[str, Curve]]


@dataclass(frozen=True)
class Bars:
    """The last panel: one bar per result row (left axis, blue) and one dot per row (right axis,
    red), the rows named under the bars."""
    title: str
    names: Sequence[str]
    bars: Sequence[float]
    bars_label: str
    dots: Sequence[float]
    dots_label: str


def plot_panels(name: str, panels: Sequence[Panel], bars: Bars, *, target: float, ylabel: str,
                width: float) -> Path:
    """bench/out/NAME: the accuracy panels (the target as a dotted line) side by side, ``width``
    inches each, then the bar chart; e.g. a benchmark's ``plot(res, target)`` returns
    ``plot_panels("elastic.png", [Panel(...) per scenario], Bars(...), target=target, ...)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(width * (len(panels) + 1), 4))
    for ax, panel in zip(axes, panels):
        for label, curve in panel.curves:
            ax.plot(*zip(*curve), label=label)
        ax.axhline(target, color="grey", ls=":")
        ax.set(title=panel.title, xlabel="seconds", ylabel=ylabel, ylim=(0.5, 1.0))
        ax.legend(fontsize=8)
    ax = axes[-1]
    xs = range(len(bars.names))
    ax.bar(xs, bars.bars, color="tab:blue")
    ax.set_xticks(xs, bars.names, fontsize=7, rotation=60)
    ax.set_ylabel(bars.bars_label, color="tab:blue")
    tw = ax.twinx()
    tw.plot(xs, bars.dots, "o", color="tab:red")
    tw.set_ylabel(bars.dots_label, color="tab:red")
    ax.set_title(bars.title)
    return save_png(fig, name)

"""Shared benchmark parts: markdown tables and PNG plots under bench/out/, and what the benchmarks
that run the CLI (bench/canary.py, bench/elastic.py, bench/preduce.py, bench/hetero.py) do alike:
write a topology with ``p2psync topo``, run ``p2psync run`` and read every node's records, reduce
them (time to a target, final accuracy, the accuracy curve), repeat a configuration and combine the
runs, draw the accuracy panels beside one bar chart; and the built-in job's ``--model``/``--data``
they take (:func:`add_model_args`, :func:`resolve_model`, :func:`model_argv`), with the
:class:`Metric` a model is judged by (a classifier's test accuracy or a language model's
validation bits per byte)."""

from __future__ import annotations

import argparse
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
        if v is not None and Metric(key).reached(v, target):
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


@dataclass(frozen=True)
class Metric:
    """What a benchmark reads of its runs for ``--model`` (:meth:`of`): a classifier's test
    ``accuracy`` (higher is better) or a language model's ``val_bpb`` (validation bits per byte,
    lower is better); its target, final value, curves and their labels."""

    key: str

    @classmethod
    def of(cls, model: str) -> "Metric":
        return cls(metric_key(model))

    @property
    def lower_is_better(self) -> bool:
        return self.key == "val_bpb"

    @property
    def name(self) -> str:
        """A label: ``test accuracy`` or ``validation bpb``."""
        return "validation bpb" if self.lower_is_better else "test accuracy"

    @property
    def short(self) -> str:
        """A table column's word: ``acc`` or ``bpb`` (``final acc``)."""
        return "bpb" if self.lower_is_better else "acc"

    def target(self, target: float) -> str:
        """A target as it reads in a title or header: ``95%`` or ``3.9 bpb``."""
        return f"{target:g} bpb" if self.lower_is_better else f"{target:.0%}"

    def reached(self, value: float, target: float) -> bool:
        """Whether ``value`` is at ``target`` or better (the rule of :func:`first_reach`)."""
        return value <= target if self.lower_is_better else value >= target

    def worse_by(self, value: float, base: float) -> float:
        """How much worse ``value`` is than ``base`` (negative: better): accuracy points, or a
        language model's bpb in percent of ``base``'s."""
        if self.lower_is_better:
            return (value - base) / base * 100 if base else 0.0
        return (base - value) * 100

    @property
    def ylim(self) -> tuple[float, float] | None:
        """The curves' y range: accuracy 0.5 to 1; a bpb's: the plot's own."""
        return None if self.lower_is_better else (0.5, 1.0)


def add_model_args(ap: argparse.ArgumentParser, default: str = "mlp") -> None:
    """``--model`` (default ``default``) and ``--data`` (default: the model's own), passed to
    every ``p2psync run`` of a benchmark by :func:`model_argv`."""
    ap.add_argument("--model", default=default,
                    help=f"the built-in job's --model (default {default}); {', '.join(LM_MODELS)}: the byte-level "
                         "language model, judged by validation bpb (lower is better) instead of test accuracy")
    ap.add_argument("--data", help="the built-in job's --data (default: the model's: digits; pysource for a "
                                   "language model)")


def resolve_model(args: argparse.Namespace, **defaults: tuple[Any, Any]) -> Metric:
    """After parsing (:func:`add_model_args`): ``--data pysource`` for a language model that
    names none, every option of ``defaults`` that was not given (None) set to its (classifier,
    language model) default, e.g. ``target=(0.93, 3.9)``; the :class:`Metric` of the model."""
    lm = is_lm(args.model)
    if args.data is None and lm:
        args.data = "pysource"
    for name, (classifier, language_model) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, language_model if lm else classifier)
    return Metric.of(args.model)


def is_lm(model: str) -> bool:
    """Whether ``--model`` is a language model (:data:`LM_MODELS`)."""
    return model in LM_MODELS


def model_argv(model: str, data: str | None, lr: float | None = None, strategy: str | None = None) -> list[str]:
    """The ``p2psync run`` options of the model: ``--model``, ``--data`` when given, ``--lr``
    when given (None: the model's own), and ``--optimizer sgd`` where ``strategy`` cannot train
    a language model with its default AdamW (:func:`needs_sgd`)."""
    out = ["--model", model, *(["--data", data] if data else []), *(["--lr", str(lr)] if lr is not None else [])]
    if strategy is not None and needs_sgd(strategy, model):
        out += ["--optimizer", "sgd"]
    return out


def needs_sgd(strategy: str, model: str) -> bool:
    """Whether ``strategy`` refuses a language model's default optimizer (AdamW) and needs
    ``--optimizer sgd`` (its needs: plain SGD, e.g. ``dts``, whose compensation replays SGD's
    arithmetic; the model's SGD learning rate then applies unless ``--lr``)."""
    if not is_lm(model):
        return False
    from p2psync.strategies.base import REGISTRY, get_strategy

    get_strategy("ssgd")  # imports p2psync.strategies: registers the built-ins
    cls = REGISTRY.get(strategy)
    return cls is not None and cls.needs.optimizer == "plain_sgd"


def model_title(model: str, data: str | None) -> str:
    """The model in a benchmark's title: ``mlp``, ``lm-tiny on pysource``."""
    return f"{model} on {data}" if data else model


def png_name(stem: str, model: str, default: str = "mlp") -> str:
    """A benchmark's PNG under bench/out/: ``STEM.png`` for its default model, else
    ``STEM-MODEL.png``."""
    return f"{stem}.png" if model == default else f"{stem}-{model}.png"


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
                width: float, ylim: tuple[float, float] | None = (0.5, 1.0)) -> Path:
    """bench/out/NAME: the accuracy panels (the target as a dotted line; y from ``ylim``, None:
    matplotlib's own, as for a bpb) side by side, ``width`` inches each, then the bar chart; e.g.
    a benchmark's ``plot(res, target)`` returns
    ``plot_panels("elastic.png", [Panel(...) per scenario], Bars(...), target=target, ...)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(width * (len(panels) + 1), 4))
    for ax, panel in zip(axes, panels):
        for label, curve in panel.curves:
            ax.plot(*zip(*curve), label=label)
        ax.axhline(target, color="grey", ls=":")
        ax.set(title=panel.title, xlabel="seconds", ylabel=ylabel)
        if ylim is not None:
            ax.set_ylim(*ylim)
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

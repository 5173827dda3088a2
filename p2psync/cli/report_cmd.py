"""``p2psync report RUN_DIR``: a run folder -> summary table (stdout, markdown) + PNG plots."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

from p2psync.errors import ConfigError, translate
from p2psync.files import reason
from p2psync.training.metrics import bytes_sent, read_jsonl


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("report", help="summarize a run folder: table + PNG plots",
                       description="Reads runs/<run-id>/node-*.jsonl and writes report.png "
                                   "(loss, accuracy, bytes per NIC over time) into the folder.")
    p.add_argument("run_dir")
    p.add_argument("-o", "--output", help="PNG path (default RUN_DIR/report.png)")
    p.set_defaults(func=run)


def load_run(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: not a run folder")
    nodes = {}
    for f in sorted(run_dir.glob("node-*.jsonl")):
        m = re.fullmatch(r"node-(\d+)\.jsonl", f.name)
        if m:
            nodes[int(m.group(1))] = read_jsonl(f)
    if not nodes or not any(nodes.values()):
        raise ConfigError(f"{run_dir}: no node metrics (node-<id>.jsonl) found")
    return nodes


def _num(value: Any) -> float | None:
    """``value`` if it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _cell(value: Any, spec: str) -> str:
    """``value`` formatted with ``spec``, or '-' where a record lacks it (None, missing, NaN)."""
    v = _num(value)
    return "-" if v is None else format(int(v) if spec == "d" else v, spec)


def step_unit(run_dir: Path) -> str:
    """What a metrics record's ``step`` counts in this run: its strategy's
    :attr:`~p2psync.strategies.base.Strategy.step_unit` (ESync: ``round``), by the strategy
    that ``summary.json`` or ``config.json`` names; ``step`` when neither does."""
    from p2psync.strategies.base import get_strategy

    for name in ("summary.json", "config.json"):
        try:
            strategy = json.loads((run_dir / name).read_text()).get("strategy")
            return get_strategy(strategy).step_unit
        except (OSError, ValueError, AttributeError, TypeError, ConfigError):
            continue
    return "step"


def table(nodes: dict[int, list[dict[str, Any]]], unit: str = "step") -> str:
    """One row per node from its last record ('-' for what it never reported: a script that
    logs no loss, a run without evaluations); accuracy is the last one any record holds.
    ``unit``: what the records' ``step`` counts (:func:`step_unit`). A language model's run (its
    records hold ``val_bpb``) adds the last validation bits per byte after the accuracy."""
    lm = any(_num(x.get("val_bpb")) is not None for recs in nodes.values() for x in recs)
    head = (f"| node | {unit}s | time s | last loss | accuracy | " + ("val bpb | " if lm else "")
            + "samples/s | compute s | comm s | wait s | sent MB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, recs in sorted(nodes.items()):
        if not recs:
            lines.append(f"| {i} |" + " - |" * (head.count("|") - 2))
            continue
        r = recs[-1]
        acc = next((x["accuracy"] for x in reversed(recs) if _num(x.get("accuracy")) is not None), None)
        bpb = next((x["val_bpb"] for x in reversed(recs) if _num(x.get("val_bpb")) is not None), None)
        loss = next((x["loss"] for x in reversed(recs) if _num(x.get("loss")) is not None), None)
        sent = bytes_sent(r) / 1e6 if isinstance(r.get("nics"), dict) else None
        cells = [_cell(r.get("step"), "d"), _cell(r.get("time"), ".1f"), _cell(loss, ".4f"), _cell(acc, ".4f"),
                 *([_cell(bpb, ".4f")] if lm else []), _cell(r.get("samples_per_s"), ".0f"), _cell(r.get("compute_s"), ".1f"),
                 _cell(r.get("comm_s"), ".1f"), _cell(r.get("wait_s"), ".1f"), _cell(sent, ".2f")]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _series(recs: list[dict[str, Any]], value: Any) -> list[tuple[float, float]]:
    """``(time, value(record))`` of the records where both are numbers."""
    out = []
    for r in recs:
        t, v = _num(r.get("time")), _num(value(r))
        if t is not None and v is not None:
            out.append((t, v))
    return out


def _nic_total(r: dict[str, Any], nic: str) -> Any:
    stats = r.get("nics", {}).get(nic) if isinstance(r.get("nics"), dict) else None
    if not isinstance(stats, dict) or _num(stats.get("sent")) is None or _num(stats.get("recv")) is None:
        return None
    return (stats["sent"] + stats["recv"]) / 1e6


def plot(nodes: dict[int, list[dict[str, Any]]], path: Path, title: str) -> None:
    """Loss, accuracy (a language model's run: validation bits per byte) and bytes per NIC over
    wall time; a panel no record has a value for says so instead of a curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(14, 4))
    drawn = {a1: False, a2: False, a3: False}
    lm = any(_num(x.get("val_bpb")) is not None for recs in nodes.values() for x in recs)
    for i, recs in sorted(nodes.items()):
        loss = _series(recs, lambda r: r.get("loss"))
        if loss:
            a1.plot(*zip(*loss), lw=0.8, label=f"node {i}")
            drawn[a1] = True
        ev = _series(recs, lambda r: r.get("val_bpb" if lm else "accuracy"))
        if ev:
            a2.plot(*zip(*ev), marker=".", label=f"node {i}")
            drawn[a2] = True
        last_nics = recs[-1].get("nics") if recs else None
        for nic in (last_nics if isinstance(last_nics, dict) else {}):
            traffic = _series(recs, lambda r, nic=nic: _nic_total(r, nic))
            if traffic:
                a3.plot(*zip(*traffic), label=f"{i}/{nic}")
                drawn[a3] = True
    a1.set(title="training loss", xlabel="wall time (s)")
    a2.set(title="validation bits per byte" if lm else "test accuracy", xlabel="wall time (s)")
    a3.set(title="bytes per NIC (sent + received, MB)", xlabel="wall time (s)")
    for a, has in drawn.items():
        if has:
            a.legend(fontsize=7)
        else:
            a.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=a.transAxes)
    fig.suptitle(title)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    nodes = load_run(run_dir)
    print(f"## run {run_dir.name}\n")
    print(table(nodes, step_unit(run_dir)))
    out = Path(args.output) if args.output else run_dir / "report.png"
    with translate({OSError: lambda e: ConfigError(f"cannot write the plot {out}: {reason(e)} (-o FILE writes it "
                                                   "elsewhere)")}):
        plot(nodes, out, run_dir.name)
    print(f"\nplot: {out}")
    return 0

"""``p2psync report RUN_DIR``: a run folder -> summary table (stdout, markdown) + PNG plots."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from p2psync.errors import ConfigError
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


def table(nodes: dict[int, list[dict[str, Any]]]) -> str:
    head = "| node | steps | time s | last loss | accuracy | samples/s | compute s | comm s | wait s | sent MB |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, recs in sorted(nodes.items()):
        if not recs:
            lines.append(f"| {i} | - | - | - | - | - | - | - | - | - |")
            continue
        r = recs[-1]
        acc = next((x["accuracy"] for x in reversed(recs) if x.get("accuracy") is not None), None)
        sent = bytes_sent(r) / 1e6
        lines.append(f"| {i} | {r['step']} | {r['time']:.1f} | {r['loss']:.4f} | "
                     f"{'-' if acc is None else f'{acc:.4f}'} | {r.get('samples_per_s', 0):.0f} | "
                     f"{r.get('compute_s', 0):.1f} | {r.get('comm_s', 0):.1f} | {r.get('wait_s', 0):.1f} | "
                     f"{sent:.2f} |")
    return "\n".join(lines)


def plot(nodes: dict[int, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(14, 4))
    for i, recs in sorted(nodes.items()):
        t = [r["time"] for r in recs]
        a1.plot(t, [r["loss"] for r in recs], lw=0.8, label=f"node {i}")
        ev = [(r["time"], r["accuracy"]) for r in recs if r.get("accuracy") is not None]
        if ev:
            a2.plot(*zip(*ev), marker=".", label=f"node {i}")
        for nic in (recs[-1].get("nics", {}) if recs else {}):
            a3.plot(t, [(r["nics"][nic]["sent"] + r["nics"][nic]["recv"]) / 1e6 for r in recs],
                    label=f"{i}/{nic}")
    a1.set(title="training loss", xlabel="wall time (s)")
    a2.set(title="test accuracy", xlabel="wall time (s)")
    a3.set(title="bytes per NIC (sent + received, MB)", xlabel="wall time (s)")
    for a in (a1, a2, a3):
        a.legend(fontsize=7)
    fig.suptitle(title)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    nodes = load_run(run_dir)
    print(f"## run {run_dir.name}\n")
    print(table(nodes))
    out = Path(args.output) if args.output else run_dir / "report.png"
    plot(nodes, out, run_dir.name)
    print(f"\nplot: {out}")
    return 0

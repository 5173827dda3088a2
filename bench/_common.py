"""Shared benchmark output: markdown tables and PNG plots under bench/out/."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

OUT = Path(__file__).resolve().parent / "out"


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


def first_reach(recs: Sequence[dict[str, Any]], target: float) -> float:
    """The time of a node's first evaluation at or above ``target`` (inf if none)."""
    for r in recs:
        acc = r.get("accuracy")
        if acc is not None and acc >= target:
            return float(r["time"])
    return INF


def run_nodes(cmd: Sequence[str], out: Path, run_id: str, nodes: int, timeout: float) -> list[list[dict[str, Any]]]:
    """Run one ``p2psync run`` command line; every node's records (node-<i>.jsonl)."""
    import json
    import subprocess

    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"{run_id} failed:\n{r.stderr[-3000:]}")
    return [[json.loads(ln) for ln in (out / run_id / f"node-{i}.jsonl").read_text().splitlines() if ln.strip()]
            for i in range(nodes)]

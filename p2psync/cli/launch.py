"""Launch every node of a topology as a subprocess on this host, show progress, summarize.

Each node runs ``python -m p2psync run TOPOLOGY --node I --run-id ID ...`` with its output in
``<run>/node-I.log``. Progress is read from the nodes' metrics files. SIGINT/SIGTERM stop every
node (SIGTERM, then SIGKILL after a grace period); children also die with the launcher
(``PR_SET_PDEATHSIG``). A node that fails is reported with the last line of its log.
"""

from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from p2psync.cli.run_cmd import EXIT_FAILED, EXIT_INTERRUPTED, default_threads
from p2psync.errors import ConfigError
from p2psync.topology import Topology
from p2psync.training.config import RunConfig
from p2psync.training.metrics import bytes_sent
from p2psync.api.runtime import default_run_id

STOP_GRACE_S = 4.0
POLL_S = 0.25


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class _Tail:
    """Incrementally reads the JSON lines appended to a metrics file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0
        self.buf = ""
        self.last: dict[str, Any] = {}
        self.last_acc: float | None = None

    def poll(self) -> None:
        try:
            with self.path.open() as f:
                f.seek(self.pos)
                chunk = f.read()
                self.pos = f.tell()
        except FileNotFoundError:
            return
        self.buf += chunk
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.last = rec
            if rec.get("accuracy") is not None:
                self.last_acc = rec["accuracy"]


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or [""])[-1][:300]


def _progress_table(tails: dict[int, _Tail], codes: dict[int, int | None], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title)
    for col in ("node", "step", "loss", "accuracy", "samples/s", "sent MB", "state"):
        t.add_column(col, justify="right")
    for i, tail in tails.items():
        r = tail.last
        sent = bytes_sent(r) / 1e6
        code = codes[i]
        state = "running" if code is None else ("done" if code == 0 else f"exit {code}")
        t.add_row(str(i), str(r.get("step", "-")), f"{r['loss']:.4f}" if "loss" in r else "-",
                  f"{tail.last_acc:.4f}" if tail.last_acc is not None else "-",
                  f"{r.get('samples_per_s', 0):.0f}", f"{sent:.2f}", state)
    return t


def _status_line(tails: dict[int, _Tail]) -> str:
    parts = []
    for i, tail in tails.items():
        r = tail.last
        if not r:
            parts.append(f"n{i} starting")
            continue
        acc = f" acc {tail.last_acc:.3f}" if tail.last_acc is not None else ""
        parts.append(f"n{i} step {r['step']} loss {r['loss']:.3f}{acc}")
    return " | ".join(parts)


def print_summary(run_dir: Path, tails: dict[int, _Tail], wall: float) -> None:
    from rich.console import Console
    from rich.table import Table

    summary_path = run_dir / "summary.json"
    nodes: dict[str, Any] = {}
    if summary_path.exists():
        nodes = json.loads(summary_path.read_text()).get("nodes", {})
    t = Table(title=f"run {run_dir.name}")
    for col in ("node", "steps", "final accuracy", "wall s", "samples/s", "sent MB"):
        t.add_column(col, justify="right")
    tot_sps = tot_sent = 0.0
    accs = []
    for i, tail in tails.items():
        s = nodes.get(str(i))
        if s is None:  # node did not finish: use its last metrics record
            r = tail.last
            s = {"steps": r.get("step"), "final_accuracy": tail.last_acc, "wall_s": r.get("time"),
                 "samples_per_s": r.get("samples_per_s", 0.0),
                 "bytes_sent": bytes_sent(r)}
        acc = s.get("final_accuracy")
        if acc is not None:
            accs.append(acc)
        tot_sps += s.get("samples_per_s") or 0.0
        tot_sent += s.get("bytes_sent") or 0.0
        t.add_row(str(i), str(s.get("steps")), f"{acc:.4f}" if acc is not None else "-",
                  f"{s.get('wall_s') or 0:.1f}", f"{s.get('samples_per_s') or 0:.0f}",
                  f"{(s.get('bytes_sent') or 0) / 1e6:.2f}")
    mean_acc = f"{sum(accs) / len(accs):.4f}" if accs else "-"
    t.add_row("all", "", mean_acc, f"{wall:.1f}", f"{tot_sps:.0f}", f"{tot_sent / 1e6:.2f}")
    console = Console()
    console.print(t)
    console.print(f"run folder: {run_dir}")


def launch(cfg: RunConfig, topo: Topology) -> int:
    netns = None
    if cfg.shaper == "netem":
        from p2psync.cli.netns_cmd import link_specs
        from p2psync.transport import netem

        netns = netem.plan(topo, link_specs(topo, cfg.wan))
        try:
            netem.up(netns)
        except netem.NetemUnavailable as exc:
            raise ConfigError(f"--shaper netem: {exc}") from None
    try:
        return _launch(cfg, topo, netns)
    finally:
        if netns is not None:
            from p2psync.transport import netem

            netem.down(netns)


def _launch(cfg: RunConfig, topo: Topology, netns: Any) -> int:
    run_id = cfg.run_id or default_run_id(topo, cfg.strategy)
    run_dir = Path(cfg.out) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    child = replace(cfg, run_id=run_id, threads=cfg.threads or default_threads(topo.size))
    base = [sys.executable, "-m", "p2psync", "run", cfg.topology, *child.to_argv()]
    stop = {"signal": None}

    def on_signal(sig: int, _frame: Any) -> None:
        stop["signal"] = sig

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    procs: dict[int, subprocess.Popen[bytes]] = {}
    logs = []
    t0 = time.monotonic()
    try:
        for i in topo.ids:
            log_f = (run_dir / f"node-{i}.log").open("wb")
            logs.append(log_f)
            prefix = netns.exec_prefix(i) if netns is not None else []
            procs[i] = subprocess.Popen([*prefix, *base, "--node", str(i)], stdout=log_f, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        return _monitor(cfg, run_dir, procs, stop, t0)
    finally:
        _stop_all(procs)
        for f in logs:
            f.close()
        for s, h in old.items():
            signal.signal(s, h)


def _monitor(cfg: RunConfig, run_dir: Path, procs: dict[int, subprocess.Popen[bytes]],
             stop: dict[str, Any], t0: float) -> int:
    tails = {i: _Tail(run_dir / f"node-{i}.jsonl") for i in procs}
    codes: dict[int, int | None] = {i: None for i in procs}
    live = None
    if cfg.progress and sys.stdout.isatty():
        from rich.live import Live

        live = Live(_progress_table(tails, codes, run_dir.name), refresh_per_second=4)
        live.start()
    last_print = time.monotonic()
    first_failure: float | None = None
    patience = cfg.failure_timeout + cfg.peer_timeout + 15
    try:
        while True:
            for i, p in procs.items():
                if codes[i] is None:
                    codes[i] = p.poll()
                    if codes[i] not in (None, 0) and first_failure is None:
                        first_failure = time.monotonic()
            for tail in tails.values():
                tail.poll()
            if live is not None:
                live.update(_progress_table(tails, codes, run_dir.name))
            elif cfg.progress and time.monotonic() - last_print > 5:
                print(_status_line(tails), flush=True)
                last_print = time.monotonic()
            if stop["signal"] is not None:
                break
            if all(c is not None for c in codes.values()):
                break
            if first_failure is not None and time.monotonic() - first_failure > patience:
                print(f"nodes still running {patience:.0f}s after a failure: stopping them", file=sys.stderr)
                break
            time.sleep(POLL_S)
    finally:
        if live is not None:
            live.stop()
    if stop["signal"] is not None:
        _stop_all(procs)
        print(f"interrupted: stopped {len(procs)} nodes", file=sys.stderr)
        return EXIT_INTERRUPTED
    _stop_all(procs)
    for tail in tails.values():
        tail.poll()
    print_summary(run_dir, tails, time.monotonic() - t0)
    failed = {i: procs[i].returncode for i in procs if procs[i].returncode != 0}
    for i, code in sorted(failed.items()):
        print(f"node {i} failed (exit {code}): {_last_line(run_dir / f'node-{i}.log')}", file=sys.stderr)
    return EXIT_FAILED if failed else 0


def _stop_all(procs: dict[int, subprocess.Popen[bytes]]) -> None:
    alive = [p for p in procs.values() if p.poll() is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in alive:
        try:
            p.wait(timeout=max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

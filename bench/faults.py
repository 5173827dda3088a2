"""Chaos on a WAN: nodes killed (kill -9) and restarted while they train (issue 10).

    python -m bench.faults [--duration 180] [--every 20] [--down 5] [--strategies asgd ssgd esync]

Eight node processes (``p2psync run CLUSTER --node I``, one per node, as on eight hosts) train
on a full mesh whose links follow the four-region WAN profile (two nodes per region, 2 ms
inside a region, 50-210 ms RTT between regions; in-process shaper). For every strategy the
same run is done twice: clean, and with a chaos schedule that kills one node every ``--every``
seconds and restarts it ``--down`` seconds later with the same ``--node`` (it rejoins the run);
the coordinator (node 0) is among the victims, so coordinator failover is exercised too.

Reported per strategy (markdown table + ``bench/out/faults.png``):

* detection: seconds from each kill to each survivor's "peer V failed" log line (mean / max);
* false detections: a node declared failed while it was alive (not killed in the preceding
  detection window) — target 0;
* hangs: processes still running ``--grace`` seconds after the end of the budget (killed) —
  target 0;
* steps lost: local steps (all nodes) of the chaos run relative to the clean run;
* throughput: samples per second of the chaos run relative to the clean run — target >= 50 %;
* final accuracy (mean over nodes in ``summary.json``) of both runs — target within 1 point.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import ROOT, markdown_table, save_png
from tests.helpers import free_port

N = 8
_DECLARED = re.compile(r"node (\d+): peer (\d+) failed \(at ([0-9.]+)\)")


def make_cluster(tmp: Path) -> tuple[Path, Path]:
    """An 8-node mesh and a WAN profile placing two nodes in each of the four regions."""
    from p2psync.topology import mesh, save

    topo = tmp / "mesh8.json"
    save(mesh(N, base_port=free_port()), topo)
    base = json.loads((ROOT / "topologies" / "wan-4-regions.json").read_text())
    regions = {name: [i, i + 4] for name, (i,) in base["regions"].items()}
    wan = tmp / "wan-8.json"
    wan.write_text(json.dumps({"name": "wan-8-regions", "regions": regions, "rtt_ms": base["rtt_ms"],
                               "intra_rtt_ms": 2, "jitter_ms": 0, "bandwidth_mbps": None, "loss": 0}))
    return topo, wan


@dataclass
class Run:
    strategy: str
    chaos: bool
    kills: list[tuple[int, float]] = field(default_factory=list)  # (victim, wall time)
    logs: list[tuple[int, str]] = field(default_factory=list)  # (node, stderr of one process)
    hangs: int = 0
    wall_s: float = 0.0


def node_cmd(args: argparse.Namespace, topo: Path, wan: Path, out: Path, run_id: str, strategy: str,
             node: int, seconds: float) -> list[str]:
    return [sys.executable, "-m", "p2psync", *(["-v"] if args.verbose else []), "run", str(topo), "--node", str(node), "--strategy", strategy,
            "--time", f"{seconds:.1f}", "--out", str(out), "--run-id", run_id, "--shaper", "inproc",
            "--wan", str(wan), "--threads", "1", "--eval-every", "50", "--eval-seconds", "10",
            "--start-timeout", "90", "--lr", "0.05", "--no-progress"]


def spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"), cwd=ROOT)


def run(args: argparse.Namespace, topo: Path, wan: Path, out: Path, strategy: str, chaos: bool) -> Run:
    run_id = f"{strategy}-{'chaos' if chaos else 'clean'}"
    logs = out / f"{run_id}-logs"
    logs.mkdir()
    res = Run(strategy, chaos)
    procs: list[tuple[int, subprocess.Popen[bytes], Path]] = []

    def start(node: int, seconds: float) -> subprocess.Popen[bytes]:
        log = logs / f"node-{node}-{len(procs)}.log"
        p = spawn(node_cmd(args, topo, wan, out, run_id, strategy, node, seconds), log)
        procs.append((node, p, log))
        return p

    live = {i: start(i, args.duration) for i in range(N)}
    # training starts once every node has registered: count the schedule from the first metrics
    deadline = time.monotonic() + 120
    first = out / run_id / "node-0.jsonl"
    while time.monotonic() < deadline and not (first.exists() and first.stat().st_size > 0):
        time.sleep(0.2)
    t0 = time.monotonic()
    victims = [3, 0, 5, 2, 7, 1, 6, 4]
    k = 0
    while chaos:
        t_kill = t0 + args.every * (k + 1)
        # a restarted process needs time to start (Python, torch, data: tens of seconds on a
        # loaded machine) and join; a restart that cannot make it before the end only waits
        # for a rendezvous that never comes (up to --start-timeout), which is not a hang
        if t_kill + args.down + args.join_margin > t0 + args.duration:
            break
        time.sleep(max(0.0, t_kill - time.monotonic()))
        v = victims[k % len(victims)]
        live[v].send_signal(signal.SIGKILL)
        res.kills.append((v, time.time()))
        live[v].wait()
        time.sleep(args.down)
        live[v] = start(v, args.duration)  # the run's own options: it joins and ends with the run
        k += 1
    end = t0 + args.duration + args.grace
    for _, p, _ in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            res.hangs += 1
            p.kill()
            p.wait()
    res.wall_s = time.monotonic() - t0
    res.logs = [(n, log.read_text(errors="replace")) for n, _, log in procs]
    return res


def samples_and_steps(out: Path, run_id: str) -> tuple[float, int]:
    """Samples and local steps of all nodes and all their incarnations (metrics files append;
    a restarted process starts its counters again)."""
    samples, steps = 0.0, 0
    for i in range(N):
        path = out / run_id / f"node-{i}.jsonl"
        if not path.exists():
            continue
        recs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        seg_samples = seg_steps = 0
        prev_time = -1.0
        for r in recs:
            if r["time"] < prev_time:  # a new incarnation
                samples += seg_samples
                steps += seg_steps
                seg_steps = 0
            seg_samples = r["samples"]
            seg_steps += 1
            prev_time = r["time"]
        samples += seg_samples
        steps += seg_steps
    return samples, steps


def detections(res: Run, window: float) -> tuple[list[float], int]:
    """Detection delays for each (kill, survivor) and the number of false detections."""
    delays: list[float] = []
    false = 0
    for _node, text in res.logs:
        for _who, peer, at in _DECLARED.findall(text):
            t = float(at)
            kills = [tk for v, tk in res.kills if v == int(peer) and tk <= t <= tk + window]
            if kills:
                delays.append(t - max(kills))
            else:
                false += 1
    return delays, false


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=float, default=180.0, help="training budget per run (s)")
    ap.add_argument("--every", type=float, default=20.0, help="seconds between kills")
    ap.add_argument("--down", type=float, default=5.0, help="seconds a killed node stays down")
    ap.add_argument("--join-margin", type=float, default=45.0,
                    help="no kill later than this many seconds (plus --down) before the end")
    ap.add_argument("--grace", type=float, default=60.0, help="seconds after the budget before a hang")
    ap.add_argument("--strategies", nargs="+", default=["asgd", "ssgd", "esync"])
    ap.add_argument("--keep", action="store_true", help="keep the run folders and logs (path printed)")
    ap.add_argument("--verbose", action="store_true", help="nodes log at INFO level")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="p2psync-faults-"))
    rows: list[list[Any]] = []
    curves: dict[str, dict[bool, list[tuple[float, float]]]] = {}
    try:
        topo, wan = make_cluster(tmp)
        for s in args.strategies:
            clean = run(args, topo, wan, tmp, s, chaos=False)
            chaos = run(args, topo, wan, tmp, s, chaos=True)
            stats = {}
            for r in (clean, chaos):
                rid = f"{s}-{'chaos' if r.chaos else 'clean'}"
                summary_path = tmp / rid / "summary.json"
                summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
                samples, steps = samples_and_steps(tmp, rid)
                stats[r.chaos] = (samples / max(r.wall_s, 1e-9), steps, summary.get("accuracy_mean"))
                recs = [json.loads(ln) for ln in (tmp / rid / "node-1.jsonl").read_text().splitlines()
                        if ln.strip()] if (tmp / rid / "node-1.jsonl").exists() else []
                curves.setdefault(s, {})[r.chaos] = [(x["time"], x["accuracy"]) for x in recs
                                                     if x.get("accuracy") is not None]
            delays, false = detections(chaos, window=15.0)
            clean_false = detections(clean, window=15.0)[1]
            (thr_c, steps_c, acc_c), (thr_x, steps_x, acc_x) = stats[False], stats[True]
            rows.append([s, len(chaos.kills), f"{np.mean(delays):.2f} / {np.max(delays):.2f}" if delays else "-",
                         false + clean_false, clean.hangs + chaos.hangs,
                         f"{100 * (1 - steps_x / max(steps_c, 1)):.0f} %",
                         f"{100 * thr_x / max(thr_c, 1e-9):.0f} %",
                         f"{acc_c:.4f}" if acc_c is not None else "none",
                         f"{acc_x:.4f}" if acc_x is not None else "none"])
            print(f"  {s}: {rows[-1]}", flush=True)
    finally:
        if args.keep:
            print("kept:", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n## Chaos on an 8-node WAN mesh: kill -9 + restart every {args.every:g} s "
          f"({args.down:g} s down), {args.duration:g} s budget\n")
    print(markdown_table(["strategy", "kills", "detection s (mean / max)", "false detections", "hangs",
                          "steps lost", "throughput vs clean", "accuracy clean", "accuracy chaos"], rows))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * max(1, len(curves)), 4), sharey=True, squeeze=False)
    for ax, (s, c) in zip(axes[0], curves.items()):
        for chaos_run, pts in sorted(c.items()):
            if pts:
                t, a = zip(*pts)
                ax.plot(t, a, label="chaos" if chaos_run else "clean")
        ax.set_title(f"{s} (node 1)")
        ax.set_xlabel("wall time of the process (s)")
    axes[0][0].set_ylabel("test accuracy")
    axes[0][0].legend()
    print("\nplot:", save_png(fig, "faults.png"))


if __name__ == "__main__":
    main()

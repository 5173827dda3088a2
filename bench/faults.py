"""Faults a run must survive: pauses and partitions of a 4-node ring, and the older chaos of
kill -9 and restart on an 8-node WAN mesh.

    python -m bench.faults [--scenarios ...] [--strategies ssgd esync dts elastic_bsp] [--time 30]
                           [--step-time 0.1] [--mode wait|compute] [--model mlp] [--data DATA]
    python -m bench.faults --chaos [--duration 180] [--every 20] [--down 5] [--strategies asgd ssgd esync]
                           [--model mlp] [--data DATA]
    python -m bench.faults --model lm-tiny [--data pysource] ...   # a language model (either part)

**Pauses and partitions** (the default). Every case is one run of ``p2psync run RING --time T``
(the launcher, as a user starts it: it starts a fenced node again, up to 3 times) on a ring of 4
nodes with a fixed emulated step time (``--step-time``, so the throughput is the protocol's, not
the 2 cores'), with the strategy's clean run of the same ``--time`` as the reference. Once every
node trains, ``--lead`` seconds later the fault starts:

* ``pause-member-3`` / ``pause-member-15``: node 2 is stopped (SIGSTOP) for 3 s / 15 s, then
  continued (SIGCONT); ``pause-coord-3`` / ``pause-coord-15``: the same for the coordinator,
  node 0. The launcher forks its nodes (the default, ``P2PSYNC_LAUNCH=fork``; each forked node
  is named ``p2psync-nodeK`` in ``/proc/PID/comm``); with ``--launch exec`` it execs them and a
  node is found by its command line (``--node K``). Either way the node is a process of the
  launcher's run (its command line holds the run's ``--out`` folder and ``--run-id``).
* ``split-2-2`` ({0,1} | {2,3}: links 1-2 and 3-0 cut) and ``split-3-1`` ({0,1,2} | {3}: links
  2-3 and 3-0 cut), healed after 15 s. These runs use ``--shaper netem``: the launcher builds one
  network namespace per node (veth pairs and a bridge per ring link, addresses from the
  benchmarking range 198.18.0.0/15, names ``bNNNNnK`` / ``bNNNNKvJ`` with this process's
  ``P2PSYNC_NETNS_PREFIX``, so that other runs' namespaces on the host never clash) and execs
  each node inside its namespace; the cut is ``ip link set DEV down`` on both ends' veths of
  each cut link inside the nodes' namespaces (:func:`bench._netns.set_links`), the heal ``up``
  again. No traffic shaping (this kernel has no netem qdisc; none is needed). Needs root and iproute2; skipped
  (said so) otherwise. The clean reference runs on loopback, as the pause cases do: at 0.1 s
  emulated steps the transport's share of a step is the same on both.

Reported per case (markdown table + ``bench/out/faults_partitions.png``):

* models: distinct ``params_sha1`` among the nodes in ``summary.json`` (must be 1 for ssgd;
  the asynchronous strategies keep one replica per node and may differ);
* summary: whether ``summary.json`` exists and names every node;
* recovery: seconds from the resume / heal until every node that finished had completed a step
  after it (a restarted node: its new process's first step). A record's wall time is its
  process's start (the earliest ``seen - time`` over the process's records, the files being
  read every 0.1 s) plus its ``time`` field;
* steps lost: the mean final step of the finished nodes against the clean run's;
* throughput: samples of every node's every process (the metrics records' ``samples``) against
  the clean run's, in the same ``--time`` budget;
* false detections: nodes a coordinator declared failed (its ``declared failed`` log line) that
  were not paused nor cut off from it (in a 2|2 split node 0 may declare the first of nodes 2
  and 3 that falls silent: 3 of 4 are left; then it has no majority and declares nobody else);
* fenced restarts: the launcher's ``starting it again`` lines; exit: the launcher's exit code
  (0: every node ended well and the majority's coordinator wrote the summary); ``hung`` when it
  had not ended ``--time + --quorum-timeout + 120`` s after the start (everything is killed).

``--quorum-timeout`` (default 60 s here, 300 s in ``p2psync run``) bounds how long a node that
hears no majority waits: a partition that never merges ends the case with ``NoQuorum`` instead
of five minutes of waiting.

**Chaos** (``--chaos``): eight node processes (``p2psync run CLUSTER --node I``, one per node, as
on eight hosts) train on a full mesh whose links follow the four-region WAN profile (two nodes
per region, 2 ms inside a region, 50-210 ms RTT between regions; in-process shaper). For every
strategy the same run is done twice: clean, and with a chaos schedule that kills one node every
``--every`` seconds and restarts it ``--down`` seconds later with the same ``--node`` (it rejoins
the run); the coordinator (node 0) is among the victims, so coordinator failover is exercised too.

Reported per strategy (markdown table + ``bench/out/faults.png``):

* detection: seconds from each kill to each survivor's "peer V failed" log line (mean / max);
* false detections: a node declared failed while it was alive (not killed in the preceding
  detection window) — target 0;
* hangs: processes still running ``--grace`` seconds after the end of the budget (killed) —
  target 0;
* steps lost: local steps (all nodes) of the chaos run relative to the clean run;
* throughput: samples per second of the chaos run relative to the clean run — target >= 50 %;
* final accuracy (mean over nodes in ``summary.json``) of both runs — target within 1 point.

``--model lm-tiny`` (or ``lm-small``/``lm-base``; ``--data`` defaults to ``pysource``) runs the
byte-level language model in either part, with its own defaults (AdamW at its peak learning
rate; the chaos runs' ``--lr 0.05`` is the MLP's). ``dts`` refuses AdamW (its compensation
replays plain SGD), so its runs of a language model take ``--optimizer sgd`` (the model's SGD
learning rate; said so on stderr). The chaos table and plot read the final validation bits per
byte (``final_val_bpb`` in ``summary.json``; lower is better) instead of the accuracy. In the
pauses and partitions, whose emulated step time is the MLP's 0.1 s, a language model's step
defaults to 1 s (``--step-time``; its real compute is far longer), made up of real compute
(``--mode compute``, as bench/hetero.py; the MLP's default stays ``wait``), and a run lasts
60 s (``--time``). The PNGs are named after the model: bench/out/faults-MODEL.png,
faults_partitions-MODEL.png.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench._common import (ROOT, Metric, accuracy_curve, add_model_args, markdown_table, model_argv, model_title,
                           needs_sgd, png_name, resolve_model, save_png)
from p2psync.training.hetero import SLOWDOWN_MODES
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
            "--start-timeout", "90", *model_argv(args.model, args.data, args.lr, strategy), "--no-progress"]


def spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"), cwd=ROOT)


def chaos_run(args: argparse.Namespace, topo: Path, wan: Path, out: Path, strategy: str, chaos: bool) -> Run:
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


def samples_and_steps(out: Path, run_id: str, n: int = N) -> tuple[float, int]:
    """Samples and local steps of all ``n`` nodes and all their incarnations (metrics files
    append; a restarted process starts its counters again)."""
    samples, steps = 0.0, 0
    for i in range(n):
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




# -- chaos: kill -9 and restart on an 8-node WAN mesh ----------------------------------------

def main_chaos(args: argparse.Namespace) -> None:
    """The kill -9 / restart chaos on the 8-node WAN mesh (``--chaos``)."""
    tmp = Path(tempfile.mkdtemp(prefix="p2psync-faults-"))
    metric = Metric.of(args.model)
    summary_key = "accuracy_mean" if metric.key == "accuracy" else "final_val_bpb"
    rows: list[list[Any]] = []
    curves: dict[str, dict[bool, list[tuple[float, float]]]] = {}
    try:
        topo, wan = make_cluster(tmp)
        for s in args.strategies:
            clean = chaos_run(args, topo, wan, tmp, s, chaos=False)
            chaos = chaos_run(args, topo, wan, tmp, s, chaos=True)
            stats = {}
            for r in (clean, chaos):
                rid = f"{s}-{'chaos' if r.chaos else 'clean'}"
                summary_path = tmp / rid / "summary.json"
                summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
                samples, steps = samples_and_steps(tmp, rid)
                stats[r.chaos] = (samples / max(r.wall_s, 1e-9), steps, summary.get(summary_key))
                recs = [json.loads(ln) for ln in (tmp / rid / "node-1.jsonl").read_text().splitlines()
                        if ln.strip()] if (tmp / rid / "node-1.jsonl").exists() else []
                curves.setdefault(s, {})[r.chaos] = accuracy_curve(recs, metric.key)
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
    print(f"\n## Chaos on an 8-node WAN mesh, {model_title(args.model, args.data)}: kill -9 + restart every "
          f"{args.every:g} s ({args.down:g} s down), {args.duration:g} s budget\n")
    what = "accuracy" if metric.key == "accuracy" else "val bpb"
    print(markdown_table(["strategy", "kills", "detection s (mean / max)", "false detections", "hangs",
                          "steps lost", "throughput vs clean", f"{what} clean", f"{what} chaos"], rows))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * max(1, len(curves)), 4), sharey=True, squeeze=False)
    for ax, (s, c) in zip(axes[0], curves.items()):
        for is_chaos, pts in sorted(c.items()):
            if pts:
                t, a = zip(*pts)
                ax.plot(t, a, label="chaos" if is_chaos else "clean")
        ax.set_title(f"{s} (node 1)")
        ax.set_xlabel("wall time of the process (s)")
    axes[0][0].set_ylabel(metric.name)
    axes[0][0].legend()
    print("\nplot:", save_png(fig, png_name("faults", args.model)))


# -- pauses and partitions of a 4-node ring, through the launcher ---------------------------

RING = 4
POLL_S = 0.1
#: the launcher's namespace prefix in the split cases (``P2PSYNC_NETNS_PREFIX``): this process's own
PREFIX = f"b{os.getpid() % 10000}"
_COORD_DECLARED = re.compile(r"coordinator (\d+): nodes \[([0-9, ]*)\] .*?declared failed")
_RESTARTED = re.compile(r"node (\d+) was removed from the run .*starting it again")


@dataclass(frozen=True)
class Fault:
    """One case: ``kind`` clean, pause (SIGSTOP ``paused`` for ``seconds``) or split (the links
    ``cuts`` down for ``seconds``, in network namespaces). ``removable``: the nodes a
    coordinator may rightly declare failed (paused, or alone on a minority side)."""

    name: str
    kind: str
    seconds: float = 0.0
    paused: tuple[int, ...] = ()
    cuts: tuple[tuple[int, int], ...] = ()
    removable: frozenset[int] = frozenset()

    @property
    def netns(self) -> bool:
        return self.kind == "split"


CLEAN = Fault("clean", "clean")
FAULTS = {f.name: f for f in (
    Fault("pause-member-3", "pause", 3.0, paused=(2,), removable=frozenset({2})),
    Fault("pause-member-15", "pause", 15.0, paused=(2,), removable=frozenset({2})),
    Fault("pause-coord-3", "pause", 3.0, paused=(0,), removable=frozenset({0})),
    Fault("pause-coord-15", "pause", 15.0, paused=(0,), removable=frozenset({0})),
    # node 0 may remove the first of 2 and 3 it stops hearing (3 of 4 are left), not both
    Fault("split-2-2", "split", 15.0, cuts=((1, 2), (3, 0)), removable=frozenset({2, 3})),
    Fault("split-3-1", "split", 15.0, cuts=((2, 3), (3, 0)), removable=frozenset({3})),
)}

#: (wall time the record was seen, the record)
Seen = tuple[float, dict[str, Any]]
#: one process's records with their wall times: (wall time, record)
Incarnation = list[tuple[float, dict[str, Any]]]


class Tailer(threading.Thread):
    """Reads every node's metrics file (``node-K.jsonl``) every :data:`POLL_S` and keeps each
    record with the wall time it was first seen (``seen[node]``)."""

    def __init__(self, run_dir: Path, n: int) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.n = run_dir, n
        self.seen: dict[int, list[Seen]] = {i: [] for i in range(n)}
        self._pos = {i: 0 for i in range(n)}
        self._buf = {i: "" for i in range(n)}
        self._halt = threading.Event()

    def poll(self) -> None:
        now = time.time()
        for i in range(self.n):
            try:
                with (self.run_dir / f"node-{i}.jsonl").open() as f:
                    f.seek(self._pos[i])
                    chunk = f.read()
                    self._pos[i] = f.tell()
            except FileNotFoundError:
                continue
            *lines, self._buf[i] = (self._buf[i] + chunk).split("\n")
            for ln in lines:
                try:
                    rec = json.loads(ln)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("time"), (int, float)):
                    self.seen[i].append((now, rec))

    def run(self) -> None:
        while not self._halt.wait(POLL_S):
            self.poll()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self.poll()


def incarnations(seen: list[Seen]) -> list[Incarnation]:
    """One node's records split by process (a record whose ``time`` is below the previous
    one's starts a new process: times count from each process's start), each record with its
    wall time: the process's start, estimated as the earliest ``seen - time`` over its records
    (a record is seen at most one poll plus one flush after it was written), plus its ``time``."""
    groups: list[list[Seen]] = []
    prev = None
    for at, rec in seen:
        if prev is None or rec["time"] < prev:
            groups.append([])
        groups[-1].append((at, rec))
        prev = rec["time"]
    out = []
    for g in groups:
        t0 = min(at - rec["time"] for at, rec in g)
        out.append([(t0 + rec["time"], rec) for _, rec in g])
    return out


def recovery_s(procs: dict[int, list[Incarnation]], finished: set[int], heal: float) -> float | None:
    """Seconds from ``heal`` until every node of ``finished`` completed a step after it: a node
    whose last process started after ``heal`` (it was fenced and started again) counts from that
    process's first step, any other from its first step after ``heal``. None when a finished
    node has no such step (or none finished)."""
    firsts = []
    for n in sorted(finished):
        incs = [inc for inc in procs.get(n, []) if inc]
        if not incs:
            return None
        last = incs[-1]
        if last[0][0] - last[0][1]["time"] > heal:  # a new process
            firsts.append(last[0][0])
            continue
        after = [wall for inc in incs for wall, _ in inc if wall > heal]
        if not after:
            return None
        firsts.append(min(after))
    return max(firsts) - heal if firsts else None


def total_samples(procs: dict[int, list[Incarnation]]) -> float:
    """Samples of every node's every process (each process counts its own from 0)."""
    return float(sum(inc[-1][1].get("samples", 0) for incs in procs.values() for inc in incs if inc))


def declared_failed(logs: list[str]) -> list[int]:
    """The nodes coordinators declared failed, in the order of their log lines (``coordinator C:
    nodes [..] ...: declared failed``), every node's log."""
    out: list[int] = []
    for text in logs:
        for _c, nodes in _COORD_DECLARED.findall(text):
            out += [int(x) for x in nodes.replace(" ", "").split(",") if x]
    return out


def restarts(launcher_err: str) -> list[int]:
    """The nodes the launcher started again after a fence, one entry per restart."""
    return [int(n) for n in _RESTARTED.findall(launcher_err)]


def _proc_argv(pid: int) -> list[str]:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def run_pids(markers: Sequence[str]) -> list[int]:
    """Processes whose command line holds every one of ``markers`` (a run's launcher and nodes)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            line = " ".join(_proc_argv(int(d.name)))
            if line and all(m in line for m in markers):
                out.append(int(d.name))
    return out


def node_pid(node: int, launcher: int, markers: Sequence[str]) -> int | None:
    """The live process of node ``node`` of the run started by ``launcher``: forked (its name
    ``p2psync-nodeK``) or exec'd (``--node K`` on its command line)."""
    for pid in run_pids(markers):
        if pid == launcher:
            continue
        argv = _proc_argv(pid)
        try:
            comm = (Path("/proc") / str(pid) / "comm").read_text().strip()
        except OSError:
            continue
        k = argv.index("--node") if "--node" in argv else -1
        if comm == f"p2psync-node{node}" or (0 <= k < len(argv) - 1 and argv[k + 1] == str(node)):
            return pid
    return None


@dataclass
class Case:
    strategy: str
    fault: Fault
    rc: int | None = None
    hung: bool = False
    summary: dict[str, Any] = field(default_factory=dict)
    procs: dict[int, list[Incarnation]] = field(default_factory=dict)
    heal: float | None = None
    declared: list[int] = field(default_factory=list)
    restarted: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    error: str = ""

    @property
    def finished(self) -> set[int]:
        return {int(n) for n in self.summary.get("nodes", {})}

    @property
    def models(self) -> int | None:
        nodes = self.summary.get("nodes", {})
        return len({v.get("params_sha1") for v in nodes.values()}) if nodes else None

    @property
    def steps(self) -> float | None:
        steps = [v["steps"] for v in self.summary.get("nodes", {}).values() if isinstance(v.get("steps"), int)]
        return sum(steps) / len(steps) if steps else None

    @property
    def false_detections(self) -> int:
        return sum(1 for n in self.declared if n not in self.fault.removable)


def ring_topology(path: Path, netns: bool) -> Path:
    """A 4-node ring on free ports (in 198.18.0.0/16 for the namespaces)."""
    from p2psync.topology import ring, save

    save(ring(RING, base_port=free_port(), subnet="198.18.0.0/16" if netns else None), path)
    return path


def launch_cmd(args: argparse.Namespace, topo: Path, out: Path, run_id: str, strategy: str, netns: bool) -> list[str]:
    return [sys.executable, "-m", "p2psync", *(["-v"] if args.verbose else []), "run", str(topo),
            "--strategy", strategy, "--time", f"{args.time:g}", *model_argv(args.model, args.data, None, strategy),
            "--step-time", ",".join(f"{i}:{args.step_time:g}" for i in range(RING)),
            "--slowdown-mode", args.mode,
            "--out", str(out), "--run-id", run_id, "--threads", "1", "--eval-every", "1000000",
            "--quorum-timeout", f"{args.quorum_timeout:g}", "--start-timeout", "120", "--no-progress",
            *(["--shaper", "netem"] if netns else [])]


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_case(args: argparse.Namespace, tmp: Path, strategy: str, fault: Fault) -> Case:
    """One launcher run of ``strategy`` with ``fault`` (see the module docstring); every process
    of the run is continued and killed, and the links healed, whatever happens."""
    from bench._netns import set_links
    from p2psync.topology import load
    from p2psync.transport import netem

    case = Case(strategy, fault)
    run_id = f"{strategy}-{fault.name}"
    topo_path = ring_topology(tmp / f"{run_id}.json", fault.netns)
    topo = load(topo_path)
    run_dir = tmp / run_id
    markers = (str(tmp), run_id)
    cmd = launch_cmd(args, topo_path, tmp, run_id, strategy, fault.netns)
    env = {**os.environ, "P2PSYNC_LAUNCH": args.launch, netem.ENV_PREFIX: PREFIX}
    leftovers = netem.plan(topo, {}, prefix=PREFIX) if fault.netns else None
    if leftovers is not None:
        netem.down(leftovers)  # an interrupted run's namespaces
    err_path = tmp / f"{run_id}.launcher.err"
    t_start = time.monotonic()
    with err_path.open("wb") as err_f:
        launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_f, cwd=ROOT, env=env,
                                    start_new_session=True)
    tail = Tailer(run_dir, RING)
    tail.start()
    stopped: list[int] = []
    cut = False
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and launcher.poll() is None \
                and not all(len(tail.seen[i]) >= 3 for i in range(RING)):
            time.sleep(0.2)
        if launcher.poll() is None and fault.kind != "clean":
            time.sleep(args.lead)
            if fault.kind == "pause":
                for v in fault.paused:
                    pid = node_pid(v, launcher.pid, markers)
                    if pid is None:
                        raise RuntimeError(f"node {v}'s process not found")
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
                time.sleep(fault.seconds)
                _signal_all(stopped, signal.SIGCONT)
                stopped = []
            else:
                cut = True
                errors = set_links(topo, fault.cuts, up=False, prefix=PREFIX)
                if errors:
                    raise RuntimeError(f"cutting {fault.cuts}: {errors}")
                time.sleep(fault.seconds)
                errors = set_links(topo, fault.cuts, up=True, prefix=PREFIX)
                cut = False
                if errors:
                    raise RuntimeError(f"healing {fault.cuts}: {errors}")
            case.heal = time.time()
        try:
            case.rc = launcher.wait(timeout=max(1.0, t_start + args.time + args.quorum_timeout + 120
                                                - time.monotonic()))
        except subprocess.TimeoutExpired:
            case.hung = True
    except RuntimeError as exc:
        case.error = str(exc)
    finally:
        _signal_all(stopped, signal.SIGCONT)
        if cut:
            set_links(topo, fault.cuts, up=True, prefix=PREFIX)
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)  # it stops its nodes and removes its namespaces
            try:
                launcher.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        left = run_pids(markers)
        _signal_all(left, signal.SIGCONT)
        _signal_all(left, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if leftovers is not None:
            netem.down(leftovers)
        tail.stop()
    case.wall_s = time.monotonic() - t_start
    if case.rc is None and not case.hung:
        case.rc = launcher.returncode
    summary_path = run_dir / "summary.json"
    try:
        case.summary = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        case.summary = {}
    case.procs = {i: incarnations(tail.seen[i]) for i in range(RING)}
    logs = [p.read_text(errors="replace") for p in sorted(run_dir.glob("node-*.log"))]
    case.declared = declared_failed(logs)
    case.restarted = restarts(err_path.read_text(errors="replace"))
    return case


def case_row(case: Case, clean: Case | None) -> list[Any]:
    """The table's row of ``case`` against its strategy's ``clean`` run."""
    summary_ok = bool(case.summary) and case.finished == set(range(RING))
    rec = recovery_s(case.procs, case.finished, case.heal) if case.heal is not None and case.finished else None
    steps, clean_steps = case.steps, clean.steps if clean is not None else None
    lost = (f"{clean_steps - steps:.0f} ({100 * (1 - steps / clean_steps):.0f} %)"
            if steps is not None and clean_steps else "-")
    base = total_samples(clean.procs) if clean is not None else 0.0
    thr = f"{100 * total_samples(case.procs) / base:.0f} %" if base else "-"
    exit_cell = "hung" if case.hung else str(case.rc)
    if case.error:
        exit_cell += f" ({case.error[:60]})"
    return [case.strategy, case.fault.name, case.models if case.models is not None else "-",
            "yes" if summary_ok else ("partial" if case.summary else "no"),
            "-" if case.fault.kind == "clean" else (f"{rec:.1f}" if rec is not None else "never"),
            lost, thr, f"{case.false_detections}" + (f" {sorted(set(case.declared))}" if case.declared else ""),
            len(case.restarted), exit_cell]


HEADERS = ["strategy", "case", "models", "summary names all", "recovery s", "steps lost", "throughput vs clean",
           "false detections (declared)", "fenced restarts", "launcher exit"]


def netns_available() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    import shutil

    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    return f"network namespaces need {', '.join(missing)} (iproute2)" if missing else None


def plot_cases(cases: list[tuple[Case, Case | None]], model: str = "mlp") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = [c for c, _ in cases if c.fault.kind != "clean"]
    names = [f"{c.strategy}\n{c.fault.name}" for c in faults]
    clean_of = {c.strategy: cl for c, cl in cases}
    recs = [recovery_s(c.procs, c.finished, c.heal) if c.heal is not None and c.finished else None for c in faults]
    thr = []
    for c in faults:
        cl = clean_of.get(c.strategy)
        base = total_samples(cl.procs) if cl is not None else 0.0
        thr.append(100 * total_samples(c.procs) / base if base else 0.0)
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.55 * len(faults) + 2), 7), sharex=True)
    xs = range(len(faults))
    axes[0].bar(xs, [r if r is not None else 0.0 for r in recs],
                color=["tab:blue" if r is not None else "tab:red" for r in recs])
    axes[0].set_ylabel("recovery after resume / heal (s)\n(red: never)")
    axes[1].bar(xs, thr, color="tab:green")
    axes[1].axhline(100, color="grey", ls=":")
    axes[1].set_ylabel("throughput vs clean (%)")
    axes[1].set_xticks(list(xs), names, fontsize=7, rotation=70)
    axes[0].set_title(f"pauses and partitions of a 4-node ring, {model} (p2psync run, launcher)")
    return save_png(fig, png_name("faults_partitions", model))


def main_partitions(args: argparse.Namespace) -> None:
    """The pause and partition cases (the default)."""
    scenarios = [FAULTS[s] for s in args.scenarios]
    why_not = netns_available()
    if why_not is not None and any(f.netns for f in scenarios):
        print(f"skipping the split cases: {why_not}", file=sys.stderr)
        scenarios = [f for f in scenarios if not f.netns]
    tmp = Path(tempfile.mkdtemp(prefix="p2psync-faults-"))
    cases: list[tuple[Case, Case | None]] = []
    t0 = time.monotonic()
    try:
        for s in args.strategies:
            clean = run_case(args, tmp, s, CLEAN) if args.clean else None
            if clean is not None:
                cases.append((clean, clean))
                print(f"  {s} clean: {case_row(clean, clean)}", file=sys.stderr, flush=True)
            for f in scenarios:
                case = run_case(args, tmp, s, f)
                cases.append((case, clean))
                print(f"  {s} {f.name}: {case_row(case, clean)}", file=sys.stderr, flush=True)
    finally:
        if args.keep:
            print("kept:", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n## Pauses and partitions of a 4-node ring, {model_title(args.model, args.data)}: p2psync run "
          f"--time {args.time:g} --step-time {args.step_time:g} (every node, {args.mode} mode), fault {args.lead:g} s after every node "
          f"trains; {time.monotonic() - t0:.0f} s in all\n")
    print(markdown_table(HEADERS, [case_row(c, cl) for c, cl in cases]))
    print("\nplot:", plot_cases(cases, args.model))


def sgd_notes(args: argparse.Namespace) -> None:
    """Say on stderr which strategies train a language model with ``--optimizer sgd``."""
    for s in args.strategies:
        if needs_sgd(s, args.model):
            print(f"{s}: --optimizer sgd ({args.model}'s AdamW is refused by {s}: its compensation replays plain SGD)",
                  file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chaos", action="store_true", help="the kill -9 / restart chaos on an 8-node WAN mesh")
    ap.add_argument("--strategies", nargs="+",
                    help="default: ssgd esync dts elastic_bsp (pauses and partitions), asgd ssgd esync (--chaos)")
    ap.add_argument("--keep", action="store_true", help="keep the run folders and logs (path printed)")
    ap.add_argument("--verbose", action="store_true", help="nodes log at INFO level")
    g = ap.add_argument_group("pauses and partitions")
    g.add_argument("--scenarios", nargs="+", default=list(FAULTS), choices=list(FAULTS), metavar="CASE",
                   help=f"among {', '.join(FAULTS)} (default: all)")
    g.add_argument("--time", type=float, help="--time of every run (s; default 30, a language model 60)")
    g.add_argument("--step-time", type=float, help="emulated step time of every node (s; default 0.1, a language "
                                                    "model 1.0)")
    g.add_argument("--mode", choices=SLOWDOWN_MODES, help="--slowdown-mode of the emulated step time (default wait; "
                                                          "a language model: compute)")
    g.add_argument("--lead", type=float, default=4.0, help="seconds of training before the fault")
    g.add_argument("--quorum-timeout", type=float, default=60.0, help="the nodes' --quorum-timeout (s)")
    g.add_argument("--launch", choices=("fork", "exec"), default="fork",
                   help="P2PSYNC_LAUNCH of the pause cases (the split cases exec, in namespaces)")
    g.add_argument("--no-clean", dest="clean", action="store_false",
                   help="no clean reference runs (no steps lost / throughput)")
    c = ap.add_argument_group("--chaos")
    c.add_argument("--duration", type=float, default=180.0, help="training budget per run (s)")
    c.add_argument("--every", type=float, default=20.0, help="seconds between kills")
    c.add_argument("--down", type=float, default=5.0, help="seconds a killed node stays down")
    c.add_argument("--join-margin", type=float, default=45.0,
                   help="no kill later than this many seconds (plus --down) before the end")
    c.add_argument("--grace", type=float, default=60.0, help="seconds after the budget before a hang")
    c.add_argument("--lr", type=float, help="default 0.05; a language model: its own")
    add_model_args(ap)
    args = ap.parse_args()
    resolve_model(args, time=(30.0, 60.0), step_time=(0.1, 1.0), mode=("wait", "compute"), lr=(0.05, None))
    if args.chaos:
        args.strategies = args.strategies or ["asgd", "ssgd", "esync"]
        sgd_notes(args)
        main_chaos(args)
    else:
        args.strategies = args.strategies or ["ssgd", "esync", "dts", "elastic_bsp"]
        sgd_notes(args)
        main_partitions(args)


if __name__ == "__main__":
    main()

"""The CLI end to end, in subprocesses, as a user runs it."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2psync.topology import bcube, mesh, ring, save, topology_to_dict
from tests.e2e.zygote import spawn_node
from tests.helpers import NETNS, free_port, netns_mesh2

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def cli(*args, timeout=150, **kw):
    return subprocess.run([sys.executable, "-m", "p2psync", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=kw.pop("cwd", ROOT), **kw)


def spawn(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "p2psync", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, **kw)


def spawn_warm(*args, log):
    """``p2psync ARGS`` (a built-in job's ``run ... --node I``) forked from a parent that imported
    torch already (tests/e2e/zygote.py), its stdout and stderr appended to ``log``: a process of
    its own as with :func:`spawn`, started 3-5 s of CPU sooner; :func:`spawn` keeps the cold
    start covered (test_node_mode_separate_processes)."""
    return spawn_node([*map(str, args)], log)


def wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def node_logs(run_dir):
    """Every node's log, for an assertion message (a CI failure must be diagnosable)."""
    return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                   for p in sorted(Path(run_dir).glob("node-*.log")))


def lines(path):
    try:
        return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


@pytest.mark.xdist_group("shipped-ring4")  # binds the shipped topology's port 29500
def test_readme_main_job_shipped_ring4(tmp_path):
    r = cli("run", "topologies/ring-4.json", "--steps", "40", "--out", tmp_path, "--run-id", "r4")
    assert r.returncode == 0, r.stderr + r.stdout
    run = tmp_path / "r4"
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["nodes"]) == {"0", "1", "2", "3"} and summary["failed"] == []
    assert summary["accuracy_mean"] > 0.5
    for i in range(4):
        recs = lines(run / f"node-{i}.jsonl")
        assert recs[-1]["step"] == 40 and "accuracy" in recs[-1]
        assert {"loss", "compute_s", "comm_s", "wait_s", "nics", "samples_per_s"} <= set(recs[-1])
    assert "final accuracy" in r.stdout and str(run) in r.stdout
    assert r.stderr.count("is unauthenticated") == 1, r.stderr  # no keys: said once (issue 16)


def test_bcube_traffic_on_every_nic(tmp_path):
    topo = tmp_path / "b.json"
    save(bcube(2, 2, base_port=free_port()), topo)
    r = cli("run", topo, "--steps", "15", "--out", tmp_path, "--run-id", "b")
    assert r.returncode == 0, r.stderr
    for i in range(4):
        nics = lines(tmp_path / "b" / f"node-{i}.jsonl")[-1]["nics"]
        assert set(nics) == {"l0", "l1"}
        assert all(v["sent"] + v["recv"] > 0 for v in nics.values()), nics


def test_node_mode_separate_processes(tmp_path):
    topo = tmp_path / "m.json"
    save(mesh(2, base_port=free_port()), topo)
    procs = [spawn("run", topo, "--node", i, "--steps", "20", "--out", tmp_path) for i in (1, 0)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    (run,) = list(tmp_path.glob("*-mesh-2-ssgd"))  # the run id the coordinator chose
    assert (run / "node-0.jsonl").exists() and (run / "node-1.jsonl").exists()
    assert json.loads((run / "summary.json").read_text())["failed"] == []


@pytest.mark.parametrize("strategy", ["ssgd", "asgd"])
def test_killed_node(tmp_path, strategy):
    """ssgd with --on-failure stop: the old fail-stop, PeerFailure naming the killed node."""
    topo = tmp_path / "m.json"
    save(mesh(3, base_port=free_port()), topo)
    budget = "60" if strategy == "ssgd" else "8"
    stop = ["--on-failure", "stop"] if strategy == "ssgd" else []
    procs = [spawn_warm("run", topo, "--node", i, "--strategy", strategy, "--time", budget, "--out", tmp_path,
                        "--run-id", "k", "--eval-every", "1000", *stop, log=tmp_path / f"process-{i}.log")
             for i in range(3)]
    try:
        wait_for(lambda: len(lines(tmp_path / "k" / "node-2.jsonl")) >= 5, 90, "node 2 to train")
        procs[2].kill()
        t_kill = time.monotonic()
        outs = [p.communicate(timeout=60) for p in procs[:2]]
        elapsed = time.monotonic() - t_kill
    finally:
        for p in procs:
            p.kill()
    codes = [p.returncode for p in procs[:2]]
    if strategy == "ssgd":
        assert codes == [1, 1], outs
        assert elapsed < 20
        for _, err in outs:
            assert "PeerFailure" in err and "2" in err.split("PeerFailure")[1], err
    else:
        assert codes == [0, 0], outs
        recs = lines(tmp_path / "k" / "node-0.jsonl")
        assert recs[-1]["alive"] == 2 and recs[-1]["time"] >= 8


def _pids_with(marker: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (d / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def _cmdline(pid: int) -> list[str]:
    return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]


@pytest.mark.parametrize("launch", ["fork", "exec"])
def test_sigint_stops_everything(tmp_path, launch):
    """SIGINT to the launcher stops every node, whether they were forked from it (the default:
    the same command line as the launcher's, each node its own process group) or exec'd
    (``P2PSYNC_LAUNCH=exec``: ``python -m p2psync run ... --node I``)."""
    topo = tmp_path / "r.json"
    save(ring(4, base_port=free_port()), topo)
    marker = f"sigint-{os.getpid()}-{time.time_ns()}"
    p = spawn("run", topo, "--time", "120", "--out", tmp_path, "--run-id", marker,
              env={**os.environ, "P2PSYNC_LAUNCH": launch})
    try:
        wait_for(lambda: all(lines(tmp_path / marker / f"node-{i}.jsonl") for i in range(4)), 90, "training")
        nodes = [pid for pid in _pids_with(marker) if pid != p.pid]
        assert len(nodes) == 4  # + the launcher
        for pid in nodes:
            cmd = _cmdline(pid)
            assert (cmd == _cmdline(p.pid)) == (launch == "fork") and ("--node" in cmd) == (launch == "exec"), cmd
            assert os.getpgid(pid) == pid
        p.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        p.communicate(timeout=15)
        assert time.monotonic() - t0 < 6
        assert p.returncode == 130
        wait_for(lambda: not _pids_with(marker), 2, "no process left behind")
    finally:
        p.kill()


def test_broken_topology_and_options_exit_2(tmp_path):
    d = topology_to_dict(ring(3))
    d["nodes"][1]["nics"][0]["port"] = 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    r = cli("run", bad, timeout=60)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "nodes[1].nics[0].port" in err[0]
    r = cli("run", "topologies/ring-4.json", "--lr", "-1", timeout=60)
    assert r.returncode == 2 and "--lr" in r.stderr
    r = cli("run", "topologies/ring-4.json", "--node", "9", timeout=60)
    assert r.returncode == 2 and "--node 9" in r.stderr
    r = cli("run", "topologies/ring-4.json", "--slowdown-mode", "quota", "--step-time", "0:0.1", timeout=60)
    assert r.returncode == 2 and "--slowdown-mode quota" in r.stderr and "--step-time" in r.stderr
    r = cli("run", tmp_path / "missing.json", timeout=60)
    assert r.returncode == 2 and "cannot read topology" in r.stderr
    r = cli("run", "--help", timeout=60)
    assert r.returncode == 0 and "--strategy" in r.stdout and "--partition" in r.stdout


def test_forked_and_execd_nodes_train_identically(tmp_path):
    """A forked node (the default) seeds, shares out threads and trains exactly as an exec'd one
    (``P2PSYNC_LAUNCH=exec``): ssgd over a ring is bitwise deterministic given the seed."""
    topo = tmp_path / "r.json"
    save(ring(4, base_port=free_port()), topo)
    summaries = {}
    for launch in ("exec", "fork"):
        r = cli("run", topo, "--strategy", "ssgd", "--steps", "8", "--seed", "3", "--eval-every", "4",
                "--out", tmp_path, "--run-id", launch, env={**os.environ, "P2PSYNC_LAUNCH": launch})
        assert r.returncode == 0, r.stderr + r.stdout + node_logs(tmp_path / launch)
        assert "starting the nodes with exec" not in r.stderr  # forking was safe
        summaries[launch] = json.loads((tmp_path / launch / "summary.json").read_text())["nodes"]
    fields = ("steps", "final_accuracy", "final_test_loss", "params_sha1")
    fork, exe = ({i: [s[f] for f in fields] for i, s in summaries[k].items()} for k in ("fork", "exec"))
    assert fork == exe and all(all(v) for v in fork.values()), summaries
    assert len({s["params_sha1"] for s in summaries["fork"].values()}) == 1


def test_shm_trains_exactly_as_tcp_and_carries_the_pieces(tmp_path):
    """``--shm``: the ring's pieces between nodes of this host go through shared memory
    (``shm_frames`` in the summary), and the run is bitwise the run without it (ssgd, one seed);
    nothing is rejected."""
    topo = tmp_path / "r.json"
    save(ring(4, base_port=free_port()), topo)
    summaries = {}
    for run_id, extra in (("tcp", []), ("shm", ["--shm"])):
        r = cli("run", topo, "--strategy", "ssgd", "--steps", "8", "--seed", "3", "--eval-every", "4",
                "--hidden", "1024", "--out", tmp_path, "--run-id", run_id, *extra)
        assert r.returncode == 0, r.stderr + r.stdout + node_logs(tmp_path / run_id)
        summaries[run_id] = json.loads((tmp_path / run_id / "summary.json").read_text())["nodes"]
    assert all(s["shm_frames"] > 0 and not s["rejected"] for s in summaries["shm"].values()), summaries["shm"]
    assert all(s["shm_frames"] == 0 for s in summaries["tcp"].values())
    fields = ("steps", "final_accuracy", "final_test_loss", "params_sha1")
    tcp, shm = ({i: [s[f] for f in fields] for i, s in summaries[k].items()} for k in ("tcp", "shm"))
    assert tcp == shm, summaries
    r = cli("run", topo, "--shm", "--keys", str(tmp_path), "--steps", "1", "--out", tmp_path)
    assert r.returncode == 2 and "--shm cannot be used with --keys" in r.stderr, r.stderr


NO_TORCH = ("import sys; from p2psync.cli.main import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")


def test_usage_errors_are_found_without_importing_torch(tmp_path):
    """The launcher imports torch (for the nodes it forks) only once the run is known valid."""
    for args, env in ((["--lr", "-1"], {}), (["--steps", "1"], {"P2PSYNC_LAUNCH": "vfork"})):
        r = subprocess.run([sys.executable, "-c", NO_TORCH, "run", "topologies/ring-4.json", *args, "--out",
                            str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=ROOT,
                           env={**os.environ, **env})
        assert r.returncode == 2 and "torch imported" not in r.stderr, r.stderr
        assert (args[0] if not env else "P2PSYNC_LAUNCH=vfork") in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())  # no run started


@pytest.mark.xdist_group("netns")  # network namespaces and 198.18.0.0/15 addresses: one at a time
@NETNS
def test_run_inside_network_namespaces(tmp_path):
    topo = netns_mesh2(tmp_path)
    r = cli("run", topo, "--shaper", "netem", "--steps", "10", "--out", tmp_path, "--run-id", "ns")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "ns" / "summary.json").read_text())["failed"] == []
    assert "p2pn0" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    d = json.loads(topo.read_text())
    d["links"] = [{"a": 0, "b": 1, "latency_ms": 20}]
    topo.write_text(json.dumps(d))
    r = cli("run", topo, "--shaper", "netem", "--steps", "5", "--out", tmp_path)
    if r.returncode == 2:  # a kernel without netem (like this one): the error names the qdisc
        assert "sch_netem" in r.stderr
    else:
        assert r.returncode == 0, r.stderr


@pytest.mark.xdist_group("shipped-ring4")  # binds the shipped topology's port 29500
def test_lossy_codec_runs_every_requested_step(tmp_path):
    """Issue 9.1: ``--codec int8`` used to end SSGD after 1 step at chance accuracy, exit 0
    (every strategy x codec is covered in-process by tests/integration/test_strategy_matrix.py)."""
    r = cli("run", "topologies/ring-4.json", "--strategy", "ssgd", "--codec", "int8", "--error-feedback",
            "--steps", "30", "--slowdown", "3:2", "--slowdown-mode", "compute", "--out", tmp_path,
            "--run-id", "q")
    assert r.returncode == 0, r.stderr + r.stdout + node_logs(tmp_path / "q")
    summary = json.loads((tmp_path / "q" / "summary.json").read_text())
    assert summary["accuracy_mean"] > 0.5
    for i in range(4):
        assert lines(tmp_path / "q" / f"node-{i}.jsonl")[-1]["step"] == 30


@pytest.mark.timeout(240)
def test_ring6_kill9_only_that_node_is_declared_failed(tmp_path):
    """Issue 10: kill -9 the coordinator's neighbour on a 6-node ring (control traffic of nodes
    2 and 3 was relayed through it): every survivor declares that node, and only it, failed
    within 3 s + 2 x RTT, and the asgd survivors finish normally."""
    import re

    with ring_run(tmp_path, "r6", "--time", "12", n=6, strategy="asgd") as (_, _, procs):
        procs[1].send_signal(signal.SIGKILL)
        t_kill = time.time()
        errs = exit_0(procs, (0, 2, 3, 4, 5), timeout=90)
    for i, err in errs.items():
        declared = re.findall(r"node \d+: peer (\d+) failed \(at ([0-9.]+)\)", err)
        assert [int(p) for p, _ in declared] == [1], (i, err[-3000:])
        delay = float(declared[0][1]) - t_kill
        print(f"node {i} declared node 1 failed {delay:.2f}s after kill -9")
        assert delay < 3.0, (i, delay)  # 3 s + 2 x RTT; RTT ~ 0 on loopback
    summary = json.loads((tmp_path / "r6" / "summary.json").read_text())
    assert summary["failed"] == [1] and set(summary["nodes"]) == {"0", "2", "3", "4", "5"}


def ring_nodes(tmp_path, run_id, *budget, n=4, strategy="ssgd", step_s=0.05):
    """``start(i)`` for the node processes of an ``n``-node ring run (one ``--node`` each, as on
    separate hosts; fixed step times), and the run folder."""
    topo = tmp_path / f"r{n}.json"
    save(ring(n, base_port=free_port()), topo)
    step_time = ",".join(f"{i}:{step_s}" for i in range(n))
    args = ["run", topo, "--strategy", strategy, *budget, "--out", tmp_path, "--run-id", run_id,
            "--eval-every", "1000", "--threads", "1", "--step-time", step_time]
    starts = itertools.count()
    return (lambda i: spawn_warm(*args, "--node", i, log=tmp_path / f"process-{run_id}-{i}-{next(starts)}.log")), \
        tmp_path / run_id


def wait_training(run, n, steps=20):
    wait_for(lambda: all(len(lines(run / f"node-{i}.jsonl")) >= steps for i in range(n)), 90,
             "every node to train")


@contextlib.contextmanager
def ring_run(tmp_path, run_id, *budget, n=4, **kw):
    """The node processes of an ``n``-node ring run (:func:`ring_nodes`), all started and every
    node training (:func:`wait_training`): yields ``start`` (a node started again: the caller
    appends its process), the run folder and the processes; every process killed on the way out::

        with ring_run(tmp_path, "rf", "--time", "14") as (start, run, procs):
            procs[2].send_signal(signal.SIGKILL)
            errs = exit_0(procs, (0, 1, 3), timeout=90)
    """
    start, run = ring_nodes(tmp_path, run_id, *budget, n=n, **kw)
    procs = [start(i) for i in range(n)]
    try:
        wait_training(run, n)
        yield start, run, procs
    finally:
        for p in procs:
            p.kill()


def exit_0(procs, ids, timeout):
    """Waits for the processes ``procs[i]``, i in ``ids``, to end, each with exit code 0; their
    stderr by index."""
    outs = {i: procs[i].communicate(timeout=timeout) for i in ids}
    for i, (_, err) in outs.items():
        assert procs[i].returncode == 0, (i, err[-6000:])
    return {i: err for i, (_, err) in outs.items()}


def agreement(summary):
    """The nodes' final steps and parameter hashes in a run's summary, as two sets (one element
    each where every node ended at the same step with the same parameters)."""
    nodes = summary["nodes"].values()
    return {v["steps"] for v in nodes}, {v["params_sha1"] for v in nodes}


def test_ring4_ssgd_kill9_survivors_reform_and_finish(tmp_path):
    """Issue 10 item 5: kill -9 a non-coordinator node; the ssgd survivors re-form over the
    new view at the next step, finish with exit 0 and bitwise equal parameters, and the summary
    lists the killed node as failed."""
    with ring_run(tmp_path, "rf", "--time", "14") as (_, run, procs):
        procs[2].send_signal(signal.SIGKILL)
        t_kill = time.time()
        errs = exit_0(procs, (0, 1, 3), timeout=90)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failed"] == [2] and set(summary["nodes"]) == {"0", "1", "3"}
    steps, hashes = agreement(summary)
    assert len(steps) == 1 and len(hashes) == 1, summary["nodes"]
    recs = lines(run / "node-0.jsonl")
    after = [r for r in recs if r.get("members") == 3]
    assert after and recs[-1]["members"] == 3
    reform = float(re.findall(r"re-formed over view \d+ .* in ([0-9.]+)s", errs[0])[0])
    print(f"kill at {t_kill:.2f}: node 0 re-formed {reform:.2f}s after its step failed")


def test_ring4_ssgd_killed_node_restarted_rejoins(tmp_path):
    """Issue 10 item 5: kill -9 node 2, restart it with the same --node and --run-id while the
    run goes on: it joins (state from a live peer), and every node ends with the same step and
    bitwise the same parameters."""
    # a step budget (not --time): the joiner's process start-up may take a while on a busy
    # host, and the run must still be going when it registers (~30 s of 0.1 s steps)
    # a cosine LR schedule: the joiner's fresh scheduler would run another lr, so bitwise
    # equality needs the scheduler's state to travel with the parameters
    with ring_run(tmp_path, "rj", "--steps", "300", "--lr-schedule", "cosine", step_s=0.1) as (start, run, procs):
        procs[2].send_signal(signal.SIGKILL)
        wait_for(lambda: any(r.get("members") == 3 for r in lines(run / "node-0.jsonl")), 30,
                 "the survivors to re-form")
        n_before = len(lines(run / "node-2.jsonl"))
        procs.append(start(2))
        errs = exit_0(procs, (0, 1, 3, 4), timeout=120)
    assert "joined with" in errs[4] or "adopted node" in errs[4], errs[4][-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["nodes"]) == {"0", "1", "2", "3"} and summary["failed"] == []
    steps, hashes = agreement(summary)
    assert steps == {300} and len(hashes) == 1, summary["nodes"]
    assert len(lines(run / "node-2.jsonl")) > n_before  # the new process trained


@pytest.mark.slow
def test_ring4_diloco_killed_node_restarted_rejoins(tmp_path):
    """DiLoCo (Streaming: 2 fragments, tau=2) through node processes: kill -9 node 2 and restart
    it while the run goes on; the survivors redo their sum without it, the new process adopts
    the leader's global copy, outer momentum and inner state, and every node ends at the same
    step with the same model. (~75 s; the shorter equivalent, in one process, is
    tests/integration/test_diloco_elastic_zmq.py.)"""
    budget = ("--steps", "300", "--lr-schedule", "cosine", "--opt", "inner_steps=10", "--opt", "tau=2",
              "--opt", "fragments=2")
    with ring_run(tmp_path, "rj", *budget, strategy="diloco", step_s=0.1) as (start, run, procs):
        procs[2].send_signal(signal.SIGKILL)
        wait_for(lambda: any(r.get("members") == 3 for r in lines(run / "node-0.jsonl")), 30,
                 "the survivors to re-form")
        n_before = len(lines(run / "node-2.jsonl"))
        procs.append(start(2))
        errs = exit_0(procs, (0, 1, 3, 4), timeout=120)
    assert "adopted the leader's DiLoCo state" in errs[4], errs[4][-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["nodes"]) == {"0", "1", "2", "3"} and summary["failed"] == []
    steps, hashes = agreement(summary)
    assert steps == {300} and len(hashes) == 1, summary["nodes"]
    assert len(lines(run / "node-2.jsonl")) > n_before  # the new process trained


def test_a_port_in_use_is_named_with_how_to_choose_others(tmp_path):
    """Node 0's port is held by another program: the node's error names the address and port
    and points to --base-port (or the topology file)."""
    import socket

    topo_obj = ring(2, base_port=free_port())
    topo = tmp_path / "r2.json"
    save(topo_obj, topo)
    nic = topo_obj.node(0).nics[0]
    with socket.socket() as held:
        held.bind((nic.address, nic.port))
        held.listen()
        r = cli("run", topo, "--node", "0", "--steps", "1", "--out", tmp_path, "--run-id", "busy", timeout=90)
    assert r.returncode != 0, r.stdout + r.stderr
    assert f"cannot bind {nic.address}:{nic.port}, the port is in use" in r.stderr, r.stderr
    assert "--base-port" in r.stderr and "nodes[0].nics[0].port" in r.stderr, r.stderr


def test_init_from_starts_the_built_in_job_from_an_earlier_runs_weights(tmp_path):
    """``--init-from`` a node's checkpoint of an earlier run: the new run's first loss is the
    trained model's, not a fresh one's (ln 10 on digits); a file of another model is named
    with the tensor that does not fit, and a missing one before any node starts."""
    topo = tmp_path / "r.json"
    save(ring(2, base_port=free_port()), topo)
    r = cli("run", topo, "--steps", "30", "--checkpoint-every", "30", "--out", tmp_path, "--run-id", "a",
            "--no-progress")
    assert r.returncode == 0, r.stderr + node_logs(tmp_path / "a")
    ckpt = tmp_path / "a" / "node-0" / "checkpoint.pt"
    r = cli("run", topo, "--steps", "2", "--init-from", ckpt, "--out", tmp_path, "--run-id", "b", "--no-progress")
    assert r.returncode == 0, r.stderr + node_logs(tmp_path / "b")
    first = {run: lines(tmp_path / run / "node-0.jsonl")[0]["loss"] for run in ("a", "b")}
    assert first["a"] > 2.0 and first["b"] < 1.0, first
    r = cli("run", topo, "--steps", "2", "--hidden", "64", "--init-from", ckpt, "--out", tmp_path, "--run-id", "c",
            "--no-progress")
    assert r.returncode != 0 and "model.1.weight: shape (128, 64)" in r.stderr, r.stderr
    r = cli("run", topo, "--steps", "2", "--init-from", tmp_path / "nope.pt", "--out", tmp_path)
    assert r.returncode == 2 and "--init-from" in r.stderr and "no such file" in r.stderr, r.stderr

"""``p2psync run TOPOLOGY [options] -- CMD ARGS...``: the user's own command once per node (or one
node with ``--node K``), in real subprocesses, with the environment of ``p2psync.api.env``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from p2psync.api.env import from_env
from p2psync.cli.launch import STOP_GRACE_S, default_threads
from p2psync.cli.main import build_parser, parse_args
from p2psync.cli.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED
from p2psync.cli.run_cmd import config_from_args
from p2psync.topology import ring, save
from tests.e2e.test_cli_run import cli as _cli
from tests.e2e.test_cli_run import spawn, wait_for
from tests.helpers import NETNS, free_port, netns_mesh2

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)

#: records its environment and arguments in its node folder, then does what argv[1] says
SCRIPT = r'''
import json, os, signal, subprocess, sys, time
node = os.environ["P2PSYNC_NODE"]
keys = [k for k in os.environ if k.startswith("P2PSYNC_") or k in
        ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")]
rec = {"env": {k: os.environ[k] for k in keys}, "argv": sys.argv[1:], "pid": os.getpid(), "children": []}
mode = sys.argv[1]
if mode == "sleep" and node == "0":  # something the script started: must be stopped with it
    rec["children"].append(subprocess.Popen(["sleep", "1000"]).pid)
if mode == "sleep" and node == "2":  # a script that ignores SIGTERM: needs the SIGKILL
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
out = os.path.join(os.environ.get("P2PSYNC_RUN_DIR", "."), "rec.json")
with open(out + ".tmp", "w") as f:
    json.dump(rec, f)
os.replace(out + ".tmp", out)
print(f"node {node} started", flush=True)
if mode == "fail1" and node == "1":
    print(f"error: boom on node {node}", file=sys.stderr)
    sys.exit(3)
if mode in ("sleep", "fail1"):
    while True:
        time.sleep(1)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
'''


def cli(*args, timeout=45, **kw):
    return _cli(*args, timeout=timeout, **kw)


def gone(pid: int) -> bool:
    """No such process (or only a zombie nobody reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


@pytest.fixture
def ring3(tmp_path):
    topo = tmp_path / "r3.json"
    save(ring(3, base_port=free_port()), topo)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return topo, script


def rec(run: Path, i: int):
    try:
        return json.loads((run / f"node-{i}" / "rec.json").read_text())
    except FileNotFoundError:
        return None


def test_every_node_runs_the_script_with_its_environment(tmp_path, ring3):
    topo, script = ring3
    opts = ["--strategy", "asgd", "--opt", "max_inflight=4", "--codec", "int8", "--peer-timeout", "12",
            "--shaper", "inproc", "--seed", "7", "--partition", "dirichlet", "--on-failure", "stop",
            "--lr", "0.2", "--out", tmp_path, "--run-id", "s"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = cli("run", topo, *opts, "--", sys.executable, script, "exit", "--lr", "0.1", "--", "x", env=env)
    # the script never calls p2psync.attach: every copy ran, and the launcher says it never joined
    assert r.returncode == EXIT_FAILED and "never joined the run" in r.stderr, r.stderr + r.stdout
    assert "run folder:" in r.stdout
    # the config the user typed, as p2psync's own parser makes it, plus what the launcher fixes
    args = parse_args(build_parser(), ["run", str(topo), *map(str, opts), "--", "ignored"])
    want = replace(config_from_args(args), topology=str(topo.absolute()), threads=default_threads(3),
                   progress=False, command=(sys.executable, str(script), "exit", "--lr", "0.1", "--", "x"))
    assert want.lr == 0.2 and want.epochs is None and want.steps is None
    for i in range(3):
        got = rec(tmp_path / "s", i)
        assert got is not None, (tmp_path / "s" / f"node-{i}.log").read_text()
        assert got["argv"] == ["exit", "--lr", "0.1", "--", "x"]  # untouched by p2psync
        env = got["env"]
        assert env["P2PSYNC_NODE"] == str(i) and env["RANK"] == str(i) and env["WORLD_SIZE"] == "3"
        assert env["LOCAL_RANK"] == str(i) and env["LOCAL_WORLD_SIZE"] == "3"
        assert env["P2PSYNC_STRATEGY"] == "asgd"
        # three copies share the host's cores (torch would start a thread per core in each)
        assert env["OMP_NUM_THREADS"] == str(default_threads(3))
        assert env["P2PSYNC_RUN_DIR"] == str((tmp_path / "s" / f"node-{i}").absolute())
        ne = from_env(env)
        assert ne is not None and ne.node_id == i and ne.rank == i and ne.world_size == 3
        assert ne.config == want
        assert f"node {i} started" in (tmp_path / "s" / f"node-{i}.log").read_text()


def test_a_failing_node_is_named_and_the_others_stopped(tmp_path, ring3):
    """Node 1 exits 3, nodes 0 and 2 would run forever: exit EXIT_FAILED naming node 1 and its
    last log line, the others stopped within the launcher's patience, nothing left running."""
    topo, script = ring3
    timing = ["--heartbeat", "0.2", "--failure-timeout", "0.5", "--peer-timeout", "1"]
    t0 = time.monotonic()
    r = cli("run", topo, *timing, "--out", tmp_path, "--run-id", "f", "--no-progress", "--",
            sys.executable, script, "fail1")
    elapsed = time.monotonic() - t0
    assert r.returncode == EXIT_FAILED, r.stderr + r.stdout
    assert "node 1 failed (exit 3): error: boom on node 1" in r.stderr, r.stderr
    assert "node 0 stopped by the launcher" in r.stderr and "node 2 stopped by the launcher" in r.stderr
    assert "node 0 failed" not in r.stderr and "node 2 failed" not in r.stderr
    patience = 0.5 + 1 + 15
    assert elapsed < patience + STOP_GRACE_S + 20, elapsed  # + start-up of a loaded host
    for i in range(3):
        got = rec(tmp_path / "f", i)
        assert got is not None and gone(got["pid"])


def test_sigint_stops_every_script_and_what_it_started(tmp_path, ring3):
    topo, script = ring3
    p = spawn("run", topo, "--out", tmp_path, "--run-id", "i", "--no-progress", "--",
              sys.executable, script, "sleep")
    try:
        run = tmp_path / "i"
        wait_for(lambda: all(rec(run, i) for i in range(3)), 40, "every script to start")
        pids = [rec(run, i)["pid"] for i in range(3)] + rec(run, 0)["children"]
        assert len(pids) == 4 and not any(gone(pid) for pid in pids)
        p.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=STOP_GRACE_S + 10)
        assert time.monotonic() - t0 < STOP_GRACE_S + 5  # node 2 ignores SIGTERM: SIGKILL after the grace
        assert p.returncode == EXIT_INTERRUPTED, err
        assert "interrupted: stopped 3 nodes" in err
        wait_for(lambda: all(gone(pid) for pid in pids), 2, "no process left behind")
    finally:
        p.kill()
        p.wait()


def test_node_k_runs_only_that_node_in_the_foreground(tmp_path, ring3):
    topo, script = ring3
    p = spawn("run", topo, "--node", "1", "--strategy", "esync", "--out", tmp_path, "--run-id", "k", "--threads", "1",
              "--", sys.executable, script, "exit", "--epochs", "3", env={**os.environ, "EXIT_CODE": "7"})
    out, err = p.communicate(timeout=45)
    assert p.returncode == 7, err  # the script's own exit code
    assert "node 1 started" in out  # its output on this terminal, not in a log file
    got = rec(tmp_path / "k", 1)
    assert got["pid"] == p.pid  # p2psync became the script (exec)
    assert got["argv"] == ["exit", "--epochs", "3"]
    # the ring's three loopback nodes are on this host
    assert got["env"]["RANK"] == "1" and got["env"]["LOCAL_RANK"] == "1" and got["env"]["LOCAL_WORLD_SIZE"] == "3"
    assert got["env"]["OMP_NUM_THREADS"] == "1"  # --threads
    ne = from_env(got["env"])
    assert ne is not None and ne.strategy == "esync" and ne.config.run_id == "k" and ne.config.epochs is None
    assert not (tmp_path / "k" / "node-0").exists() and not (tmp_path / "k" / "node-2").exists()


def test_node_k_gets_the_environment_the_launcher_gives_node_k(tmp_path, ring3):
    """Nodes 0 and 2 started on their own (--node) see exactly what the launcher gave their
    copies when it started all three: their own folders, ranks, threads, config."""
    topo, script = ring3
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    opts = ["--strategy", "esync", "--seed", "3", "--out", tmp_path, "--run-id", "same", "--no-progress"]
    r = cli("run", topo, *opts, "--", sys.executable, script, "exit", env=env)
    assert r.returncode == EXIT_FAILED and "never joined the run" in r.stderr, r.stderr + r.stdout
    launched = {i: rec(tmp_path / "same", i) for i in range(3)}
    assert all(launched.values()), launched
    for i in (0, 2):
        r = cli("run", topo, "--node", str(i), *opts, "--", sys.executable, script, "exit", env=env)
        assert r.returncode == 0, r.stderr
        got = rec(tmp_path / "same", i)
        assert got["pid"] != launched[i]["pid"] and got["env"] == launched[i]["env"]
        assert got["env"]["P2PSYNC_RUN_DIR"] == str((tmp_path / "same" / f"node-{i}").absolute())
        assert got["env"]["OMP_NUM_THREADS"] == str(default_threads(3))


def test_node_k_with_a_command_needs_the_run_id(tmp_path, ring3):
    """Without --run-id the copy's own folder is not known (the run is named by its coordinator
    when the script joins): an error, not a copy writing into the current directory."""
    topo, _ = ring3
    r = cli("run", topo, "--node", "0", "--out", tmp_path, "--", sys.executable, "-c", "print('ran')")
    assert r.returncode == 2 and "--node 0 with a command needs --run-id" in r.stderr, r.stderr
    assert "ran" not in r.stdout


def test_usage_errors_exit_2(tmp_path, ring3):
    topo, _ = ring3
    r = cli("run", topo, "--")
    assert r.returncode == 2 and "nothing to run after --" in r.stderr, r.stderr
    r = cli("run", topo, "--node", "1", "--")
    assert r.returncode == 2 and "nothing to run after --" in r.stderr, r.stderr
    r = cli("run", topo, "--", tmp_path / "no-such-script")
    assert r.returncode == 2 and "no-such-script" in r.stderr, r.stderr
    r = cli("run", topo, "--node", "9", "--", "true")
    assert r.returncode == 2 and "--node 9" in r.stderr, r.stderr


def test_double_dash_splits_only_run():
    parser = build_parser()
    args = parse_args(parser, ["run", "t.json", "--strategy", "asgd", "--", "python", "train.py", "--lr", "0.1"])
    assert args.strategy == "asgd" and args.cmd == ["python", "train.py", "--lr", "0.1"]
    assert config_from_args(args).lr == 0.05  # the script's own --lr is not p2psync's
    assert parse_args(parser, ["-v", "run", "t.json", "--"]).cmd == []
    assert parse_args(parser, ["run", "t.json"]).cmd is None
    assert config_from_args(parse_args(parser, ["run", "t.json"])).epochs == 20.0  # built-in job budget
    assert config_from_args(parse_args(parser, ["run", "t.json", "--", "x"])).epochs is None
    args = parse_args(parser, ["report", "--", "-odd-folder"])  # '--' as argparse means it
    assert args.command == "report" and args.run_dir == "-odd-folder" and not hasattr(args, "cmd")


@pytest.mark.xdist_group("netns")  # network namespaces and 198.18.0.0/15 addresses: one at a time
@NETNS
def test_scripts_run_inside_network_namespaces(tmp_path):
    topo = netns_mesh2(tmp_path)
    code = ("import os, pathlib; pathlib.Path(os.environ['P2PSYNC_RUN_DIR'], 'netns').write_text("
            "os.readlink('/proc/self/ns/net'))")
    r = cli("run", topo, "--shaper", "netem", "--out", tmp_path, "--run-id", "ns", "--",
            sys.executable, "-c", code)
    if r.returncode == 2 and "netem" in r.stderr:
        pytest.skip(f"no network namespaces here: {r.stderr.strip()}")
    assert r.returncode == EXIT_FAILED and "never joined the run" in r.stderr, r.stderr + r.stdout
    own = os.readlink("/proc/self/ns/net")
    spaces = {(tmp_path / "ns" / f"node-{i}" / "netns").read_text() for i in range(2)}
    assert len(spaces) == 2 and own not in spaces
    assert "p2pn0" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


#: node 0 stands for the coordinator that ends the run (it writes summary.json after 1.5 s);
#: node 1 is fenced (exit 75) at once, and its restarted process finds the run over
#: (rendezvous fails: exit 1) unless argv[1] is "late", where node 1 is fenced only after the end
FENCED_SCRIPT = r'''
import json, os, sys, time
node, mode = os.environ["P2PSYNC_NODE"], sys.argv[1]
run = os.path.dirname(os.environ["P2PSYNC_RUN_DIR"])
life = os.path.join(os.environ["P2PSYNC_RUN_DIR"], "lives")
with open(life, "a") as f:
    f.write("x")
lives = len(open(life).read())
if node == "0":
    time.sleep(1.5)
    with open(os.path.join(run, "summary.json"), "w") as f:
        json.dump({"nodes": {}, "failed": [1]}, f)
    sys.exit(0)
if lives == 1:
    time.sleep(3.0 if mode == "late" else 0.2)
    sys.exit(75)
while not os.path.exists(os.path.join(run, "summary.json")):
    time.sleep(0.1)
print("rendezvous with coordinator 0 failed", flush=True)
sys.exit(1)
'''


@pytest.mark.parametrize("mode", ["early", "late"])
def test_a_fenced_node_that_cannot_rejoin_before_the_end_is_left_out(tmp_path, mode):
    """A fenced node is started again only while the run goes on; when the run ends first (the
    coordinator wrote summary.json) it is named as left out, and the launcher exits 0: the
    run ended as one, with the majority's model."""
    topo = tmp_path / "m2.json"
    save(ring(2, base_port=free_port()), topo)
    script = tmp_path / "fenced.py"
    script.write_text(FENCED_SCRIPT)
    r = cli("run", topo, "--on-failure", "continue", "--out", tmp_path, "--run-id", "f", "--",
            sys.executable, script, mode)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "node 1 left out" in r.stderr, r.stderr
    lives = (tmp_path / "f" / "node-1" / "lives").read_text()
    assert lives == ("xx" if mode == "early" else "x"), r.stderr

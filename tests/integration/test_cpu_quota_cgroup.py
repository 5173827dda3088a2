"""``--slowdown-mode quota`` on this host's real CPU controller (skipped where it cannot be
written): a capped process gets no more CPU than its quota, and its group is gone after it
closes; a run of the launcher caps every node and leaves no group behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from p2psync.errors import ConfigError
from p2psync.topology import ring, save
from p2psync.training.cpu_quota import PREFIX, controller, orphans, probe
from tests.helpers import free_port

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.xdist_group("cgroup")]  # one at a time: the run's launcher sweeps dead nodes' groups


def _writable() -> bool:
    try:
        probe()
    except ConfigError:
        return False
    return True


needs_cgroup = pytest.mark.skipif(not _writable(), reason="no writable CPU controller (root and cgroups needed)")

BURN = """
import json, os, time
from p2psync.training.cpu_quota import CpuQuota
q = CpuQuota.create()
q.set(0.2)
w0, c0 = time.monotonic(), time.process_time()
while time.monotonic() - w0 < 1.5:
    pass
w, c = time.monotonic() - w0, time.process_time() - c0
path = str(q.path)
q.close()
print(json.dumps({"wall": w, "cpu": c, "gone": not os.path.exists(path)}))
"""


@needs_cgroup
def test_a_capped_process_computes_at_most_its_quota_and_removes_its_group():
    r = subprocess.run([sys.executable, "-c", BURN], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    # a busy loop alone would take ~100 % of a core; capped at 0.2 cores it takes at most that
    # (less when other processes load the host), with 50 ms of slack (five 10 ms periods)
    assert got["cpu"] <= 0.2 * got["wall"] + 0.05, got
    assert got["gone"], got


@needs_cgroup
def test_a_quota_run_gives_every_node_its_share_and_leaves_no_group_behind(tmp_path):
    group = controller().group
    before = {p.name for p in group.glob(f"{PREFIX}*")}
    topo = tmp_path / "ring4.json"
    save(ring(4, base_port=free_port()), topo)
    r = subprocess.run([sys.executable, "-m", "p2psync", "run", str(topo), "--steps", "20", "--slowdown",
                        "0:1,1:1,2:2,3:4", "--slowdown-mode", "quota", "--out", str(tmp_path), "--run-id", "q",
                        "--no-progress", "--eval-every", "20"], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    nodes = json.loads((tmp_path / "q" / "summary.json").read_text())["nodes"]
    share = 0.9 * len(os.sched_getaffinity(0)) / 2.75
    assert {n: s.get("cpu_share") for n, s in nodes.items()} == {str(n): pytest.approx(share, abs=1e-3)
                                                                  for n in range(4)}, nodes
    # no group of a process that is gone (others' runs may hold groups of live nodes meanwhile)
    left = {p.name for p in orphans(controller())}
    assert left <= before, left


CAPPED_SCRIPT = """
import os, pathlib, torch, p2psync
from p2psync.training.cpu_quota import controller, _limit
ctl = controller()
pathlib.Path(os.environ["P2PSYNC_RUN_DIR"], "cap.txt").write_text(f"{ctl.group.name} {_limit(ctl.group, ctl.v2)}")
model = torch.nn.Linear(4, 2)
opt = p2psync.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(5):
    opt.zero_grad()
    (model(torch.ones(2, 4)) ** 2).mean().backward()
    opt.step()
"""


@needs_cgroup
def test_a_commands_nodes_run_capped_at_their_devices_share(tmp_path):
    """The user's own script under ``--slowdown-mode quota``: every copy runs in a group of its
    own (the copy's pid) capped at share / factor; the groups are gone after the run."""
    script = tmp_path / "s.py"
    script.write_text(CAPPED_SCRIPT)
    topo = tmp_path / "ring2.json"
    save(ring(2, base_port=free_port()), topo)
    r = subprocess.run([sys.executable, "-m", "p2psync", "run", str(topo), "--slowdown", "0:1,1:4", "--slowdown-mode",
                        "quota", "--out", str(tmp_path), "--run-id", "s", "--no-progress", "--", sys.executable,
                        str(script)], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    share = 0.9 * len(os.sched_getaffinity(0)) / 1.25  # two nodes at factors 1 and 4
    caps = {}
    for node, factor in ((0, 1), (1, 4)):
        group, cores = (tmp_path / "s" / f"node-{node}" / "cap.txt").read_text().split()
        assert group.startswith(PREFIX), group
        caps[node] = float(cores)
        assert caps[node] == pytest.approx(share / factor, rel=0.01), (node, cores)
    assert not orphans(controller())


def test_a_commands_nodes_refuse_padded_devices(tmp_path):
    """``--slowdown`` of the padded modes, ``--step-time`` and schedules act on the built-in
    job's steps only: with a command they are an error, not a run that emulates nothing."""
    topo = tmp_path / "ring2.json"
    save(ring(2, base_port=free_port()), topo)
    for opts in (["--slowdown", "1:4"], ["--step-time", "0:0.1"], ["--slowdown", "1:4", "--slowdown-mode", "compute"],
                 ["--slowdown-mode", "quota", "--step-jitter", "0.1"]):
        r = subprocess.run([sys.executable, "-m", "p2psync", "run", str(topo), *opts, "--out", str(tmp_path),
                            "--", sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "--slowdown-mode quota" in r.stderr, (opts, r.stderr[-2000:])

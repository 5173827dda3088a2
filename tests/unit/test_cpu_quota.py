"""``--slowdown-mode quota``: the shares, the profile's rules, and the control-group files,
on a directory tree laid out as cgroup v1 and v2 mount it (the real controller: see
tests/integration/test_cpu_quota_cgroup.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from p2psync.errors import ConfigError
from p2psync.training.cpu_quota import PERIOD_US, CpuQuota, Throttle, controller, shares, sweep
from p2psync.training.hetero import Slowdown, parse_profiles


def test_shares_fit_the_nodes_at_their_fastest_into_nine_tenths_of_the_cores():
    share = shares({0: 1, 1: 1, 2: 2, 3: 4}, 2)
    assert share == pytest.approx(0.9 * 2 / 2.75)
    assert sum(share / f for f in (1, 1, 2, 4)) == pytest.approx(1.8)
    with pytest.raises(ConfigError):
        shares({}, 2)


def test_a_quota_profile_pads_nothing_and_knows_its_fastest_factor():
    p = parse_profiles("3:4", "3:30:2,3:60:8", mode="quota")[3]
    assert p.pad(0.01, 0.0) == 0.0 and p.pad(0.01, 100.0) == 0.0
    assert p.fastest == 2 and p.factor_at(45) == 2
    assert Slowdown(factor=3).fastest == 3


@pytest.mark.parametrize("kw", [{"step_time": 0.1}, {"jitter": 0.2}])
def test_quota_mode_refuses_padded_step_times(kw):
    with pytest.raises(ConfigError, match="--slowdown-mode quota"):
        Slowdown(mode="quota", **kw)


def _v1(tmp_path: Path) -> tuple[Path, str]:
    grp = tmp_path / "cpu" / "job"
    grp.mkdir(parents=True)
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    (grp / "cgroup.procs").write_text("")
    return grp, "4:memory:/x\n1:cpu:/job\n0::/\n"


def _v2(tmp_path: Path) -> tuple[Path, str]:
    grp = tmp_path / "job"
    grp.mkdir(parents=True)
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids")
    (grp / "cgroup.subtree_control").write_text("memory")
    (grp / "cgroup.procs").write_text("")
    return grp, "0::/job\n"


def test_the_controller_is_found_for_v1_and_v2_and_its_absence_is_named(tmp_path):
    grp, text = _v1(tmp_path / "a")
    assert controller(tmp_path / "a", text).group == grp and not controller(tmp_path / "a", text).v2
    grp2, text2 = _v2(tmp_path / "b")
    assert controller(tmp_path / "b", text2).group == grp2 and controller(tmp_path / "b", text2).v2
    (tmp_path / "c").mkdir()
    with pytest.raises(ConfigError, match="no CPU controller"):
        controller(tmp_path / "c", "1:cpu:/\n0::/\n")


def test_a_v1_quota_writes_period_quota_and_the_process(tmp_path):
    grp, text = _v1(tmp_path)
    q = CpuQuota.create("t", root=tmp_path, proc_cgroup=text)
    path = grp / "p2psync-t"
    assert (path / "cpu.cfs_period_us").read_text() == str(PERIOD_US)
    assert (path / "cgroup.procs").read_text() == str(os.getpid())
    t = Throttle(q, 0.6)
    t.follow(2.0)
    assert (path / "cpu.cfs_quota_us").read_text() == str(round(PERIOD_US * 0.3))
    (path / "cpu.cfs_quota_us").write_text("untouched")
    t.follow(2.0)  # the same factor: no write
    assert (path / "cpu.cfs_quota_us").read_text() == "untouched"
    t.follow(600.0)  # below the kernel's 1 ms floor per period
    assert (path / "cpu.cfs_quota_us").read_text() == "1000"
    t.close()  # the process goes back to the group it came from
    assert (grp / "cgroup.procs").read_text() == str(os.getpid())


def test_a_v2_quota_enables_the_controller_for_children_and_writes_cpu_max(tmp_path):
    grp, text = _v2(tmp_path)
    q = CpuQuota.create("t", root=tmp_path, proc_cgroup=text, join=False)
    assert (grp / "cgroup.subtree_control").read_text() == "+cpu"
    q.set(0.25)
    assert (grp / "p2psync-t" / "cpu.max").read_text() == f"{PERIOD_US // 4} {PERIOD_US}"
    with pytest.raises(ConfigError):
        q.set(0)


def test_sweep_removes_the_empty_groups_of_dead_processes_only(tmp_path):
    grp, text = _v1(tmp_path)
    dead = 2 ** 22 + 12345  # above the kernel's pid_max default: no such process
    for name in (f"p2psync-{dead}", f"p2psync-{os.getpid()}", "p2psync-probe-1", "other"):
        (grp / name).mkdir()
    assert sweep(tmp_path, text) == [grp / f"p2psync-{dead}"]
    assert sorted(p.name for p in grp.iterdir() if p.is_dir()) == sorted(
        [f"p2psync-{os.getpid()}", "p2psync-probe-1", "other"])

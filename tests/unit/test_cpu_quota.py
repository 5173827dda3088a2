"""``--slowdown-mode quota``: the shares, the profile's rules, and the control-group files,
on a directory tree laid out as cgroup v1 and v2 mount it (the real controller: see
tests/integration/test_cpu_quota_cgroup.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from p2psync.errors import ConfigError
from p2psync.topology import ring
from p2psync.training.cpu_quota import (PERIOD_US, Controller, CpuQuota, Throttle, available_cores, bandwidth,
                                        controller, shares, sweep)
from p2psync.training.hetero import Slowdown, fastest_on_host, parse_profiles


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


def _v1(tmp_path: Path) -> tuple[Path, Controller]:
    """A v1 ``cpu,cpuacct`` hierarchy mounted at ``tmp_path/cpu``, this process in ``/job``."""
    grp = tmp_path / "cpu" / "job"
    grp.mkdir(parents=True)
    (grp / "cgroup.procs").write_text("")
    mountinfo = (f"30 25 0:26 / {tmp_path}/cpu rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
                 f"31 25 0:27 / {tmp_path}/memory rw - cgroup cgroup rw,memory\n")
    return grp, controller("4:memory:/x\n1:cpu,cpuacct:/job\n0::/\n", mountinfo)


def _v2(tmp_path: Path) -> tuple[Path, Controller]:
    grp = tmp_path / "job"
    grp.mkdir(parents=True)
    (grp / "cgroup.controllers").write_text("cpuset cpu io memory pids")
    (grp / "cgroup.subtree_control").write_text("memory")
    (grp / "cgroup.procs").write_text("")
    return grp, controller("0::/job\n", f"40 1 0:30 / {tmp_path} rw - cgroup2 cgroup2 rw,nsdelegate\n")


def test_the_controller_is_found_for_v1_and_v2_also_where_the_mount_starts_at_the_group(tmp_path):
    grp, ctl = _v1(tmp_path / "a")
    assert ctl.group == grp and not ctl.v2 and ctl.mount == tmp_path / "a" / "cpu"
    grp2, ctl2 = _v2(tmp_path / "b")
    assert ctl2.group == grp2 and ctl2.v2
    # a container: /proc/self/cgroup names /docker/abc, and the mount's root is that group
    box = tmp_path / "c" / "cpu"
    box.mkdir(parents=True)
    inside = controller("1:cpu:/docker/abc\n", f"30 25 0:26 /docker/abc {box} rw - cgroup cgroup rw,cpu\n")
    assert inside.group == box and inside.mount == box
    # a mount point with a space (mountinfo escapes it)
    spaced = tmp_path / "d e"
    (spaced / "g").mkdir(parents=True)
    escaped = str(spaced).replace(" ", "\\040")
    assert controller("1:cpu:/g\n", f"30 25 0:26 / {escaped} rw - cgroup cgroup rw,cpu\n").group == spaced / "g"
    with pytest.raises(ConfigError, match="no CPU controller"):
        controller("1:cpu:/\n0::/\n", f"31 25 0:27 / {tmp_path} rw - cgroup cgroup rw,memory\n")
    (grp2 / "cgroup.controllers").write_text("memory")  # v2 without cpu for this group
    with pytest.raises(ConfigError, match="no CPU controller"):
        controller("0::/job\n", f"40 1 0:30 / {tmp_path / 'b'} rw - cgroup2 cgroup2 rw\n")


def test_the_bandwidth_keeps_the_quota_above_the_kernels_floor_by_a_longer_period():
    assert bandwidth(0.5) == (PERIOD_US // 2, PERIOD_US)
    assert bandwidth(0.0857) == (1000, 11669)  # not 1000 per 10 ms, which would be 0.1 cores
    assert bandwidth(4) == (4 * PERIOD_US, PERIOD_US)
    for bad in (0, -1, 0.0005):
        with pytest.raises(ConfigError):
            bandwidth(bad)


def test_the_cores_available_are_within_every_limit_up_to_the_mount(tmp_path):
    grp, ctl = _v1(tmp_path)
    assert available_cores(ctl) == len(os.sched_getaffinity(0))
    (grp.parent / "cpu.cfs_quota_us").write_text("50000")  # the mount's top: 0.5 cores
    (grp.parent / "cpu.cfs_period_us").write_text("100000")
    (grp / "cpu.cfs_quota_us").write_text("-1")
    (grp / "cpu.cfs_period_us").write_text("100000")
    assert available_cores(ctl) == 0.5
    grp2, ctl2 = _v2(tmp_path / "v2")
    (grp2 / "cpu.max").write_text("150000 100000")
    assert available_cores(ctl2) == min(1.5, len(os.sched_getaffinity(0)))


def test_a_v1_quota_writes_period_quota_and_the_process(tmp_path):
    grp, ctl = _v1(tmp_path)
    q = CpuQuota.create("t", ctl=ctl)
    path = grp / "p2psync-t"
    assert (path / "cgroup.procs").read_text() == str(os.getpid())
    t = Throttle(q, 0.6)
    t.follow(2.0)
    assert (path / "cpu.cfs_quota_us").read_text() == str(round(PERIOD_US * 0.3))
    assert (path / "cpu.cfs_period_us").read_text() == str(PERIOD_US)
    (path / "cpu.cfs_quota_us").write_text("untouched")
    t.follow(2.0)  # the same factor: no write
    assert (path / "cpu.cfs_quota_us").read_text() == "untouched"
    t.follow(600.0)  # 0.001 cores: the kernel's longest period with its shortest quota
    assert (path / "cpu.cfs_quota_us").read_text() == "1000"
    assert (path / "cpu.cfs_period_us").read_text() == "1000000"
    t.close()  # the process goes back to the group it came from
    assert (grp / "cgroup.procs").read_text() == str(os.getpid())


def test_a_v2_quota_enables_the_controller_for_children_and_writes_cpu_max(tmp_path):
    grp, ctl = _v2(tmp_path)
    q = CpuQuota.create("t", ctl=ctl, join=False)
    assert (grp / "cgroup.subtree_control").read_text() == "+cpu"
    q.set(0.25)
    assert (grp / "p2psync-t" / "cpu.max").read_text() == f"{PERIOD_US // 4} {PERIOD_US}"
    with pytest.raises(ConfigError):
        q.set(0)


def test_sweep_removes_the_empty_groups_of_dead_processes_only(tmp_path):
    grp, ctl = _v1(tmp_path)
    dead = 2 ** 22 + 12345  # above the kernel's pid_max default: no such process
    for name in (f"p2psync-{dead}", f"p2psync-{os.getpid()}", "p2psync-probe-1", "other"):
        (grp / name).mkdir()
    assert sweep(ctl) == [grp / f"p2psync-{dead}"]
    assert sorted(p.name for p in grp.iterdir() if p.is_dir()) == sorted(
        [f"p2psync-{os.getpid()}", "p2psync-probe-1", "other"])


def test_the_shares_divide_only_the_nodes_on_this_nodes_host():
    topo = ring(4, hosts=["a", "a", "b", "b"])
    profiles = parse_profiles("0:1,1:2,2:4,3:8", mode="quota")
    assert fastest_on_host(profiles, topo, 0) == {0: 1.0, 1: 2.0}
    assert fastest_on_host(profiles, topo, 3) == {2: 4.0, 3: 8.0}


def test_quota_mode_refuses_netem_and_a_commands_padded_devices():
    from p2psync.training.config import RunConfig

    with pytest.raises(ConfigError, match="--shaper netem"):
        RunConfig(topology="t.json", slowdown_mode="quota", shaper="netem")
    with pytest.raises(ConfigError, match="a command's nodes emulate slower devices with"):
        RunConfig(topology="t.json", command=("python", "x.py"), slowdown_mode="quota", step_jitter=0.1)
    RunConfig(topology="t.json", command=("python", "x.py"), slowdown="1:4", slowdown_mode="quota")
    RunConfig(topology="t.json", slowdown="1:4", step_time="0:0.1")  # the built-in job pads


def test_the_capped_wrapper_refuses_a_bad_cap_before_touching_any_group(capsys):
    from p2psync.cli.capped import main

    assert main(["inf", "--", "true"]) == 2
    assert main(["x", "--", "true"]) == 2
    assert main(["0.5", "true"]) == 2  # no "--"
    assert "p2psync" in capsys.readouterr().err

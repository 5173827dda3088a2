"""CPU quotas for ``--slowdown-mode quota``: each node's process computes at the speed of its
emulated device, and its idle time speeds up nobody else.

Why: the ``compute`` mode pads a step with real work, so slowness costs CPU; but on a host with
fewer cores than nodes, a node that waits (at a barrier, for a sync) hands its core to the
others, which then run faster than their devices would: the emulation flatters whatever makes
fast nodes wait. Here a node's process runs in a control group of its own whose CPU bandwidth
is ``share / factor`` cores: a slow device really computes its step, at a lower rate, and when
the shares of all nodes on the host add up to fewer cores than it has (:func:`shares` leaves
10 % headroom), no node's speed depends on what the others do, as on separate devices.

Mechanism: the Linux CPU controller's bandwidth limit, cgroup v2 (``cpu.max``) or v1
(``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), in a group ``p2psync-<pid>`` created under the
process's current one, with a 10 ms period (a throttled process runs in slices of that order,
shorter than a training step). Creating the group needs write access to the controller (root,
or a delegated subtree). :func:`probe` says why that fails, so the launcher refuses the mode
before it starts a node. :meth:`CpuQuota.close` moves the process back and removes the group;
:func:`sweep` removes the empty groups of processes that died without closing theirs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from p2psync.errors import ConfigError

log = logging.getLogger("p2psync.training")

#: where the control-group file systems are mounted
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: the bandwidth period: the quota is granted per this many microseconds
PERIOD_US = 10_000
#: the fraction of the host's cores the nodes' shares add up to at most
HEADROOM = 0.9
PREFIX = "p2psync-"


def shares(fastest: Mapping[int, float], cores: float, headroom: float = HEADROOM) -> float:
    """Pure: the CPU cores a node of factor 1 gets, so that every node of ``fastest`` (node ->
    its smallest slowdown factor over the run, all on this host) running at ``share / factor``
    together takes at most ``headroom`` of ``cores``."""
    if not fastest or cores <= 0:
        raise ConfigError("CPU shares need at least one node and one core")
    return headroom * cores / sum(1.0 / f for f in fastest.values())


@dataclass(frozen=True)
class Controller:
    """A writable CPU controller: the directory of this process's current group in it, and
    whether it is cgroup v2."""

    group: Path
    v2: bool


def _current(root: Path, proc_cgroup: str) -> Controller | None:
    """The CPU controller this process's group is in (``proc_cgroup``: the text of
    /proc/self/cgroup), or None when no CPU controller is mounted under ``root``."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "" and (root / "cgroup.controllers").exists():
            if "cpu" in (root / "cgroup.controllers").read_text().split():
                return Controller(root / rel, v2=True)
        elif "cpu" in controllers.split(","):
            for name in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                if (root / name / "cpu.cfs_quota_us").exists():
                    return Controller(root / name / rel, v2=False)
    return None


def controller(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> Controller:
    """This process's CPU controller; ConfigError saying why none can be used."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError as exc:
            raise ConfigError(f"--slowdown-mode quota: cannot read /proc/self/cgroup ({exc.strerror}); it needs "
                              "Linux control groups") from None
    found = _current(root, proc_cgroup)
    if found is None:
        raise ConfigError(f"--slowdown-mode quota: no CPU controller is mounted under {root} (cgroup v2 with "
                          "'cpu' enabled, or v1 'cpu'): use --slowdown-mode compute or wait")
    if not os.access(found.group, os.W_OK):
        raise ConfigError(f"--slowdown-mode quota: cannot create control groups in {found.group} (run as root, "
                          "or delegate that subtree): use --slowdown-mode compute or wait")
    return found


def probe(root: Path = CGROUP_ROOT) -> None:
    """Whether this host lets a node cap its CPU: create a group, set a quota and remove it.
    ConfigError naming what failed (the launcher's check before it starts any node)."""
    quota = CpuQuota.create(f"probe-{os.getpid()}", root=root, join=False)
    try:
        quota.set(1.0)
    finally:
        quota.close()


class CpuQuota:
    """This process in a control group of its own with a CPU bandwidth limit (:meth:`set`)."""

    def __init__(self, ctl: Controller, path: Path, joined: bool) -> None:
        self.ctl, self.path, self.joined = ctl, path, joined
        self.cores: float | None = None

    @classmethod
    def create(cls, name: str | None = None, *, root: Path = CGROUP_ROOT, join: bool = True,
               proc_cgroup: str | None = None) -> CpuQuota:
        """Create the group ``p2psync-<name>`` (default: this process's pid) under this process's
        own and, with ``join``, move this process (every thread of it) into it, unlimited so
        far. ConfigError when the host does not allow it."""
        ctl = controller(root, proc_cgroup)
        path = ctl.group / f"{PREFIX}{name if name is not None else os.getpid()}"
        try:
            if ctl.v2 and "cpu" not in (ctl.group / "cgroup.subtree_control").read_text().split():
                (ctl.group / "cgroup.subtree_control").write_text("+cpu")  # its children get cpu.max
            path.mkdir(exist_ok=True)
            if not ctl.v2:
                (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            quota = cls(ctl, path, joined=False)
            if join:
                (path / "cgroup.procs").write_text(str(os.getpid()))
                quota.joined = True
        except OSError as exc:
            raise ConfigError(f"--slowdown-mode quota: cannot set up the control group {path}: "
                              f"{exc.strerror or exc}") from None
        return quota

    def set(self, cores: float) -> None:
        """Let the group's processes use at most ``cores`` CPU cores (a fraction: part of one)."""
        if not cores > 0:
            raise ConfigError(f"a CPU quota must be > 0 cores, got {cores}")
        quota_us = max(1000, round(PERIOD_US * cores))  # the kernel's floor is 1 ms
        try:
            if self.ctl.v2:
                (self.path / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
            else:
                (self.path / "cpu.cfs_quota_us").write_text(str(quota_us))
        except OSError as exc:
            raise ConfigError(f"--slowdown-mode quota: cannot set the CPU quota of {self.path}: "
                              f"{exc.strerror or exc}") from None
        self.cores = cores

    def close(self) -> None:
        """Move this process back to the group it came from and remove this one (logged, not
        raised, when that fails: a leftover empty group is removed by :func:`sweep`)."""
        try:
            if self.joined:
                (self.ctl.group / "cgroup.procs").write_text(str(os.getpid()))
                self.joined = False
            self.path.rmdir()
        except OSError as exc:
            log.warning("could not remove the control group %s: %s", self.path, exc.strerror or exc)


class Throttle:
    """A node's emulated device in ``quota`` mode: its process capped at ``share / factor``
    cores, the cap following the factor as a schedule changes it (:meth:`follow`)."""

    def __init__(self, quota: CpuQuota, share: float) -> None:
        self.quota, self.share = quota, share
        self.factor: float | None = None

    def follow(self, factor: float) -> None:
        """Cap the process at this factor's cores (a write only when the factor changed)."""
        if factor != self.factor:
            self.quota.set(self.share / factor)
            self.factor = factor

    def close(self) -> None:
        self.quota.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> list[Path]:
    """Remove the empty ``p2psync-<pid>`` groups under this process's own whose process is
    gone (a node killed before it could close its quota); the groups removed."""
    try:
        ctl = controller(root, proc_cgroup)
    except ConfigError:
        return []
    gone = []
    for path in ctl.group.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX):]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            path.rmdir()
            gone.append(path)
        except OSError:
            pass
    return gone


__all__ = ["CGROUP_ROOT", "Controller", "CpuQuota", "HEADROOM", "PERIOD_US", "Throttle", "controller", "probe",
           "shares", "sweep"]

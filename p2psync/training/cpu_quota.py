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
process's current one (found through /proc/self/cgroup and /proc/self/mountinfo, so also inside
a container whose mount starts at its own group), with a 10 ms period (longer where the quota
would fall under the kernel's 1 ms floor: :func:`bandwidth`), so a throttled process runs in
slices shorter than a training step. The host's cores are those the process may run on, within
every limit above its group (:func:`available_cores`: a container's ``--cpus``). Creating the
group needs write access to the controller (root, or a delegated subtree; on cgroup v2 the
current group must hold no other process). :func:`probe` says why that fails, so the launcher
refuses the mode before it starts a node. :meth:`CpuQuota.close` moves the process back and
removes the group; :func:`sweep` removes the empty groups of processes that died without
closing theirs.

The cap covers the whole process: the transport's threads, codecs and coordinator duties of a
slow node run at its device's rate too, which a slow GPU would not impose on them. For the
training step's compute, the point of the emulation, it is exact.
"""

from __future__ import annotations

import errno
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from p2psync.errors import ConfigError
from p2psync.topology import Topology
from p2psync.training.hetero import Slowdown, fastest_on_host

log = logging.getLogger("p2psync.training")

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
    """A CPU controller this process's group is in: that group's directory, whether it is
    cgroup v2, and the directory the controller is mounted at (the top this process sees)."""

    group: Path
    v2: bool
    mount: Path


def _unescape(field: str) -> str:
    """A path field of /proc/self/mountinfo (spaces and the like are octal escapes: ``\\040``)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """The cgroup mounts of a mountinfo text: (file system type, mount root, mount point,
    super options)."""
    found = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        found.append((tail[0], _unescape(fields[3]), _unescape(fields[4]), set(tail[2].split(","))))
    return found


def _current(proc_cgroup: str, mountinfo: str) -> Controller | None:
    """The CPU controller this process's group is in (``proc_cgroup``: the text of
    /proc/self/cgroup; ``mountinfo``: of /proc/self/mountinfo), its group's path mapped
    through the mount's root (a container's mount starts at its own group), or None when no
    CPU controller is mounted. A v1 ``cpu`` hierarchy wins over v2 (a hybrid host)."""
    mounts = _mounts(mountinfo)
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[1] == "" and parts[0] == "0":
            v2 = parts[2]
        elif len(parts) == 3 and "cpu" in parts[1].split(","):
            v1 = parts[2]
    for fstype, path in (("cgroup", v1), ("cgroup2", v2)):
        if path is None:
            continue
        for kind, root, point, opts in mounts:
            if kind != fstype or (kind == "cgroup" and "cpu" not in opts):
                continue
            if root != "/" and not (path == root or path.startswith(root.rstrip("/") + "/")):
                continue  # a mount of another part of the hierarchy
            rel = path[len(root):] if root != "/" else path
            group = Path(point) / rel.lstrip("/")
            if kind == "cgroup2":
                try:
                    if "cpu" not in (group / "cgroup.controllers").read_text().split():
                        continue
                except OSError:
                    continue
            return Controller(group, v2=kind == "cgroup2", mount=Path(point))
    return None


def controller(proc_cgroup: str | None = None, mountinfo: str | None = None) -> Controller:
    """This process's CPU controller; ConfigError saying why none can be used (the texts of
    /proc/self/cgroup and /proc/self/mountinfo are read unless given)."""
    try:
        proc_cgroup = Path("/proc/self/cgroup").read_text() if proc_cgroup is None else proc_cgroup
        mountinfo = Path("/proc/self/mountinfo").read_text() if mountinfo is None else mountinfo
    except OSError as exc:
        raise ConfigError(f"--slowdown-mode quota: cannot read /proc/self ({exc.strerror}); it needs Linux "
                          "control groups") from None
    found = _current(proc_cgroup, mountinfo)
    if found is None:
        raise ConfigError("--slowdown-mode quota: this process's group has no CPU controller (cgroup v1 'cpu', "
                          "or v2 with 'cpu' in its cgroup.controllers): use --slowdown-mode compute or wait")
    if not os.access(found.group, os.W_OK):
        raise ConfigError(f"--slowdown-mode quota: cannot create control groups in {found.group} (run as root, "
                          "or in a delegated subtree): use --slowdown-mode compute or wait")
    return found


def _limit(group: Path, v2: bool) -> float | None:
    """The CPU cores ``group``'s own bandwidth limit allows (None: unlimited or unreadable)."""
    try:
        if v2:
            quota, period = (group / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((group / "cpu.cfs_quota_us").read_text())
        return None if quota_us < 0 else quota_us / int((group / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def available_cores(ctl: Controller) -> float:
    """The CPU cores this process can use: those it may run on (its affinity), within every
    bandwidth limit of its group and the groups above it up to the mount (a container's
    ``--cpus``), which a child's quota must not exceed."""
    cores = float(len(os.sched_getaffinity(0)))
    group = ctl.group
    while True:
        limit = _limit(group, ctl.v2)
        if limit is not None:
            cores = min(cores, limit)
        if group == ctl.mount or group.parent == group:
            return cores
        group = group.parent


def bandwidth(cores: float) -> tuple[int, int]:
    """Pure: (quota, period) in microseconds that grant ``cores``: the period is
    :data:`PERIOD_US`, or longer where the quota would fall below the kernel's 1 ms floor
    (which would grant more than asked); ConfigError under a thousandth of a core (the
    period's 1 s ceiling)."""
    if not cores > 0:
        raise ConfigError(f"a CPU quota must be > 0 cores, got {cores}")
    period = max(PERIOD_US, math.ceil(1000 / cores))
    if period > 1_000_000:
        raise ConfigError(f"a CPU quota of {cores:g} cores is below what the kernel can grant (0.001)")
    return max(1000, round(period * cores)), period


def probe(cores: float = 1.0) -> None:
    """Whether this host lets a node cap its CPU at ``cores`` (the largest cap a node of the
    run will set): create a group, set the quota, remove the group. ConfigError naming what
    failed (the launcher's check before it starts any node)."""
    quota = CpuQuota.create(f"probe-{os.getpid()}", join=False)
    try:
        quota.set(cores)
    finally:
        quota.close()


class CpuQuota:
    """This process in a control group of its own with a CPU bandwidth limit (:meth:`set`)."""

    def __init__(self, ctl: Controller, path: Path, joined: bool) -> None:
        self.ctl, self.path, self.joined = ctl, path, joined
        self.cores: float | None = None

    @classmethod
    def create(cls, name: str | None = None, *, join: bool = True, ctl: Controller | None = None) -> CpuQuota:
        """Create the group ``p2psync-<name>`` (default: this process's pid) under this process's
        own (``ctl``, default :func:`controller`) and, with ``join``, move this process (every
        thread of it) into it, unlimited so far. ConfigError when the host does not allow it."""
        ctl = controller() if ctl is None else ctl
        path = ctl.group / f"{PREFIX}{name if name is not None else os.getpid()}"
        try:
            if ctl.v2:
                _delegate_cpu(ctl.group)
            path.mkdir(exist_ok=True)
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
        quota_us, period_us = bandwidth(cores)
        try:
            if self.ctl.v2:
                (self.path / "cpu.max").write_text(f"{quota_us} {period_us}")
            else:
                (self.path / "cpu.cfs_period_us").write_text(str(period_us))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota_us))
        except OSError as exc:
            raise ConfigError(f"--slowdown-mode quota: cannot set the CPU quota of {self.path} to {cores:.4g} "
                              f"cores: {exc.strerror or exc}") from None
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


def host_share(profiles: Mapping[int, Slowdown], topo: Topology, node_id: int, ctl: Controller) -> float:
    """The cores a node of factor 1 gets (:func:`shares`) when the nodes on ``node_id``'s host,
    each at its fastest (:func:`~p2psync.training.hetero.fastest_on_host`), share what this
    process may use: the same for the launcher's checks and the node's own cap."""
    return shares(fastest_on_host(profiles, topo, node_id), available_cores(ctl))


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


def _delegate_cpu(group: Path) -> None:
    """cgroup v2: let ``group``'s children have the CPU controller (``+cpu`` in its
    ``cgroup.subtree_control``). The kernel refuses that (EBUSY) while ``group`` itself holds
    processes, unless it is the root: ConfigError saying so."""
    control = group / "cgroup.subtree_control"
    if "cpu" in control.read_text().split():
        return
    try:
        control.write_text("+cpu")
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        raise ConfigError(f"--slowdown-mode quota: cgroup v2 gives a group's children the CPU controller only "
                          f"when the group holds no processes, and {group} holds this one: start p2psync in a "
                          "group of its own that it may manage (e.g. systemd-run --scope -p Delegate=yes p2psync "
                          "run ...)") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def orphans(ctl: Controller) -> list[Path]:
    """The ``p2psync-<pid>`` groups under ``ctl``'s group whose process is gone."""
    return [path for path in ctl.group.glob(f"{PREFIX}*")
            if path.name[len(PREFIX):].isdigit() and not _alive(int(path.name[len(PREFIX):]))]


def sweep(ctl: Controller | None = None) -> list[Path]:
    """Remove the empty :func:`orphans` (a node killed before it could close its quota); the
    groups removed."""
    if ctl is None:
        try:
            ctl = controller()
        except ConfigError:
            return []
    gone = []
    for path in orphans(ctl):
        try:
            path.rmdir()
            gone.append(path)
        except OSError:
            pass
    return gone


__all__ = ["Controller", "CpuQuota", "HEADROOM", "PERIOD_US", "Throttle", "available_cores", "bandwidth",
           "controller", "host_share", "orphans", "probe", "shares", "sweep"]

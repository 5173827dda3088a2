"""Kernel-shaped links for the benchmarks: network namespaces, veth pairs, one ``tbf``
per NIC.

:func:`shaped_network` builds the namespaces of a topology with
:func:`p2psync.transport.netem.plan` (one namespace per node, one bridge per network, addresses
from the topology; generate it with ``subnet=`` from the benchmarking range 198.18.0.0/15) and
then puts a ``tbf`` root qdisc of ``rate_bps`` on every NIC's veth: a NIC sends at most that
rate, whichever peers it talks to (a per-NIC limit, as a real 1 Gb/s port; the netem backend's
own shaping is per link). Needs root, ``ip`` and ``tc`` with the tbf qdisc (no netem needed).
:func:`run_in_netns` is a process target that enters a node's namespace before running the
benchmark worker, so the worker's sockets (and ZeroMQ's IO threads) live there.

Partitions (bench/faults.py, tests/e2e/test_partitions.py): :func:`link_ends` names both ends
(namespace, veth) of the network between two nodes, :func:`set_links` takes such links down
(``ip link set DEV down`` on both ends, inside the nodes' namespaces: nothing crosses the link,
existing TCP connections stall as on a cut cable) and up again (the addresses stay, the routes
come back with the link).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from typing import Any, Callable, Iterator

CLONE_NEWNET = 0x40000000


def nic_device(prefix: str, node: int, j: int) -> str:
    """The veth name of node ``node``'s NIC number ``j`` inside its namespace (netem.plan's)."""
    return f"{prefix}{node}v{j}"


@contextlib.contextmanager
def shaped_network(topo: Any, rate_bps: float, prefix: str = "bk") -> Iterator[Any]:
    from p2psync.transport import netem

    p = netem.plan(topo, {}, prefix=prefix)
    burst = max(512 << 10, int(rate_bps / 8 / 250))  # >= one GSO super-packet and rate / HZ
    for node in topo.nodes:
        for j, _nic in enumerate(node.nics):
            p.up.append(["ip", "netns", "exec", p.namespaces[node.id], "tc", "qdisc", "replace", "dev",
                         nic_device(prefix, node.id, j), "root", "tbf", "rate", f"{int(rate_bps)}bit",
                         "burst", str(burst), "latency", "100ms"])
    netem.down(p)  # leftovers of an interrupted run
    netem.up(p)
    try:
        yield p
    finally:
        netem.down(p)


def link_ends(topo: Any, a: int, b: int, prefix: str) -> list[tuple[str, str]]:
    """(namespace, veth) of node ``a``'s and node ``b``'s NICs on the networks they share (a
    ring's point-to-point link), as :func:`p2psync.transport.netem.plan` with ``prefix`` names
    them; ValueError when the two share no network."""
    out = []
    for me, other in ((a, b), (b, a)):
        for j, nic in enumerate(topo.node(me).nics):
            if other in topo.members(nic.network):
                out.append((f"{prefix}n{me}", nic_device(prefix, me, j)))
    if not out:
        raise ValueError(f"nodes {a} and {b} share no network")
    return out


def set_links(topo: Any, pairs: Any, *, up: bool, prefix: str) -> list[str]:
    """Take the links between the node pairs ``pairs`` down (``up=False``: a cut) or up again;
    every end is tried. Returns the errors (empty: all done)."""
    errors = []
    for a, b in pairs:
        for ns, dev in link_ends(topo, a, b, prefix):
            r = subprocess.run(["ip", "-n", ns, "link", "set", dev, "up" if up else "down"],
                               capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                errors.append(f"{ns} {dev}: {r.stderr.strip()}")
    return errors


def enter_netns(name: str) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {name}")
    finally:
        os.close(fd)


def run_in_netns(name: str, env: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    enter_netns(name)
    os.environ.update(env)
    target(*args)


def tbf_stats(p: Any, prefix: str, topo: Any) -> dict[str, int]:
    """Bytes each NIC's tbf sent (``tc -s``), by device."""
    out = {}
    for node in topo.nodes:
        for j, _ in enumerate(node.nics):
            dev = nic_device(prefix, node.id, j)
            r = subprocess.run(["ip", "netns", "exec", p.namespaces[node.id], "tc", "-s", "qdisc", "show", "dev", dev],
                               capture_output=True, text=True)
            words = r.stdout.split()
            out[dev] = int(words[words.index("Sent") + 1]) if "Sent" in words else 0
    return out

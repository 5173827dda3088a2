"""Kernel link emulation: network namespaces, veth pairs, bridges and ``tc`` per link.

Layout for a topology (``prefix`` keeps names unique, <= 15 characters each):

* one namespace per node, ``<prefix>n<id>``, and one switch namespace ``<prefix>sw`` holding
  one bridge per network;
* one veth pair per NIC: ``<prefix><id>v<j>`` in the node's namespace with the NIC's address
  (/24), its peer ``<prefix><id>s<j>`` attached to the network's bridge;
* egress shaping per destination on every NIC: an ``htb`` root, one class per peer reached
  over that NIC (u32 filter on the peer's address), under it ``netem`` for delay/jitter/loss
  when the link has any, and ``tbf`` for the rate.

Nodes then run inside their namespaces (``ip netns exec``). Needs root, ``ip`` and ``tc``;
delay, jitter and loss need the kernel's netem qdisc (sch_netem), rate only needs tbf/htb.
:func:`preflight` checks all of that first and names what is missing. Addresses must be
routable (not 127.x): generate the topology with ``p2psync topo ... --subnet 198.18.0.0/16``.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Mapping

from p2psync.errors import ConfigError, TransportError
from p2psync.topology import Topology
from p2psync.transport.shaping import LinkSpec

Cmd = list[str]


#: the names' prefix of the launcher's namespaces (``p2psync run TOPOLOGY --shaper netem``):
#: node K runs in ``p2pnK``; its NIC number j is ``p2pKvj`` there
DEFAULT_PREFIX = "p2p"
#: the environment variable that sets another prefix for the launcher's namespaces (namespace
#: names are global to the host: two such runs at once need two prefixes)
ENV_PREFIX = "P2PSYNC_NETNS_PREFIX"


def launcher_prefix() -> str:
    """The prefix of the launcher's namespaces: ``$P2PSYNC_NETNS_PREFIX`` or
    :data:`DEFAULT_PREFIX` (checked by :func:`plan`: 1-5 letters or digits)."""
    return os.environ.get(ENV_PREFIX) or DEFAULT_PREFIX


class NetemUnavailable(TransportError):
    """The machine cannot run the netem backend; the message says exactly why."""


@dataclass
class NetnsPlan:
    namespaces: dict[int, str]
    switch_ns: str
    up: list[Cmd] = field(default_factory=list)
    down: list[Cmd] = field(default_factory=list)
    needs_netem: bool = False

    def exec_prefix(self, node: int) -> Cmd:
        return ["ip", "netns", "exec", self.namespaces[node]]


def plan(topo: Topology, links: Mapping[tuple[int, int], LinkSpec], *, prefix: str = DEFAULT_PREFIX) -> NetnsPlan:
    """The commands that build (``up``) and remove (``down``) the emulated network. Pure."""
    if not prefix.isalnum() or not prefix.isascii() or len(prefix) > 5:
        raise ConfigError(f"netns prefix {prefix!r}: 1-5 letters or digits")
    for node in topo.nodes:
        for c in node.nics:
            addr = ipaddress.ip_address(c.address) if _is_ip(c.address) else None
            if addr is None or addr.is_loopback or addr.version != 4:
                raise ConfigError(f"netem needs routable IPv4 addresses, node {node.id} NIC {c.name} has "
                                  f"{c.address!r}; generate the topology with --subnet 198.18.0.0/16")
    ns = {n.id: f"{prefix}n{n.id}" for n in topo.nodes}
    sw = f"{prefix}sw"
    p = NetnsPlan(namespaces=ns, switch_ns=sw)
    p.up += [["ip", "netns", "add", sw], ["ip", "-n", sw, "link", "set", "lo", "up"]]
    bridges = {net.name: f"br{k}" for k, net in enumerate(topo.networks)}
    for br in bridges.values():
        p.up += [["ip", "-n", sw, "link", "add", br, "type", "bridge"], ["ip", "-n", sw, "link", "set", br, "up"]]
    for node in topo.nodes:
        me = ns[node.id]
        p.up += [["ip", "netns", "add", me], ["ip", "-n", me, "link", "set", "lo", "up"]]
        for j, nic in enumerate(node.nics):
            dev, peer = f"{prefix}{node.id}v{j}", f"{prefix}{node.id}s{j}"
            if len(dev) > 15 or len(peer) > 15:
                raise ConfigError("netns interface names too long: use a shorter prefix")
            p.up += [
                ["ip", "link", "add", dev, "netns", me, "type", "veth", "peer", "name", peer, "netns", sw],
                ["ip", "-n", me, "addr", "add", f"{nic.address}/24", "dev", dev],
                ["ip", "-n", me, "link", "set", dev, "up"],
                ["ip", "-n", sw, "link", "set", peer, "master", bridges[nic.network]],
                ["ip", "-n", sw, "link", "set", peer, "up"],
            ]
            p.up += _shaping(topo, links, node.id, nic.network, me, dev, p)
    p.down = [["ip", "netns", "del", n] for n in (*ns.values(), sw)]
    return p


def _shaping(topo: Topology, links: Mapping[tuple[int, int], LinkSpec], src: int, network: str,
             ns: str, dev: str, p: NetnsPlan) -> list[Cmd]:
    peers = [m for m in topo.members(network) if m != src]
    specs = [(m, links.get((src, m), LinkSpec())) for m in peers]
    specs = [(m, s) for m, s in specs if not s.trivial]
    if not specs:
        return []
    tc = ["ip", "netns", "exec", ns, "tc"]
    out: list[Cmd] = [tc + ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "999"],
                      tc + ["class", "add", "dev", dev, "parent", "1:", "classid", "1:999", "htb", "rate", "10gbit"]]
    for k, (m, s) in enumerate(specs, start=1):
        addr = next(c.address for c in topo.node(m).nics if c.network == network)
        out.append(tc + ["class", "add", "dev", dev, "parent", "1:", "classid", f"1:{k}", "htb", "rate", "10gbit"])
        out.append(tc + ["filter", "add", "dev", dev, "protocol", "ip", "parent", "1:", "prio", "1", "u32",
                         "match", "ip", "dst", f"{addr}/32", "flowid", f"1:{k}"])
        parent = f"1:{k}"
        if s.latency_s or s.jitter_s or s.loss:
            p.needs_netem = True
            netem = tc + ["qdisc", "add", "dev", dev, "parent", parent, "handle", f"{10 + k}:", "netem",
                          "delay", f"{s.latency_s * 1e3:.3f}ms"]
            if s.jitter_s:
                netem += [f"{s.jitter_s * 1e3:.3f}ms"]
            if s.loss:
                netem += ["loss", f"{s.loss * 100:.4f}%"]
            out.append(netem)
            parent = f"{10 + k}:"
        if s.bandwidth_bps:
            out.append(tc + ["qdisc", "add", "dev", dev, "parent", parent, "handle", f"{100 + k}:", "tbf",
                             "rate", f"{int(s.bandwidth_bps)}bit", "burst", "64kb", "latency", "400ms"])
    return out


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


#: seconds one ip / tc command may take
COMMAND_TIMEOUT = 30.0


def _run(cmd: Cmd) -> subprocess.CompletedProcess[str]:
    """Run one ip / tc command; a missing program or one past :data:`COMMAND_TIMEOUT` comes back
    as a failed result whose stderr says so (callers report it), never as an exception."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    except FileNotFoundError:
        return subprocess.CompletedProcess(cmd, 127, "", f"command not found: '{cmd[0]}' (package iproute2)")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 124, "", f"'{' '.join(cmd)}' timed out after {COMMAND_TIMEOUT:g} s")


def preflight(*, need_netem: bool) -> None:
    """Raise NetemUnavailable naming what is missing: root, ip/tc, namespaces, netem qdisc."""
    if os.geteuid() != 0:
        raise NetemUnavailable("the netem backend needs root (network namespaces and tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetemUnavailable(f"the netem backend needs the '{tool}' command (package iproute2)")
    probe = f"p2pprobe{os.getpid() % 100000}"
    r = _run(["ip", "netns", "add", probe])
    if r.returncode != 0:
        raise NetemUnavailable(f"cannot create a network namespace: {r.stderr.strip()}")
    try:
        kinds = ["tbf rate 1mbit burst 32kbit latency 50ms"] + (["netem delay 1ms"] if need_netem else [])
        for spec in kinds:
            r = _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", *spec.split()])
            if r.returncode != 0:
                qdisc = spec.split()[0]
                raise NetemUnavailable(
                    f"this kernel has no '{qdisc}' qdisc (module sch_{qdisc}): {r.stderr.strip()}; "
                    "use --shaper inproc here, or a kernel with sch_netem")
            _run(["ip", "netns", "exec", probe, "tc", "qdisc", "del", "dev", "lo", "root"])
    finally:
        _run(["ip", "netns", "del", probe])


def up(p: NetnsPlan) -> None:
    """Build the namespaces; on any failure, remove what was built and raise."""
    preflight(need_netem=p.needs_netem)
    for cmd in p.up:
        r = _run(cmd)
        if r.returncode != 0:
            down(p)
            raise NetemUnavailable(f"'{' '.join(cmd)}' failed: {r.stderr.strip()}")


def down(p: NetnsPlan) -> list[str]:
    """Remove every namespace of the plan (veths and bridges go with them). Returns errors."""
    errors = []
    for cmd in p.down:
        r = _run(cmd)
        if r.returncode != 0 and "No such file" not in r.stderr:
            errors.append(r.stderr.strip())
    return errors

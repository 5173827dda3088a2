"""Topology builders: ring, mesh, star, BCube and a mesh of groups. Pure.

Addresses: by default every NIC gets its own loopback address (127.0.1.1, 127.0.1.2, ...) on
one port, so a whole cluster runs on one host. With ``hosts`` (one per node, cycled), every
NIC of node i lives on ``hosts[i % len(hosts)]`` and the NICs sharing a host get consecutive
ports from ``base_port``, which makes files for multi-host runs.

BCube(alpha, beta) follows Canary §4.4.1 (after Guo et al.): ``alpha**beta`` nodes, ``beta``
levels; node ``i`` has digits ``d_l = (i // alpha**l) % alpha``; the level-l switch joins the
``alpha`` nodes that differ only in digit ``l``; each node has one NIC per level (``l0``,
``l1``, ...), and level-l traffic goes over NIC ``l``.

A mesh of groups (:func:`groups`) is G sites of S nodes each: a LAN switch per site joins its
nodes, and the site's gateways reach the other sites' gateways over WAN links; it is the one
builder that sets link attributes (LAN and WAN latency and bandwidth).
"""

from __future__ import annotations

import ipaddress
import math
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Sequence

from p2psync.errors import ConfigError
from p2psync.topology.io import loopback_address
from p2psync.topology.model import LinkAttrs, Network, Nic, Node, Topology

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class AddressPlan:
    base_port: int = DEFAULT_PORT
    hosts: tuple[str, ...] = ()
    #: e.g. "198.18.0.0/16": network k gets the /24 number k, member j the address .j+1
    #: (routable addresses for network namespaces: ``--shaper netem``)
    subnet: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.base_port <= 65535:
            raise ConfigError("base_port must be in 1..65535")
        if self.subnet is not None:
            net = ipaddress.ip_network(self.subnet, strict=False)
            if net.version != 4 or net.prefixlen > 16:
                raise ConfigError("--subnet must be an IPv4 network of /16 or larger")
        if self.subnet and self.hosts:
            raise ConfigError("--subnet and --hosts are exclusive")


class _Assembler:
    """Collects NICs per node and assigns addresses/ports from an :class:`AddressPlan`."""

    def __init__(self, n: int, plan: AddressPlan) -> None:
        self.n = n
        self.plan = plan
        self.nics: dict[int, list[tuple[str, str]]] = defaultdict(list)  # node -> [(nic, net)]
        self.networks: list[Network] = []

    def network(self, name: str, level: int | None = None) -> str:
        self.networks.append(Network(name=name, level=level))
        return name

    def attach(self, node: int, nic: str, network: str) -> None:
        self.nics[node].append((nic, network))

    def build(self, *, name: str, kind: str, params: dict[str, Any], coordinator: int = 0) -> Topology:
        nodes: list[Node] = []
        nic_index = 0
        host_ports: dict[str, int] = defaultdict(int)
        net_index = {n.name: k for k, n in enumerate(self.networks)}
        members: dict[str, int] = defaultdict(int)
        for i in range(self.n):
            nics: list[Nic] = []
            host = "localhost"
            for nic_name, net in self.nics[i]:
                if self.plan.subnet:
                    base = ipaddress.ip_network(self.plan.subnet, strict=False).network_address
                    k, members[net] = net_index[net], members[net] + 1
                    if k > 255 or members[net] > 254:
                        raise ConfigError("subnet plan: at most 256 networks of 254 members")
                    address = str(base + (k << 8) + members[net])
                    port = self.plan.base_port
                elif self.plan.hosts:
                    host = self.plan.hosts[i % len(self.plan.hosts)]
                    address = host
                    port = self.plan.base_port + host_ports[host]
                    host_ports[host] += 1
                    if port > 65535:
                        raise ConfigError("port range exhausted; use fewer nodes per host")
                else:
                    address = loopback_address(nic_index)
                    port = self.plan.base_port
                nic_index += 1
                nics.append(Nic(name=nic_name, address=address, port=port, network=net))
            nodes.append(Node(id=i, host=host, nics=tuple(nics)))
        return Topology(nodes=tuple(nodes), networks=tuple(self.networks), name=name, kind=kind,
                        coordinator=coordinator, params=params)


def _plan(base_port: int, hosts: Sequence[str] | None, subnet: str | None = None) -> AddressPlan:
    return AddressPlan(base_port=base_port, hosts=tuple(hosts or ()), subnet=subnet)


def ring(n: int, *, base_port: int = DEFAULT_PORT, hosts: Sequence[str] | None = None,
         subnet: str | None = None) -> Topology:
    """``n`` nodes in a ring of point-to-point links; node i's ``right`` NIC reaches i+1."""
    if n < 2:
        raise ConfigError("a ring needs at least 2 nodes")
    asm = _Assembler(n, _plan(base_port, hosts, subnet))
    edges = sorted({(min(i, (i + 1) % n), max(i, (i + 1) % n)) for i in range(n)})
    for a, b in edges:
        net = asm.network(f"ring-{a}-{b}")
        # the "right" NIC of a node goes to its successor in ring order
        if (a + 1) % n == b:
            asm.attach(a, "right", net)
            asm.attach(b, "left", net)
        else:
            asm.attach(b, "right", net)
            asm.attach(a, "left", net)
    return asm.build(name=f"ring-{n}", kind="ring", params={"n": n})


def mesh(n: int, *, base_port: int = DEFAULT_PORT, hosts: Sequence[str] | None = None,
         subnet: str | None = None) -> Topology:
    """``n`` nodes on one switch: everyone reaches everyone over its single NIC ``eth0``."""
    if n < 1:
        raise ConfigError("a mesh needs at least 1 node")
    asm = _Assembler(n, _plan(base_port, hosts, subnet))
    net = asm.network("mesh")
    for i in range(n):
        asm.attach(i, "eth0", net)
    return asm.build(name=f"mesh-{n}", kind="mesh", params={"n": n})


def star(n: int, *, base_port: int = DEFAULT_PORT, hosts: Sequence[str] | None = None,
         subnet: str | None = None) -> Topology:
    """Hub 0 with one link (and NIC ``leaf<k>``) to each leaf 1..n-1; leaves reach only the hub."""
    if n < 2:
        raise ConfigError("a star needs at least 2 nodes")
    asm = _Assembler(n, _plan(base_port, hosts, subnet))
    for leaf in range(1, n):
        net = asm.network(f"star-{leaf}")
        asm.attach(0, f"leaf{leaf}", net)
        asm.attach(leaf, "eth0", net)
    return asm.build(name=f"star-{n}", kind="star", params={"n": n, "hub": 0})


def bcube_digits(node: int, alpha: int, beta: int) -> tuple[int, ...]:
    """Digits (d_0, ..., d_{beta-1}) of ``node`` in base ``alpha``."""
    return tuple((node // alpha**level) % alpha for level in range(beta))


def bcube_switch(node: int, level: int, alpha: int, beta: int) -> int:
    """Index of the level-``level`` switch of ``node``: its digits without digit ``level``."""
    digits = bcube_digits(node, alpha, beta)
    rest = [d for i, d in enumerate(digits) if i != level]
    return sum(d * alpha**i for i, d in enumerate(rest))


def bcube(alpha: int, beta: int, *, base_port: int = DEFAULT_PORT,
          hosts: Sequence[str] | None = None, subnet: str | None = None) -> Topology:
    """BCube(alpha, beta): alpha**beta nodes, beta levels of alpha-port switches."""
    if alpha < 2 or beta < 1:
        raise ConfigError("bcube needs alpha >= 2 and beta >= 1")
    n = alpha**beta
    if n > 4096:
        raise ConfigError("bcube larger than 4096 nodes is not supported")
    asm = _Assembler(n, _plan(base_port, hosts, subnet))
    for level in range(beta):
        for s in range(alpha ** (beta - 1)):
            asm.network(f"bcube-l{level}-s{s}", level=level)
    for i in range(n):
        for level in range(beta):
            asm.attach(i, f"l{level}", f"bcube-l{level}-s{bcube_switch(i, level, alpha, beta)}")
    return asm.build(name=f"bcube-{alpha}x{beta}", kind="bcube", params={"alpha": alpha, "beta": beta})


def _latency(value: float, name: str) -> float:
    """``value`` as a float when it is a finite number >= 0, else a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"must be a finite number >= 0 (ms), got {value!r}", field=name)
    return float(value)


def _bandwidth(value: float | None, name: str) -> float | None:
    """None (unlimited), or ``value`` as a float when it is a finite number > 0, else a
    ConfigError naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"must be a finite number > 0 (Mb/s) or None, got {value!r}", field=name)
    return float(value)


def groups(g: int, s: int, *, gateways: int = 1, lan_ms: float = 0.2, wan_ms: float = 20.0,
           lan_mbps: float | None = 10_000.0, wan_mbps: float | None = 1_000.0,
           base_port: int = DEFAULT_PORT, hosts: Sequence[str] | None = None,
           subnet: str | None = None) -> Topology:
    """A mesh of groups: ``g`` groups (sites) of ``s`` nodes, ``g * s`` nodes in all.

    Group ``k`` holds the contiguous ids ``k*s .. k*s + s - 1``; its nodes share the LAN switch
    ``group-<k>`` over their NIC ``lan`` (every pair of them adjacent). Its ``gateways`` lowest
    ids are its gateways: gateway ``j`` (id ``k*s + j``) has a second NIC ``wan`` on the WAN
    network ``wan-<j>``, which joins gateway ``j`` of every group, so each gateway is adjacent
    to the same-rank gateway of every other group and traffic between groups relays
    member -> gateway -> gateway -> member. Adjacent pairs: ``g*s*(s-1)/2`` on the LANs plus
    ``gateways * g*(g-1)/2`` on the WANs.

    Link attributes: :attr:`Topology.default_link` is the LAN (``lan_ms`` one way, ``lan_mbps``),
    and every WAN pair is in :attr:`Topology.links` (``wan_ms``, ``wan_mbps``); a bandwidth of
    None is unlimited (``link(a, b)`` of two nodes that are not adjacent is the LAN too, and
    means nothing). The LAN networks have level 0, the WAN ones level 1. ``params`` records every argument but the addresses. ConfigError naming
    the argument when ``g`` < 1, ``s`` < 1, ``g * s`` < 2, ``gateways`` is not in 1..``s``, a
    latency is not a finite number >= 0 or a bandwidth is not None nor a finite number > 0.
    """
    for value, name in ((g, "g"), (s, "s"), (gateways, "gateways")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"must be an integer, got {value!r}", field=name)
    if g < 1:
        raise ConfigError(f"a mesh of groups needs at least 1 group, got {g}", field="g")
    if s < 1:
        raise ConfigError(f"a group needs at least 1 node, got {s}", field="s")
    if g * s < 2:
        raise ConfigError("a mesh of groups needs at least 2 nodes (g * s >= 2)", field="s")
    if not 1 <= gateways <= s:
        raise ConfigError(f"must be in 1..s ({s}), got {gateways}", field="gateways")
    lan = LinkAttrs(latency_ms=_latency(lan_ms, "lan_ms"), bandwidth_mbps=_bandwidth(lan_mbps, "lan_mbps"))
    wan = LinkAttrs(latency_ms=_latency(wan_ms, "wan_ms"), bandwidth_mbps=_bandwidth(wan_mbps, "wan_mbps"))
    n = g * s
    asm = _Assembler(n, _plan(base_port, hosts, subnet))
    for k in range(g):
        net = asm.network(f"group-{k}", level=0)
        for i in range(k * s, (k + 1) * s):
            asm.attach(i, "lan", net)
    links: dict[tuple[int, int], LinkAttrs] = {}
    if g > 1:
        for j in range(gateways):
            net = asm.network(f"wan-{j}", level=1)
            for k in range(g):
                asm.attach(k * s + j, "wan", net)
                links.update({(h * s + j, k * s + j): wan for h in range(k)})
    topo = asm.build(name=f"groups-{g}x{s}", kind="groups",
                     params={"groups": g, "size": s, "gateways": gateways, "lan_ms": lan.latency_ms,
                             "wan_ms": wan.latency_ms, "lan_mbps": lan.bandwidth_mbps,
                             "wan_mbps": wan.bandwidth_mbps})
    return replace(topo, links=links, default_link=lan)


def group_of(node: int, s: int) -> int:
    """The group of ``node`` in a mesh of groups of ``s`` nodes each (:func:`groups`)."""
    return node // s


def is_gateway(node: int, s: int, gateways: int = 1) -> bool:
    """Whether ``node`` is a gateway in a mesh of groups of ``s`` nodes with ``gateways``
    gateways per group (:func:`groups`: the lowest ids of each group)."""
    return node % s < gateways


BUILDERS = {"ring": ring, "mesh": mesh, "star": star}

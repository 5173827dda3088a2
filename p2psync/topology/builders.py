"""Topology builders: ring, mesh, star and BCube. Pure.

Addresses: by default every NIC gets its own loopback address (127.0.1.1, 127.0.1.2, ...) on
one port, so a whole cluster runs on one host. With ``hosts`` (one per node, cycled), every
NIC of node i lives on ``hosts[i % len(hosts)]`` and the NICs sharing a host get consecutive
ports from ``base_port``, which makes files for multi-host runs.

BCube(alpha, beta) follows Canary §4.4.1 (after Guo et al.): ``alpha**beta`` nodes, ``beta``
levels; node ``i`` has digits ``d_l = (i // alpha**l) % alpha``; the level-l switch joins the
``alpha`` nodes that differ only in digit ``l``; each node has one NIC per level (``l0``,
``l1``, ...), and level-l traffic goes over NIC ``l``.
"""

from __future__ import annotations

import ipaddress
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

from p2psync.errors import ConfigError
from p2psync.topology.io import loopback_address
from p2psync.topology.model import Network, Nic, Node, Topology

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


BUILDERS = {"ring": ring, "mesh": mesh, "star": star}

"""Topology model: nodes, their NICs, the networks (switches) that join NICs, link attributes.

Pure data. Two nodes are *adjacent* when one NIC of each sits on the same network; traffic
between them goes over those NICs. Link attributes (latency, jitter, bandwidth) are looked up
per unordered node pair and are used by link shaping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping


@dataclass(frozen=True)
class Nic:
    """One network interface of a node: its name (``eth0``), the address and port its ROUTER
    socket binds, and the network (switch) it sits on."""

    name: str
    address: str
    port: int
    network: str

    @property
    def endpoint(self) -> str:
        """The ZeroMQ endpoint ``tcp://address:port``; transport/zmq_endpoint.py binds and
        connects to it (``s.bind(nic.endpoint)``)."""
        return f"tcp://{self.address}:{self.port}"


@dataclass(frozen=True)
class Node:
    """One node (one process) of the topology: its id, its NICs, the host it runs on and, in a
    keyed cluster, its public key. Example: ``topology.node(node_id).nics``."""

    id: int
    nics: tuple[Nic, ...]
    host: str = "localhost"
    #: the node's CurveZMQ public key (Z85, 40 characters) in a keyed cluster, else None
    #: (``p2psync keys gen`` writes them; the secret keys never appear in a topology)
    curve_public: str | None = None

    def nic(self, name: str) -> Nic:
        """The NIC called ``name`` (KeyError when the node has none)."""
        for n in self.nics:
            if n.name == name:
                return n
        raise KeyError(f"node {self.id} has no NIC {name!r}")


@dataclass(frozen=True)
class Network:
    """A switch or link joining NICs: two nodes with a NIC on the same network are adjacent."""

    name: str
    #: BCube level (or any grouping level); None for plain switches/links
    level: int | None = None


@dataclass(frozen=True)
class LinkAttrs:
    """What the link between two nodes is like (for link shaping): one-way latency and jitter
    in ms, bandwidth in Mb/s (None: unlimited), loss probability in [0, 1). Looked up with
    :meth:`Topology.link`; transport/shaping.py turns it into a ``LinkSpec.from_attrs``."""

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_mbps: float | None = None
    loss: float = 0.0


@dataclass(frozen=True)
class Route:
    """How ``src`` reaches adjacent ``dst`` on one network: the local and the remote NIC."""

    network: str
    local_nic: str
    remote_nic: str


@dataclass(frozen=True, eq=False)
class Topology:
    """A cluster: its nodes, the networks joining their NICs, per-pair link attributes, the
    node that coordinates first, and the builder's name, kind and parameters.

    Loaded from JSON by :func:`~p2psync.topology.io.load` (or built by
    :mod:`~p2psync.topology.builders`); every layer above reads it, e.g. ssgd via
    ``self.ctx.topology``, transport/base.py: ``self.node = topology.node(node_id)``.
    """

    nodes: tuple[Node, ...]
    networks: tuple[Network, ...]
    name: str = "custom"
    kind: str = "custom"
    coordinator: int = 0
    params: Mapping[str, Any] = field(default_factory=dict)
    links: Mapping[tuple[int, int], LinkAttrs] = field(default_factory=dict)
    default_link: LinkAttrs = field(default_factory=LinkAttrs)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    # -- lookups -------------------------------------------------------------------------

    @cached_property
    def _by_id(self) -> dict[int, Node]:
        return {n.id: n for n in self.nodes}

    @property
    def ids(self) -> list[int]:
        """Every node id, sorted."""
        return sorted(self._by_id)

    def has(self, node_id: int) -> bool:
        """Is ``node_id`` a node of this topology (a dict lookup: the transport asks on every send)?"""
        return node_id in self._by_id

    @property
    def size(self) -> int:
        """The number of nodes (N); e.g. asgd.py: ``1.0 / self.ctx.topology.size``."""
        return len(self.nodes)

    @property
    def keyed(self) -> bool:
        """Every node has a CurveZMQ public key: the cluster authenticates its peers."""
        return all(n.curve_public is not None for n in self.nodes)

    @cached_property
    def node_by_key(self) -> dict[str, int]:
        """Z85 public key -> node id (empty for a cluster without keys)."""
        return {n.curve_public: n.id for n in self.nodes if n.curve_public is not None}

    def node(self, node_id: int) -> Node:
        """The node with id ``node_id`` (KeyError naming the topology when there is none)."""
        try:
            return self._by_id[node_id]
        except KeyError:
            raise KeyError(f"no node {node_id} in topology {self.name!r}") from None

    @cached_property
    def _members(self) -> dict[str, list[tuple[int, str]]]:
        out: dict[str, list[tuple[int, str]]] = {n.name: [] for n in self.networks}
        for node in self.nodes:
            for nic in node.nics:
                out.setdefault(nic.network, []).append((node.id, nic.name))
        return out

    def members(self, network: str) -> list[int]:
        """Node ids with a NIC on ``network``."""
        return sorted({nid for nid, _ in self._members.get(network, [])})

    def network(self, name: str) -> Network:
        """The network called ``name`` (KeyError when there is none)."""
        for n in self.networks:
            if n.name == name:
                return n
        raise KeyError(f"no network {name!r}")

    @cached_property
    def _routes(self) -> dict[tuple[int, int], tuple[Route, ...]]:
        out: dict[tuple[int, int], list[Route]] = {}
        for net, mem in self._members.items():
            for a, a_nic in mem:
                for b, b_nic in mem:
                    if a != b:
                        out.setdefault((a, b), []).append(Route(net, a_nic, b_nic))
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def _adjacent(self) -> dict[int, list[int]]:
        """Node id -> its neighbours, sorted: built once, in time linear in the pairs of
        nodes that share a network (a ring's validation never scans every route per node)."""
        out: dict[int, set[int]] = {n.id: set() for n in self.nodes}
        for mem in self._members.values():
            ids = {nid for nid, _ in mem}
            if len(ids) > 1:
                for a in ids:
                    out[a].update(ids)
        return {k: sorted(v - {k}) for k, v in out.items()}

    def adjacent(self, a: int, b: int) -> bool:
        """Do ``a`` and ``b`` share a network (is there a route between them)?"""
        return a != b and b in self._adjacent.get(a, ())

    def routes(self, src: int, dst: int) -> tuple[Route, ...]:
        """Every direct way from ``src`` to ``dst`` (empty when they are not adjacent)."""
        return self._routes.get((src, dst), ())

    def neighbors(self, node_id: int) -> list[int]:
        """The nodes adjacent to ``node_id`` (sharing a network with it), sorted; e.g.
        regroup.py picks a joiner's donors among ``ctx.topology.neighbors(me)``."""
        return list(self._adjacent.get(node_id, ()))

    def neighbors_on(self, node_id: int, nic: str) -> list[int]:
        """The other nodes on the network of ``node_id``'s NIC ``nic``."""
        net = self.node(node_id).nic(nic).network
        return [m for m in self.members(net) if m != node_id]

    def degree(self, node_id: int) -> int:
        """The number of nodes adjacent to ``node_id``."""
        return len(self._adjacent.get(node_id, ()))

    def link(self, a: int, b: int) -> LinkAttrs:
        """The attributes of the link between ``a`` and ``b`` (either order), else
        :attr:`default_link`; e.g. transport/shaping.py: ``LinkSpec.from_attrs(topo.link(node_id, dst))``."""
        return self.links.get((min(a, b), max(a, b)), self.default_link)

    def lonely(self) -> list[int]:
        """The nodes that share no network with any other node (in node order; empty for a
        single node). Linear in the NICs."""
        if len(self.nodes) < 2:
            return []
        crowded = {net for net, mem in self._members.items() if len({nid for nid, _ in mem}) > 1}
        return [n.id for n in self.nodes if not any(nic.network in crowded for nic in n.nics)]

    def is_connected(self) -> bool:
        """Every node reaches every other one through adjacent nodes (topology/io.py refuses
        a topology that is not). A walk over nodes and networks: linear in the NICs, even
        when one switch joins every node."""
        if not self.nodes:
            return True
        seen = {self.nodes[0].id}
        nets_seen: set[str] = set()
        todo = [self.nodes[0].id]
        while todo:
            for nic in self._by_id[todo.pop()].nics:
                if nic.network in nets_seen:
                    continue
                nets_seen.add(nic.network)
                for nb, _ in self._members.get(nic.network, ()):
                    if nb not in seen:
                        seen.add(nb)
                        todo.append(nb)
        return len(seen) == len(self.nodes)

"""Topology JSON: load, validate (every error names its field), save. Pure.

File format (version 1)::

    {"version": 1, "name": "ring-4", "kind": "ring", "params": {"n": 4},
     "coordinator": 0,
     "networks": [{"name": "ring-0-1", "level": null}, ...],
     "nodes": [{"id": 0, "host": "localhost",
                "nics": [{"name": "eth0", "address": "127.0.1.1", "port": 29500,
                          "network": "ring-0-1"}, ...],
                "curve_public": "<40 Z85 characters>"}, ...],
     "default_link": {"latency_ms": 0, "jitter_ms": 0, "bandwidth_mbps": null, "loss": 0},
     "links": [{"a": 0, "b": 1, "latency_ms": 50.0, ...}],
     "metadata": {}}

``curve_public`` (optional, all nodes or none): the node's CurveZMQ public key, written by
``p2psync keys gen``; a topology with keys is a keyed cluster (see :mod:`p2psync.transport.keys`).
"""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import json
import math
import re
from pathlib import Path
from typing import AbstractSet, Any, Iterator, Mapping

from p2psync.errors import ConfigError, translate
from p2psync.topology.model import LinkAttrs, Network, Nic, Node, Topology

FORMAT_VERSION = 1
_TOP_KEYS = {"version", "name", "kind", "params", "coordinator", "networks", "nodes", "links",
             "default_link", "metadata"}
_LINK_KEYS = {"latency_ms", "jitter_ms", "bandwidth_mbps", "loss"}
#: a CurveZMQ key in Z85: 40 characters of the Z85 alphabet
_NIC_KEYS = frozenset({"name", "address", "port", "network"})
_NETWORK_KEYS = frozenset({"name", "level"})
_NODE_KEYS = frozenset({"id", "host", "nics", "curve_public"})
#: what a name or an address may not hold (one C scan instead of a Python loop per character)
_SPACE = re.compile(r"\s")
_BAD_ADDRESS = re.compile(r"[\s/:]")
_Z85_KEY = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")


def _req(obj: Mapping[str, Any], key: str, typ: type | tuple[type, ...], path: str) -> Any:
    try:
        value = obj[key]
    except KeyError:
        raise ConfigError("missing", field=f"{path}.{key}" if path else key) from None
    if type(value) is typ:  # the common case, without building the field's name
        return value
    return _typed(value, typ, f"{path}.{key}" if path else key)


def _typed(value: Any, typ: type | tuple[type, ...], path: str) -> Any:
    if type(value) is typ:  # exactly the type asked for (a bool is never exactly an int)
        return value
    ok = isinstance(value, typ) and not (isinstance(value, bool) and typ in (int, (int, float)))
    if not ok:
        names = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise ConfigError(f"expected {names}, got {type(value).__name__}", field=path)
    return value


def _no_extra(obj: Mapping[str, Any], allowed: AbstractSet[str], path: str) -> None:
    if obj.keys() <= allowed:
        return
    extra = sorted(set(obj) - allowed)
    raise ConfigError(f"unknown key {extra[0]!r}", field=path or "<root>")


def _name(value: Any, path: str) -> str:
    text: str = _typed(value, str, path)
    if not text or len(text) > 64 or _SPACE.search(text):
        raise ConfigError("must be 1-64 characters without spaces", field=path)
    return text


def _link_attrs(obj: Any, path: str, extra: set[str] = frozenset()) -> LinkAttrs:  # type: ignore[assignment]
    _typed(obj, dict, path)
    _no_extra(obj, _LINK_KEYS | set(extra), path)
    vals: dict[str, Any] = {}
    for key in _LINK_KEYS:
        if key not in obj or (key == "bandwidth_mbps" and obj[key] is None):
            continue
        v = _typed(obj[key], (int, float), f"{path}.{key}")
        if not math.isfinite(v) or v < 0 or (key == "bandwidth_mbps" and v == 0):
            raise ConfigError("must be a finite number >= 0 (bandwidth > 0)", field=f"{path}.{key}")
        if key == "loss" and v >= 1:
            raise ConfigError("must be in [0, 1)", field=f"{path}.{key}")
        vals[key] = float(v)
    return LinkAttrs(**vals)



def _nic(obj: Any, path: str, networks: Mapping[str, int]) -> Nic:
    """The NIC ``obj`` describes, or the ConfigError naming its first bad field."""
    _typed(obj, dict, path)
    _no_extra(obj, _NIC_KEYS, path)
    name = _name(_req(obj, "name", str, path), f"{path}.name")
    address = _req(obj, "address", str, path)
    if not address or len(address) > 253 or _BAD_ADDRESS.search(address):
        raise ConfigError(f"bad address {address!r}", field=f"{path}.address")
    port = _req(obj, "port", int, path)
    if not 1 <= port <= 65535:
        raise ConfigError(f"port {port} out of range 1-65535", field=f"{path}.port")
    network = _req(obj, "network", str, path)
    if network not in networks:
        raise ConfigError(f"unknown network {network!r}", field=f"{path}.network")
    return Nic(name=name, address=address, port=port, network=network)


def _nic_fast(obj: Any, node: int, index: int, networks: Mapping[str, int]) -> Nic:
    """:func:`_nic` for ``nodes[node].nics[index]``: a valid NIC passes a few exact type and
    range checks (no field names built: a topology has one NIC per link end, and a large one
    must load in time linear in them with a small constant); anything else goes through
    :func:`_nic` for its precise error."""
    if type(obj) is dict and obj.keys() <= _NIC_KEYS:
        name, address, port, network = obj.get("name"), obj.get("address"), obj.get("port"), obj.get("network")
        if (type(name) is str and 0 < len(name) <= 64 and not _SPACE.search(name)
                and type(address) is str and 0 < len(address) <= 253 and not _BAD_ADDRESS.search(address)
                and type(port) is int and 1 <= port <= 65535 and type(network) is str and network in networks):
            return Nic(name=name, address=address, port=port, network=network)
    return _nic(obj, f"nodes[{node}].nics[{index}]", networks)


def _check_keys(nodes: list[Node]) -> None:
    """Public keys: on every node or on none, and no key twice."""
    keyed = [i for i, n in enumerate(nodes) if n.curve_public is not None]
    if keyed and len(keyed) != len(nodes):
        missing = next(i for i, n in enumerate(nodes) if n.curve_public is None)
        raise ConfigError("missing: every node of a keyed cluster needs a public key "
                          "(p2psync keys gen)", field=f"nodes[{missing}].curve_public")
    seen: dict[str, int] = {}
    for i in keyed:
        key = nodes[i].curve_public or ""
        if key in seen:
            raise ConfigError(f"duplicate of nodes[{seen[key]}].curve_public", field=f"nodes[{i}].curve_public")
        seen[key] = i


def topology_from_dict(doc: Any) -> Topology:
    """Validate a parsed JSON document and build a :class:`Topology`."""
    _typed(doc, dict, "<root>")
    _no_extra(doc, _TOP_KEYS, "")
    version = _req(doc, "version", int, "")
    if version != FORMAT_VERSION:
        raise ConfigError(f"unsupported version {version} (expected {FORMAT_VERSION})", field="version")
    name = _name(doc.get("name", "custom"), "name")
    kind = _name(doc.get("kind", "custom"), "kind")
    params = _typed(doc.get("params", {}), dict, "params")
    metadata = _typed(doc.get("metadata", {}), dict, "metadata")

    nets_raw = _req(doc, "networks", list, "")
    networks: list[Network] = []
    seen_nets: dict[str, int] = {}
    for i, n in enumerate(nets_raw):
        p = f"networks[{i}]"
        _typed(n, dict, p)
        _no_extra(n, _NETWORK_KEYS, p)
        nname = _req(n, "name", str, p)
        if not nname or len(nname) > 64 or _SPACE.search(nname):
            _name(nname, f"{p}.name")
        if nname in seen_nets:
            raise ConfigError(f"duplicate of networks[{seen_nets[nname]}]", field=f"{p}.name")
        seen_nets[nname] = i
        level = n.get("level")
        if level is not None:
            _typed(level, int, f"{p}.level")
        networks.append(Network(name=nname, level=level))

    nodes_raw = _req(doc, "nodes", list, "")
    if not nodes_raw:
        raise ConfigError("at least one node is required", field="nodes")
    nodes: list[Node] = []
    ids: dict[int, int] = {}
    endpoints: dict[tuple[str, int], tuple[int, int]] = {}  # -> (node index, NIC index)
    for i, n in enumerate(nodes_raw):
        p = f"nodes[{i}]"
        _typed(n, dict, p)
        _no_extra(n, _NODE_KEYS, p)
        nid = _req(n, "id", int, p)
        if nid < 0 or nid > (1 << 20) - 1:
            raise ConfigError("must be in 0..1048575", field=f"{p}.id")
        if nid in ids:
            raise ConfigError(f"duplicate of nodes[{ids[nid]}].id", field=f"{p}.id")
        ids[nid] = i
        host = n.get("host", "localhost")
        if type(host) is not str:
            _typed(host, str, f"{p}.host")
        nics_raw = _req(n, "nics", list, p)
        if not nics_raw:
            raise ConfigError("a node needs at least one NIC", field=f"{p}.nics")
        nics: list[Nic] = []
        nic_names: dict[str, int] = {}
        for j, raw in enumerate(nics_raw):
            nic = _nic_fast(raw, i, j, seen_nets)
            if nic.name in nic_names:
                raise ConfigError(f"duplicate of {p}.nics[{nic_names[nic.name]}]",
                                  field=f"{p}.nics[{j}].name")
            nic_names[nic.name] = j
            where = (nic.address, nic.port)
            if where in endpoints:
                ni, nj = endpoints[where]
                raise ConfigError(f"duplicate of nodes[{ni}].nics[{nj}] ({nic.address}:{nic.port})",
                                  field=f"{p}.nics[{j}].port")
            endpoints[where] = (i, j)
            nics.append(nic)
        key = n.get("curve_public")
        if key is not None and (not isinstance(key, str) or not _Z85_KEY.match(key)):
            raise ConfigError("must be a CurveZMQ public key: 40 Z85 characters (p2psync keys gen)",
                              field=f"{p}.curve_public")
        nodes.append(Node(id=nid, host=host, nics=tuple(nics), curve_public=key))

    _check_keys(nodes)
    coordinator = doc.get("coordinator", min(ids))
    _typed(coordinator, int, "coordinator")
    if coordinator not in ids:
        raise ConfigError(f"no node with id {coordinator}", field="coordinator")

    default_link = _link_attrs(doc.get("default_link", {}), "default_link")
    links: dict[tuple[int, int], LinkAttrs] = {}
    for i, raw in enumerate(_typed(doc.get("links", []), list, "links")):
        p = f"links[{i}]"
        _typed(raw, dict, p)
        a = _req(raw, "a", int, p)
        b = _req(raw, "b", int, p)
        for key, v in (("a", a), ("b", b)):
            if v not in ids:
                raise ConfigError(f"no node with id {v}", field=f"{p}.{key}")
        if a == b:
            raise ConfigError("a link joins two different nodes", field=f"{p}.b")
        pair = (min(a, b), max(a, b))
        if pair in links:
            raise ConfigError(f"duplicate link {pair}", field=p)
        links[pair] = _link_attrs({k: v for k, v in raw.items() if k not in ("a", "b")}, p)

    topo = Topology(nodes=tuple(nodes), networks=tuple(networks), name=name, kind=kind,
                    coordinator=coordinator, params=params, links=links,
                    default_link=default_link, metadata=metadata)
    lonely = topo.lonely()
    if lonely:
        raise ConfigError(f"node {lonely[0]} shares no network with any other node",
                          field=f"nodes[{ids[lonely[0]]}].nics")
    if not topo.is_connected():
        raise ConfigError("the nodes do not form one connected cluster", field="nodes")
    for i, link in enumerate(doc.get("links", [])):
        if not topo.adjacent(link["a"], link["b"]):
            raise ConfigError(f"nodes {link['a']} and {link['b']} share no network", field=f"links[{i}]")
    return topo


def topology_to_dict(topo: Topology) -> dict[str, Any]:
    """The JSON document of ``topo`` (format version 1, see the module docstring); the inverse
    of :func:`topology_from_dict`. api/runtime.py hashes it into the run id."""
    def link_dict(la: LinkAttrs) -> dict[str, Any]:
        return {"latency_ms": la.latency_ms, "jitter_ms": la.jitter_ms,
                "bandwidth_mbps": la.bandwidth_mbps, "loss": la.loss}

    return {
        "version": FORMAT_VERSION,
        "name": topo.name,
        "kind": topo.kind,
        "params": dict(topo.params),
        "coordinator": topo.coordinator,
        "networks": [{"name": n.name, "level": n.level} for n in topo.networks],
        "nodes": [
            {"id": n.id, "host": n.host,
             "nics": [{"name": c.name, "address": c.address, "port": c.port, "network": c.network}
                      for c in n.nics],
             **({"curve_public": n.curve_public} if n.curve_public is not None else {})}
            for n in topo.nodes
        ],
        "default_link": link_dict(topo.default_link),
        "links": [{"a": a, "b": b, **link_dict(la)} for (a, b), la in sorted(topo.links.items())],
        "metadata": dict(topo.metadata),
    }


def dumps(topo: Topology) -> str:
    """``topo`` as indented JSON text; ``p2psync topo`` prints it: ``sys.stdout.write(dumps(topo))``."""
    return json.dumps(topology_to_dict(topo), indent=2) + "\n"


def loads(text: str, *, source: str = "<string>") -> Topology:
    """Parse and validate topology JSON text; ConfigError prefixed with ``source`` (the file
    name) and naming the bad field."""
    with _collector_paused():
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
        try:
            return topology_from_dict(doc)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (if it was on). Parsing and
    validating a topology allocates a few objects per NIC and frees none of them, and the
    collector's passes over that growing heap cost a large topology (30 000 nodes) about as
    much as the validation itself; the document and the topology hold no cycles."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load(path: str | Path) -> Topology:
    """Read and validate the topology file ``path`` (ConfigError when unreadable or invalid).
    Example, cli/builtin_job.py: ``topo = load(cfg.topology)``."""
    p = Path(path)
    with translate({OSError: lambda e: ConfigError(f"cannot read topology {p}: {e.strerror}")}):
        text = p.read_text()
    return loads(text, source=str(p))


def save(topo: Topology, path: str | Path) -> None:
    """Write ``topo`` to ``path`` as JSON (:func:`dumps`); ``p2psync topo -o FILE`` and
    ``p2psync keys`` use it. A file that cannot be written is a ConfigError naming it and why."""
    p = Path(path)
    with translate({OSError: lambda e: ConfigError(f"cannot write topology {p}: {e.strerror or e}")}):
        p.write_text(dumps(topo))


def loopback_address(index: int) -> str:
    """The ``index``-th distinct loopback address: 127.0.1.1, 127.0.1.2, ... (skipping .0/.255)."""
    if index < 0 or index >= 254 * 254 * 254:
        raise ConfigError("loopback address pool exhausted")
    a, rest = divmod(index, 254 * 254)
    b, c = divmod(rest, 254)
    return str(ipaddress.IPv4Address(f"127.{a}.{b + 1}.{c + 1}"))

"""``p2psync topo``: build or check a topology file."""

from __future__ import annotations

import argparse
import sys

from p2psync.errors import ConfigError
from p2psync.topology import bcube, dumps, groups, load, mesh, ring, save, star
from p2psync.topology.builders import DEFAULT_PORT


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("topo", help="write a ring/mesh/star/bcube/groups topology, or check a file",
                       description="Write a topology JSON file (stdout unless -o), or check one.")
    tsub = p.add_subparsers(dest="topo_kind", required=True, metavar="KIND")
    for kind, helptext in (("ring", "n nodes in a ring of point-to-point links"),
                           ("mesh", "n nodes on one switch"),
                           ("star", "hub 0 linked to n-1 leaves")):
        k = tsub.add_parser(kind, help=helptext)
        k.add_argument("-n", "--nodes", type=int, required=True, help="number of nodes")
        _common(k)
    b = tsub.add_parser("bcube", help="BCube(alpha, beta): alpha**beta nodes, one NIC per level")
    b.add_argument("--alpha", type=int, required=True, help="switch port count (>= 2)")
    b.add_argument("--beta", type=int, required=True, help="number of levels (>= 1)")
    _common(b)
    g = tsub.add_parser("groups", help="a mesh of groups: G groups of S nodes, a LAN switch per group, WAN links "
                                       "between the groups' gateways (their lowest ids)")
    g.add_argument("--groups", type=int, required=True, help="number of groups G (>= 1)")
    g.add_argument("--size", type=int, required=True, help="nodes per group S (>= 1; G * S >= 2)")
    g.add_argument("--gateways", type=int, default=1, help="gateways per group, 1..S (default 1)")
    g.add_argument("--lan-ms", type=float, default=0.2, help="one-way LAN latency in ms (default 0.2)")
    g.add_argument("--wan-ms", type=float, default=20.0, help="one-way WAN latency in ms (default 20)")
    g.add_argument("--lan-mbps", type=float, default=10_000.0, help="LAN bandwidth in Mb/s (default 10000)")
    g.add_argument("--wan-mbps", type=float, default=1_000.0, help="WAN bandwidth in Mb/s (default 1000)")
    _common(g)
    c = tsub.add_parser("check", help="validate a topology file and print a summary")
    c.add_argument("file")
    p.set_defaults(func=run)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-port", type=int, default=DEFAULT_PORT,
                   help=f"port of every NIC on loopback, first port per host with --hosts (default {DEFAULT_PORT})")
    p.add_argument("--hosts", default="",
                   help="comma-separated host addresses, one per node (cycled) for multi-host files; "
                        "default: a distinct loopback address per NIC")
    p.add_argument("--subnet", help="give network k the /24 number k of this IPv4 network "
                   "(e.g. 198.18.0.0/16): routable addresses for --shaper netem namespaces")
    p.add_argument("--coordinator", type=int, default=0, help="coordinator node id (default 0)")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")


def run(args: argparse.Namespace) -> int:
    if args.topo_kind == "check":
        topo = load(args.file)
        print(f"{args.file}: {topo.name} ({topo.kind}), {topo.size} nodes, "
              f"{len(topo.networks)} networks, coordinator {topo.coordinator}: OK")
        return 0
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    kw = {"base_port": args.base_port, "hosts": hosts, "subnet": args.subnet}
    if args.topo_kind == "bcube":
        topo = bcube(args.alpha, args.beta, **kw)
    elif args.topo_kind == "groups":
        try:
            topo = groups(args.groups, args.size, gateways=args.gateways, lan_ms=args.lan_ms, wan_ms=args.wan_ms,
                          lan_mbps=args.lan_mbps, wan_mbps=args.wan_mbps, **kw)
        except ConfigError as exc:  # name the option, not the builder's argument
            if exc.field is None:
                raise
            option = {"g": "groups", "s": "size"}.get(exc.field, exc.field).replace("_", "-")
            raise ConfigError(str(exc).removeprefix(f"{exc.field}: "), field=f"--{option}") from None
    else:
        topo = {"ring": ring, "mesh": mesh, "star": star}[args.topo_kind](args.nodes, **kw)
    if args.coordinator not in topo.ids:
        raise ConfigError(f"--coordinator {args.coordinator}: no such node")
    if args.coordinator != topo.coordinator:
        from dataclasses import replace
        topo = replace(topo, coordinator=args.coordinator)
    if args.output:
        save(topo, args.output)
        print(f"wrote {args.output}: {topo.size} nodes", file=sys.stderr)
    else:
        sys.stdout.write(dumps(topo))
    return 0

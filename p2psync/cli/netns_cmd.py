"""``p2psync netns up|down TOPOLOGY``: build or remove the kernel-emulated network."""

from __future__ import annotations

import argparse
import sys

from p2psync.topology import Topology, load
from p2psync.transport import netem
from p2psync.transport.shaping import LinkSpec, load_wan_profile


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("netns", help="build/remove network namespaces + tc shaping for a topology",
                       description="One namespace per node, a veth per NIC, a bridge per network, "
                                   "tc netem/tbf per link (root; netem qdisc for delay).")
    p.add_argument("action", choices=("up", "down"))
    p.add_argument("topology")
    p.add_argument("--wan", metavar="PROFILE.json", help="link delays from a WAN profile")
    p.add_argument("--prefix", default="p2p", help="name prefix for namespaces and interfaces")
    p.set_defaults(func=run)


def link_specs(topo: Topology, wan: str | None) -> dict[tuple[int, int], LinkSpec]:
    if wan:
        return load_wan_profile(wan, topo)
    return {(a, b): LinkSpec.from_attrs(topo.link(a, b)) for a in topo.ids for b in topo.ids if a != b}


def run(args: argparse.Namespace) -> int:
    topo = load(args.topology)
    plan = netem.plan(topo, link_specs(topo, args.wan), prefix=args.prefix)
    try:
        if args.action == "up":
            netem.up(plan)
            print(f"netns up: {', '.join(plan.namespaces.values())} (+ {plan.switch_ns})")
        else:
            errors = netem.down(plan)
            for e in errors:
                print(f"netns down: {e}", file=sys.stderr)
            return 1 if errors else 0
    except netem.NetemUnavailable as exc:
        print(f"p2psync netns: {exc}", file=sys.stderr)
        return 1
    return 0

"""``p2psync sim``: every node of a topology running the real membership in virtual time, with
faults, checked against the invariants; writes ``summary.json``.

Only membership runs (rendezvous, heartbeats, failure detection, failover, views): no model,
no strategy. TOPOLOGY is a topology file or a generated one (``ring:16``, ``mesh:64``,
``star:8``, ``bcube:4x3``). The exit code is 0 when every invariant held, 1 otherwise. The
simulated nodes' own logs are shown with ``-v`` only. ``summary.json`` carries ``replay``, the
command that runs the same events again (``digest`` is their hash).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

from p2psync.cli.exit_codes import EXIT_FAILED, EXIT_OK
from p2psync.errors import ConfigError
from p2psync.files import write_atomic
from p2psync.topology import Topology, bcube, load, mesh, ring, star



def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sim", help="simulate the membership of every node of a topology in virtual time",
                       description="Run the real membership (heartbeats, failure detection, failover, views) of "
                                   "every node of TOPOLOGY in one process over the in-memory transport, on a "
                                   "virtual clock, with faults; check the invariants and write summary.json. "
                                   "Exit code 0 when every invariant held, 1 when one did not.")
    p.add_argument("topology", help="a topology file, or ring:N, mesh:N, star:N, bcube:AxB")
    p.add_argument("--seed", type=int, default=0, help="seed of the drawn faults (--faults random:N)")
    p.add_argument("--faults", default="",
                   help="comma list: kill:17@30, pause:5@40+15, partition:0-7|8-15@60+20 (times in virtual "
                        "seconds after the rendezvous; let the last one end a few detection times before "
                        "the end, or one_view_at_end cannot hold), or random:N (N faults drawn from --seed)")
    p.add_argument("--virtual-seconds", type=float, default=60.0, help="virtual seconds to run (default 60)")
    p.add_argument("--latency-ms", type=float, default=1.0,
                   help="one-way latency of every link in ms (default 1; -1: the topology's link attributes)")
    p.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat interval in seconds (default 0.5)")
    p.add_argument("--failure-timeout", type=float, default=2.0,
                   help="least silence before a node is declared failed, seconds (default 2)")
    p.add_argument("--out", default=".", help="folder for summary.json (default: here)")
    p.set_defaults(func=run)


def topology_arg(text: str) -> Topology:
    """A generated topology (``ring:16``, ``mesh:64``, ``star:8``, ``bcube:4x3``) or a file."""
    m = re.fullmatch(r"(ring|mesh|star):(\d+)", text)
    if m is not None:
        return {"ring": ring, "mesh": mesh, "star": star}[m.group(1)](int(m.group(2)))
    m = re.fullmatch(r"bcube:(\d+)x(\d+)", text)
    if m is not None:
        return bcube(int(m.group(1)), int(m.group(2)))
    if not Path(text).exists():
        raise ConfigError(f"{text}: no such topology file, nor ring:N, mesh:N, star:N, bcube:AxB")
    return load(text)


def run(args: argparse.Namespace) -> int:
    from p2psync.sim.cluster import SimCluster, SimOptions, detection_bound
    from p2psync.sim.faults import draw, parse_faults
    from p2psync.sim.loop import VirtualLoop
    from p2psync.sim.loop import run as run_virtual

    if not args.verbose:  # every simulated node logs each failure it sees: with -v only
        logging.getLogger("p2psync").setLevel(logging.CRITICAL)
    if not args.virtual_seconds > 0:
        raise ConfigError("--virtual-seconds must be > 0")
    topo = topology_arg(args.topology)
    m = re.fullmatch(r"random:(\d+)", args.faults.strip())
    opts = SimOptions(heartbeat=args.heartbeat, failure_timeout=args.failure_timeout,
                      latency_s=None if args.latency_ms < 0 else args.latency_ms / 1e3)
    # drawn faults are over four detection bounds before the end: the views can settle
    settle = 4 * detection_bound(topo, opts)
    faults = (draw(random.Random(args.seed), topo.ids, int(m.group(1)), start=5.0,
                   end=max(5.0, args.virtual_seconds - settle))
              if m is not None else parse_faults(args.faults, topo.ids))

    async def main() -> dict[str, Any]:
        async with SimCluster(topo, opts=opts, faults=faults) as cluster:
            return await cluster.run(args.virtual_seconds)

    wall = time.perf_counter()
    loop = VirtualLoop()
    summary = run_virtual(main(), loop=loop)
    summary["wall_s"] = round(time.perf_counter() - wall, 3)  # the close of every node included
    summary["seed"] = args.seed
    summary["events"] = loop.steps
    summary["digest"] = loop.digest()
    summary["replay"] = (f"p2psync sim {args.topology} --seed {args.seed} --faults "
                         f"'{','.join(f.spec() for f in faults)}' --virtual-seconds {args.virtual_seconds:g} "
                         f"--latency-ms {args.latency_ms:g} --heartbeat {args.heartbeat:g} "
                         f"--failure-timeout {args.failure_timeout:g}")
    out = Path(args.out) / "summary.json"
    try:
        write_atomic(out, lambda f: f.write(json.dumps(summary, indent=2).encode()), mode=0o644)
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror}") from None
    broken = {k: v for k, v in summary["invariants"].items() if v != "held"}
    print(f"p2psync sim {topo.name}: {summary['nodes']} nodes, {args.virtual_seconds:g} virtual s in "
          f"{summary['wall_s']:.2f} wall s, {summary['events']} events, {len(faults)} faults; "
          + ("every invariant held" if not broken else f"{len(broken)} invariant(s) violated") + f"; {out}")
    for name, why in broken.items():
        print(f"  {name}: {why}", file=sys.stderr)
    return EXIT_OK if not broken else EXIT_FAILED

"""``p2psync sim``: every node of a topology running the real membership in virtual time, with
faults, checked against the invariants; writes ``summary.json``.

Without ``--strategy`` only membership runs (rendezvous, heartbeats, failure detection,
failover, views): no model, no strategy. With ``--strategy S`` every node also runs the
strategy's real step logic and collectives over the in-memory transport, on a tiny model whose
iterations take ``--step-time`` virtual seconds (:mod:`p2psync.sim.training`); the summary
then carries each node's outcome, steps and model hash, and two more invariants
(``strategy_finished``, ``same_model_at_end``: ``not promised`` where the strategy promises
no single model, which is said, and is no violation). TOPOLOGY is a topology file or a
generated one (``ring:16``, ``mesh:64``, ``star:8``, ``bcube:4x3``). The exit code is 0 when
every invariant held, 1 otherwise. The simulated nodes' own logs are shown with ``-v`` only.
``summary.json`` carries ``replay``, the command that runs the same events again (``digest`` is
their hash).

``--runs N`` is the seeded chaos runner (:mod:`p2psync.sim.chaos`): N runs with faults drawn
from seeds ``--seed`` .. ``--seed + N - 1``, a markdown table of the runs and of the violations
per invariant, and, for every failing run, the command that replays it exactly.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from p2psync.cli.exit_codes import EXIT_FAILED, EXIT_OK
from p2psync.errors import ConfigError
from p2psync.files import write_atomic
from p2psync.topology import Topology, bcube, groups, load, mesh, ring, star



def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sim", help="simulate the membership of every node of a topology in virtual time",
                       description="Run the real membership (heartbeats, failure detection, failover, views) of "
                                   "every node of TOPOLOGY in one process over the in-memory transport, on a "
                                   "virtual clock, with faults; check the invariants and write summary.json. "
                                   "Exit code 0 when every invariant held, 1 when one did not.")
    p.add_argument("topology", help="a topology file, or ring:N, mesh:N, star:N, bcube:AxB, groups:GxS "
                                    "(G groups of S nodes: a LAN per group, WAN links between the groups' gateways)")
    p.add_argument("--seed", type=int, default=0, help="seed of the drawn faults (--faults random:N)")
    p.add_argument("--faults", default="",
                   help="comma list: kill:17@30, restart:17@50 (a new process of node 17 joins; a running one "
                        "is killed first), pause:5@40+15, partition:0-7|8-15@60+20, slow:3-4@10+30x10 (every "
                        "link of nodes 3 and 4 ten times its latency for 30 s; slow:3|4@... only the links "
                        "between the two sides) (times in virtual seconds after the rendezvous; let the last "
                        "one end a few detection times before the end, or one_view_at_end cannot hold), or "
                        "random:N (N faults drawn from --seed)")
    p.add_argument("--virtual-seconds", type=float, default=60.0, help="virtual seconds to run (default 60)")
    p.add_argument("--latency-ms", type=float, default=1.0,
                   help="one-way latency of every link in ms (default 1; -1: the topology's link attributes, "
                        "e.g. groups:GxS's LAN and WAN latencies)")
    p.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat interval in seconds (default 0.5)")
    p.add_argument("--failure-timeout", type=float, default=2.0,
                   help="least silence before a node is declared failed, seconds (default 2)")
    p.add_argument("--runs", type=int, default=None,
                   help="chaos: N runs, run i with seed --seed + i and --faults random:K drawn from it (TOPOLOGY may "
                        "be a comma list, taken in turn); prints a table and each failing run's replay command, "
                        "writes chaos.md and chaos.json")
    p.add_argument("--overlap", action="store_true",
                   help="with --runs: draw faults that may overlap (default: one after another, two detection "
                        "bounds apart, as the invariants judge each fault alone)")
    p.add_argument("--strategy", default=None,
                   help="every node also trains with this strategy (simulated: ssgd, esync, dts, diloco, asgd, "
                        "preduce, bsp, asp, ssp, dssp, elastic_bsp), on a tiny model, until the virtual seconds "
                        "are over and the strategy agrees "
                        "to stop; with --runs a comma list (ssgd,asgd,...): taken in turn, every topology with "
                        "every strategy")
    p.add_argument("--step-time", default="0.1", metavar="SECONDS[,NODE:SECONDS...]",
                   help="with --strategy: virtual seconds of compute per local iteration (default 0.1), "
                        "optionally per node (0.1,3:0.5)")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="with --strategy: every node also wants to stop after N steps, as p2psync run --steps "
                        "(the strategies that plan their stop from the budget do; the virtual seconds still end "
                        "a run that has not reached it)")
    p.add_argument("--opt", action="append", default=[], metavar="NAME=VALUE",
                   help="with --strategy: a strategy option (repeatable), as p2psync run --opt")
    p.add_argument("--spread-floor", type=int, default=None, metavar="BYTES",
                   help="with --strategy: the smallest piece (bytes) a collective cuts the model into to spread "
                        "it over the members (default 4096: the tiny model in one piece, cheap at thousands of "
                        "nodes; 0: every member owns a piece, as in a real run)")
    p.add_argument("--out", default=".", help="folder for summary.json (default: here)")
    p.set_defaults(func=run)


def topology_arg(text: str) -> Topology:
    """A generated topology (``ring:16``, ``mesh:64``, ``star:8``, ``bcube:4x3``, ``groups:8x8``:
    :func:`~p2psync.topology.builders.groups` with its default LAN/WAN attributes) or a file;
    ConfigError when ``text`` is neither."""
    m = re.fullmatch(r"(ring|mesh|star):(\d+)", text)
    if m is not None:
        return {"ring": ring, "mesh": mesh, "star": star}[m.group(1)](int(m.group(2)))
    m = re.fullmatch(r"bcube:(\d+)x(\d+)", text)
    if m is not None:
        return bcube(int(m.group(1)), int(m.group(2)))
    m = re.fullmatch(r"groups:(\d+)x(\d+)", text)
    if m is not None:
        return groups(int(m.group(1)), int(m.group(2)))
    if not Path(text).exists():
        raise ConfigError(f"{text}: no such topology file, nor ring:N, mesh:N, star:N, bcube:AxB, groups:GxS")
    return load(text)


def _replay(args: argparse.Namespace, topology: str, seed: int, faults: Sequence[Any],
            training: Any = None) -> str:
    """The command that runs the same events as a run of ``topology`` with ``faults`` (and
    ``training``, a :class:`~p2psync.sim.training.TrainingSpec`)."""
    return (f"p2psync sim {topology} --seed {seed} --faults '{','.join(f.spec() for f in faults)}' "
            f"--virtual-seconds {args.virtual_seconds:g} --latency-ms {args.latency_ms:g} "
            f"--heartbeat {args.heartbeat:g} --failure-timeout {args.failure_timeout:g}"
            + (f" --spread-floor {args.spread_floor}" if args.spread_floor is not None else "")
            + (f" {training.args()}" if training is not None else ""))


def _training(args: argparse.Namespace) -> Any:
    """The :class:`~p2psync.sim.training.TrainingSpec` of each strategy of ``--strategy`` (a comma list:
    one per strategy, with ``--runs`` only), ``--step-time`` and ``--opt`` (None without
    ``--strategy``); ConfigError for a bad one, for ``--step-time`` or ``--opt`` without
    ``--strategy``, or for ``--opt`` with several strategies."""
    from p2psync.sim.training import TrainingSpec, parse_step_time

    if args.strategy is None:
        if args.opt or args.step_time != "0.1" or args.steps is not None:
            raise ConfigError("--step-time, --steps and --opt need --strategy")
        return None
    names = [n.strip() for n in args.strategy.split(",") if n.strip()]
    if len(names) != 1:
        if args.runs is None or not names:
            raise ConfigError(f"--strategy {args.strategy!r}: one strategy, or a comma list of them with --runs")
        if args.opt:
            raise ConfigError("--opt names one strategy's options: give one --strategy with it")
    options: dict[str, str] = {}
    for item in args.opt:
        if "=" not in item:
            raise ConfigError(f"--opt {item!r}: expected NAME=VALUE")
        k, v = item.split("=", 1)
        options[k.strip()] = v.strip()
    step, per = parse_step_time(args.step_time)
    specs = [TrainingSpec(strategy=n, step_time=step, step_times=per, options=options, seed=args.seed,
                          steps=args.steps) for n in names]
    return specs if len(specs) > 1 else specs[0]


def _write(out: Path, text: str) -> None:
    try:
        write_atomic(out, lambda f: f.write(text.encode()), mode=0o644)
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror}") from None


def run(args: argparse.Namespace) -> int:
    """``p2psync sim``: one simulated run, or ``--runs`` of them; the level of the ``p2psync``
    logger is restored afterwards (the command may run inside another program, or a test)."""
    from p2psync.sim.loop import quiet_logs

    with quiet_logs(not args.verbose):  # every simulated node logs each failure it sees: with -v only
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from p2psync.sim.chaos import draw_faults, simulate
    from p2psync.sim.cluster import SimOptions
    from p2psync.sim.faults import parse_faults
    from p2psync.sim.invariants import NOT_PROMISED, violated

    if not args.virtual_seconds > 0:
        raise ConfigError("--virtual-seconds must be > 0")
    if args.spread_floor is not None and args.spread_floor < 0:
        raise ConfigError("--spread-floor must be a number of bytes >= 0")
    opts = SimOptions(heartbeat=args.heartbeat, failure_timeout=args.failure_timeout,
                      latency_s=None if args.latency_ms < 0 else args.latency_ms / 1e3,
                      **({} if args.spread_floor is None else {"spread_floor_bytes": args.spread_floor}))
    m = re.fullmatch(r"random:(\d+)", args.faults.strip())
    training = _training(args)
    if args.runs is not None:
        return _chaos(args, opts, int(m.group(1)) if m is not None else -1, training)
    topo = topology_arg(args.topology)
    faults = (draw_faults(topo, opts, args.seed, int(m.group(1)), args.virtual_seconds)
              if m is not None else parse_faults(args.faults, topo.ids))
    summary = simulate(topo, faults, opts, args.virtual_seconds, training)
    summary["seed"] = args.seed
    summary["replay"] = _replay(args, args.topology, args.seed, faults, training)
    out = Path(args.out) / "summary.json"
    _write(out, json.dumps(summary, indent=2))
    broken = {k: v for k, v in summary["invariants"].items() if violated(v)}
    unproven = {k: v for k, v in summary["invariants"].items() if v != "held" and not violated(v)}
    print(f"p2psync sim {topo.name}: {summary['nodes']} nodes, {args.virtual_seconds:g} virtual s in "
          f"{summary['wall_s']:.2f} wall s, {summary['events']} events, {len(faults)} faults"
          f"{_trained(summary)}; "
          + ("every invariant held" if not broken and not unproven else
             f"{len(broken)} invariant(s) violated" if broken else "every invariant that applies held")
          + f"; {out}")
    for name, why in unproven.items():  # said, not hidden: nothing was proven
        print(f"  {name}: {NOT_PROMISED.upper()}{why[len(NOT_PROMISED):]}" if why.startswith(NOT_PROMISED)
              else f"  {name}: {why}", file=sys.stderr)
    for name, why in broken.items():
        print(f"  {name}: {why}", file=sys.stderr)
    return EXIT_OK if not broken else EXIT_FAILED


def _trained(summary: dict[str, Any]) -> str:
    """``; ssgd: 7 of 8 nodes finished at step 40`` for a run that trained, else ``""``."""
    t = summary.get("training")
    if t is None:
        return ""
    out = f"; {t['strategy']}: {t['finished']} of {summary['nodes']} nodes finished"
    if t["steps"] is not None:
        lo, hi = t["steps"]["min"], t["steps"]["max"]
        out += f" at {t['unit']} {lo}" + (f"..{hi}" if hi != lo else "")
    return out


def _chaos(args: argparse.Namespace, opts: Any, count: int, training: Any = None) -> int:
    """``--runs N``: N runs of drawn faults (:func:`p2psync.sim.chaos.chaos`); writes
    ``chaos.json`` and ``chaos.md`` and prints the table and each failing run's replay."""
    from p2psync.sim.chaos import ChaosRun, chaos, table

    if args.runs < 1:
        raise ConfigError("--runs must be >= 1")
    if count < 0:
        raise ConfigError("--runs draws its faults: give --faults random:K (K faults per run)")
    topos = [(t, topology_arg(t)) for t in args.topology.split(",") if t]

    out = Path(args.out)
    done: list[ChaosRun] = []

    def save(runs: list[ChaosRun]) -> str:
        report = table(runs)
        _write(out / "chaos.md", report)
        _write(out / "chaos.json", json.dumps([{"topology": r.topology, "strategy": r.strategy or None,
                                                "seed": r.seed, "faults": list(r.faults),
                                                "broken": r.broken, "wall_s": r.wall_s, "events": r.events,
                                                "digest": r.digest, "replay": r.replay} for r in runs], indent=2))
        return report

    def progress(r: ChaosRun) -> None:
        done.append(r)
        save(done)  # after every run: an interrupted series keeps its table
        if r.broken:
            print(f"seed {r.seed} ({r.topology}{', ' + r.strategy if r.strategy else ''}): "
                  f"{', '.join(sorted(r.broken))} violated; replay: {r.replay}",
                  file=sys.stderr)
            for name, why in sorted(r.broken.items()):
                print(f"  {name}: {why[:600]}", file=sys.stderr)

    runs = chaos(topos, runs=args.runs, seed=args.seed, count=count, virtual_seconds=args.virtual_seconds,
                 opts=opts, replay=lambda t, s, f, spec: _replay(args, t, s, f, spec),
                 progress=progress, overlap=args.overlap, training=training)
    print(save(runs), end="")
    return EXIT_OK if not any(r.broken for r in runs) else EXIT_FAILED

"""Seeded chaos: many simulated runs, each with faults drawn from its own seed, and what broke.

:func:`simulate` runs one :class:`~p2psync.sim.cluster.SimCluster` on a fresh
:class:`~p2psync.sim.loop.VirtualLoop` and returns its summary with the event count and
digest (the same topology, options, faults and seconds give the same events). :func:`chaos`
runs ``runs`` of them: run ``i`` takes the ``i``-th topology of a list (round robin) and seed
``seed + i``, draws ``count`` faults from that seed (:func:`draw_faults`, as ``--faults
random:N`` does), and records whether every invariant held, or which did not (a run that
raised is recorded as ``crashed``). With several trainings (strategies), run ``i`` of ``T``
topologies and ``S`` trainings takes training ``(i // T) % S``: every ``T * S`` runs cover every
pair. :func:`table` is the markdown report: one line per failing run with the command that
replays it, the violations counted per invariant, and the runs per strategy.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from p2psync.errors import P2PSyncError
from p2psync.sim.cluster import SimCluster, SimOptions, detection_bound
from p2psync.sim.faults import Fault, draw
from p2psync.sim.invariants import violated
from p2psync.sim.loop import VirtualLoop, sparse_gc
from p2psync.sim.loop import run as run_virtual
from p2psync.sim.training import TrainingCluster, TrainingSpec
from p2psync.topology import Topology

#: drawn faults start this many virtual seconds after the rendezvous
FAULTS_FROM_S = 5.0
#: the invariant name a run that raised is counted under
CRASHED = "crashed"


def draw_faults(topo: Topology, opts: SimOptions, seed: int, count: int, virtual_seconds: float, *,
                spaced: bool = False) -> list[Fault]:
    """``count`` faults drawn from ``seed`` (:func:`p2psync.sim.faults.draw`), over before
    the last four detection bounds of the run: the views can settle before it ends.
    ``spaced``: one after another, two detection bounds apart at least (the invariants judge
    each fault alone: a fault during another's failover is not covered by them)."""
    bound = detection_bound(topo, opts)
    return draw(random.Random(seed), topo.ids, count, start=FAULTS_FROM_S,
                end=max(FAULTS_FROM_S, virtual_seconds - 4 * bound), gap=2 * bound if spaced else None)


def simulate(topo: Topology, faults: Sequence[Fault], opts: SimOptions, virtual_seconds: float,
             training: TrainingSpec | None = None) -> dict[str, Any]:
    """One simulated run's summary (:meth:`SimCluster.run`; with ``training``, every node
    also runs its strategy: :class:`~p2psync.sim.training.TrainingCluster`) with ``wall_s``
    counting the close of every node, ``events`` (callbacks run) and ``digest`` (their hash)."""
    async def main() -> dict[str, Any]:
        cluster = (SimCluster(topo, opts=opts, faults=faults) if training is None
                   else TrainingCluster(topo, training=training, opts=opts, faults=faults))
        async with cluster:
            return await cluster.run(virtual_seconds)

    wall = time.perf_counter()
    loop = VirtualLoop()
    with sparse_gc():
        summary = run_virtual(main(), loop=loop)
    summary["wall_s"] = round(time.perf_counter() - wall, 3)
    summary["events"] = loop.steps
    summary["digest"] = loop.digest()
    return summary


@dataclass(frozen=True)
class ChaosRun:
    """One run of :func:`chaos`: its topology (as given), seed, faults, the invariants that did
    not hold (name -> why; empty: every one held), wall seconds, events, digest and the
    command that replays it."""

    topology: str
    seed: int
    faults: tuple[str, ...]
    broken: dict[str, str] = field(default_factory=dict)
    #: the strategy every node trained ("": membership only)
    strategy: str = ""
    wall_s: float = 0.0
    events: int = 0
    digest: str = ""
    replay: str = ""


def chaos(topologies: Sequence[tuple[str, Topology]], *, runs: int, seed: int, count: int,
          virtual_seconds: float, opts: SimOptions,
          replay: Callable[[str, int, Sequence[Fault], TrainingSpec | None], str],
          progress: Callable[[ChaosRun], None] | None = None, overlap: bool = False,
          training: TrainingSpec | Sequence[TrainingSpec] | None = None) -> list[ChaosRun]:
    """``runs`` simulated runs (see the module docstring); ``topologies``: (text, topology)
    pairs taken in turn; ``replay(text, seed, faults, training)``: the command that replays one run;
    ``progress`` is called after each. The faults of a run come one after another
    (:func:`draw_faults` ``spaced``) unless ``overlap``; with ``training`` every node runs
    its strategy too (:func:`simulate`), its gradients drawn from the run's seed (a restarted
    node joins the training: :mod:`p2psync.sim.training`); several trainings are taken as the
    module docstring says."""
    trainings: list[TrainingSpec | None] = (
        [None] if training is None else [training] if isinstance(training, TrainingSpec) else list(training))
    if runs < 1 or not topologies or not trainings:
        raise ValueError("chaos needs at least one run, one topology and one training (or None)")
    out: list[ChaosRun] = []
    for i in range(runs):
        text, topo = topologies[i % len(topologies)]
        spec = trainings[(i // len(topologies)) % len(trainings)]
        s = seed + i
        faults = draw_faults(topo, opts, s, count, virtual_seconds, spaced=not overlap)
        specs = tuple(f.spec() for f in faults)
        run_spec = None if spec is None else replace(spec, seed=s)
        cmd = replay(text, s, faults, run_spec)
        name = "" if spec is None else spec.strategy
        wall = time.perf_counter()
        try:
            summary = simulate(topo, faults, opts, virtual_seconds, run_spec)
        except P2PSyncError as exc:
            run = ChaosRun(topology=text, seed=s, faults=specs, broken={CRASHED: f"{type(exc).__name__}: {exc}"[:500]},
                           strategy=name, wall_s=round(time.perf_counter() - wall, 3), replay=cmd)
        else:
            broken = {k: v for k, v in summary["invariants"].items() if violated(v)}
            run = ChaosRun(topology=text, seed=s, faults=specs, broken=broken, strategy=name,
                           wall_s=summary["wall_s"], events=summary["events"], digest=summary["digest"], replay=cmd)
        out.append(run)
        if progress is not None:
            progress(run)
    return out


def table(runs: Sequence[ChaosRun]) -> str:
    """The markdown report of :func:`chaos`'s runs (see the module docstring)."""
    bad = [r for r in runs if r.broken]
    names: dict[str, int] = {}
    for r in bad:
        for k in r.broken:
            names[k] = names.get(k, 0) + 1
    wall = sum(r.wall_s for r in runs)
    topos = sorted({r.topology for r in runs})
    lines = [
        "| runs | topologies | seeds | every invariant held | violated | wall s (sum) | wall s (slowest) |",
        "|---|---|---|---|---|---|---|",
        f"| {len(runs)} | {', '.join(topos)} | {min(r.seed for r in runs)}..{max(r.seed for r in runs)} | "
        f"{len(runs) - len(bad)} | {len(bad)} | {wall:.1f} | {max(r.wall_s for r in runs):.2f} |",
        "",
        "| invariant | runs violating it |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in sorted(names.items())] or ["| (none) | 0 |"]
    strategies = sorted({r.strategy for r in runs if r.strategy})
    if strategies:
        lines += ["", "| strategy | runs | every invariant held | wall s (sum) |", "|---|---|---|---|"]
        for name in strategies:
            mine = [r for r in runs if r.strategy == name]
            lines.append(f"| {name} | {len(mine)} | {sum(not r.broken for r in mine)} | "
                         f"{sum(r.wall_s for r in mine):.1f} |")
    if bad:
        lines += ["", "| seed | topology | strategy | faults | violated | replay |", "|---|---|---|---|---|---|"]
        lines += [f"| {r.seed} | {r.topology} | {r.strategy or '-'} | `{','.join(r.faults)}` | "
                  f"{', '.join(sorted(r.broken))} | `{r.replay}` |" for r in bad]
    return "\n".join(lines) + "\n"


__all__ = ["CRASHED", "ChaosRun", "FAULTS_FROM_S", "chaos", "draw_faults", "simulate", "table"]

"""Heterogeneous-device emulation: per-node slowdown profiles. Pure.

A profile turns the measured compute time of a step into the time the step should take on the
emulated device; the difference is padded on the node's compute thread, so the emulated device
is busy for the whole step (nothing else the node runs on its device, such as applying a
gradient or reading the parameters, can start before the step ends), in one of two modes
(``--slowdown-mode``):

* ``wait`` (default): the compute thread *waits* for the pad, leaving the CPU free, so eight
  slow nodes fit on two cores;
* ``compute``: the compute thread does real extra work (matrix products) for the pad, so the
  emulated slowness also costs CPU, memory bandwidth and the GIL like a real slow device. Use it
  to check claims that waiting could flatter. On a host with fewer cores than nodes, a node
  that waits hands its core to the others, so they run faster than their devices would.
* ``quota``: no pad; the node's whole process is capped at ``share / factor`` CPU cores
  (:mod:`p2psync.training.cpu_quota`, a control group of its own; ``share`` so that all the
  nodes' caps fit in 90 % of the host's cores), so a slow device really computes every step at a
  lower rate, and no node's idle time speeds up another: separate devices of different speeds
  on one host. Needs write access to the CPU controller (root); constant factors and schedules
  only (``--step-time`` and ``--step-jitter`` describe padded step times).

The pad of ``wait`` and ``compute`` can be cut short by an abort (ESync abandoning an
iteration).

* constant factor: ``--slowdown 0:1,1:1,2:2,3:8`` (node 3 is 8x slower);
* schedule: ``--slowdown-schedule 2:30:4`` (node 2 becomes 4x slower 30 s into training;
  several entries per node allowed);
* fixed emulated step time: ``--step-time 0:0.05,3:0.4`` (a step takes exactly that long, or
  its real time if longer) for deterministic runs;
* jitter: ``--step-jitter 0.2`` makes every node's emulated step time vary by up to +-20 %
  (uniform, drawn per step from the node's seed, so runs stay repeatable): the natural
  variation of real devices, which barrier placement (ElasticBSP) and grouping (P-Reduce)
  react to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, get_args

from p2psync.errors import ConfigError, translate
from p2psync.topology import Topology

SlowdownMode = Literal["wait", "compute", "quota"]
SLOWDOWN_MODES: tuple[str, ...] = get_args(SlowdownMode)


@dataclass(frozen=True)
class Slowdown:
    factor: float = 1.0
    #: (after seconds, factor) changes, sorted by time
    schedule: tuple[tuple[float, float], ...] = ()
    step_time: float | None = None
    mode: SlowdownMode = "wait"
    #: the emulated step time is multiplied by ``1 + jitter * u``, ``u`` uniform in [-1, 1]
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in SLOWDOWN_MODES:
            raise ConfigError(f"--slowdown-mode {self.mode!r}: choose from {', '.join(SLOWDOWN_MODES)}")
        if self.factor < 1 or any(f < 1 or t < 0 for t, f in self.schedule):
            raise ConfigError("slowdown factors must be >= 1 and schedule times >= 0")
        if self.step_time is not None and self.step_time <= 0:
            raise ConfigError("--step-time must be > 0")
        if not 0.0 <= self.jitter < 1.0:
            raise ConfigError(f"--step-jitter must be in [0, 1), got {self.jitter}")
        if self.mode == "quota" and (self.step_time is not None or self.jitter):
            raise ConfigError("--slowdown-mode quota caps the CPU a node computes with: it takes --slowdown and "
                              "--slowdown-schedule, not --step-time or --step-jitter (padded step times: use "
                              "--slowdown-mode wait or compute)")

    def factor_at(self, elapsed: float) -> float:
        f = self.factor
        for t, g in self.schedule:
            if elapsed >= t:
                f = g
        return f

    def pad(self, compute_s: float, elapsed: float, u: float = 0.0) -> float:
        """Seconds to wait after a step whose real compute took ``compute_s``; ``u`` in [-1, 1]
        draws the jitter (a step cannot take less than its real compute)."""
        if self.mode == "quota":  # the CPU quota slows the compute itself
            return 0.0
        f = self.factor_at(elapsed) * (1.0 + self.jitter * u)
        if self.step_time is not None:
            return max(0.0, self.step_time * f - compute_s)
        return max(0.0, (f - 1.0) * compute_s)

    @property
    def fastest(self) -> float:
        """The smallest factor this device has at any time of the run."""
        return min([self.factor, *(f for _, f in self.schedule)])

    @property
    def trivial(self) -> bool:
        return self.factor == 1 and not self.schedule and self.step_time is None and self.jitter == 0


def _pairs(text: str, what: str, parts: int) -> list[list[str]]:
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        fields = item.split(":")
        if len(fields) != parts:
            raise ConfigError(f"--{what} {item!r}: expected {':'.join(['X'] * parts)}")
        out.append(fields)
    return out


def parse_profiles(slowdown: str = "", schedule: str = "", step_time: str = "",
                   mode: str = "wait", jitter: float = 0.0) -> dict[int, Slowdown]:
    """Profiles per node id from the CLI option strings (nodes not named get
    :func:`default_profile`)."""
    if mode not in SLOWDOWN_MODES:
        raise ConfigError(f"--slowdown-mode {mode!r}: choose from {', '.join(SLOWDOWN_MODES)}")
    with translate({ValueError: lambda e: ConfigError(f"bad slowdown profile: {e}")}):
        factors = {int(n): float(f) for n, f in _pairs(slowdown, "slowdown", 2)}
        steps = {int(n): float(s) for n, s in _pairs(step_time, "step-time", 2)}
        sched: dict[int, list[tuple[float, float]]] = {}
        for n, t, f in _pairs(schedule, "slowdown-schedule", 3):
            sched.setdefault(int(n), []).append((float(t), float(f)))
    nodes = set(factors) | set(steps) | set(sched)
    default_profile(mode, jitter)  # validate
    return {n: Slowdown(factor=factors.get(n, 1.0), schedule=tuple(sorted(sched.get(n, []))),
                        step_time=steps.get(n), mode=mode, jitter=jitter)  # type: ignore[arg-type]
            for n in nodes}


def fastest_on_host(profiles: Mapping[int, Slowdown], topo: Topology, node_id: int) -> dict[int, float]:
    """The nodes on ``node_id``'s host (the topology's ``host``) and each one's smallest
    slowdown factor over the run: what the CPU shares of ``--slowdown-mode quota`` divide."""
    host = topo.node(node_id).host
    return {n: profiles[n].fastest if n in profiles else 1.0 for n in topo.ids if topo.node(n).host == host}


def default_profile(mode: str = "wait", jitter: float = 0.0) -> Slowdown:
    """The profile of a node no option names: its own speed, with the run's jitter."""
    return Slowdown(mode=mode, jitter=jitter)  # type: ignore[arg-type]

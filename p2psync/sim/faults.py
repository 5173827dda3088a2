"""Faults of a simulated run and their text form. Pure.

``kill:17@30`` kills node 17 at virtual second 30 (for good); ``pause:5@40+15`` stops node 5
at 40 for 15 seconds, as ``SIGSTOP`` / ``SIGCONT`` would; ``partition:0-7|8-15@60+20`` cuts
every link between nodes 0..7 and 8..15 at 60 for 20 seconds (a side may list ranges and
single ids joined by ``.``: ``0-3.9|4-8``; the second side may be left out: every other node).
A list is comma-separated. ``random:N`` draws N faults from a seed (:func:`draw`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal, Sequence

from p2psync.errors import ConfigError

FaultKind = Literal["kill", "pause", "partition"]


@dataclass(frozen=True)
class Fault:
    """One fault: ``nodes`` are killed or paused, or are one side of a partition whose other
    side is ``other``; it starts ``at`` (virtual seconds) and lasts ``duration`` (None: for
    good, a kill)."""

    kind: FaultKind
    at: float
    nodes: tuple[int, ...]
    duration: float | None = None
    other: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.at < 0:
            raise ConfigError(f"fault {self.spec()}: a time must be >= 0")
        if not self.nodes:
            raise ConfigError(f"fault {self.kind}@{self.at:g}: names no node")
        if self.kind == "kill" and self.duration is not None:
            raise ConfigError(f"fault {self.spec()}: a kill lasts for good (no +duration)")
        if self.kind != "kill" and (self.duration is None or self.duration <= 0):
            raise ConfigError(f"fault {self.kind}@{self.at:g}: a {self.kind} needs a duration > 0 (+seconds)")
        if self.kind == "partition" and set(self.nodes) & set(self.other):
            raise ConfigError(f"fault {self.spec()}: the two sides of a partition overlap")

    @property
    def end(self) -> float | None:
        """When the fault is over (None: never)."""
        return None if self.duration is None else self.at + self.duration

    def spec(self) -> str:
        """The text form (:func:`parse_faults` reads it back)."""
        who = _ids_text(self.nodes) + (f"|{_ids_text(self.other)}" if self.other else "")
        return f"{self.kind}:{who}@{self.at:g}" + (f"+{self.duration:g}" if self.duration is not None else "")


def _ids_text(ids: Sequence[int]) -> str:
    parts: list[str] = []
    run: list[int] = []
    for i in sorted(ids):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [i]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ".".join(parts)


def _ids(text: str, where: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in text.split("."):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ConfigError(f"fault {where}: {part!r} is not a node id or a range a-b")
        a, b = int(m.group(1)), int(m.group(2) or m.group(1))
        if b < a:
            raise ConfigError(f"fault {where}: range {part} runs backwards")
        out.extend(range(a, b + 1))
    return tuple(sorted(set(out)))


_FAULT = re.compile(r"(kill|pause|partition):([^@]+)@([0-9.]+)(?:\+([0-9.]+))?")


def parse_faults(spec: str, ids: Sequence[int]) -> list[Fault]:
    """The faults of ``spec`` (see the module docstring) over the nodes ``ids``, sorted by
    time; ConfigError naming the bad part."""
    known = set(ids)
    out: list[Fault] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        m = _FAULT.fullmatch(part)
        if m is None:
            raise ConfigError(f"fault {part!r}: expected kind:nodes@time[+duration] with kind kill, pause or "
                              "partition (e.g. kill:17@30, pause:5@40+15, partition:0-7|8-15@60+20)")
        kind, who, at, dur = m.group(1), m.group(2), float(m.group(3)), m.group(4)
        sides = who.split("|")
        if len(sides) > 2 or (len(sides) == 2 and kind != "partition"):
            raise ConfigError(f"fault {part!r}: only a partition has two sides (a|b)")
        nodes = _ids(sides[0], part)
        other = _ids(sides[1], part) if len(sides) == 2 else \
            (tuple(sorted(known - set(nodes))) if kind == "partition" else ())
        unknown = sorted((set(nodes) | set(other)) - known)
        if unknown:
            raise ConfigError(f"fault {part!r}: nodes {unknown} are not in the topology")
        out.append(Fault(kind=kind, at=at, nodes=nodes, other=other,  # type: ignore[arg-type]
                         duration=float(dur) if dur is not None else None))
    return sorted(out, key=lambda f: f.at)


def draw(rng: random.Random, ids: Sequence[int], count: int, *, start: float, end: float,
         gap: float | None = None) -> list[Fault]:
    """``count`` faults drawn from ``rng`` that start and end between ``start`` and ``end``:
    kills and pauses of single nodes (never the same node twice; any node, the coordinator
    included) and partitions into a contiguous block and the rest, lasting 1 to 20 seconds
    (less when ``end`` comes first). With ``gap`` they come one after another instead, each
    starting ``gap`` to ``2 * gap`` seconds after the previous one ended (a kill ends at
    once), lasting 1 to 10 seconds; those that would end after ``end`` are left out."""
    nodes = sorted(ids)
    out: list[Fault] = []
    used: set[int] = set()
    t = start
    for _ in range(count):
        kind = rng.choice(("kill", "pause", "partition"))
        if gap is not None:
            at = round(t + rng.uniform(0.0, gap), 3)
            dur = round(rng.uniform(1.0, 10.0), 3)
            if at + (dur if kind != "kill" else 0.0) > end:
                break
            t = at + (dur if kind != "kill" else 0.0) + gap
        else:
            at = round(rng.uniform(start, end), 3)
            dur = round(min(rng.uniform(1.0, 20.0), max(end - at, 0.001)), 3)
        if kind == "partition":
            size = rng.randint(1, max(1, len(nodes) // 2))
            first = rng.randrange(len(nodes))
            side = tuple(sorted(nodes[(first + k) % len(nodes)] for k in range(size)))
            out.append(Fault(kind="partition", at=at, nodes=side, duration=dur,
                             other=tuple(n for n in nodes if n not in side)))
            continue
        free = [n for n in nodes if n not in used]
        if not free:
            continue
        n = rng.choice(free)
        used.add(n)
        out.append(Fault(kind="kill", at=at, nodes=(n,)) if kind == "kill"
                   else Fault(kind="pause", at=at, nodes=(n,), duration=dur))
    return sorted(out, key=lambda f: f.at)


__all__ = ["Fault", "FaultKind", "draw", "parse_faults"]

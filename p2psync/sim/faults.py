"""Faults of a simulated run and their text form. Pure.

``kill:17@30`` kills node 17 at virtual second 30 (for good, unless restarted);
``restart:17@50`` starts node 17 again at 50 as a new process (a new incarnation that joins
the run; a node still running is killed first, as a launcher restarting it would);
``pause:5@40+15`` stops node 5 at 40 for 15 seconds, as ``SIGSTOP`` / ``SIGCONT`` would;
``partition:0-7|8-15@60+20`` cuts every link between nodes 0..7 and 8..15 at 60 for 20 seconds
(a side may list ranges and single ids joined by ``.``: ``0-3.9|4-8``; the second side may be
left out: every other node); ``slow:3-4@10+30x10`` makes every link of nodes 3 and 4 ten times
slower (its one-way latency times 10) at 10 for 30 seconds, and ``slow:3|4@10+30x10`` only the
links that join the two sides (here the link 3-4; with one side there is no "every other
node": a slowed node is slow towards everybody). A list is comma-separated. ``random:N``
draws N faults from a seed (:func:`draw`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal, Sequence

from p2psync.errors import ConfigError

FaultKind = Literal["kill", "pause", "partition", "restart", "slow"]

#: the kinds that last a duration (``+seconds``)
LASTING = ("pause", "partition", "slow")


@dataclass(frozen=True)
class Fault:
    """One fault: ``nodes`` are killed, restarted or paused, or are one side of a partition
    whose other side is ``other``, or the nodes whose links are slowed (every link of theirs,
    or with ``other`` the links joining the two sides) ``factor`` times; it starts ``at``
    (virtual seconds) and lasts ``duration`` (None: a kill, for good until a restart; a
    restart, at once)."""

    kind: FaultKind
    at: float
    nodes: tuple[int, ...]
    duration: float | None = None
    other: tuple[int, ...] = ()
    #: a slowdown's factor on the links' one-way latency (> 1); None for every other kind
    factor: float | None = None

    def __post_init__(self) -> None:
        if self.at < 0:
            raise ConfigError(f"fault {self.spec()}: a time must be >= 0")
        if not self.nodes:
            raise ConfigError(f"fault {self.kind}@{self.at:g}: names no node")
        if self.kind in ("kill", "restart") and self.duration is not None:
            raise ConfigError(f"fault {self.spec()}: a {self.kind} takes no +duration")
        if self.kind in LASTING and (self.duration is None or self.duration <= 0):
            raise ConfigError(f"fault {self.kind}@{self.at:g}: a {self.kind} needs a duration > 0 (+seconds)")
        if self.kind in ("partition", "slow") and set(self.nodes) & set(self.other):
            raise ConfigError(f"fault {self.spec()}: the two sides of a {self.kind} overlap")
        if self.other and self.kind not in ("partition", "slow"):
            raise ConfigError(f"fault {self.spec()}: only a partition or a slowdown has two sides")
        if (self.factor is not None) != (self.kind == "slow"):
            raise ConfigError(f"fault {self.kind}@{self.at:g}: " + (
                "a slowdown needs a factor (xF)" if self.kind == "slow" else "only a slowdown has a factor (xF)"))
        if self.factor is not None and not self.factor > 1:
            raise ConfigError(f"fault {self.spec()}: a slowdown's factor must be > 1")

    @property
    def end(self) -> float | None:
        """When the fault is over (None: never)."""
        return None if self.duration is None else self.at + self.duration

    def slows(self, a: int, b: int) -> bool:
        """Whether this slowdown slows the link between ``a`` and ``b`` (False for every other
        kind)."""
        if self.kind != "slow":
            return False
        if self.other:
            return (a in self.nodes and b in self.other) or (a in self.other and b in self.nodes)
        return a in self.nodes or b in self.nodes

    def spec(self) -> str:
        """The text form (:func:`parse_faults` reads it back)."""
        who = _ids_text(self.nodes) + (f"|{_ids_text(self.other)}" if self.other else "")
        return (f"{self.kind}:{who}@{self.at:g}" + (f"+{self.duration:g}" if self.duration is not None else "")
                + (f"x{self.factor:g}" if self.factor is not None else ""))


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


_FAULT = re.compile(r"(kill|pause|partition|restart|slow):([^@]+)@([0-9.]+)(?:\+([0-9.]+))?(?:x([0-9.]+))?")


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
            raise ConfigError(f"fault {part!r}: expected kind:nodes@time[+duration][xfactor] with kind kill, "
                              "restart, pause, partition or slow (e.g. kill:17@30, restart:17@50, pause:5@40+15, "
                              "partition:0-7|8-15@60+20, slow:3-4@10+30x10)")
        kind, who, dur, factor = m.group(1), m.group(2), m.group(4), m.group(5)
        try:
            at = float(m.group(3))
            duration = float(dur) if dur is not None else None
            times = float(factor) if factor is not None else None
        except ValueError:
            raise ConfigError(f"fault {part!r}: {m.group(3)}, {dur} or {factor} is not a number") from None
        sides = who.split("|")
        if len(sides) > 2 or (len(sides) == 2 and kind not in ("partition", "slow")):
            raise ConfigError(f"fault {part!r}: only a partition or a slowdown has two sides (a|b)")
        nodes = _ids(sides[0], part)
        other = _ids(sides[1], part) if len(sides) == 2 else \
            (tuple(sorted(known - set(nodes))) if kind == "partition" else ())
        unknown = sorted((set(nodes) | set(other)) - known)
        if unknown:
            raise ConfigError(f"fault {part!r}: nodes {unknown} are not in the topology")
        out.append(Fault(kind=kind, at=at, nodes=nodes, other=other,  # type: ignore[arg-type]
                         duration=duration, factor=times))
    return sorted(out, key=lambda f: f.at)


def draw(rng: random.Random, ids: Sequence[int], count: int, *, start: float, end: float,
         gap: float | None = None) -> list[Fault]:
    """``count`` faults drawn from ``rng`` that start and end between ``start`` and ``end``:
    kills, restarts and pauses of single nodes (never the same node twice; any node, the
    coordinator included), slowdowns of every link of a single node, and partitions (or
    slowdowns of the links between the two sides) into a contiguous block and the rest,
    lasting 1 to 20 seconds (less when ``end`` comes first). With ``gap`` they come one after
    another instead, each starting ``gap`` to ``2 * gap`` seconds after the previous one ended
    (a kill or a restart ends at once, a kill restarted later at its restart), lasting 1 to 10
    seconds; those that would end after ``end`` are left out.

    The kind, time, duration and nodes of each fault come from ``rng`` as a choice among
    kill, pause and partition; a second stream, seeded from ``rng``'s state when called (it
    takes nothing from ``rng``), then turns a third of the kills into a restart of the live
    node, another third (unless it is the last of the count) into a kill followed by a
    restart of that node after the duration drawn (two faults of the count: the last one
    drawn is left out), a third of the pauses into a slowdown of the node's links and a
    quarter of the partitions into a slowdown of the links across, with a factor from 3 to
    5000 (log-uniform). So the faults that stay kills, pauses and partitions are those of the
    draw without the second stream, except that a kill restarted later takes the place of
    the last fault and moves the faults after it (with ``gap``) past its restart."""
    nodes = sorted(ids)
    side = random.Random(repr(rng.getstate()))
    out: list[Fault] = []
    used: set[int] = set()
    t = start
    left = count
    while left > 0:
        left -= 1
        kind = rng.choice(("kill", "pause", "partition"))
        u = side.random()
        factor = round(10 ** side.uniform(0.5, 3.7), 1)
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
            side_a = tuple(sorted(nodes[(first + k) % len(nodes)] for k in range(size)))
            rest = tuple(n for n in nodes if n not in side_a)
            out.append(Fault(kind="slow", at=at, nodes=side_a, duration=dur, other=rest, factor=factor)
                       if u < 0.25 and rest else
                       Fault(kind="partition", at=at, nodes=side_a, duration=dur, other=rest))
            continue
        free = [n for n in nodes if n not in used]
        if not free:
            continue
        n = rng.choice(free)
        used.add(n)
        if kind == "pause":
            out.append(Fault(kind="slow", at=at, nodes=(n,), duration=dur, factor=factor) if u < 1 / 3
                       else Fault(kind="pause", at=at, nodes=(n,), duration=dur))
        elif u < 1 / 3:
            out.append(Fault(kind="restart", at=at, nodes=(n,)))
        else:
            out.append(Fault(kind="kill", at=at, nodes=(n,)))
            if u < 2 / 3 and left > 0 and round(at + dur, 3) <= end:
                left -= 1  # (two faults of the count)
                out.append(Fault(kind="restart", at=round(at + dur, 3), nodes=(n,)))
                if gap is not None:
                    t = at + dur + gap
    return sorted(out, key=lambda f: f.at)


__all__ = ["Fault", "FaultKind", "LASTING", "draw", "parse_faults"]

"""One node's part of a collective plan, piece by piece: the steps the executor's piece
coroutines walk (:class:`~p2psync.collectives.piece_run.Run`). Pure.

A plan lists rounds of transfers for the whole group; each node only walks, for each of its
pieces, the rounds in which it sends or receives that piece. Working that out (filtering every
round for every piece, sorting the senders, deciding which partial sums are sent straight on)
is the same for every operation of the same plan, so the executor computes it once per plan,
phases and piece count (:func:`schedule`) and keeps it: per operation and piece, walking the
cached steps is all that is left.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Sequence

from p2psync.collectives.plan import Plan, Transfer


@dataclass(slots=True)
class Expect:
    """A receive of one piece: from ``src`` under the operation's tag plus ``suffix``
    (``.<phase>.<src>.<piece>``); ``reduce``: its values are added in, else copied over. A
    value: never changed once made."""

    src: int
    suffix: str
    reduce: bool


@dataclass(frozen=True, slots=True)
class Step:
    """What one round does with one piece on this node: ``sends`` (this node's transfers of
    the piece, to each ``dst`` over ``nic``) under the operation's tag plus ``send_suffix``
    (``.<phase>.<me>.<piece>``), ``incoming`` (``(src, reduce)`` per transfer of the piece to
    this node, in sender order: sums do not depend on arrival order, their rounding does) and
    their receives (``expects``, in the same order). ``defer``: what arrives is a partial sum
    that nothing but the next step's send reads (:func:`deferrable`)."""

    phase: str
    sends: tuple[Transfer, ...]
    send_suffix: str
    incoming: tuple[tuple[int, bool], ...]
    expects: tuple[Expect, ...]
    defer: bool


@dataclass(frozen=True)
class Schedule:
    """Every piece's steps on one node (``pieces[k]``), and the pieces it owns fully reduced
    after the reduce-scatter (``owned``)."""

    pieces: tuple[tuple[Step, ...], ...]
    owned: frozenset[int]


def deferrable(me: int, steps: Sequence[tuple[str, Sequence[Transfer]]], j: int) -> bool:
    """Whether what step ``j`` receives for a piece (of this node's ``steps`` for it) can be
    added straight into the next step's send instead of into the working buffer: step ``j``
    only receives, one partial sum; the next, in the reduce-scatter, only sends it, once; the
    one after (if any) only receives the piece whole (ring: a partial sum sent on, then the
    final value in the allgather). So nothing but that send reads the sum. (Lossless codecs
    without an extra piece check only: the caller decides that.)"""
    now = steps[j][1]
    if len(now) != 1 or now[0].dst != me or not now[0].reduce or j + 1 >= len(steps):
        return False
    phase, nxt = steps[j + 1]
    if not phase.startswith("rs") or len(nxt) != 1 or nxt[0].src != me:
        return False
    return j + 2 >= len(steps) or all(t.dst == me and not t.reduce for t in steps[j + 2][1])


def schedule(plan: Plan, me: int, pieces: int, phases: tuple[str, ...], fused: bool) -> Schedule:
    """Node ``me``'s steps for each of ``pieces`` pieces through ``plan``'s ``phases`` (``rs``
    then ``ag``, those given). ``fused``: the executor checks received pieces itself, fused with
    their use (lossless codec, no extra check): only then may a partial sum be sent straight on."""
    ts, rounds = plan.by_node.get(me, ((), array("i")))
    nrs = len(plan.rs)
    per: list[list[tuple[int, Transfer]]] = [[] for _ in range(pieces)]  # (round, transfer) per piece
    for t, r in zip(ts, rounds):
        if ("rs" if r < nrs else "ag") in phases:
            for k in range(max(t.lo, 0), min(t.hi, pieces)):
                per[k].append((r, t))
    out = []
    for k in range(pieces):
        mine: list[tuple[str, list[Transfer]]] = []  # this piece's rounds, in order, with its transfers in each
        last = -1
        for r, t in per[k]:
            if r == last:
                mine[-1][1].append(t)
            else:
                mine.append((f"rs{r}" if r < nrs else f"ag{r - nrs}", [t]))
                last = r
        steps = []
        for j, (phase, tk) in enumerate(mine):
            incoming = tuple(sorted((t.src, t.reduce) for t in tk if t.dst == me))
            steps.append(Step(phase=phase, sends=tuple(t for t in tk if t.src == me),
                              send_suffix=f".{phase}.{me}.{k}", incoming=incoming,
                              expects=tuple(Expect(src, f".{phase}.{src}.{k}", reduce) for src, reduce in incoming),
                              defer=fused and bool(incoming) and deferrable(me, mine, j)))
        out.append(tuple(steps))
    owned = frozenset(k for lo, hi in plan.owner.get(me, ()) for k in range(lo, hi))
    return Schedule(pieces=tuple(out), owned=owned)


__all__ = ["Expect", "Schedule", "Step", "deferrable", "schedule"]

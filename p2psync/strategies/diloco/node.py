"""The node's DiLoCo state (plain data; no IO beyond cancelling the operation in flight): θ_g,
the outer momentum, the fragment map and schedule, the counters, the operation in flight, the
stop's flags and the step report's counts.

One :class:`NodeState` per strategy; the strategy's parts (:mod:`.adoption`, :mod:`.ops`,
:mod:`.stop`, :mod:`.strategy`) each hold a reference to it and read and write its fields, and
none of them keeps a copy of any. What each field means is documented here, once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from p2psync.strategies.diloco.fragments import Ranges
from p2psync.strategies.diloco.schedule import Cursor, Schedule
from p2psync.strategies.diloco.state import Counters
from p2psync.tasks import cancel_all


@dataclass
class Op:
    """One operation: a fragment's (or, ``f == FULL``, the whole model's) weighted
    pseudo-gradient sum, launched at ``counters``."""

    f: int
    payload: np.ndarray
    w: float
    stop: bool
    nonfinite: bool
    counters: Counters
    #: this node's inner steps per second when it launched the op (DyLU)
    speed: float = 0.0
    task: asyncio.Task[Any] | None = None
    #: the sums when they arrived before a checkpoint that this op was restored from
    result: tuple[np.ndarray, np.ndarray] | None = None
    #: eager: the own fresh term of this round that θ_g holds (:func:`~.outer.own_term`):
    #: this node's, or the leader's when it adopted the leader's state in this round
    held: np.ndarray | None = None

    @property
    def k(self) -> int:
        return self.counters.op


@dataclass
class NodeState:
    """What a DiLoCo node keeps between steps. Empty until the strategy's ``start`` cuts the
    fragments and builds the schedule; θ_g is set at the first step (or by an adoption, or a
    checkpoint)."""

    #: each fragment's (lo, hi) ranges of the flat vector, its positions there (in that order),
    #: and the map's digest the members compare
    ranges: list[Ranges] = field(default_factory=list)
    frags: list[np.ndarray] = field(default_factory=list)
    digest: float = 0.0
    schedule: Schedule | None = None
    cursor: Cursor | None = None
    #: θ_g (host float32) and the outer momentum per fragment (None before its first outer step)
    theta: np.ndarray | None = None
    bufs: list[np.ndarray | None] = field(default_factory=list)
    #: inner steps taken, operations launched, outer steps applied (per fragment)
    t: int = 0
    ops: int = 0
    applied: int = 0
    #: the operation in flight; one restored from a checkpoint without its sums, to launch again
    #: at the next step; the counters of the latest launch (what a member behind adopts)
    inflight: Op | None = None
    relaunch: Op | None = None
    launched: Counters = field(default_factory=lambda: Counters(0, 0, 0, 0))
    #: fragments this node has not trained a full interval on since it adopted a state, and
    #: the replica's sample count at each fragment's last send (``weighting=samples``)
    fresh: set[int] = field(default_factory=set)
    marks: list[int] = field(default_factory=list)
    #: inner steps per second (EMA over compute time only), the steps measured, and the
    #: fastest member's speed (DyLU)
    speed: float = 0.0
    measured: int = 0
    fastest: float = 0.0
    #: this node wishes to stop (its wish rides in the side sum of every operation it launches)
    want_stop: bool = False
    #: the leader's counters showed it at the stop (a member that missed the agreed stop)
    stopping: bool = False
    #: θ_g holds the final sync already (adopted from a leader in the closing checks)
    final_done: bool = False
    #: the step report's counts: rounds skipped for a non-finite Δ, applies that waited on a
    #: sum, states adopted
    skipped: int = 0
    blocked: int = 0
    adoptions: int = 0

    async def drop_inflight(self) -> None:
        """Forget the operation in flight and cancel its task (none: nothing to do)."""
        op, self.inflight = self.inflight, None
        if op is not None:
            await cancel_all([op.task])

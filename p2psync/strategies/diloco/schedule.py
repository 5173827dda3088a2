"""Which fragment is sent and applied after which inner step (pure), with a fixed interval
(:class:`Schedule`) or one that DyLU changes between cycles (:class:`Cursor`,
:func:`dylu_interval`).

With ``h = H / P_total`` the node sends fragment ``(t/h − 1) mod P_total`` after inner step
``t`` when ``t mod h == 0``, and applies the fragment sent at ``t − τ`` after inner step ``t``:
fragment f goes out at ``t ∈ {(f+1)·h + k·H}``, every H steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2psync.errors import ConfigError


@dataclass(frozen=True)
class Schedule:
    """When fragments are sent and applied: ``inner_steps`` H, ``parts`` P_total, ``tau`` τ."""

    inner_steps: int
    parts: int
    tau: int

    def __post_init__(self) -> None:
        if self.parts < 1 or self.inner_steps % self.parts:
            raise ConfigError(f"--opt inner_steps={self.inner_steps}: must be a multiple of the number of "
                              f"fragments ({self.parts})")
        if not 0 <= self.tau < self.interval:
            raise ConfigError(f"--opt tau={self.tau}: must be 0 <= tau < inner_steps / fragments = {self.interval} "
                              f"(at most one fragment in flight)")

    @property
    def interval(self) -> int:
        """h = H / P_total: inner steps between two consecutive sends."""
        return self.inner_steps // self.parts

    def send(self, t: int) -> int | None:
        """The fragment sent after inner step ``t`` (t >= 1), else None."""
        h = self.interval
        if t < h or t % h:
            return None
        return (t // h - 1) % self.parts

    def apply(self, t: int) -> int | None:
        """The fragment whose average is applied after inner step ``t`` (sent at ``t − τ``)."""
        return self.send(t - self.tau)


@dataclass
class Cursor:
    """One node's place in the schedule: it sends fragment ``next_frag`` once ``since`` inner
    steps since its last send reach ``interval``, and applies the fragment in flight ``delay``
    steps after it was sent (``due``: steps left, None when nothing is in flight). Fragments
    go out in the order 0, 1, ..., ``parts`` − 1, again and again. With a constant interval h
    and delay τ it is :class:`Schedule` (sends after inner steps h, 2h, ...); DyLU changes the
    interval of a node between cycles (:func:`dylu_interval`)."""

    parts: int
    interval: int
    delay: int
    since: int = 0
    next_frag: int = 0
    due: int | None = None

    def step(self) -> tuple[int | None, bool]:
        """One inner step done: (the fragment to send now or None, whether the fragment in
        flight is applied now — after the send, which comes first when ``delay`` is 0)."""
        self.since += 1
        send: int | None = None
        if self.due is not None:
            self.due -= 1
        if self.since >= self.interval:
            send = self.next_frag
        apply = self.due is not None and self.due <= 0 and send is None
        return send, apply

    def sent(self, frag: int) -> bool:
        """Fragment ``frag`` went out now; True when that ended a cycle (the last fragment)."""
        self.since = 0
        self.next_frag = (frag + 1) % self.parts
        self.due = self.delay
        return self.next_frag == 0

    def applied(self) -> None:
        self.due = None

    def apply_now(self) -> bool:
        """After a send: whether its fragment is applied at once (``delay`` 0)."""
        return self.due is not None and self.due <= 0


def dylu_interval(speed: float, fastest: float, inner_steps: int, parts: int, min_steps: int) -> int:
    """Dynamic Local Updates (Async Local-SGD Eq. 6, per fragment): a node's steps between two
    sends, h_m = max(⌈min_steps / P⌉, ⌊⌊v_m / max v · H⌋ / P⌋); equal speeds give H / P."""
    if not (speed > 0 and fastest > 0):
        return inner_steps // parts
    steps = math.floor(min(1.0, speed / fastest) * inner_steps)
    return max(-(-min_steps // parts), steps // parts, 1)


__all__ = ["Cursor", "Schedule", "dylu_interval"]

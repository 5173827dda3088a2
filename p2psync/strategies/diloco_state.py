"""DiLoCo's arithmetic and schedule as pure functions: the outer Nesterov step, the α merge, which
fragment is sent and applied after which inner step, the fragment map, and the state vector a
member behind adopts. Used by :mod:`p2psync.strategies.diloco`; unit-tested against worked
examples computed by hand (tests/unit/test_diloco_state.py).

Conventions:

* The outer gradient is ``Δ = θ_g − θ_local`` (start point minus end point: it points uphill
  like a gradient) and the outer optimizer descends: ``θ_g ← θ_g − η·(Nesterov-filtered Δ̄)``.
* The outer step is PyTorch's ``SGD(lr=η, momentum=μ, nesterov=True)`` with dampening 0 and
  no weight decay, in float32 numpy with a fixed order of operations (no fused multiply-adds),
  so the same Δ̄ gives the same bits on every host::

      b ← b·μ ; b ← b + Δ̄            (first step of a fragment: b ← copy(Δ̄))
      d ← b·μ ; d ← d + Δ̄            (nesterov; plain momentum: d ← b)
      d ← d·η ; θ_g ← θ_g − d

* Schedule: with ``h = H / P_total`` the node sends fragment ``(t/h − 1) mod P_total`` after
  inner step ``t`` when ``t mod h == 0``, and applies the fragment sent at ``t − τ`` after
  inner step ``t``: fragment f goes out at ``t ∈ {(f+1)·h + k·H}``, every H steps.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from p2psync.errors import ConfigError, ProtocolError
from p2psync.model import Layer

#: a fragment: (lo, hi) ranges of the flat parameter vector, in increasing order
Ranges = tuple[tuple[int, int], ...]


def outer_step(theta: np.ndarray, buf: np.ndarray | None, delta: np.ndarray, *, lr: float, momentum: float,
               nesterov: bool) -> np.ndarray | None:
    """One outer SGD step on ``theta`` (float32, updated in place) with the averaged outer
    gradient ``delta``; ``buf`` is the momentum buffer (None before the fragment's first step,
    updated in place otherwise). Returns the buffer to keep (None when ``momentum`` is 0)."""
    f32 = np.float32
    d32 = np.asarray(delta, np.float32)
    if momentum:
        if buf is None:
            buf = d32.copy()
        else:
            np.multiply(buf, f32(momentum), out=buf)
            np.add(buf, d32, out=buf)
        if nesterov:
            d = np.multiply(buf, f32(momentum))
            np.add(d, d32, out=d)
        else:
            d = buf.copy()
    else:
        d = d32.copy()
    np.multiply(d, f32(lr), out=d)
    np.subtract(theta, d, out=theta)
    return buf if momentum else None


def merge(theta_g: np.ndarray, local: np.ndarray, alpha: float) -> np.ndarray:
    """Streaming DiLoCo's merge: ``α·θ_local + (1 − α)·θ_g``, computed as
    ``θ_g + α·(θ_local − θ_g)`` (α = 0: θ_g exactly; α = 1: θ_local exactly)."""
    if alpha == 0.0:
        return np.array(theta_g, np.float32, copy=True)
    if alpha == 1.0:
        return np.array(local, np.float32, copy=True)
    out: np.ndarray = np.subtract(local, theta_g, dtype=np.float32)
    np.multiply(out, np.float32(alpha), out=out)
    np.add(out, theta_g, out=out)
    return out


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


def eager_gradient(own: np.ndarray, expected: float, others: np.ndarray | None) -> np.ndarray:
    """The outer gradient of one node in an eager round (Eager updates, Kale, Douillard,
    Donchev, arXiv 2502.12996, in the "replace your own stale contribution" form): its own fresh weighted pseudo-gradient
    over the members expected in this round, plus the others' contributions of the previous
    round (:func:`others_mean`; None in the first round)::

        g = w·Δ_m(r) / M_r + (Σ_i w_i·Δ_i(r−1) − w_m·Δ_m(r−1)) / Σ_i w_i(r−1)

    Every contribution enters a node's θ_g exactly once: its own at once, the others' one round
    late. (The formula is reconstructed from secondary summaries of the paper's Algorithm 3.)"""
    g: np.ndarray = np.divide(own, np.float32(expected), dtype=np.float32)
    if others is not None:
        np.add(g, others, out=g)
    return g


def others_mean(total: np.ndarray, own: np.ndarray, sum_w: float) -> np.ndarray:
    """The previous round's sum without this node's own weighted contribution, over the
    round's total weight (an eager round's late part, and the completion step at the end)."""
    out: np.ndarray = np.subtract(total, own, dtype=np.float32)
    np.divide(out, np.float32(sum_w), out=out)
    return out


def _block_key(name: str) -> tuple[str, int] | None:
    """(prefix, index) of a module name inside a repeated block (``blocks.3.attn`` ->
    ``("blocks", 3)``; ``3`` -> ``("", 3)``), else None."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if re.fullmatch(r"[0-9]+", p):
            return ".".join(parts[:i]), int(p)
    return None


def fragment_map(layers: Sequence[Layer], numel: int, fragments: int, *, by: Literal["blocks", "flat"],
                 pattern: Literal["strided", "sequential"]) -> list[Ranges]:
    """The fragments of a flat vector of ``numel`` values (Streaming DiLoCo §2.2: strided or
    sequential groups of blocks).

    ``fragments`` = 1: the whole vector. ``by="blocks"``: the repeated blocks (modules named
    ``<prefix>.<index>...``; the prefix with the most indices wins) are dealt to ``fragments``
    fragments, ``strided`` (block i to fragment i mod P) or ``sequential`` (block i to
    ⌊i·P/L⌋); every other parameter (embeddings, final norm, head) forms one more fragment,
    the last. ``by="flat"``: ``fragments`` contiguous ranges of near-equal size cut at layer
    boundaries. ConfigError when the model cannot be cut so."""
    if fragments == 1:
        return [((0, numel),)]
    if by == "flat":
        cuts = sorted({layer.offset for layer in layers} | {numel}) if layers else []
        if len(cuts) < fragments:
            cuts = [round(i * numel / fragments) for i in range(1, fragments + 1)]
        bounds = [0]
        for i in range(1, fragments):
            want = i * numel / fragments
            best = min((c for c in cuts if bounds[-1] < c < numel), key=lambda c: abs(c - want), default=None)
            if best is None:
                raise ConfigError(f"--opt fragments={fragments}: the model has too few layers to cut "
                                  f"{fragments} fragments")
            bounds.append(best)
        bounds.append(numel)
        if any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise ConfigError(f"--opt fragments={fragments}: the model has too few layers to cut "
                              f"{fragments} fragments")
        return [((a, b),) for a, b in zip(bounds, bounds[1:])]
    keyed = [(layer, _block_key(layer.name)) for layer in layers]
    counts: dict[str, set[int]] = {}
    for _, key in keyed:
        if key is not None:
            counts.setdefault(key[0], set()).add(key[1])
    if not counts:
        raise ConfigError(f"--opt fragments={fragments}: the model has no repeated blocks (modules named "
                          "like blocks.3 or layers.3): use --opt fragment_by=flat")
    prefix = max(counts, key=lambda p: len(counts[p]))
    index = {b: i for i, b in enumerate(sorted(counts[prefix]))}
    n_blocks = len(index)
    if fragments > n_blocks:
        raise ConfigError(f"--opt fragments={fragments}: the model has only {n_blocks} blocks "
                          f"({prefix or 'top-level'} modules)")
    parts: list[list[tuple[int, int]]] = [[] for _ in range(fragments + 1)]
    covered = 0
    for layer, key in keyed:
        if key is not None and key[0] == prefix:
            i = index[key[1]]
            f = i % fragments if pattern == "strided" else i * fragments // n_blocks
        else:
            f = fragments
        parts[f].append((layer.offset, layer.offset + layer.numel))
        covered += layer.numel
    if covered != numel:
        raise ConfigError(f"--opt fragments={fragments}: the model's layers cover {covered} of its {numel} "
                          "parameters: use --opt fragment_by=flat")
    if not parts[fragments]:
        parts.pop()
    return [_coalesce(p) for p in parts]


def _coalesce(ranges: Sequence[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def indices(ranges: Ranges) -> np.ndarray:
    """The flat-vector positions of a fragment, in its fixed order (its ranges in turn)."""
    return np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in ranges])


def map_digest(frags: Sequence[Ranges]) -> float:
    """A float32-exact digest of a fragment map (members compare it: same model, same cut)."""
    h = 0
    for f, ranges in enumerate(frags):
        for lo, hi in ranges:
            h = (h * 1_000_003 + f * 7919 + lo * 31 + hi) % (1 << 23)
    return float(h)


# -- the state a member behind adopts -------------------------------------------------------

#: integer counters travel as pairs of float32 (high and low 20 bits): exact below 2**43
_SPLIT = 1 << 20


@dataclass(frozen=True)
class Counters:
    """Where a node stands when it launches operation ``op`` (of fragment ``frag``: -1 for the
    final full-model sync, -2 for the stop's closing checks after it): its inner step ``t``,
    its loop's step, and the outer steps applied so far."""

    op: int
    t: int
    step: int
    applied: int
    frag: int = 0

    def pack(self) -> np.ndarray:
        vals = (self.op, self.t, self.step, self.applied, self.frag + 2)  # (frag >= -2: the stop's markers)
        if any(v < 0 or v >= 1 << 43 for v in vals):
            raise ConfigError(f"DiLoCo counters out of range: {vals}")
        return np.array([x for v in vals for x in divmod(v, _SPLIT)], np.float32)

    @classmethod
    def unpack(cls, vec: np.ndarray) -> Counters:
        if vec.size != COUNTERS or not np.isfinite(vec).all() or (vec < 0).any() or (vec != np.floor(vec)).any():
            raise ProtocolError("state", "malformed DiLoCo counters")
        v = [int(vec[2 * i]) * _SPLIT + int(vec[2 * i + 1]) for i in range(5)]
        return cls(op=v[0], t=v[1], step=v[2], applied=v[3], frag=v[4] - 2)


COUNTERS = 10


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


def state_size(numel: int, parts: int) -> int:
    """Length of :func:`pack_state`'s vector."""
    return 2 * numel + parts + COUNTERS


def pack_state(theta: np.ndarray, bufs: Sequence[np.ndarray | None], frags: Sequence[np.ndarray],
               counters: Counters) -> np.ndarray:
    """θ_g ‖ b (zeros where a fragment has no buffer yet) ‖ which fragments have one ‖ counters."""
    mom = np.zeros_like(theta)
    have = np.zeros(len(frags), np.float32)
    for f, (b, idx) in enumerate(zip(bufs, frags)):
        if b is not None:
            mom[idx] = b
            have[f] = 1.0
    return np.concatenate([theta, mom, have, counters.pack()]).astype(np.float32, copy=False)


def unpack_state(vec: np.ndarray, numel: int, frags: Sequence[np.ndarray]
                 ) -> tuple[np.ndarray, list[np.ndarray | None], Counters]:
    """:func:`pack_state`'s parts back: θ_g, the buffers, the counters."""
    parts = len(frags)
    if vec.size != state_size(numel, parts):
        raise ProtocolError("state", f"a DiLoCo state of {vec.size} values, expected {state_size(numel, parts)}")
    theta = np.array(vec[:numel], np.float32, copy=True)
    mom = vec[numel:2 * numel]
    have = vec[2 * numel:2 * numel + parts]
    bufs: list[np.ndarray | None] = [np.array(mom[idx], np.float32, copy=True) if have[f] else None
                                     for f, idx in enumerate(frags)]
    return theta, bufs, Counters.unpack(np.asarray(vec[2 * numel + parts:]))


__all__ = ["COUNTERS", "Counters", "Cursor", "Ranges", "Schedule", "dylu_interval", "eager_gradient", "fragment_map",
           "indices", "map_digest", "merge", "others_mean", "outer_step", "pack_state", "state_size", "unpack_state"]

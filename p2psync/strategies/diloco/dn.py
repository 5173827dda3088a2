"""Delayed Nesterov (Async Local-SGD, arXiv 2401.09135, Alg. 3 with c = 0) and Dynamic Local
Updates (Eq. 6): the pure decision logic of ``--strategy diloco-async`` (no IO, no clock).

:class:`DNState` is one replica of the "server" of Alg. 3: θ_g, the outer momentum m, the sum of
the current buffer's pseudo-gradients and two counters. :func:`apply_update` applies one
pseudo-gradient g (Δ = θ_start − θ_local: it points uphill, the update descends):

* every update: θ ← θ − ε·(g/N); the buffer sum gains g;
* the N-th update of a buffer (``in_buffer`` reaches N): m ← β·m + (Σ buffer)/N, then
  θ ← θ − ε·(β·m), and the buffer empties.

With c = 0 (the paper's default; the only value p2psync allows: c > 0 makes the intermediate
steps depend on when a buffer completes) the state after a complete buffer does not depend on
the order of the buffer's updates in exact arithmetic (a sum), and when the buffer holds one
update per worker it equals one synchronous Nesterov step (``torch.optim.SGD(lr=ε, momentum=β,
nesterov=True)``) on the buffer's mean. In float32 the order of the additions changes the last
bits, which is why every node applies the stream in one total order: the same operations on the
same bytes give the same bits (numpy float32 elementwise, no fused multiply-add).

The operation order is fixed (every node runs exactly these): ``u = g / N; u *= ε; θ -= u``;
``buf += g``; at a boundary ``m *= β; m += buf / N; d = m * β; d *= ε; θ -= d; buf = 0``.
The functions work on any numpy dtype, including ``object`` arrays of
:class:`fractions.Fraction` (exact arithmetic, for the tests).

:func:`dylu_steps`: H_m = max(dylu_min_steps, ⌊v_m / max v · H⌋), H the fastest node's inner
steps (Eq. 6; the official notebook's floor of 5 steps), capped at H.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np


def _scalar(x: Any, like: np.ndarray) -> Any:
    """``x`` in ``like``'s element type (float32 stays float32; Fractions stay exact)."""
    return x if like.dtype == object else like.dtype.type(x)


@dataclass
class DNState:
    """One node's replica of the Delayed Nesterov state (see the module docstring)."""

    theta: np.ndarray
    momentum: np.ndarray
    buffer: np.ndarray
    #: updates applied so far (the next update's number in the stream)
    count: int = 0
    #: updates in the current buffer (its sum is ``buffer``)
    in_buffer: int = 0
    #: the stream ended at ``count`` (the last update applied carried the stop)
    stop: bool = False

    @classmethod
    def start(cls, theta: np.ndarray) -> "DNState":
        """A fresh state at θ_0 (a copy), zero momentum and an empty buffer."""
        t = np.array(theta, copy=True)
        return cls(theta=t, momentum=np.zeros_like(t), buffer=np.zeros_like(t))

    def copy(self) -> "DNState":
        return DNState(theta=self.theta.copy(), momentum=self.momentum.copy(), buffer=self.buffer.copy(),
                       count=self.count, in_buffer=self.in_buffer, stop=self.stop)


def apply_update(st: DNState, g: np.ndarray, *, lr: float, momentum: float, buffer: int) -> bool:
    """Apply pseudo-gradient ``g`` as update number ``st.count`` (in place); ``buffer`` = N.
    Returns whether it completed a buffer (the momentum step ran). A buffer that holds more
    than N updates already (N shrank with the group) completes at this one."""
    if buffer < 1:
        raise ValueError(f"DN buffer size must be >= 1, got {buffer}")
    if g.shape != st.theta.shape:
        raise ValueError(f"pseudo-gradient of shape {g.shape}, θ_g has {st.theta.shape}")
    eps, beta = _scalar(lr, st.theta), _scalar(momentum, st.theta)
    u = g / _scalar(buffer, st.theta) if st.theta.dtype == object else np.divide(g, buffer, dtype=st.theta.dtype)
    u *= eps
    st.theta -= u
    st.buffer += g
    st.count += 1
    st.in_buffer += 1
    if st.in_buffer < buffer:
        return False
    st.momentum *= beta
    if st.theta.dtype == object:
        st.momentum += st.buffer / _scalar(buffer, st.theta)
    else:
        st.momentum += np.divide(st.buffer, buffer, dtype=st.theta.dtype)
    d = st.momentum * beta
    d *= eps
    st.theta -= d
    st.buffer[...] = 0
    st.in_buffer = 0
    return True


def dylu_steps(own: float, speeds: Iterable[float], *, inner_steps: int, min_steps: int) -> int:
    """Dynamic Local Updates (Eq. 6): this node's inner steps for its next phase from its speed
    ``own`` and the members' ``speeds`` (steps/s; its own among them or not): max(min_steps,
    ⌊own / max · H⌋), at most H. Without a measured speed (0 or not finite), H."""
    fastest = max([own, *speeds])
    if not (math.isfinite(own) and math.isfinite(fastest)) or own <= 0 or fastest <= 0:
        return inner_steps
    return min(inner_steps, max(min_steps, math.floor(own / fastest * inner_steps)))


def int_slots(values: Iterable[int | float]) -> np.ndarray:
    """Whole numbers as float64 bit patterns in two float32 slots each (exact up to 2**53):
    how counters ride in a float32 state vector. :func:`slot_ints` reads them back."""
    return np.array(list(values), np.float64).view(np.float32)


def slot_ints(slots: np.ndarray) -> list[int]:
    """The whole numbers :func:`int_slots` wrote."""
    return [int(v) for v in np.array(slots, np.float32).view(np.float64)]


def pack(st: DNState) -> np.ndarray:
    """θ_g ‖ m ‖ buffer ‖ [count, in_buffer, stop] as one float32 vector (what a member behind
    adopts; the counters as float64 bit patterns in six float32 slots, exact)."""
    counters = int_slots([st.count, st.in_buffer, float(st.stop)])
    return np.concatenate([st.theta, st.momentum, st.buffer, counters]).astype(np.float32, copy=False)


def unpack(vec: np.ndarray, n: int) -> DNState:
    """The state :func:`pack` packed, for a model of ``n`` parameters."""
    if vec.size != state_size(n):
        raise ValueError(f"a DN state of {n} parameters has {state_size(n)} values, got {vec.size}")
    count, in_buffer, stop = slot_ints(vec[3 * n:])
    return DNState(theta=np.array(vec[:n], np.float32), momentum=np.array(vec[n:2 * n], np.float32),
                   buffer=np.array(vec[2 * n:3 * n], np.float32), count=count, in_buffer=in_buffer,
                   stop=bool(stop))


def state_size(n: int) -> int:
    """The length of :func:`pack`'s vector for ``n`` parameters."""
    return 3 * n + 6


__all__ = ["DNState", "apply_update", "dylu_steps", "int_slots", "pack", "slot_ints", "state_size", "unpack"]

"""DiLoCo's outer-step arithmetic (pure): the outer Nesterov step, Streaming DiLoCo's α merge,
and the eager round's outer gradient.

Conventions:

* The outer gradient is ``Δ = θ_g − θ_local`` (start point minus end point: it points uphill
  like a gradient) and the outer optimizer descends: ``θ_g ← θ_g − η·(Nesterov-filtered Δ̄)``.
* The outer step is PyTorch's ``SGD(lr=η, momentum=μ, nesterov=True)`` with dampening 0 and
  no weight decay, in float32 numpy with a fixed order of operations (no fused multiply-adds),
  so the same Δ̄ gives the same bits on every host::

      b ← b·μ ; b ← b + Δ̄            (first step of a fragment: b ← copy(Δ̄))
      d ← b·μ ; d ← d + Δ̄            (nesterov; plain momentum: d ← b)
      d ← d·η ; θ_g ← θ_g − d
"""

from __future__ import annotations

import numpy as np


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


def own_term(own: np.ndarray, expected: float) -> np.ndarray:
    """An eager round's own fresh term: this node's weighted pseudo-gradient over the members
    expected in the round, ``w·Δ_m(r) / M_r`` (float32). A node's θ_g holds it from the round's
    outer step until its :func:`late_part` takes it out again."""
    out: np.ndarray = np.divide(own, np.float32(expected), dtype=np.float32)
    return out


def eager_gradient(own: np.ndarray, expected: float, others: np.ndarray | None) -> np.ndarray:
    """The outer gradient of one node in an eager round (Eager updates, Kale, Douillard,
    Donchev, arXiv 2502.12996, in the "replace your own stale contribution" form): its own fresh
    term (:func:`own_term`) plus the previous round's late part (:func:`late_part`; None in the
    first round)::

        g = w·Δ_m(r) / M_r + Σ_i w_i·Δ_i(r−1) / Σ_i w_i(r−1) − w_m·Δ_m(r−1) / M_{r−1}

    Every contribution enters a node's θ_g exactly once, with the weight the round's mean gives
    it: the others' one round late, its own at once over M_r, exchanged one round later for its
    share of the mean (the terms over M cancel however Σw turns out). (The formula is
    reconstructed from secondary summaries of the paper's Algorithm 3.)"""
    g = own_term(own, expected)
    if others is not None:
        np.add(g, others, out=g)
    return g


def late_part(total: np.ndarray, sum_w: float, held: np.ndarray) -> np.ndarray:
    """An eager round's late part (and the stop's completion step): the round's mean
    ``total / sum_w`` less the own fresh term ``held`` (:func:`own_term`) that θ_g holds already
    of that round — this node's own, or, in the round it adopted a leader's state in, the
    leader's (its θ_g holds that one)."""
    out: np.ndarray = np.divide(total, np.float32(sum_w), dtype=np.float32)
    np.subtract(out, held, out=out)
    return out


def others_mean(total: np.ndarray, own: np.ndarray, sum_w: float, expected: float | None = None) -> np.ndarray:
    """:func:`late_part` of a node whose own fresh term of the round was ``own`` over
    ``expected`` members (``sum_w`` when None: every expected member took part with weight 1)."""
    return late_part(total, sum_w, own_term(own, sum_w if expected is None else expected))


__all__ = ["eager_gradient", "late_part", "merge", "others_mean", "outer_step", "own_term"]

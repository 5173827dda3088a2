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


__all__ = ["eager_gradient", "merge", "others_mean", "outer_step"]

"""DTS's compensation as pure state: what to send when a window closes, and the corrections to
the weights and SGD's momentum buffers when its average is applied t steps later.

Paper: *Distributed Training Across the World*, Sec. 3.1 (delayed update, Eqs. 2-8),
Sec. 3.2 (temporally sparse update, Eqs. 9-11), Sec. 3.3 (both, Eqs. 12-13). This module
implements one normalized rule, which
covers every one of those equations with one convention and corrects the paper's errors:

* **descent sign** (§4 A1): the paper writes ``w + λ∇w``; here ``w - λ·g``.
* **t = 0 means no delay** (§4 A4): ``t`` is the number of *extra* iterations the barrier is
  postponed, Table 1's and Eqs. 12-13's convention. The paper's Eqs. 3/7/8 count one more
  (their t = 1 is SSGD): ``t_Eq3 = t + 1``.
* **Eq. 11's momentum line** (§4 A6, off by one) and **Eq. 13's weight line** (§4 A7, wrong
  for t ≥ 1: the t momentum steps after the window add a geometric sum, they do not scale the
  window by m^t) are replaced by the exact forms below.
* **learning-rate schedules** (§4 A11): λ is folded into the accumulator A per iteration, and
  the coefficient c of the late momentum steps uses the λ of each of those steps, so the
  compensation stays exact under warm-up, cosine or step schedules.

The rule (PyTorch order; ``g_i`` is what SGD adds to its buffer: the gradient plus
weight_decay·w; ``u_i = m·u_(i-1) + g_i``; ``w_(i+1) = w_i - λ_i·u_i``):

* Window r (since ``base``) covers iterations ``[base + r·p, base + r·p + p - 1]``; its end is
  ``e_r``. Inside a window ``S = m·S + g`` and ``A = A + λ_i·S`` (S restarts at 0 with the
  window). With m = 0, ``A = Σ λ_i·g_i``.
* At the end of ``e_r`` the window's payload is averaged over the group: ``[A]`` when m = 0,
  ``[S]`` when the window is one iteration long (then ``A = λ_e·S``, derived on both sides),
  else ``[S, A]`` (two tensors: Table 1's "4|w|").
* After the step of iteration ``i = e_r + t`` (the only barrier), with ``dS = S̄ - S``,
  ``dA = Ā - A`` and ``c = Σ_{q=e_r+1}^{i} λ_q·m^(q - e_r)``:
  ``u += m^(i - e_r)·dS`` and ``w -= dA + c·dS``.

Why it is exact (§1.7, "Exactness principle"): SGD with momentum is linear in the gradients,
so the correction replaces, in the closed form of (w, u), the local gradients of the window by
the group's averages. After the last window is applied every node holds the same (w, u) as
synchronous SGD on the averaged gradients would, up to rounding. The unit tests check the
spec's exact vectors (§2.3) and this oracle for random t, p, m and per-step learning rates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from p2psync.errors import ConfigError
from p2psync.model import PerElement


@dataclass
class Window:
    """One closed window: its local accumulators, kept until its average is applied."""

    index: int
    start: int
    end: int
    #: local S at the window end (None when the compensation has no momentum part)
    s: np.ndarray | None
    #: local A = Σ λ_i·S_i over the window
    a: np.ndarray
    #: λ of the window's last iteration (derives A from S for one-iteration windows)
    lr_end: PerElement

    @property
    def length(self) -> int:
        return self.end - self.start + 1


@dataclass
class DtsState:
    """Per-node DTS bookkeeping. ``t`` delay (0: none), ``p`` period, ``momentum`` the m the
    compensation uses (0: weights only), ``base`` the first iteration of window 0."""

    t: int
    p: int
    momentum: float
    base: int = 0
    _s: np.ndarray | None = field(default=None, init=False, repr=False)
    _a: np.ndarray | None = field(default=None, init=False, repr=False)
    _start: int | None = field(default=None, init=False, repr=False)
    _next: int | None = field(default=None, init=False, repr=False)
    #: λ of every iteration after the oldest window not applied yet
    _lrs: dict[int, PerElement] = field(default_factory=dict, init=False, repr=False)
    #: closed windows whose average is not applied yet, by index
    pending: dict[int, Window] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        validate(self.t, self.p, self.momentum)
        self._next = self.base

    # -- per iteration -------------------------------------------------------------------

    def step(self, i: int, g: np.ndarray, lr: PerElement) -> Window | None:
        """Record iteration ``i``'s local step (``g`` what SGD fed to its buffer, ``lr`` its λ).
        Returns the window that closes at ``i`` (launch its payload now), else None."""
        if i != self._next:
            raise ConfigError(f"DTS: iteration {i} recorded after {self._next - 1 if self._next is not None else '?'}"
                              " (iterations must be consecutive)")
        self._next = i + 1
        m = self.momentum
        g = np.asarray(g)  # float32 in the strategy; float64 in exactness tests
        if self._start is None:
            self._start = i
            self._s = g.copy()
            self._a = np.asarray(lr * g, dtype=g.dtype)
        else:
            if self._s is None or self._a is None:
                raise ConfigError("DTS: window accumulators lost")
            if m:
                self._s = (g.dtype.type(m) * self._s + g).astype(g.dtype, copy=False)
                self._a = self._a + lr * self._s
            else:
                self._a = self._a + lr * g
        self._lrs[i] = lr
        if (i - self.base) % self.p == self.p - 1:
            return self._close(i)
        return None

    def close_partial(self, i: int) -> Window | None:
        """End of training: close the window in progress early (it ends at ``i``)."""
        return self._close(i) if self._start is not None else None

    def _close(self, i: int) -> Window:
        if self._start is None or self._a is None:
            raise ConfigError("DTS: no window in progress")
        r = (self._start - self.base) // self.p
        w = Window(index=r, start=self._start, end=i, s=self._s if self.momentum else None,
                   a=self._a, lr_end=self._lrs[i])
        self._start, self._s, self._a = None, None, None
        self.pending[r] = w
        self._prune()
        return w

    def due(self, i: int) -> int | None:
        """The index of the window whose average must be applied after iteration ``i``."""
        k = i - self.t - self.base
        if k < 0 or k % self.p != self.p - 1:
            return None
        r = k // self.p
        return r if r in self.pending else None

    # -- payloads ------------------------------------------------------------------------

    def payload_parts(self, w: Window) -> list[np.ndarray]:
        """The tensors averaged over the group for window ``w`` (see the module docstring):
        ``[A]``, ``[S]`` or ``[S, A]``. Two tensors are averaged separately, so a lossy codec
        with error feedback (top-k) selects within each one: S and A differ in scale (A is
        about λ·p·S), and a selection over both together would keep almost only S."""
        if not self.momentum:
            return [w.a]
        if w.s is None:
            raise ConfigError("DTS: momentum window without S")
        if w.length == 1:
            return [w.s]
        return [w.s, w.a]

    def payload(self, w: Window) -> np.ndarray:
        """The payload parts as one vector (the layout :meth:`correction` takes)."""
        parts = self.payload_parts(w)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def payload_tensors(self, w: Window) -> int:
        """How many model-sized tensors the window sends (1 or 2)."""
        return len(self.payload_parts(w))

    def correction(self, w: Window, avg: np.ndarray, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Apply window ``w``'s average ``avg`` (the mean of every member's payload) after
        iteration ``i``: returns ``(dw, du)`` to add to the weights and the momentum buffers
        (``du`` None without momentum). The window is no longer pending."""
        if self.pending.get(w.index) is not w:
            raise ConfigError(f"DTS: window {w.index} is not pending (applied twice?)")
        if i < w.end:
            raise ConfigError(f"DTS: window {w.index} (ends at {w.end}) applied at iteration {i}")
        n = w.a.size
        dt = w.a.dtype
        avg = np.asarray(avg, dtype=dt)
        if avg.size != self.payload(w).size:
            raise ConfigError(f"DTS: average of window {w.index} has {avg.size} values, expected "
                              f"{self.payload(w).size}")
        m = self.momentum
        c = self._late_coefficient(w.end, i) if m else 0.0
        del self.pending[w.index]
        self._prune()
        if not m:
            return (w.a - avg).astype(dt, copy=False), None
        if w.s is None:
            raise ConfigError("DTS: momentum window without S")
        s_bar = avg[:n]
        a_bar = w.lr_end * s_bar if w.length == 1 else avg[n:]
        a_loc = w.a
        ds = s_bar - w.s
        da = a_bar - a_loc
        du = (dt.type(m ** (i - w.end)) * ds).astype(dt, copy=False)
        dw = -(da + c * ds) if not _is_zero(c) else -da
        return np.asarray(dw, dtype=dt), du

    def _late_coefficient(self, end: int, i: int) -> PerElement:
        """c = Σ_{q=end+1}^{i} λ_q·m^(q-end): how far the late momentum steps carried dS."""
        c: PerElement = 0.0
        m = self.momentum
        for q in range(end + 1, i + 1):
            c = c + self._lrs[q] * (m ** (q - end))
        return c

    def _prune(self) -> None:
        """Forget the λ of iterations no pending window or the window in progress needs."""
        ends = [w.end for w in self.pending.values()]
        lo = min(ends) + 1 if ends else (self._next if self._next is not None else 0)
        if self._start is not None:
            lo = min(lo, self._start)
        for q in [q for q in self._lrs if q < lo]:
            del self._lrs[q]

    @property
    def last(self) -> int:
        """The last iteration recorded (``base - 1`` before the first)."""
        return (self._next if self._next is not None else self.base) - 1

    @property
    def in_progress(self) -> bool:
        """A window has recorded iterations and is not closed yet."""
        return self._start is not None

    @property
    def in_flight(self) -> int:
        return len(self.pending)


def max_in_flight(t: int, p: int) -> int:
    """Windows whose average can be outstanding at once: ceil(t / p), and at least one while
    the exchange of a window with t = 0 runs."""
    return max(1, -(-t // p))


def validate(t: int, p: int, momentum: float) -> None:
    if type(t) is not int or t < 0:
        raise ConfigError(f"DTS: t={t!r}: the delay must be an integer >= 0 (0: no delay)")
    if type(p) is not int or p < 1:
        raise ConfigError(f"DTS: p={p!r}: the period must be an integer >= 1")
    if not 0.0 <= momentum < 1.0:
        raise ConfigError(f"DTS: momentum {momentum!r} must be in [0, 1)")


def _is_zero(x: PerElement) -> bool:
    return isinstance(x, float) and x == 0.0


__all__ = ["DtsState", "Window", "max_in_flight", "validate"]

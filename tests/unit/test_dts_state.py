"""DTS's pure compensation against the reading notes' exact vectors (../shared/specs/dts.md
§2.3), the "oracle" closed form (§1.7, §5 item 2) for random t, p, m and per-step learning
rates, the local-SGD equivalence (§5 item 4), path independence (§5 item 9), payload sizes
(§5 item 7), the schedule (§5 item 8) and validation (§5 item 10)."""

from __future__ import annotations

from fractions import Fraction as F

import numpy as np
import pytest

from p2psync.errors import ConfigError
from p2psync.strategies.dts_state import DtsState, max_in_flight

G0 = [1, 2, 3, 4, 5, 6, 7, 8]
G1 = [3, 2, 1, 0, -1, -2, -3, -4]


def simulate(t: int, p: int, m: float, grads: list[list[float]], lrs: list[float] | float = 1.0,
             flush: bool = False, dtype=np.float64):
    """Momentum SGD in PyTorch order on each worker with DTS compensation; returns the
    (w, u) trace per worker after every iteration (and after a final flush)."""
    n = len(grads[0])
    lr_of = (lambda i: lrs[i]) if isinstance(lrs, list) else (lambda i: lrs)
    states = [DtsState(t=t, p=p, momentum=m) for _ in grads]
    w = [np.zeros(1, dtype) for _ in grads]
    u = [np.zeros(1, dtype) for _ in grads]
    payloads: dict[int, list[np.ndarray]] = {}
    trace: list[list[tuple[float, float]]] = [[] for _ in grads]

    def apply(j: int, r: int, i: int) -> None:
        win = states[j].pending[r]
        avg = np.mean(np.stack(payloads[r]), axis=0)
        dw, du = states[j].correction(win, avg, i)
        w[j] += dw
        if du is not None:
            u[j] += du

    for i in range(n):
        for j, g in enumerate(grads):
            gi = np.array([g[i]], dtype)
            u[j] = m * u[j] + gi
            w[j] = w[j] - lr_of(i) * u[j]
            win = states[j].step(i, gi, lr_of(i))
            if win is not None:
                payloads.setdefault(win.index, []).append(states[j].payload(win))
        for j in range(len(grads)):
            r = states[j].due(i)
            if r is not None:
                apply(j, r, i)
            trace[j].append((float(w[j][0]), float(u[j][0])))
    if flush:
        for j in range(len(grads)):
            win = states[j].close_partial(n - 1)
            if win is not None:
                payloads.setdefault(win.index, []).append(states[j].payload(win))
        for j in range(len(grads)):
            for r in sorted(states[j].pending):
                apply(j, r, n - 1)
            trace[j].append((float(w[j][0]), float(u[j][0])))
    return trace, states


def fr(s: str) -> list[F]:
    return [F(x) for x in s.split()]


# §2.3: (t, p) -> worker -> (w row, u row)
VECTORS = {
    (0, 1): {0: ("-2 -5 -17/2 -49/4 -129/8 -321/16 -769/32 -1793/64", "2 3 7/2 15/4 31/8 63/16 127/32 255/64"),
             1: ("-2 -5 -17/2 -49/4 -129/8 -321/16 -769/32 -1793/64", "2 3 7/2 15/4 31/8 63/16 127/32 255/64")},
    (1, 1): {0: ("-1 -5 -19/2 -57/4 -153/8 -385/16 -929/32 -2177/64", "1 3 9/2 23/4 55/8 127/16 287/32 639/64"),
             1: ("-3 -5 -15/2 -41/4 -105/8 -257/16 -609/32 -1409/64", "3 3 5/2 7/4 7/8 -1/16 -33/32 -129/64")},
    (0, 2): {0: ("-1 -5 -19/2 -49/4 -153/8 -321/16 -929/32 -1793/64", "1 3 9/2 15/4 55/8 63/16 287/32 255/64"),
             1: ("-3 -5 -15/2 -49/4 -105/8 -321/16 -609/32 -1793/64", "3 3 5/2 15/4 7/8 63/16 -33/32 255/64")},
    (1, 2): {0: ("-1 -7/2 -19/2 -63/4 -153/8 -457/16 -929/32 -2657/64", "1 5/2 9/2 25/4 55/8 151/16 287/32 799/64"),
             1: ("-3 -13/2 -15/2 -35/4 -105/8 -185/16 -609/32 -929/64", "3 7/2 5/2 5/4 7/8 -25/16 -33/32 -289/64")},
    (2, 3): {0: ("-1 -7/2 -31/4 -111/8 -177/8 -513/16 -1409/32 -2657/64", "1 5/2 17/4 49/8 63/8 159/16 383/32 799/64"),
             1: ("-3 -13/2 -37/4 -85/8 -81/8 -129/16 -129/32 -929/64", "3 7/2 11/4 11/8 -1/8 -33/16 -129/32 -289/64")},
}


@pytest.mark.parametrize("t,p", sorted(VECTORS))
def test_exact_vectors_of_the_spec(t, p):
    trace, _ = simulate(t, p, 0.5, [G0, G1])
    for j, (ws, us) in VECTORS[(t, p)].items():
        assert [F(w) for w, _ in trace[j]] == fr(ws), (t, p, j, "w")
        assert [F(u) for _, u in trace[j]] == fr(us), (t, p, j, "u")


def test_exact_vectors_in_float32_too():
    """The strategy runs in float32: the dyadic vectors are exact there as well."""
    trace, _ = simulate(1, 2, 0.5, [G0, G1], dtype=np.float32)
    assert [F(w) for w, _ in trace[0]] == fr(VECTORS[(1, 2)][0][0])


def test_vanilla_delay_closed_form():
    """§2.3: m = 0, t = 2, p = 1: w0 = -1, -3, -7, -11, ...; w1 = -3, -5, -5, ..."""
    trace, _ = simulate(2, 1, 0.0, [G0, G1])
    assert [w for w, _ in trace[0]] == [-1, -3, -7, -11, -15, -19, -23, -27]
    assert [w for w, _ in trace[1]] == [-3, -5, -5, -5, -5, -5, -5, -5]


def _oracle(t: int, p: int, m: float, grads, lrs, applied_upto):
    """(w, u) of momentum SGD driven by e_k = mean gradient for every k whose window has been
    applied, else the local g_k (§1.7 "Exactness principle")."""
    mean = np.mean(np.array(grads), axis=0)
    out = []
    for j, g in enumerate(grads):
        rows = []
        for i in range(len(g)):
            w = u = 0.0
            for k in range(i + 1):
                e = mean[k] if k <= applied_upto(i) else g[k]
                u = m * u + e
                w = w - lrs[k] * u
            rows.append((w, u))
        out.append(rows)
    return out


@pytest.mark.parametrize("t,p,m", [(0, 1, 0.9), (0, 3, 0.9), (1, 1, 0.5), (3, 2, 0.9), (4, 4, 0.7),
                                   (2, 5, 0.0), (5, 1, 0.0), (3, 3, 0.95)])
def test_oracle_with_a_learning_rate_schedule(t, p, m):
    rng = np.random.default_rng(t * 100 + p)
    n = 23
    grads = rng.normal(size=(4, n)).tolist()
    lrs = list(rng.uniform(0.01, 0.5, size=n))

    def applied_upto(i: int) -> int:
        k = i - t  # the newest window end whose average is applied after iteration i
        if k < 0:
            return -1
        return (k - (p - 1)) // p * p + p - 1 if k >= p - 1 else -1

    trace, _ = simulate(t, p, m, grads, lrs)
    want = _oracle(t, p, m, grads, lrs, applied_upto)
    np.testing.assert_allclose(np.array(trace), np.array(want), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("t,p", [(0, 1), (0, 4), (3, 1), (2, 3), (5, 2)])
def test_after_flush_every_worker_holds_the_synchronous_model(t, p):
    rng = np.random.default_rng(7)
    grads = rng.normal(size=(3, 17)).tolist()
    lrs = list(rng.uniform(0.05, 0.2, size=17))
    trace, states = simulate(t, p, 0.9, grads, lrs, flush=True)
    final = [tr[-1] for tr in trace]
    sync = _oracle(t, p, 0.9, grads, lrs, lambda i: i)
    for fw, fu in final:
        assert fw == pytest.approx(sync[0][-1][0], rel=1e-10)
        assert fu == pytest.approx(sync[0][-1][1], rel=1e-10)
    assert all(not s.pending for s in states)


def test_no_delay_sparse_equals_local_sgd_averaging_weights_and_momentum():
    """§5 item 4: t = 0, p > 1 is local SGD averaging w and u after iterations p-1, 2p-1, ..."""
    rng = np.random.default_rng(3)
    grads = rng.normal(size=(4, 20)).tolist()
    p, m, lr = 4, 0.9, 0.1
    trace, _ = simulate(0, p, m, grads, lr)
    w = np.zeros(4)
    u = np.zeros(4)
    for i in range(20):
        u = m * u + np.array([g[i] for g in grads])
        w = w - lr * u
        if i % p == p - 1:
            w[:] = w.mean()
            u[:] = u.mean()
        for j in range(4):
            assert trace[j][i][0] == pytest.approx(w[j], abs=1e-12)
            assert trace[j][i][1] == pytest.approx(u[j], abs=1e-12)


def test_path_independence():
    """§2.3 cross-check: t=2,p=3 and t=1,p=2 have both averaged {0..5} after i = 7."""
    a, _ = simulate(2, 3, 0.5, [G0, G1])
    b, _ = simulate(1, 2, 0.5, [G0, G1])
    assert a[0][7] == b[0][7] == (float(F(-2657, 64)), float(F(799, 64)))


def test_identical_gradients_give_zero_corrections():
    """§5 item 6: identical data on every worker: DTS is single-worker SGD, bitwise."""
    g = list(np.random.default_rng(1).normal(size=12))
    trace, _ = simulate(3, 2, 0.9, [g, g])
    plain, _ = simulate(0, 1, 0.9, [g])
    assert trace[0] == trace[1] == plain[0]


def test_payload_sizes():
    """§5 item 7: m = 0 -> A only; p = 1 -> g only; otherwise S and A."""
    g = np.ones(5, np.float32)
    for m, p, tensors in [(0.0, 4, 1), (0.9, 1, 1), (0.9, 4, 2)]:
        st = DtsState(t=0, p=p, momentum=m)
        win = None
        for i in range(p):
            win = st.step(i, g, 0.1)
        assert win is not None
        assert st.payload(win).size == 5 * tensors
        assert st.payload_tensors(win) == tensors


def test_schedule_launch_and_apply_points():
    """§5 item 8: window r launched at the end of r·p+p-1 and applied after r·p+p-1+t, once."""
    t, p = 3, 2
    st = DtsState(t=t, p=p, momentum=0.9)
    g = np.ones(2, np.float32)
    launched, applied = [], []
    for i in range(14):
        win = st.step(i, g, 0.1)
        if win is not None:
            launched.append((win.index, i))
        r = st.due(i)
        if r is not None:
            applied.append((r, i))
            st.correction(st.pending[r], st.payload(st.pending[r]), i)
        assert st.in_flight <= max_in_flight(t, p)
    assert launched == [(r, r * p + p - 1) for r in range(7)]
    assert applied == [(r, r * p + p - 1 + t) for r in range(len(applied))]
    with pytest.raises(ConfigError, match="not pending"):
        st.correction(st.pending.get(0) or _fake(), np.zeros(4, np.float32), 20)


def _fake():
    from p2psync.strategies.dts_state import Window

    return Window(index=0, start=0, end=1, s=np.zeros(2, np.float32), a=np.zeros(2, np.float32), lr_end=0.1)


def test_out_of_order_application_gives_the_same_state():
    """Windows applied in a different order (averages arriving out of order at a flush) end
    at the same state."""
    rng = np.random.default_rng(5)
    g = rng.normal(size=(2, 8)).astype(np.float32)
    results = []
    for order in (lambda rs: sorted(rs), lambda rs: sorted(rs, reverse=True)):
        sts = [DtsState(t=8, p=2, momentum=0.9) for _ in range(2)]
        w = [np.zeros(8, np.float64) for _ in range(2)]
        pays: dict[int, list[np.ndarray]] = {}
        for i in range(8):
            for j in range(2):
                win = sts[j].step(i, g[j, i:i + 1].repeat(8), 0.1)
                if win is not None:
                    pays.setdefault(win.index, []).append(sts[j].payload(win))
        for r in order(list(sts[0].pending)):
            dw, _ = sts[0].correction(sts[0].pending[r], np.mean(pays[r], axis=0), 7)
            w[0] += dw
        results.append(w[0])
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)


@pytest.mark.parametrize("kw,match", [(dict(t=-1, p=1, momentum=0.0), "t=-1"),
                                      (dict(t=0, p=0, momentum=0.0), "p=0"),
                                      (dict(t=1.5, p=1, momentum=0.0), "t=1.5"),
                                      (dict(t=0, p=1, momentum=1.0), "momentum")])
def test_validation(kw, match):
    with pytest.raises(ConfigError, match=match):
        DtsState(**kw)


def test_iterations_must_be_consecutive():
    st = DtsState(t=0, p=2, momentum=0.0)
    st.step(0, np.ones(1, np.float32), 0.1)
    with pytest.raises(ConfigError, match="consecutive"):
        st.step(2, np.ones(1, np.float32), 0.1)


def test_learning_rate_history_stays_bounded():
    st = DtsState(t=2, p=3, momentum=0.9)
    g = np.ones(3, np.float32)
    for i in range(300):
        st.step(i, g, 0.1)
        r = st.due(i)
        if r is not None:
            st.correction(st.pending[r], st.payload(st.pending[r]), i)
    assert len(st._lrs) <= 2 * (2 + 3)

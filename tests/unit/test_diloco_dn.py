"""Delayed Nesterov (Async Local-SGD Alg. 3, c = 0) and DyLU (Eq. 6), the pure logic of
``--strategy diloco-async``: the spec's worked vector, invariant I21 (order independence within
a buffer, exact; one update per worker equals synchronous Nesterov on the mean) and DyLU's
worked numbers."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch

from p2psync.strategies.diloco.dn import DNState, apply_update, dylu_steps, pack, state_size, unpack


def _exact(values: list[Fraction]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def test_the_worked_vector_of_delayed_nesterov() -> None:
    """ε 0.5, β 0.9, N 2, arrivals 1, 3, 2, −2 → θ −0.25, −1.9, −2.4, −2.71; m 0, 2, 2, 1.8
    (exact, in Fractions; and in float64 to the last bits)."""
    eps, beta = Fraction(1, 2), Fraction(9, 10)
    st = DNState.start(_exact([Fraction(0)]))
    got = []
    for g in (1, 3, 2, -2):
        boundary = apply_update(st, _exact([Fraction(g)]), lr=eps, momentum=beta, buffer=2)  # type: ignore[arg-type]
        got.append((st.theta[0], st.momentum[0], boundary))
    assert got == [(Fraction(-1, 4), 0, False), (Fraction(-19, 10), 2, True), (Fraction(-24, 10), 2, False),
                   (Fraction(-271, 100), Fraction(18, 10), True)]
    assert st.count == 4 and st.in_buffer == 0 and st.buffer[0] == 0
    f = DNState.start(np.zeros(1))
    thetas = []
    for g in (1.0, 3.0, 2.0, -2.0):
        apply_update(f, np.array([g]), lr=0.5, momentum=0.9, buffer=2)
        thetas.append(f.theta[0])
    np.testing.assert_allclose(thetas, [-0.25, -1.9, -2.4, -2.71], rtol=1e-12)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_complete_buffer_does_not_depend_on_the_arrival_order(n: int) -> None:
    """I21: with c = 0 the state after each complete buffer is the same for every order of the
    buffer's updates (exact arithmetic), over two buffers; the state between boundaries does
    depend on it (so the check could fail)."""
    rng = np.random.default_rng(n)
    eps, beta = Fraction(7, 10), Fraction(9, 10)
    buffers = [[_exact([Fraction(int(v), 8) for v in rng.integers(-40, 40, 3)]) for _ in range(n)] for _ in range(2)]
    finals, firsts = set(), set()
    for orders in itertools.product(itertools.permutations(range(n)), repeat=2):
        st = DNState.start(_exact([Fraction(1), Fraction(-2), Fraction(3, 4)]))
        for b, order in zip(buffers, orders):
            for i in order:
                apply_update(st, b[i], lr=eps, momentum=beta, buffer=n)  # type: ignore[arg-type]
                if st.count == 1:
                    firsts.add(tuple(st.theta))
            assert st.in_buffer == 0
        finals.add((tuple(st.theta), tuple(st.momentum)))
    assert len(finals) == 1
    assert len(firsts) == n  # the intermediate states differ with the first arrival


def test_one_update_per_worker_per_buffer_is_synchronous_nesterov_on_the_mean() -> None:
    """I21 / E9: N workers, each buffer one update from each: θ after each buffer equals
    torch.optim.SGD(lr=ε, momentum=β, nesterov=True) stepping on the buffer's mean (the spec's
    §5.7 pair means 2, 0 → −1.9, −2.71 among them)."""
    eps, beta, n = 0.5, 0.9, 4
    rng = np.random.default_rng(0)
    rounds = [rng.standard_normal((n, 6)) for _ in range(5)]
    st = DNState.start(np.zeros(6))
    p = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([p], lr=eps, momentum=beta, nesterov=True)
    for r in rounds:
        for g in r[::-1]:
            apply_update(st, g, lr=eps, momentum=beta, buffer=n)
        p.grad = torch.from_numpy(r.mean(axis=0))
        opt.step()
        np.testing.assert_allclose(st.theta, p.detach().numpy(), rtol=1e-12, atol=1e-12)
    pair = DNState.start(np.zeros(1))
    seen = []
    for g in (1.0, 3.0, 2.0, -2.0):
        if apply_update(pair, np.array([g]), lr=0.5, momentum=0.9, buffer=2):
            seen.append(pair.theta[0])
    np.testing.assert_allclose(seen, [-1.9, -2.71])


def test_float32_replicas_that_apply_one_stream_are_bitwise_equal() -> None:
    rng = np.random.default_rng(1)
    stream = [rng.standard_normal(1000).astype(np.float32) for _ in range(9)]
    a, b = DNState.start(np.ones(1000, np.float32)), DNState.start(np.ones(1000, np.float32))
    for g in stream:
        apply_update(a, g, lr=0.7, momentum=0.9, buffer=3)
    for g in stream:
        apply_update(b, g.copy(), lr=0.7, momentum=0.9, buffer=3)
    assert a.theta.dtype == np.float32 and a.theta.tobytes() == b.theta.tobytes()
    c = DNState.start(np.ones(1000, np.float32))
    for g in [stream[1], stream[0], *stream[2:]]:
        apply_update(c, g, lr=0.7, momentum=0.9, buffer=3)
    np.testing.assert_allclose(c.theta, a.theta, rtol=1e-5, atol=1e-5)  # another order: the same up to rounding


def test_a_buffer_fuller_than_n_completes_at_the_next_update_and_bad_input_is_refused() -> None:
    st = DNState.start(np.zeros(2))
    st.in_buffer = 3  # adopted with N = 4, now N = 2 (the group shrank)
    assert apply_update(st, np.ones(2), lr=1.0, momentum=0.5, buffer=2) and st.in_buffer == 0
    with pytest.raises(ValueError):
        apply_update(st, np.ones(3), lr=1.0, momentum=0.5, buffer=2)
    with pytest.raises(ValueError):
        apply_update(st, np.ones(2), lr=1.0, momentum=0.5, buffer=0)


def test_the_state_vector_round_trips_bitwise() -> None:
    rng = np.random.default_rng(2)
    st = DNState(theta=rng.standard_normal(5).astype(np.float32), momentum=rng.standard_normal(5).astype(np.float32),
                 buffer=rng.standard_normal(5).astype(np.float32), count=123456789, in_buffer=3, stop=True)
    vec = pack(st)
    assert vec.dtype == np.float32 and vec.size == state_size(5)
    back = unpack(vec, 5)
    assert back.count == 123456789 and back.in_buffer == 3 and back.stop
    assert pack(back).tobytes() == vec.tobytes()
    with pytest.raises(ValueError):
        unpack(vec[:-1], 5)


def test_dylu_worked_numbers() -> None:
    """§5.7: speeds 1.724, 1.333, 0.662, 0.300 steps/s and H 100 → 100, 77, 38, 17; equal
    speeds give H; the floor; no speed measured yet gives H."""
    speeds = [1.724, 1.333, 0.662, 0.300]
    assert [dylu_steps(v, speeds, inner_steps=100, min_steps=5) for v in speeds] == [100, 77, 38, 17]
    secs = [0.58, 0.75, 1.51, 3.33]  # the notebook's form, from seconds per step
    assert [max(int(100 * min(secs) / s), 5) for s in secs] == [100, 77, 38, 17]
    assert dylu_steps(2.0, [2.0, 2.0], inner_steps=50, min_steps=5) == 50
    assert dylu_steps(0.01, [2.0], inner_steps=50, min_steps=5) == 5
    assert dylu_steps(0.0, [2.0], inner_steps=50, min_steps=5) == 50
    assert dylu_steps(1.0, [], inner_steps=50, min_steps=5) == 50

"""DiLoCo's pure parts against worked examples: the outer Nesterov step (and torch's SGD),
periodic averaging, the Streaming schedule, the α merge, eager rounds, DyLU,
the fragment map, the adopted state, and the options' checks."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
import torch

from p2psync.errors import ConfigError, ProtocolError
from p2psync.strategies.base import get_strategy, parse_options
from p2psync.model import Layer
from p2psync.strategies.diloco.fragments import fragment_map, indices
from p2psync.strategies.diloco.outer import eager_gradient, late_part, merge, others_mean, outer_step, own_term
from p2psync.strategies.diloco.schedule import Cursor, Schedule, dylu_interval
from p2psync.strategies.diloco.state import Counters, pack_state, state_size, unpack_state
from p2psync.topology import ring


def _f32(x):
    return np.array(x, np.float32)


def test_two_outer_rounds_of_the_worked_example():
    """η = 0.7, μ = 0.9, two workers, two rounds."""
    theta = _f32([1.0, -2.0, 0.5])
    d1 = (_f32([0.1, -0.2, 0.0]) + _f32([0.3, 0.2, -0.1])) / np.float32(2)
    buf = outer_step(theta, None, d1, lr=0.7, momentum=0.9, nesterov=True)
    np.testing.assert_allclose(buf, [0.2, 0.0, -0.05], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(theta, [0.734, -2.0, 0.5665], rtol=1e-6)
    buf = outer_step(theta, buf, _f32([0.1, 0.0, 0.05]), lr=0.7, momentum=0.9, nesterov=True)
    np.testing.assert_allclose(buf, [0.28, 0.0, 0.005], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(theta, [0.4876, -2.0, 0.52835], rtol=1e-6)


def test_dyadic_rounds_are_exact_against_fractions():
    """Dyadic inputs: every float32 operation is exact, so the result equals the rational one."""
    lr, mu = 0.5, 0.75
    theta, buf = _f32([1.0, -2.0]), None
    th = [Fraction(1), Fraction(-2)]
    b: list[Fraction] | None = None
    for g in ([0.25, -0.5], [0.125, 0.0], [-0.5, 0.25]):
        buf = outer_step(theta, buf, _f32(g), lr=lr, momentum=mu, nesterov=True)
        gf = [Fraction(x) for x in g]
        b = gf if b is None else [Fraction(mu) * bi + gi for bi, gi in zip(b, gf)]
        th = [t - Fraction(lr) * (gi + Fraction(mu) * bi) for t, gi, bi in zip(th, gf, b)]
        assert [Fraction(float(x)) for x in theta] == th
        assert [Fraction(float(x)) for x in buf] == b


def test_the_outer_step_is_torch_sgd_with_nesterov_over_ten_rounds():
    """A random 1k vector, 10 rounds, against torch.optim.SGD fed Δ̄ as the gradient."""
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(1000).astype(np.float32)
    p = torch.nn.Parameter(torch.from_numpy(theta.copy()))
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    buf = None
    for _ in range(10):
        g = rng.standard_normal(1000).astype(np.float32) * np.float32(0.1)
        buf = outer_step(theta, buf, g, lr=0.7, momentum=0.9, nesterov=True)
        p.grad = torch.from_numpy(g.copy())
        opt.step()
    np.testing.assert_allclose(theta, p.detach().numpy(), rtol=1e-5, atol=1e-6)
    # heavy ball (nesterov=false) and no momentum
    t2, q = _f32([1.0]), torch.nn.Parameter(torch.tensor([1.0]))
    o2 = torch.optim.SGD([q], lr=0.5, momentum=0.5)
    b2 = None
    for g in (0.5, 0.25):
        b2 = outer_step(t2, b2, _f32([g]), lr=0.5, momentum=0.5, nesterov=False)
        q.grad = torch.tensor([g])
        o2.step()
    assert float(t2[0]) == pytest.approx(float(q.detach()[0]))
    t3 = _f32([1.0])
    assert outer_step(t3, None, _f32([0.25]), lr=1.0, momentum=0.0, nesterov=True) is None and t3[0] == 0.75


def test_outer_lr_1_without_momentum_is_model_averaging():
    """θ_g − 1·mean(θ_g − θ_m) = mean θ_m; inner SGD: the SSGD step [0.95, 1.9]."""
    theta = _f32([1.0, 2.0])
    locals_ = [theta - np.float32(0.1) * _f32([1, 0]), theta - np.float32(0.1) * _f32([0, 2])]
    mean = np.mean([theta - x for x in locals_], axis=0).astype(np.float32)
    outer_step(theta, None, mean, lr=1.0, momentum=0.0, nesterov=True)
    np.testing.assert_allclose(theta, [0.95, 1.9], rtol=1e-6)


def test_the_streaming_schedule_h12_p3_tau2():
    """H = 12, three fragments, tau = 2: fragment f sent at (f+1)·4 + 12k, applied 2 steps later; at most one in flight."""
    s = Schedule(12, 3, 2)
    sends = [(t, s.send(t)) for t in range(1, 31) if s.send(t) is not None]
    applies = [(t, s.apply(t)) for t in range(1, 31) if s.apply(t) is not None]
    assert sends == [(4, 0), (8, 1), (12, 2), (16, 0), (20, 1), (24, 2), (28, 0)]
    assert applies == [(6, 0), (10, 1), (14, 2), (18, 0), (22, 1), (26, 2), (30, 0)]
    inflight = 0
    for t in range(1, 31):
        inflight += s.send(t) is not None
        assert inflight <= 1
        inflight -= s.apply(t) is not None
    plain = Schedule(5, 1, 0)  # DiLoCo: send and apply after the same step, every H
    assert [t for t in range(1, 16) if plain.send(t) is not None] == [5, 10, 15]
    assert all(plain.send(t) == plain.apply(t) for t in range(1, 16))
    for bad in ((12, 5, 0), (12, 3, 4)):
        with pytest.raises(ConfigError):
            Schedule(*bad)


def test_the_alpha_merge():
    """θ_g[f] = [0.601, 2.133] after the outer step; worker 1 trained on to [0.7, 2.3]."""
    theta = _f32([1.0, 2.0])
    buf = outer_step(theta, None, _f32([0.3, -0.1]), lr=0.7, momentum=0.9, nesterov=True)
    assert buf is not None
    np.testing.assert_allclose(theta, [0.601, 2.133], rtol=1e-6)
    loc = _f32([0.7, 2.3])
    assert merge(theta, loc, 0.0).tobytes() == theta.tobytes()
    np.testing.assert_allclose(merge(theta, loc, 0.5), [0.6505, 2.2165], rtol=1e-6)
    assert merge(theta, loc, 1.0).tobytes() == loc.tobytes()


def _layers(names_sizes):
    out, off = [], 0
    for i, (name, n) in enumerate(names_sizes):
        out.append(Layer(name=name, kind="fc", offset=off, numel=n, params=(i,)))
        off += n
    return out, off


def test_fragment_maps_strided_sequential_flat():
    layers, n = _layers([("emb", 10), ("blocks.0.a", 4), ("blocks.0.b", 2), ("blocks.1.a", 4), ("blocks.1.b", 2),
                         ("blocks.2.a", 4), ("blocks.2.b", 2), ("blocks.3.a", 4), ("blocks.3.b", 2), ("head", 3)])
    assert fragment_map(layers, n, 1, by="blocks", pattern="strided") == [((0, n),)]
    strided = fragment_map(layers, n, 2, by="blocks", pattern="strided")
    assert strided == [((10, 16), (22, 28)), ((16, 22), (28, 34)), ((0, 10), (34, 37))]  # E last
    seq = fragment_map(layers, n, 2, by="blocks", pattern="sequential")
    assert seq == [((10, 22),), ((22, 34),), ((0, 10), (34, 37))]
    flat = fragment_map(layers, n, 2, by="flat", pattern="strided")
    assert len(flat) == 2 and flat[0][0][0] == 0 and flat[-1][-1][1] == n
    got = np.sort(np.concatenate([indices(r) for r in strided]))
    assert np.array_equal(got, np.arange(n))  # a partition of the vector
    with pytest.raises(ConfigError, match="fragments=5"):
        fragment_map(layers, n, 5, by="blocks", pattern="strided")
    plain, m = _layers([("a", 3), ("b", 3)])
    with pytest.raises(ConfigError, match="fragment_by=flat"):
        fragment_map(plain, m, 2, by="blocks", pattern="strided")


def test_the_adopted_state_round_trips():
    frags = [np.array([0, 1]), np.array([2, 3, 4])]
    theta = _f32([1, 2, 3, 4, 5])
    c = Counters(op=7, t=(1 << 30) + 5, step=123456789, applied=3)
    vec = pack_state(theta, [None, _f32([0.5, 0.25, -1])], frags, c)
    th, bufs, c2, held = unpack_state(vec, 5, frags)
    assert th.tobytes() == theta.tobytes() and bufs[0] is None and bufs[1].tolist() == [0.5, 0.25, -1]
    assert c2 == c and held is None
    with pytest.raises(ProtocolError):
        unpack_state(vec[:-1], 5, frags)


def test_the_adopted_eager_state_carries_the_held_term():
    """With eager updates the state also carries the own fresh term θ_g holds of the round in
    flight; a vector of the other layout is refused."""
    frags = [np.arange(4)]
    theta, held = _f32([1, 2, 3, 4]), _f32([0.25, -0.5, 0, 1e-30])
    c = Counters(op=5, t=20, step=19, applied=4)
    vec = pack_state(theta, [_f32([1, 1, 2, 2])], frags, c, held)
    assert vec.size == state_size(4, 1, eager=True) == state_size(4, 1) + 4
    th, bufs, c2, h = unpack_state(vec, 4, frags, eager=True)
    assert th.tobytes() == theta.tobytes() and bufs[0].tolist() == [1, 1, 2, 2] and c2 == c
    assert h is not None and h.tobytes() == held.tobytes()
    with pytest.raises(ProtocolError):
        unpack_state(vec, 4, frags)
    with pytest.raises(ProtocolError):
        unpack_state(pack_state(theta, [None], frags, c), 4, frags, eager=True)


@pytest.mark.parametrize("frag,at_stop", [(0, True), (1, False), (-1, False), (-2, False)])
def test_the_counters_carry_the_stops_markers(frag, at_stop):
    """The final sync's and the closing checks' fragment numbers, and a round launched after
    the members agreed to stop (eager's completion round), reach a member that adopts them."""
    c = Counters(op=3, t=12, step=11, applied=2, frag=frag, at_stop=at_stop)
    assert Counters.unpack(c.pack()) == c
    assert c.stopping == (frag != 1)
    bad = c.pack()
    bad[-1] = 2  # the flag is 0 or 1
    with pytest.raises(ProtocolError):
        Counters.unpack(bad)


@pytest.mark.parametrize("raw,name", [
    ({"inner_steps": 0}, "inner_steps"), ({"outer_lr": -1}, "outer_lr"), ({"outer_momentum": 1}, "outer_momentum"),
    ({"fragments": 3, "inner_steps": 10}, "inner_steps"), ({"tau": 10, "inner_steps": 10}, "tau"),
    ({"alpha": 1.5}, "alpha"), ({"eager": "true", "fragments": 2, "inner_steps": 4}, "eager"),
    ({"eager": "true", "tau": 1}, "eager"), ({"eager": "true", "weighting": "samples"}, "eager"),
    ({"eager": "true", "outer_codec": "topk"}, "eager"), ({"eager_delay": 2}, "eager_delay"),
    ({"dylu": "maybe"}, "dylu"), ({"dylu_min_steps": 3}, "dylu_min_steps"),
    ({"dylu": "true", "dylu_min_steps": 0}, "dylu_min_steps"),
    ({"join_inner_state": "peer"}, "join_inner_state"), ({"outer_codec": "e3m0:x"}, "outer_codec"),
    ({"outer_codec": "e3m0:sr:64"}, "outer_codec"),
    ({"error_feedback": "maybe"}, "error_feedback"), ({"weighting": "tokens"}, "weighting"),
    ({"final_sync": "none"}, "final_sync"), ({"nesterov": "perhaps"}, "nesterov"), ({"beta": 1}, "beta"),
    ({"outer_collective": "hypercube"}, "outer_collective")])
def test_every_bad_option_is_a_config_error_naming_it(raw, name):
    with pytest.raises(ConfigError, match=name):
        parse_options(get_strategy("diloco"), raw, topology=ring(4))


def test_good_options_parse():
    o = parse_options(get_strategy("diloco"), {"inner_steps": "12", "fragments": "3", "tau": "2",
                                               "outer_codec": "e3m0:64", "error_feedback": "on"})
    assert (o.inner_steps, o.fragments, o.tau, o.outer_codec, o.feedback) == (12, 3, 2, "e3m0:64", True)
    assert parse_options(get_strategy("diloco"), {}).feedback is None
    assert parse_options(get_strategy("diloco"), {"outer_codec": "e3m0:64:sr"}).outer_codec == "e3m0:64:sr"


def test_a_lossy_outer_codec_takes_the_direct_plan_unless_told_otherwise():
    o = parse_options(get_strategy("diloco"), {})
    assert o.outer_plan("e3m0", "auto") == o.outer_plan("int8", "ring") == "direct"
    assert o.outer_plan("none", "auto") == "auto" and o.outer_plan("topk", "ring") == "ring"
    assert parse_options(get_strategy("diloco"), {"outer_collective": "ring"}).outer_plan("e3m0", "auto") == "ring"


def test_the_cursor_is_the_schedule_when_its_interval_is_constant():
    for h_total, parts, tau in ((12, 3, 2), (5, 1, 0), (8, 2, 1), (6, 3, 0)):
        s = Schedule(h_total, parts, tau)
        c = Cursor(parts=parts, interval=s.interval, delay=tau)
        for t in range(1, 40):
            f, apply = c.step()
            if f is not None:
                c.sent(f)
                apply = c.apply_now()
            assert f == s.send(t), (h_total, parts, tau, t)
            assert (s.apply(t) is not None) == apply, (h_total, parts, tau, t)
            if apply:
                c.applied()


def test_dylu_intervals_of_the_worked_example():
    """0.58, 0.75, 1.51, 3.33 s/step (the Async Local-SGD toy example's devices), H = 100:
    H_m = 100, 77, 38, 17; equal speeds give H."""
    speeds = [1 / 0.58, 1 / 0.75, 1 / 1.51, 1 / 3.33]
    assert [dylu_interval(v, max(speeds), 100, 1, 5) for v in speeds] == [100, 77, 38, 17]
    assert [dylu_interval(v, max(speeds), 100, 4, 5) for v in speeds] == [25, 19, 9, 4]
    assert dylu_interval(0.01, 1.0, 100, 1, 5) == 5 and dylu_interval(0.01, 1.0, 100, 4, 5) == 2  # the floor
    assert dylu_interval(2.0, 2.0, 100, 4, 5) == 25
    assert dylu_interval(0.0, 0.0, 100, 4, 5) == 25  # nothing measured yet: H


def _eager_run(mu: float) -> tuple[list[list[float]], list[float], list[float]]:
    """Two nodes, η = 1, the given outer gradients per round; θ per node after each round,
    then each node's θ and buffer after the completion step."""
    rounds = [[1.0, 3.0], [2.0, 0.0], [-1.0, 1.0]]
    theta = [_f32([0.0]), _f32([0.0])]
    bufs: list = [None, None]
    seen: list[list[float]] = []
    prev = None
    for r in rounds:
        for m in range(2):
            others = None if prev is None else others_mean(_f32([sum(prev)]), _f32([prev[m]]), 2.0)
            g = eager_gradient(_f32([r[m]]), 2.0, others)
            bufs[m] = outer_step(theta[m], bufs[m], g, lr=1.0, momentum=mu, nesterov=True)
        seen.append([float(theta[0][0]), float(theta[1][0])])
        prev = r
    for m in range(2):  # completion: the others' last contributions, no new own one
        bufs[m] = outer_step(theta[m], bufs[m], others_mean(_f32([sum(prev)]), _f32([prev[m]]), 2.0),
                             lr=1.0, momentum=mu, nesterov=True)
    return seen, [float(t[0]) for t in theta], [float(b[0]) if b is not None else 0.0 for b in bufs]


def test_eager_rounds_of_the_worked_example():
    """μ = 0: −0.5/−1.5, −3/−2, −2.5/−3.5, and the completion brings both to −3;
    μ = 0.9: −0.95/−2.85, −6.105/−5.015, −7.5445/−9.3635, completion −10.24005/−10.97715,
    buffers 2.4395/2.3485 (their mean, −10.6086 and 2.394, is every node's final state)."""
    seen, final, _ = _eager_run(0.0)
    np.testing.assert_allclose(seen, [[-0.5, -1.5], [-3.0, -2.0], [-2.5, -3.5]], rtol=1e-6)
    np.testing.assert_allclose(final, [-3.0, -3.0], rtol=1e-6)
    seen, final, bufs = _eager_run(0.9)
    np.testing.assert_allclose(seen, [[-0.95, -2.85], [-6.105, -5.015], [-7.5445, -9.3635]], rtol=1e-5)
    np.testing.assert_allclose(final, [-10.24005, -10.97715], rtol=1e-5)
    np.testing.assert_allclose(bufs, [2.4395, 2.3485], rtol=1e-5)
    np.testing.assert_allclose([np.mean(final), np.mean(bufs)], [-10.6086, 2.394], rtol=1e-5)


def _eager_adoption_run(mu: float, *, adopt: bool, last: tuple[float, float, float] = (6.0, 6.0, -12.0)
                        ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Three nodes, η = 1, given weighted pseudo-gradients per round (multiples of 6: every
    float32 operation below is exact). Node 2's round 1 fails on it alone (``adopt``): its
    contribution of round 1 is in the others' sum, and in round 2 it adopts node 0's state
    through the state vector, taking part with Δ = 0 and weight 0. Returns each node's θ_g after
    round 2 and after the completion step (``last``: the pseudo-gradients of round 3)."""
    rounds = [[6.0, 12.0, -6.0], [12.0, -6.0, 24.0], [-18.0, 6.0, 12.0], list(last)]
    frags = [np.arange(1)]
    theta = [_f32([0.0]) for _ in range(3)]
    bufs: list = [None] * 3
    held: list = [None] * 3
    late: list = [None] * 3
    after: list[np.ndarray] = []
    for r, deltas in enumerate(rounds):
        w = [0.0 if adopt and r == 2 and m == 2 else 1.0 for m in range(3)]
        payload = [_f32([deltas[m] * w[m]]) for m in range(3)]
        total, sum_w = _f32([sum(float(p[0]) for p in payload)]), sum(w)
        for m in range(3):
            if adopt and r == 2 and m == 2:  # node 2 adopts node 0's state of round 2
                vec = pack_state(theta[0], [bufs[0]], frags, Counters(op=r, t=4 * r, step=4 * r, applied=r),
                                 held[0])
                th, (b,), _, h = unpack_state(vec, 1, frags, eager=True)
                theta[2], bufs[2], held[2] = th, b, h
                continue
            g = eager_gradient(payload[m], 3.0, late[m])
            bufs[m] = outer_step(theta[m], bufs[m], g, lr=1.0, momentum=mu, nesterov=True)
            held[m] = own_term(payload[m], 3.0)
        late = [late_part(total, sum_w, held[m]) for m in range(3)]
        if r == 2:
            after = [t.copy() for t in theta]
    for m in range(3):  # completion: the last round's late part, no new own term
        bufs[m] = outer_step(theta[m], bufs[m], late[m], lr=1.0, momentum=mu, nesterov=True)
    return after, theta


def test_an_eager_member_that_adopts_counts_the_leaders_contribution_once():
    """μ = 0: every contribution enters every node's θ_g once, with the weight its round's mean
    gives it — the adopter too (the leader's fresh term of the adoption round is in the θ_g it
    adopts, and its next late part takes it out of that round's mean, as the leader's does) —
    so after the completion step every node holds −Σ_r Σ w·Δ(r) / Σw(r) exactly. μ = 0.9: the
    adopter's θ_g differs from the leader's by its own fresh terms only, as a node that never
    lagged does."""
    want = -(6 + 12 - 6) / 3 - (12 - 6 + 24) / 3 - (-18 + 6) / 2 - (6 + 6 - 12) / 3
    _, final = _eager_adoption_run(0.0, adopt=True)
    assert [float(t[0]) for t in final] == [want] * 3
    _, final = _eager_adoption_run(0.0, adopt=False)  # nobody adopts: the same sum, every round over 3
    assert [float(t[0]) for t in final] == [-(12 + 30 + 0 + 0) / 3] * 3
    _, final = _eager_adoption_run(0.0, adopt=True, last=(6.0, 6.0, 6.0))
    assert [float(t[0]) for t in final] == [want - 6] * 3
    after, final = _eager_adoption_run(0.9, adopt=True, last=(6.0, 6.0, 6.0))
    assert after[2].tobytes() == after[0].tobytes()  # it adopted node 0's θ_g of round 2
    # the same own term in round 3 as node 0: its late parts are node 0's, bit for bit, so is its θ_g
    assert final[2].tobytes() == final[0].tobytes() != final[1].tobytes()


def test_a_skipped_eager_round_takes_the_held_term_out_and_adds_nothing():
    """A round whose sums carry the non-finite flag (or no weight) is skipped everywhere: the
    late part of a node whose θ_g holds its own fresh term of that round is that term negated,
    so the round leaves nothing in θ_g; a node that holds none (its Δ was the non-finite one,
    sent as zeros) gets no late part."""
    from types import SimpleNamespace

    from p2psync.strategies.diloco import Op
    from p2psync.strategies.diloco.ops import Operations

    node = SimpleNamespace(state=SimpleNamespace(skipped=0))
    held = own_term(_f32([3.0, -6.0]), 3.0)
    op = Op(f=0, payload=_f32([3.0, -6.0]), w=1.0, stop=False, nonfinite=False,
            counters=Counters(op=4, t=16, step=15, applied=3), held=held)
    total = _f32([9.0, 9.0])
    for side in (_f32([3.0, 0.0, 1.0]), _f32([0.0, 0.0, 0.0])):
        late = Operations.late_part(node, op, total, side, {})
        assert late is not None and late.tolist() == [-1.0, 2.0]
    assert node.state.skipped == 1  # (only the non-finite one counts)
    op.held = np.zeros(2, np.float32)
    assert Operations.late_part(node, op, total, _f32([3.0, 0.0, 1.0]), {}) is None
    late = Operations.late_part(node, replace(op, held=held), total, _f32([3.0, 0.0, 0.0]), {})
    assert late is not None and late.tolist() == [2.0, 5.0]  # a round that counts: Σ/Σw − held


def test_the_schedule_is_checked_against_the_fragments_the_model_is_cut_into():
    """With fragment_by=blocks the parameters outside the repeated blocks form one more
    fragment (P_total = fragments + 1). The options alone accept inner_steps and tau that fit
    fragments or fragments + 1; once the model is known, a mismatch names what the user set
    and where the extra fragment comes from."""
    from p2psync.strategies.diloco.options import DilocoOptions

    o = DilocoOptions(inner_steps=50, fragments=2)
    assert o.part_counts() == (2, 3)
    o.check_parts(2)  # (a model without parameters outside its blocks: 2 fragments)
    with pytest.raises(ConfigError) as ei:
        o.check_parts(3)
    msg = str(ei.value)
    assert msg.startswith("--opt inner_steps=50: with fragments=2 and fragment_by=blocks")
    assert "3 fragments" in msg and "embeddings" in msg and "48 or 51" in msg and "fragment_by=flat" in msg
    DilocoOptions(inner_steps=51, fragments=2).check_parts(3)  # a multiple of P_total, not of fragments
    with pytest.raises(ConfigError, match=r"--opt tau=16: with fragments=2 .* 3 fragments .* tau < 16"):
        DilocoOptions(inner_steps=48, fragments=2, tau=16).check_parts(3)
    DilocoOptions(inner_steps=48, fragments=2, tau=15).check_parts(3)
    with pytest.raises(ConfigError, match=r"--opt inner_steps=10: must be a multiple of fragments=3, or of 4"):
        DilocoOptions(inner_steps=10, fragments=3)
    flat = DilocoOptions(inner_steps=50, fragments=2, fragment_by="flat")
    assert flat.part_counts() == (2,)
    with pytest.raises(ConfigError, match=r"--opt inner_steps=51: must be a multiple of fragments=2$"):
        DilocoOptions(inner_steps=51, fragments=2, fragment_by="flat")


def test_the_language_models_blocks_are_known_from_their_names():
    """``repeated_blocks`` (what ``p2psync run`` checks DiLoCo's schedule against before any
    node starts) gives the fragment count that the fragment map of each built-in language
    model, built, has; the classifiers' shapes are left to the strategy's start."""
    from p2psync.model.flat import FlatModel
    from p2psync.strategies.diloco import DiLoCo
    from p2psync.strategies.diloco.fragments import part_count
    from p2psync.training.config import LM_SPECS, repeated_blocks
    from p2psync.training.models import build_model

    for name, spec in LM_SPECS.items():
        with torch.device("meta"):
            model = build_model(name, (1,), 256)
        flat = FlatModel(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        blocks, rest = repeated_blocks(name)
        for p in (1, 2, spec.layers):
            for by in ("blocks", "flat"):
                cut = fragment_map(flat.layers(), flat.numel, p, by=by, pattern="strided")
                assert len(cut) == part_count(p, by=by, blocks=blocks, rest=rest), (name, p, by)
        with pytest.raises(ConfigError, match=f"fragments={spec.layers + 1}: the model has only {spec.layers} blocks"):
            part_count(spec.layers + 1, by="blocks", blocks=blocks, rest=rest)
    assert repeated_blocks("mlp") is None
    opts = parse_options(DiLoCo, {"inner_steps": 50, "fragments": 2})
    with pytest.raises(ConfigError, match="inner_steps=50: with fragments=2"):
        DiLoCo.check_blocks(opts, blocks=5, rest=True)
    DiLoCo.check_blocks(opts, blocks=5, rest=False)

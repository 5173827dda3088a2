"""DiLoCo over real ZeroMQ with real trainers: θ_g bitwise identical on every node after every
outer step and equal to a single-process run of the same algorithm; Streaming fragments with
overlap, 4-bit outer gradients, error feedback and AdamW end with one model; H = 1, η = 1,
μ = 0 with plain SGD is SSGD; a bad option is refused before anything starts; a non-finite
pseudo-gradient on one node skips that round's outer step on every node; outer steps, merges and
the stop leave AdamW's state bitwise untouched; one node is Lookahead around its optimizer, and
nodes with identical data are the one-node run bitwise."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from p2psync.errors import ConfigError
from p2psync.strategies.diloco.outer import outer_step
from p2psync.topology import mesh, ring
from tests.helpers import (close_strategies, drive_until_stop, free_port, gate_path, gated, make_trainer,
                           start_strategies, trainer_params, zmq_cluster)

pytestmark = pytest.mark.timeout(120)


async def _run(topo, steps, options, *, trainer=None, codec="none", error_feedback=False, per_node=None,
               release=True, trainers=None, setup=None):
    """Train every node ``steps`` steps (``trainer``: make_trainer keywords; ``per_node``: more
    of them by node; ``trainers``: the nodes' trainers instead, by id; ``release``: as
    start_strategies'; ``setup(strategies)``: called once they started, before the first step);
    returns (final params, θ_g per node after each step, reports per node)."""
    async with zmq_cluster(topo) as eps:
        if trainers is None:
            trainers = {i: make_trainer(topo, i, **(trainer or {}), **(per_node or {}).get(i, {}))
                        for i in topo.ids}
        strats = await start_strategies(eps, topo, "diloco", options=options, trainers=trainers, max_steps=steps,
                                        codec=codec, error_feedback=error_feedback, release=release)
        try:
            if setup is not None:
                setup(strats)
            async def loop(s):
                reps, thetas, step = [], [], 0
                while True:
                    rep = await s.run_step(step, step + 1 >= steps)
                    reps.append(rep)
                    thetas.append(s.state.theta.copy())
                    step += 1
                    if rep.stop or step > 3 * steps:
                        return reps, thetas

            out = await asyncio.gather(*(loop(s) for s in strats))
            params = [await s.ctx.replica.get_params() for s in strats]
        finally:
            await close_strategies(strats)
    return params, [th for _, th in out], [r for r, _ in out]


async def _single_process(trainers, steps: int, H: int, mean_of, *, lr: float = 0.7, mom: float = 0.9):
    """The same algorithm in one process over ``trainers`` (on the gate path): inner steps,
    every ``H`` steps ``mean_of(deltas)`` (each node's float32 Δ) applied with the outer
    Nesterov step. Returns θ_g after every outer step (by the step that ended it) and the final
    θ_g."""
    async with gated(trainers) as local:
        theta = await local[0].get_params()
        buf, after = None, {}
        for k in range(1, steps + 1):
            for tr in local:
                _, g = await tr.compute_gradients()
                await tr.apply_gradients(g)
            if k % H == 0:
                deltas = [np.subtract(theta, await tr.get_params(), dtype=np.float32) for tr in local]
                buf = outer_step(theta, buf, mean_of(deltas), lr=lr, momentum=mom, nesterov=True)
                for tr in local:
                    await tr.set_params(theta.copy())
                after[k] = theta.copy()
        return after, theta


async def test_theta_g_is_bitwise_equal_everywhere_and_to_a_single_process_run():
    topo = ring(2, base_port=free_port())
    H, steps, lr, mom = 4, 12, 0.7, 0.9
    opts = {"inner_steps": H, "outer_lr": lr, "outer_momentum": mom, "final_sync": "outer"}
    params, thetas, reps = await _run(topo, steps, opts)
    assert [len(r) for r in reps] == [steps, steps]
    assert reps[0][-1].extra["outer_steps"] == steps // H
    for k in range(steps):  # after every step, every node holds the same θ_g
        assert thetas[0][k].tobytes() == thetas[1][k].tobytes()
    # the same algorithm in one process: local trainers, Δ averaged in float32, the outer step
    after, theta = await _single_process(
        [make_trainer(topo, i) for i in topo.ids], steps, H,
        lambda d: np.divide(np.add(d[0], d[1]), np.float32(2), dtype=np.float32), lr=lr, mom=mom)
    for k, want in after.items():
        assert thetas[0][k - 1].tobytes() == want.tobytes(), f"after outer step {k // H}"
    for p in params:  # the stop leaves θ_g in every model
        assert p.tobytes() == theta.tobytes()


async def test_samples_weighting_is_the_sample_weighted_mean_bitwise():
    """Nodes with batches of 16 and 8 samples: Δ̄ = (16·Δ_0 + 8·Δ_1) / 24 (weights = samples
    since the last send / H), θ_g bitwise that of the same sum in one process."""
    topo = ring(2, base_port=free_port())
    H, steps = 3, 9
    opts = {"inner_steps": H, "weighting": "samples", "final_sync": "outer"}
    sizes = {0: 16, 1: 8}
    _, thetas, _ = await _run(topo, steps, opts, per_node={i: {"batch_size": b} for i, b in sizes.items()})
    weights = [np.float32(sizes[i] * H / H) for i in topo.ids]
    after, _ = await _single_process(
        [make_trainer(topo, i, batch_size=sizes[i]) for i in topo.ids], steps, H,
        lambda d: np.divide(np.add(np.multiply(d[0], weights[0]), np.multiply(d[1], weights[1])), np.float32(24),
                            dtype=np.float32))
    for k, want in after.items():
        assert thetas[0][k - 1].tobytes() == thetas[1][k - 1].tobytes() == want.tobytes()


async def test_streaming_fragments_with_overlap_e3m0_feedback_and_adamw_end_with_one_model():
    topo = mesh(3, base_port=free_port())
    steps = 26
    opts = {"inner_steps": 6, "fragments": 2, "fragment_by": "flat", "tau": 1, "alpha": 0.5,
            "outer_codec": "e3m0", "error_feedback": "true", "outer_lr": 0.4}
    params, thetas, reps = await _run(topo, steps, opts, trainer={"optimizer": "adamw", "lr": 0.01})
    assert [len(r) for r in reps] == [steps] * 3
    for k in range(steps):
        assert thetas[0][k].tobytes() == thetas[1][k].tobytes() == thetas[2][k].tobytes()
    assert all(p.tobytes() == params[0].tobytes() for p in params)
    # fragments 0, 1 sent every 3 steps; each applied a step later; plus the final full sync (2 steps)
    assert reps[0][-1].extra["outer_steps"] == 8 + 2
    assert reps[0][3].extra.get("op_nic_bytes") and reps[0][3].extra["compression"] > 6  # 32 / 4.25 bits
    assert max(r.extra["blocked"] for r in reps[0]) <= 8


async def test_4_bit_outer_gradients_on_a_ring_are_encoded_once_through_relays():
    """e3m0 on ring-4: the outer allreduce takes the direct plan (nodes 0 and 2, 1 and 3 are
    not adjacent: their pieces are relayed unchanged), and every node holds the same θ_g bits
    after every step."""
    topo = ring(4, base_port=free_port())
    steps = 8
    _, thetas, reps = await _run(topo, steps, {"inner_steps": 2, "outer_codec": "e3m0"})
    for k in range(steps):
        assert len({thetas[i][k].tobytes() for i in topo.ids}) == 1
    synced = [r for r in reps[0] if "outer_algo" in r.extra]
    assert synced and {r.extra["outer_algo"] for r in synced} == {"direct"}
    assert all(r.extra["compression"] > 6 for r in synced)


async def test_one_inner_step_outer_lr_1_no_momentum_with_plain_sgd_is_ssgd():
    topo = ring(2, base_port=free_port())
    steps = 10
    params, _, _ = await _run(topo, steps, {"inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0},
                              trainer={"momentum": 0.0})
    async with zmq_cluster(topo) as eps:
        trainers = {i: make_trainer(topo, i, momentum=0.0) for i in topo.ids}
        strats = await start_strategies(eps, topo, "ssgd", trainers=trainers, max_steps=steps)
        try:
            for step in range(steps):
                await asyncio.gather(*(s.run_step(step, step + 1 >= steps) for s in strats))
            ref = await strats[0].ctx.replica.get_params()
        finally:
            await close_strategies(strats)
    for p in params:
        np.testing.assert_allclose(p, ref, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ref, trainer_params(make_trainer(topo, 0)))  # it trained


async def test_an_option_that_is_not_built_is_refused_before_anything_starts():
    topo = ring(2, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        for bad, name in (({"eager_delay": 2}, "eager_delay"), ({"tau": 5, "inner_steps": 4}, "tau"),
                          ({"outer_codec": "zip"}, "outer_codec")):
            with pytest.raises(ConfigError, match=name):
                await start_strategies(eps, topo, "diloco", options=bad)


async def _resumable(topo, opts, steps, cut, *, drop_result):
    """θ_g after every step of a run stopped after step ``cut - 1`` (a checkpoint of every
    node: strategy state through torch.save / weights_only load, model and optimizer state,
    data position) and resumed in fresh processes' stead. The training threads are not released
    between steps: the checkpoint is taken with the thread parked at the step's iteration, as the
    session's driver takes it (before it releases the thread)."""
    import io

    import torch

    from p2psync.model.flat import FlatModel

    thetas: list[list[bytes]] = [[] for _ in topo.ids]
    async with zmq_cluster(topo) as eps:
        trainers = {i: make_trainer(topo, i) for i in topo.ids}
        strats = await start_strategies(eps, topo, "diloco", options=opts, trainers=trainers, max_steps=steps,
                                        release=False)
        try:
            for step in range(cut):
                await asyncio.gather(*(s.run_step(step, False) for s in strats))
                for i, s in enumerate(strats):
                    thetas[i].append(s.state.theta.tobytes())
            assert all(s.state.inflight is not None for s in strats)  # a fragment's sum is in flight
            if not drop_result:  # (arrived, not applied yet: the checkpoint keeps the sums)
                await asyncio.gather(*(s.state.inflight.task for s in strats))
            saved = []
            for s in strats:
                buf = io.BytesIO()
                torch.save(s.state_dict(), buf)
                buf.seek(0)
                st = torch.load(buf, weights_only=True)
                if drop_result:  # the op is relaunched from its saved Δ
                    st["inflight"].pop("result", None)
                else:
                    assert "result" in st["inflight"]
                saved.append((st, await s.ctx.replica.export_state(), gate_path(s).trainer.batches_done))
        finally:
            await close_strategies(strats)
    topo = ring(len(topo.ids), base_port=free_port())
    async with zmq_cluster(topo) as eps:
        trainers = {i: make_trainer(topo, i) for i in topo.ids}
        for i, (_, state, done) in zip(topo.ids, saved):  # (before their training threads start)
            FlatModel(model=trainers[i].model, optimizer=trainers[i].optimizer).import_state(state)
            trainers[i].batches_done = done
        strats = await start_strategies(eps, topo, "diloco", options=opts, trainers=trainers, max_steps=steps,
                                        release=False)
        try:
            for s, (st, _, _) in zip(strats, saved):
                s.load_state_dict(st)
            for step in range(cut, steps):
                reps = await asyncio.gather(*(s.run_step(step, step + 1 >= steps) for s in strats))
                for i, s in enumerate(strats):
                    thetas[i].append(s.state.theta.tobytes())
            assert all(r.stop for r in reps)
        finally:
            await close_strategies(strats)
    return thetas


@pytest.mark.parametrize("drop_result", [False, True], ids=["sum-saved", "sum-relaunched"])
async def test_a_checkpoint_with_a_fragment_in_flight_resumes_bitwise(drop_result):
    """Stopped with a fragment's sum in flight and resumed (its saved sums applied, or the
    op relaunched from its saved Δ): θ_g after every step is bitwise that of the uninterrupted run."""
    opts = {"inner_steps": 4, "fragments": 2, "fragment_by": "flat", "tau": 1}
    steps = 14
    topo = ring(2, base_port=free_port())
    _, want, _ = await _run(topo, steps, opts, release=False)  # driven as _resumable drives
    got = await _resumable(ring(2, base_port=free_port()), opts, steps, 8, drop_result=drop_result)
    for i in range(2):
        assert [w.tobytes() for w in want[i]] == got[i]


async def test_dylu_gives_a_slow_node_fewer_inner_steps_and_one_model_at_the_end():
    """DyLU over ZeroMQ: node 1 takes 4x as long per step (emulated): after the first cycle it
    takes about a quarter of the fast node's inner steps per sum, so the fast node does not wait
    for it; the run still ends with one θ_g everywhere."""
    from tests.helpers import slowed_trainers

    topo = ring(2, base_port=free_port())
    steps = 40
    trainers = slowed_trainers(topo, "0:0.02,1:0.08")
    async with zmq_cluster(topo) as eps:
        strats = await start_strategies(eps, topo, "diloco", options={"inner_steps": 8, "dylu": "true",
                                                                           "dylu_min_steps": 1},
                                        trainers=trainers, max_steps=steps)
        try:
            reps = await drive_until_stop(strats, steps)
            params = [await s.ctx.replica.get_params() for s in strats]
            thetas = [s.state.theta.copy() for s in strats]
        finally:
            await close_strategies(strats)
    fast, slow = reps
    assert steps <= len(fast) <= steps + 8 and len(slow) < 0.6 * len(fast), (len(fast), len(slow))
    assert fast[-1].extra["outer_steps"] == slow[-1].extra["outer_steps"]  # the same sums, in the same order
    assert fast[-1].extra["h_m"] == 8 and 1 <= slow[-1].extra["h_m"] <= 4, (fast[-1].extra, slow[-1].extra)
    assert thetas[0].tobytes() == thetas[1].tobytes() and params[0].tobytes() == params[1].tobytes()


async def test_a_failed_sum_puts_back_the_error_feedback_residuals_it_consumed():
    """An attempt abandoned (here: the peer never joins it) leaves the outer codec's
    residuals as they were, so its redo does not add the quantization error twice."""
    from p2psync.coordinator import View
    from p2psync.errors import PeerFailure
    from p2psync.strategies.diloco import _Op
    from p2psync.strategies.diloco.state import Counters

    topo = ring(2, base_port=free_port())
    opts = {"inner_steps": 2, "outer_codec": "e3m0", "error_feedback": "true", "final_sync": "outer"}
    async with zmq_cluster(topo) as eps:
        strats = await start_strategies(eps, topo, "diloco", options=opts, max_steps=100)
        try:
            for step in range(2):  # one sum of fragment 0, applied: residuals recorded
                await asyncio.gather(*(s.run_step(step, False) for s in strats))
            coll = strats[0].ctx.collectives
            before = {k: v.copy() for k, v in coll.feedback.residual.items()}
            assert any(("diloco", "f0") in k for k in before)  # keyed by the fragment
            coll.timeout = 0.5
            n = strats[0].ctx.replica.numel
            op = _Op(f=0, payload=np.full(n, 0.3, np.float32), w=1.0, stop=False, nonfinite=False,
                     counters=Counters(op=7, t=4, step=3, applied=1))
            with pytest.raises(PeerFailure):
                await strats[0].ops.reduce(View(epoch=0, members=(0, 1)), op)
            after = coll.feedback.residual
            assert sorted(map(repr, after)) == sorted(map(repr, before))
            assert all(after[k].tobytes() == v.tobytes() for k, v in before.items())
        finally:
            await close_strategies(strats)


async def test_eager_rounds_keep_a_theta_per_node_and_end_with_their_exact_mean():
    """Eager updates over ZeroMQ against the same rounds in one process: every node's own θ_g
    after every step bitwise (its fresh Δ at once, the other's one round late), the completion
    step and the exact mean at the stop."""
    from p2psync.strategies.diloco.outer import eager_gradient, others_mean
    from p2psync.strategies.regroup import exact_mean_input

    topo = ring(2, base_port=free_port())
    H, steps, lr, mom = 3, 12, 0.7, 0.9
    opts = {"inner_steps": H, "eager": "true", "final_sync": "outer"}
    params, thetas, reps = await _run(topo, steps, opts)
    assert [len(r) for r in reps] == [steps, steps]
    assert thetas[0][H].tobytes() != thetas[1][H].tobytes()  # per node between flushes
    async with gated(make_trainer(topo, i) for i in topo.ids) as local:
        start = await local[0].get_params()
        theta = [start.copy(), start.copy()]
        bufs: list = [None, None]
        prev: list | None = None
        for k in range(1, steps + 1):
            for tr in local:
                _, g = await tr.compute_gradients()
                await tr.apply_gradients(g)
            if k % H == 0:
                deltas = [np.subtract(theta[m], await local[m].get_params(), dtype=np.float32) for m in range(2)]
                total = np.add(prev[0], prev[1]) if prev is not None else None
                for m in range(2):
                    others = None if total is None else others_mean(total, prev[m], 2.0)
                    bufs[m] = outer_step(theta[m], bufs[m], eager_gradient(deltas[m], 2.0, others), lr=lr,
                                         momentum=mom, nesterov=True)
                    await local[m].set_params(theta[m].copy())
                prev = deltas
            if k < steps:
                for m in range(2):
                    assert thetas[m][k - 1].tobytes() == theta[m].tobytes(), (k, m)
        total = np.add(prev[0], prev[1])
        for m in range(2):
            bufs[m] = outer_step(theta[m], bufs[m], others_mean(total, prev[m], 2.0), lr=lr, momentum=mom,
                                 nesterov=True)
        final = (np.asarray(exact_mean_input(theta[0]) + exact_mean_input(theta[1]), np.float64) / 2).astype(np.float32)
    np.testing.assert_allclose(params[0], final, rtol=1e-6, atol=1e-7)
    assert params[0].tobytes() == params[1].tobytes() == thetas[0][-1].tobytes() == thetas[1][-1].tobytes()


async def test_fragments_lower_the_peak_bytes_per_sum_not_the_bytes_per_step():
    """Two fragments move half the model per sum, but every fragment still moves
    once per H steps: bytes per inner step stay those of one fragment (side sums aside)."""
    steps, opts = 16, {"inner_steps": 8, "final_sync": "outer", "init_sync": "false"}

    async def traffic(extra_opts):
        topo = ring(2, base_port=free_port())
        async with zmq_cluster(topo) as eps:
            strats = await start_strategies(eps, topo, "diloco", options={**opts, **extra_opts}, max_steps=steps)
            try:
                peaks = []
                for step in range(steps):
                    reps = await asyncio.gather(*(s.run_step(step, step + 1 >= steps) for s in strats))
                    if "op_nic_bytes" in reps[0].extra:
                        peaks.append(sum(reps[0].extra["op_nic_bytes"].values()))
                sent = sum(v.bytes_sent for v in eps[0].nic_stats.values())
                largest = max(f.size for f in strats[0].state.frags) / strats[0].ctx.replica.numel
            finally:
                await close_strategies(strats)
        return sent, max(peaks), largest

    one_sent, one_peak, _ = await traffic({})
    two_sent, two_peak, largest = await traffic({"fragments": 2, "fragment_by": "flat"})
    # (the MLP's two layers hold 87 % and 13 % of it: flat fragments are cut at layer boundaries)
    assert largest < 0.9 and two_peak == pytest.approx(largest * one_peak, rel=0.05), (one_peak, two_peak, largest)
    assert two_sent == pytest.approx(one_sent, rel=0.15), (one_sent, two_sent)


def _record_outer(strats):
    """Wrap every node's outer step (``ops.outer``: the outer step and the merge): per node, a
    list of (operation, fragment, θ_g before, that fragment's momentum before, θ_g after, its
    momentum after, the model after) for every call."""
    calls: list[list[tuple]] = [[] for _ in strats]

    def wrap(s, out):
        outer = s.ops.outer

        async def recorded(op, total, side, extra, *, merge_local):
            st = s.state
            f = 0 if op.f < 0 else op.f
            before = st.theta.copy(), None if st.bufs[f] is None else st.bufs[f].copy()
            await outer(op, total, side, extra, merge_local=merge_local)
            after = st.theta.copy(), None if st.bufs[f] is None else st.bufs[f].copy()
            out.append((op.k, op.f, *before, *after, await s.ctx.replica.get_params()))

        s.ops.outer = recorded

    for s, out in zip(strats, calls):
        wrap(s, out)
    return calls


async def test_a_non_finite_pseudo_gradient_on_one_node_skips_that_fragments_outer_step_on_every_node():
    """Node 1's Δ of fragment 1 holds a NaN in that fragment's second round: no node applies
    that round's outer step (θ_g and the fragment's momentum bitwise unchanged on every node),
    every node sets θ_local[f] ← θ_g[f] (τ = 1, α = 0.5: a merge would keep half the local
    progress), the other rounds are applied, and the run ends with one finite model."""
    topo = mesh(3, base_port=free_port())
    steps = 14
    opts = {"inner_steps": 4, "fragments": 2, "fragment_by": "flat", "tau": 1, "alpha": 0.5,
            "final_sync": "outer"}
    calls: list = []
    poisoned: list[int] = []
    frag: list = []

    def setup(strats):
        calls.extend(_record_outer(strats))
        frag.append(strats[0].state.frags[1])  # fragment 1's positions in the flat vector
        s = strats[1]
        launch, rep = s.ops.launch, s.ctx.replica
        sent = {0: 0, 1: 0}

        async def launch_poisoned(f, step, **kw):
            sent[f] += 1
            if f != 1 or sent[f] != 2:
                return await launch(f, step, **kw)
            get = rep.get_params_range

            async def nan_range(ranges):
                vec = await get(ranges)
                vec[vec.size // 2] = np.nan
                return vec

            rep.get_params_range = nan_range  # (the read of θ_local[f] that forms this Δ)
            try:
                await launch(f, step, **kw)
            finally:
                del rep.get_params_range
            poisoned.append(s.state.inflight.k)

        s.ops.launch = launch_poisoned

    params, thetas, reps = await _run(topo, steps, opts, setup=setup)
    assert poisoned == [3]  # fragments 0, 1, 0, 1: the fourth operation
    idx = frag[0]
    for node, rec in enumerate(calls):
        by_op = {k: r for k, *r in rec}
        assert sorted(by_op) == list(range(len(rec))), [k for k, *_ in rec]  # each operation applied once
        f, th0, b0, th1, b1, local = by_op[3]
        assert f == 1
        assert th1.tobytes() == th0.tobytes(), f"node {node} applied the non-finite round"
        assert b0 is not None and b1.tobytes() == b0.tobytes()
        assert local[idx].tobytes() == th1[idx].tobytes(), f"node {node} kept local progress of fragment 1"
        for k in (1, 5):  # the rounds of fragment 1 before and after it are applied
            f, th0, _, th1, _, local = by_op[k]
            assert f == 1 and th1[idx].tobytes() != th0[idx].tobytes() and np.isfinite(th1).all()
            assert local[idx].tobytes() != th1[idx].tobytes()  # (merged with α = 0.5)
        assert reps[node][-1].extra["skipped_nonfinite"] == 1
    assert all(p.tobytes() == params[0].tobytes() for p in params) and np.isfinite(params[0]).all()
    for k in range(steps):
        assert thetas[0][k].tobytes() == thetas[1][k].tobytes() == thetas[2][k].tobytes()


def _inner_state(rep):
    """The inner optimizer's state as the replica exports it (its parameters cut off): AdamW's
    exp_avg and exp_avg_sq of every parameter, then each parameter's step."""
    async def read():
        return (await rep.export_state())[rep.numel:]
    return read()


async def test_outer_steps_merges_and_the_final_sync_leave_adamws_state_bitwise_untouched():
    """AdamW inner steps, two streamed fragments with τ = 1 and α = 0.5 and a final full sync:
    every outer step with its merge (θ_local[f] ← θ_g[f] + α·(θ_local[f] − θ_g[f])), the final
    sync and the closing θ_local ← θ_g leave AdamW's exp_avg, exp_avg_sq and step bitwise as
    they were, while they do change the model."""
    topo = ring(2, base_port=free_port())
    steps = 11
    opts = {"inner_steps": 4, "fragments": 2, "fragment_by": "flat", "tau": 1, "alpha": 0.5, "outer_lr": 0.7}
    seen: list[list[tuple[str, bytes, bytes, bool]]] = [[], []]

    def setup(strats):
        for s, out in zip(strats, seen):
            rep = s.ctx.replica

            def wrap(fn, what, out=out, rep=rep):
                async def kept(*a, **kw):
                    before, p0 = await _inner_state(rep), await rep.get_params()
                    got = await fn(*a, **kw)
                    after, p1 = await _inner_state(rep), await rep.get_params()
                    out.append((what, before.tobytes(), after.tobytes(), p0.tobytes() != p1.tobytes()))
                    return got
                return kept

            s.ops.outer = wrap(s.ops.outer, "outer")
            s.stop.close_checks = wrap(s.stop.close_checks, "close")

    params, _, reps = await _run(topo, steps, opts, trainer={"optimizer": "adamw", "lr": 0.01}, setup=setup)
    assert params[0].tobytes() == params[1].tobytes()
    for node, out in enumerate(seen):
        # fragments 0, 1 sent after steps 2, 4, 6, 8, 10 and merged a step later (the last at the
        # stop), then the final sync (one outer step over both fragments) and the closing checks
        assert [w for w, *_ in out] == ["outer"] * 6 + ["close"], out
        for what, before, after, moved in out:
            assert after == before, f"node {node}: {what} changed AdamW's state"
        assert all(moved for *_, moved in out[:-2]), f"node {node}: an outer step left the model as it was"
        state = np.frombuffer(out[0][1], np.float32)
        assert np.any(state != 0) and state[-1] >= 3  # (AdamW had state: moments and its step count)


async def test_one_node_is_lookahead_around_its_own_optimizer():
    """A single node (M = 1): every H inner steps θ_g ← θ_g − η·(Δ + μ·b) with b ← μ·b + Δ and
    Δ = θ_g − θ_local, then θ_local ← θ_g (Lookahead with a Nesterov outer step); at the stop
    the final sync takes one more such step over the steps since the last one. Bitwise against
    that arithmetic written out here in float32, on the same trainer in one process."""
    topo = mesh(1, base_port=free_port())
    H, steps, lr, mom = 4, 10, 0.7, 0.9
    params, thetas, reps = await _run(topo, steps, {"inner_steps": H, "outer_lr": lr, "outer_momentum": mom})
    assert len(reps[0]) == steps and reps[0][-1].stop
    f32 = np.float32
    async with gated([make_trainer(topo, 0)]) as (tr,):
        theta = (await tr.get_params()).copy()
        b = None
        want = {}

        async def outer():
            nonlocal b
            delta = theta - await tr.get_params()  # (float32 arrays: float32 arithmetic)
            b = delta.copy() if b is None else b * f32(mom) + delta
            theta[:] = theta - (b * f32(mom) + delta) * f32(lr)
            await tr.set_params(theta.copy())

        for k in range(1, steps + 1):
            _, g = await tr.compute_gradients()
            await tr.apply_gradients(g)
            if k % H == 0:
                await outer()
            want[k] = theta.copy()
        await outer()  # the final sync
    for k in range(1, steps):
        assert thetas[0][k - 1].tobytes() == want[k].tobytes(), f"after step {k}"
    assert thetas[0][-1].tobytes() == params[0].tobytes() == theta.tobytes()
    assert not np.array_equal(want[H], want[H - 1])  # (it moved)


async def test_identical_data_on_two_nodes_is_the_one_node_run_bitwise():
    """Two nodes with the same data, seed and model (each the one-node run's trainer): every
    Δ_m is the same, so Σw·Δ / Σw = Δ and the run — streamed fragments, overlap and α merge,
    final sync — is the one-node run, θ_g after every step and the final model bitwise."""
    one = mesh(1, base_port=free_port())
    steps = 11
    opts = {"inner_steps": 4, "fragments": 2, "fragment_by": "flat", "tau": 1, "alpha": 0.5}
    alone, want, _ = await _run(one, steps, opts)
    topo = ring(2, base_port=free_port())
    params, thetas, reps = await _run(topo, steps, opts, trainers={i: make_trainer(one, 0) for i in topo.ids})
    assert reps[0][-1].extra["sum_w"] == 2.0  # (both nodes' weights in the sums)
    for node in range(2):
        assert [t.tobytes() for t in thetas[node]] == [t.tobytes() for t in want[0]], f"node {node}"
        assert params[node].tobytes() == alone[0].tobytes()


def _blocks_and_a_head(topo, i):
    """A digits trainer whose model has two repeated blocks (``blocks.0``, ``blocks.1``) and a
    parameter layer outside them (``head``), as a transformer has its embeddings and output
    layer: fragment_by=blocks cuts ``fragments`` + 1 fragments from it."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
            self.head = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.flatten(1)
            for b in self.blocks:
                x = torch.relu(b(x))
            return self.head(x)

    tr = make_trainer(topo, i)
    torch.manual_seed(0)
    tr.model = Net()
    tr.optimizer = torch.optim.SGD(tr.model.parameters(), lr=0.05, momentum=0.9)
    return tr


async def test_the_fragment_outside_the_blocks_counts_in_the_schedule():
    """A model with two blocks and a head, fragments=2: three fragments go in turn, so
    inner_steps=4 is refused at the start with an error naming what the user set and the extra
    fragment, and inner_steps=3 (a multiple of 3, not of 2) trains: one fragment a step,
    every fragment every 3 steps, one model at the end."""
    topo = ring(2, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        with pytest.raises(ConfigError, match=r"--opt inner_steps=4: with fragments=2 and fragment_by=blocks the "
                                              r"model is synchronized as 3 fragments in turn"):
            await start_strategies(eps, topo, "diloco", options={"inner_steps": 4, "fragments": 2},
                                   trainers={i: _blocks_and_a_head(topo, i) for i in topo.ids})
    steps = 9
    params, thetas, reps = await _run(ring(2, base_port=free_port()), steps, {"inner_steps": 3, "fragments": 2},
                                      trainers={i: _blocks_and_a_head(topo, i) for i in topo.ids})
    # one fragment applied after every step, then the final sync's outer step on all three
    assert [r.extra["outer_steps"] for r in reps[0]] == [*range(1, steps), steps + 3]
    assert params[0].tobytes() == params[1].tobytes() == thetas[0][-1].tobytes()

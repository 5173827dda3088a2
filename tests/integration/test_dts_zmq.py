"""DTS over real ZeroMQ with real trainers (issue 12's invariants): t=0,p=1 is SSGD; t=0,p>1 is
local SGD averaging weights and momentum every p steps; a flush leaves every node with the
same model; bytes per step are 1/p (vanilla) or 2/p (momentum) of SSGD's; the step does not
block while exchanges finish within t compute steps; a failed peer ends the run (fail-stop)
with no hang; Adam is refused."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from p2psync.errors import ConfigError, PeerFailure
from p2psync.training.hetero import Slowdown
from p2psync.transport.shaping import InprocShaper, LinkSpec
from tests.helpers import (close_strategies, drive_until_stop, free_port, gated, make_trainer, start_strategies,
                           trainer_params, zmq_cluster)
from p2psync.topology import mesh, ring

pytestmark = pytest.mark.timeout(120)


async def _run(topo, name, steps, *, momentum=0.9, options=None, trainers=None, eps_opts=None,
               shaper=None, setup=None):
    """Train ``steps`` steps on every node; returns (params per node, strategies' reports,
    bytes sent per node, the strategies)."""
    async with zmq_cluster(topo, **(eps_opts or {})) as eps:
        if shaper is not None:
            for i, e in eps.items():
                e.shaper = shaper(i)
        trainers = trainers or {i: make_trainer(topo, i, momentum=momentum) for i in topo.ids}
        if setup is not None:
            setup(trainers)
        strats = await start_strategies(eps, topo, name, options=options, trainers=trainers, max_steps=steps)
        try:
            reps = await drive_until_stop(strats, steps)
            params = [await s.ctx.replica.get_params() for s in strats]
            sent = [sum(v.bytes_sent for v in eps[i].nic_stats.values()) for i in topo.ids]
        finally:
            await close_strategies(strats)
    return params, reps, sent, strats


@pytest.mark.parametrize("momentum", [0.0, 0.9])
async def test_no_delay_no_sparsity_equals_ssgd(momentum):
    topo = ring(4, base_port=free_port())
    steps = 50
    ref, _, _, _ = await _run(topo, "ssgd", steps, momentum=momentum)
    topo = ring(4, base_port=free_port())
    got, reps, _, _ = await _run(topo, "dts", steps, momentum=momentum, options={"t": 0, "p": 1})
    assert all(len(r) == steps for r in reps)
    for p in got:
        np.testing.assert_allclose(p, ref[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(ref[0], trainer_params(make_trainer(topo, 0)))  # it trained


async def test_no_delay_sparse_equals_local_sgd_averaging_weights_and_momentum():
    topo = ring(4, base_port=free_port())
    steps, p = 24, 4
    got, _, _, _ = await _run(topo, "dts", steps, options={"t": 0, "p": p})
    # reference: four local trainers, whole state (weights + momentum) averaged every p steps
    async with gated(make_trainer(topo, i) for i in topo.ids) as local:
        for k in range(steps):
            for tr in local:
                _, g = await tr.compute_gradients()
                await tr.apply_gradients(g)
            if k % p == p - 1:
                states = [await tr.export_state() for tr in local]
                mean = np.mean(states, axis=0).astype(np.float32)
                for tr in local:
                    await tr.import_state(mean)
        want = await local[0].get_params()
    for params in got:
        np.testing.assert_allclose(params, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("t,p", [(3, 1), (2, 3), (5, 2)])
async def test_delayed_run_ends_with_the_same_model_everywhere(t, p):
    """The flush at the stop applies every window in flight: one model on every node."""
    topo = mesh(4, base_port=free_port())
    got, reps, _, strats = await _run(topo, "dts", 23, options={"t": t, "p": p})
    assert all(len(r) == 23 for r in reps)  # stops exactly at the step budget
    for params in got[1:]:
        np.testing.assert_allclose(params, got[0], rtol=1e-5, atol=1e-6)
    assert all(s.max_flight <= max(1, -(-t // p)) for s in strats)
    assert all(not s.flights for s in strats)


@pytest.mark.parametrize("momentum,p,ratio", [(0.0, 4, 1 / 4), (0.9, 4, 2 / 4), (0.9, 1, 1.0)])
async def test_bytes_per_step_are_one_or_two_pth_of_ssgd(momentum, p, ratio):
    steps = 16
    topo = ring(4, base_port=free_port())
    _, _, ssgd, _ = await _run(topo, "ssgd", steps, momentum=momentum)
    topo = ring(4, base_port=free_port())
    _, _, dts, _ = await _run(topo, "dts", steps, momentum=momentum, options={"t": 1, "p": p})
    measured = sum(dts) / sum(ssgd)
    assert measured == pytest.approx(ratio, rel=0.1), (ssgd, dts)


async def test_exchanges_that_fit_in_t_compute_steps_never_block():
    """Links of 20 ms each way, compute 0.1 s per step: an exchange takes a few link delays,
    t = 3 steps of compute hide it: no step waits for a window that is due (the final flush
    waits for the windows still in flight by design)."""
    topo = ring(4, base_port=free_port())

    def slow(trainers):
        for tr in trainers.values():
            tr.slowdown = Slowdown(step_time=0.1)

    shaper = lambda i: InprocShaper({j: LinkSpec(latency_s=0.02) for j in topo.neighbors(i)})  # noqa: E731
    _, reps, _, strats = await _run(topo, "dts", 16, options={"t": 3, "p": 1}, shaper=shaper, setup=slow)
    for s in strats:
        assert s.windows_applied == 16
        assert s.blocked == 0, s.blocked
    # and SSGD over the same links waits every step
    topo = ring(4, base_port=free_port())
    shaper = lambda i: InprocShaper({j: LinkSpec(latency_s=0.02) for j in topo.neighbors(i)})  # noqa: E731
    _, sreps, _, _ = await _run(topo, "ssgd", 8, shaper=shaper)
    assert np.mean([r.comm_s for r in sreps[0]]) > 0.05


async def test_adam_is_refused_with_a_clear_error():
    topo = ring(2, base_port=free_port())
    trainers = {i: make_trainer(topo, i) for i in topo.ids}
    for tr in trainers.values():
        tr.optimizer = torch.optim.Adam(tr.model.parameters(), lr=1e-3)
    async with zmq_cluster(topo) as eps:
        with pytest.raises(ConfigError, match="needs torch.optim.SGD"):
            await start_strategies(eps, topo, "dts", trainers=trainers)


async def test_a_failed_peer_ends_the_run_in_bounded_time_under_fail_stop():
    """Fail-stop (no membership service): the survivors' windows in flight fail with
    PeerFailure once the peer is declared failed; nothing hangs."""
    topo = ring(4, base_port=free_port())
    async with zmq_cluster(topo, timeout=3.0) as eps:
        trainers = {i: make_trainer(topo, i) for i in topo.ids}
        strats = await start_strategies(eps, topo, "dts", options={"t": 2, "p": 2}, trainers=trainers)
        try:
            for k in range(5):
                await asyncio.gather(*(s.run_step(k, False) for s in strats))
            survivors = strats[:3]
            for s in survivors:  # what the membership service does when node 3 dies
                s.on_peer_failure(3)

            async def go(s):
                for k in range(5, 30):
                    await s.run_step(k, False)

            results = await asyncio.wait_for(asyncio.gather(*(go(s) for s in survivors),
                                                            return_exceptions=True), 30)
        finally:
            await close_strategies(strats)
    assert all(isinstance(r, PeerFailure) and "3" in str(r) for r in results), results


async def test_weight_decay_and_parameter_groups_end_with_one_model():
    """g = grad + weight_decay * w and per-group learning rates (per-element λ)."""
    topo = ring(4, base_port=free_port())

    def groups(trainers):
        for tr in trainers.values():
            params = list(tr.model.parameters())
            tr.optimizer = torch.optim.SGD([{"params": params[:1], "lr": 0.1, "weight_decay": 1e-2},
                                            {"params": params[1:], "lr": 0.05}], lr=0.1, momentum=0.9)

    got, reps, _, _ = await _run(topo, "dts", 15, options={"t": 2, "p": 3}, setup=groups)
    for params in got[1:]:
        np.testing.assert_allclose(params, got[0], rtol=1e-5, atol=1e-6)


async def test_windows_restart_after_a_resync_within_one_view():
    """Regression (review): windows restarted at index 0 after a re-sync reused the tags of the
    windows just dropped (retired), so their pieces were discarded and the run failed."""
    topo = ring(4, base_port=free_port())
    async with zmq_cluster(topo, timeout=5.0) as eps:
        trainers = {i: make_trainer(topo, i) for i in topo.ids}
        strats = await start_strategies(eps, topo, "dts", options={"t": 1, "p": 2}, trainers=trainers,
                                        max_steps=20)
        try:
            async def go(s, first, last):
                for k in range(first, last):
                    rep = await s.run_step(k, k + 1 >= 20)
                return rep

            await asyncio.wait_for(asyncio.gather(*(go(s, 0, 6) for s in strats)), 60)
            for s in strats:  # what a resumed checkpoint or a failed exchange asks for
                s._resync_due = True
            reps = await asyncio.wait_for(asyncio.gather(*(go(s, 6, 20) for s in strats)), 60)
            params = [await s.ctx.replica.get_params() for s in strats]
        finally:
            await close_strategies(strats)
    assert all(r.stop for r in reps)
    assert all(s.resyncs == 1 and s.windows_applied >= 6 for s in strats)
    for p in params[1:]:
        np.testing.assert_allclose(p, params[0], rtol=1e-5, atol=1e-6)


async def test_bad_options_and_optimizers_get_clear_errors():
    topo = ring(2, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        for opts, match in [({"t": -1}, "t=-1"), ({"p": 0}, "p=0"), ({"t": 1000, "p": 1}, "in flight"),
                            ({"momentum_compensation": "ture"}, "expected bool")]:
            with pytest.raises(ConfigError, match=match):
                await start_strategies(eps, topo, "dts", options=opts)
        trainers = {i: make_trainer(topo, i) for i in topo.ids}
        for tr in trainers.values():  # a frozen-by-omission parameter: not in the optimizer
            tr.optimizer = torch.optim.SGD(list(tr.model.parameters())[1:], lr=0.1, momentum=0.9)
        with pytest.raises(ConfigError, match="in no parameter group"):
            await start_strategies(eps, topo, "dts", trainers=trainers)


async def test_a_momentum_that_changes_during_the_run_is_refused(zmq_endpoints, strategies):
    topo = ring(2, base_port=free_port())
    strats = await strategies(await zmq_endpoints(topo), topo, "dts", options={"t": 0, "p": 1})
    await asyncio.gather(*(s.run_step(0, False) for s in strats))
    for s in strats:  # what OneCycleLR(cycle_momentum=True) does
        s.ctx.replica.flat.optimizer.param_groups[0]["momentum"] = 0.8
    with pytest.raises(ConfigError, match="momentum changed"):
        await strats[0].run_step(1, False)

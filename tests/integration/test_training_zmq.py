"""SSGD and ASGD over real ZeroMQ with real trainers, several nodes in one process."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from p2psync.topology import bcube, mesh, ring
from tests.helpers import (close_strategies, drive_until_stop, evaluate, free_port, make_trainer, start_strategies,
                           trainer_params, zmq_cluster)

pytestmark = pytest.mark.timeout(120)


async def _train(eps, topo, name, steps, lr=0.1, **opts):
    strats = await start_strategies(eps, topo, name, options=opts,
                                    trainers={i: make_trainer(topo, i, lr=lr) for i in topo.ids})
    await drive_until_stop(strats, steps)
    return strats


@pytest.mark.parametrize("make", [ring, lambda n, base_port: bcube(2, 2, base_port=base_port)])
async def test_ssgd_equals_single_process_on_union_of_batches(make):
    topo = make(4, base_port=free_port())
    steps = 8
    async with zmq_cluster(topo) as eps:
        strats = await _train(eps, topo, "ssgd", steps)
        params = [await s.ctx.replica.get_params() for s in strats]
        await close_strategies(strats)
    assert all(p.tobytes() == params[0].tobytes() for p in params)  # identical replicas

    # replay: one model, same init, each step on the concatenation of the four nodes' batches
    ref = make_trainer(topo, 0)
    samplers = [make_trainer(topo, i).sampler for i in topo.ids]
    x, y = torch.from_numpy(ref.data.x_train), torch.from_numpy(ref.data.y_train)
    for k in range(steps):
        idx = torch.from_numpy(np.concatenate([s.batch(k) for s in samplers]))
        ref.optimizer.zero_grad()
        ref.loss_fn(ref.model(x[idx]), y[idx]).backward()
        ref.optimizer.step()
    expect = trainer_params(ref)
    np.testing.assert_allclose(params[0], expect, rtol=1e-4, atol=1e-6)
    assert not np.allclose(params[0], trainer_params(make_trainer(topo, 0)))  # it did train


async def test_asgd_converges():
    # 80 steps, not 60: under a loaded machine staleness grows and 60 steps once ended at 0.786
    STEPS = 80
    topo = mesh(4, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        strats = await _train(eps, topo, "asgd", STEPS, lr=0.05)
        for _ in range(500):  # every gradient applied everywhere (no barrier: they trickle in)
            if all(s.applied_remote == 3 * STEPS for s in strats):
                break
            await asyncio.sleep(0.01)
        assert all(s.applied_remote == 3 * STEPS for s in strats)
        accs = [(await evaluate(s))[1] for s in strats]
        await close_strategies(strats)
    assert min(accs) > 0.8, accs

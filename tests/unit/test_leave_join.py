"""Issue 10 item 5, pure parts: the state-sync decision, the State Server following the view,
and the replica's whole-state export/import (parameters + optimizer state)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from p2psync.coordinator.state_server import StateServer
from p2psync.errors import PeerFailure
from p2psync.strategies.regroup import JOINING, sync_decision
from p2psync.topology import ring
from tests.helpers import gated, make_trainer

pytestmark = pytest.mark.timeout(60)


def test_sync_decision():
    assert sync_decision({0: 5, 1: 5, 3: 5}) is None
    assert sync_decision({0: 5, 1: 6, 3: 6}) == (1, 6)  # lowest id at the highest step gives
    assert sync_decision({0: 7, 1: 7, 2: JOINING, 3: 7}) == (0, 7)
    assert sync_decision({2: 4, 3: JOINING}) == (2, 4)
    with pytest.raises(PeerFailure):
        sync_decision({2: JOINING})


def test_state_server_drops_departed_and_admits_joined_devices():
    s = StateServer([0, 1, 2], epsilon=0.0)
    for r, c in ((0, 0.1), (1, 0.1), (2, 5.0)):
        s.query_state(r, 0, c, 0.0, 0.0)
    assert s.slowest().rank == 2
    # device 2 is dead: while it is a device nobody is ever READY before its 5 s are over
    assert s.query_state(0, 1, 0.1, 0.2, 0.2) is False
    s.set_members([0, 1], now=0.3)
    assert set(s.records) == {0, 1} and s.slowest().rank in (0, 1)
    assert s.query_state(0, 2, 0.1, 0.3, 0.3) is True
    for r in (0, 1):
        s.reset(r, 4, 1.0)
    s.set_members([0, 1, 3], now=1.0)  # a joiner: admitted at the current round
    rec = s.records[3]
    assert rec.round == 4 and math.isfinite(rec.capability) and rec.last_finish == 1.0


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
async def test_trainer_state_roundtrip_makes_replicas_bitwise_equal(optimizer):
    topo = ring(3)
    trainers = make_trainer(topo, 0), make_trainer(topo, 1)
    if optimizer == "adam":
        for t in trainers:
            t.optimizer = torch.optim.Adam([p for p in t.model.parameters() if p.requires_grad], lr=1e-3)
    async with gated(trainers) as (a, b):
        assert a.state_size() == b.state_size() and a.state_size() > a.numel
        assert (await b.export_state()).size == b.state_size()  # no optimizer state yet: zeros
        for _ in range(3):
            _, g = await a.compute_gradients()
            await a.apply_gradients(g)
        await b.import_state(await a.export_state())
        assert (await a.export_state()).tobytes() == (await b.export_state()).tobytes()
        _, g = await a.compute_gradients()  # the same gradient on both: bitwise the same step
        await a.apply_gradients(g)
        await b.apply_gradients(g)
        assert (await a.get_params()).tobytes() == (await b.get_params()).tobytes()
        with pytest.raises(ValueError):
            await b.import_state(np.zeros(3, np.float32))

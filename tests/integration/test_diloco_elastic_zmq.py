"""DiLoCo when nodes leave and join, over real ZeroMQ in one process (the nodes of
tests/integration/test_leave_join_zmq.py): a crash while a fragment's sum is in flight is redone
over the survivors, which end with one model and one θ_g; a restarted node adopts the leader's
θ_g and outer momentum and ends with the same model."""

from __future__ import annotations

import numpy as np
import pytest

from p2psync.topology import ring
from tests.helpers import free_port, until
from tests.integration.test_leave_join_zmq import Node, _crash, _finish, _params, _train, cluster

pytestmark = pytest.mark.timeout(120)

OPTS = {"inner_steps": 4, "fragments": 2, "fragment_by": "flat", "tau": 1, "outer_lr": 0.7}


async def test_a_crash_mid_run_is_redone_over_the_survivors_who_end_with_one_model():
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "diloco", options=OPTS) as nodes:
        await _train(nodes, 40, warm=7)
        survivors = await _crash(nodes, 2)
        ends = await _finish(survivors)
        params = await _params(survivors)
        thetas = [n.strategy.theta for n in survivors]
        reforms = [n.strategy.regroup.reforms + n.strategy.adoptions for n in survivors]
    assert len(set(ends)) == 1 and 40 <= ends[0] <= 40 + 2 + 1, ends  # the stop rides with the next sum: h + tau late
    assert all(r >= 1 for r in reforms), reforms
    assert all(t.tobytes() == thetas[0].tobytes() for t in thetas)
    assert all(p.tobytes() == thetas[0].tobytes() for p in params)


async def test_a_restarted_node_adopts_the_global_copy_and_ends_with_the_same_model():
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "diloco", options=OPTS) as nodes:
        joiner = Node(topo, 3, "diloco", options=OPTS)
        await _train(nodes, 10_000, stop=lambda: joiner.steps >= 12)
        survivors = await _crash(nodes, 3)
        await until(lambda: all(n.strategy.regroup.reforms + n.strategy.adoptions >= 1 for n in survivors), 30,
                    "re-formed")
        try:
            await joiner.restart()
            assert joiner.strategy.ctx.joining
            joiner.go(10_000)
            ends = await _finish([*survivors, joiner])
            params = await _params([*survivors, joiner])
            adopted = joiner.strategy.adoptions
        finally:
            await joiner.close()
    assert len(set(ends)) == 1, ends
    assert adopted == 1
    assert all(p.tobytes() == params[0].tobytes() for p in params)

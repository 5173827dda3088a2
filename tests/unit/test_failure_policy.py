"""The failure policy (strategies/failure.py): which errors each policy recovers from, which
way it runs an operation, and the check before every step (``Strategy.run_step``)."""

from __future__ import annotations

import pytest

from p2psync.coordinator import View
from p2psync.errors import (GroupCutOff, NonFinitePiece, P2PSyncError, PeerFailure, PeerTimeout,
                            ProtocolError)
from p2psync.strategies import get_strategy
from p2psync.strategies.failure import Reform, Stop, failure_policy
from p2psync.topology import mesh
from p2psync.transport import MemoryHub
from tests.helpers import close_replica, gate_replicas, make_context, make_trainer

pytestmark = pytest.mark.timeout(60)

ERRORS = [PeerFailure("gone", peers=(1,)), NonFinitePiece("nan", peer=1),
          GroupCutOff("cut", parts=((0,), (1,))), PeerTimeout("slow"), ProtocolError("collective_mismatch"),
          ProtocolError("state", "bad"), P2PSyncError("other"), ValueError("bug")]


async def _node(topo, node, **opts):
    hub = MemoryHub(topo)
    t = hub.endpoint(node, default_timeout=10)
    await t.start()
    replica = gate_replicas([make_trainer(topo, node)])[0]
    return make_context(topo, t, replica, options=opts)


async def _close(ctx):
    await close_replica(ctx.replica)
    await ctx.transport.close()


async def test_without_a_membership_service_the_policy_stops_and_recovers_from_nothing():
    topo = mesh(3)
    ctx = await _node(topo, 0)
    try:
        policy = failure_policy(ctx, "ssgd")
        assert isinstance(policy, Stop)
        assert [policy.recovers(e) for e in ERRORS] == [False] * len(ERRORS)
        assert policy.view() == View(epoch=0, members=(0, 1, 2))
        policy.check()
        policy.on_peer_failure(2)
        with pytest.raises(PeerFailure, match=r"peer\(s\) \[2\] failed") as ei:
            policy.check()
        assert ei.value.peers == (2,)
    finally:
        await _close(ctx)


async def test_reform_recovers_from_a_members_failure_a_timeout_and_a_mismatch_only():
    topo = mesh(3)
    ctx = await _node(topo, 0)
    try:
        policy = Reform(ctx)
        assert [policy.recovers(e) for e in ERRORS] == [True, True, True, True, True, False, False, False]
        policy.on_peer_failure(2)
        policy.check()  # a failed peer alone never stops a re-forming run
    finally:
        await _close(ctx)


async def test_stop_runs_the_operation_once_over_every_node_and_reform_runs_the_reforming_path():
    topo = mesh(3)
    ctx = await _node(topo, 0)
    calls: list[object] = []

    async def once(view: View) -> str:
        calls.append(view)
        return "once"

    async def reform() -> str:
        calls.append("reform")
        return "reform"

    try:
        assert await Stop(ctx, "x", "x.").run(once, reform) == "once"
        assert calls == [View(epoch=0, members=(0, 1, 2))]
        calls.clear()
        assert await Reform(ctx).run(once, reform) == "reform"
        assert calls == ["reform"]
    finally:
        await _close(ctx)


async def test_run_step_checks_the_policy_before_the_strategys_step():
    topo = mesh(3)
    ctx = await _node(topo, 0)
    strategy = get_strategy("ssgd")(ctx)
    await strategy.start()
    stepped: list[int] = []

    async def train_step(step, want_stop):
        stepped.append(step)
        raise AssertionError("train_step ran after a peer failed")

    strategy.train_step = train_step
    try:
        assert strategy.failure is not None
        strategy.on_peer_failure(2)  # what the membership client does on a failure event
        with pytest.raises(PeerFailure, match=r"peer\(s\) \[2\] failed"):
            await strategy.run_step(0, False)
        assert stepped == []
    finally:
        await strategy.close()
        await _close(ctx)


def test_asynchronous_strategies_have_no_policy_to_apply():
    assert get_strategy("asgd").failure is None

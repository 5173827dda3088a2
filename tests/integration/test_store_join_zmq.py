"""A node of the parameter-store strategies leaves and comes back, over real ZeroMQ in one
process: of three nodes, one crashes, the coordinator (or, when it was the coordinator, the node
taking over) declares it failed, the survivors re-shard over themselves; a new process of that
node (a new incarnation) joins the run, the three re-shard again with it, and training goes on
to the run's last step on all three. The joiner takes a member's hyperparameters.

The join's re-shard is exact: the state every owner held when it began (weights and optimizer
state of its shard, recorded on entry to :meth:`ParamStore.reshard`, when the store stops
taking pieces) equals, bitwise, the state the three take for the new split (recorded where each
builds its new shard). And a join admitted while the run stops: the end barrier gives way to
the join's re-shard. Nodes are built as in :mod:`tests.integration.test_leave_join_zmq`."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import pytest

from p2psync.coordinator.ssp_service import SchedulerService
from p2psync.params import ParamStore, shard_bounds
from p2psync.params.optim import ShardOptimizer
from p2psync.topology import ring
from p2psync.training.hetero import parse_profiles
from tests.helpers import free_port, until
from tests.integration.test_leave_join_zmq import Node, _crash, _finish, _params, _train, cluster

pytestmark = pytest.mark.timeout(90)

Shard = tuple[int, int, np.ndarray, np.ndarray]  # lo, hi, weights, optimizer state


def _spy(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[tuple[int, int], Shard], dict[tuple[int, int], Shard]]:
    """``(before, after)``: per (node, store epoch), the shard a member held when its re-shard
    to that epoch began, and the one it took."""
    before: dict[tuple[int, int], Shard] = {}
    after: dict[tuple[int, int], Shard] = {}
    reshard, shard = ParamStore.reshard, ParamStore._shard

    async def spy_reshard(self: ParamStore, members: Any, epoch: int, allreduce: Any, **kw: Any) -> np.ndarray:
        if self.holds:  # a BSP round held is applied first, as the re-shard does (nothing awaited between)
            self.barriers.flush(self.opt)
            before[self.me, epoch] = (self.lo, self.hi, self.opt.w.copy(), self.opt.export_state().copy())
        return await reshard(self, members, epoch, allreduce, **kw)

    def spy_shard(self: ParamStore, w: np.ndarray, state: np.ndarray | None = None) -> ShardOptimizer:
        if getattr(self, "_moving", None) is not None and state is not None:
            after[self.me, self._moving] = (self.lo, self.hi, w.copy(), state.copy())
        return shard(self, w, state)

    monkeypatch.setattr(ParamStore, "reshard", spy_reshard)
    monkeypatch.setattr(ParamStore, "_shard", spy_shard)
    return before, after


def _whole(shards: list[Shard], numel: int) -> tuple[np.ndarray, np.ndarray]:
    w = np.full(numel, np.nan, np.float32)
    st = np.full((shards[0][3].shape[0], numel), np.nan, np.float32)
    for lo, hi, x, s in shards:
        w[lo:hi], st[:, lo:hi] = x, s
    return w, st


async def _restart(node: Node) -> None:
    """A new process of ``node``, as a node process starts: it asks every node for the run's
    view first (the topology's coordinator, restarted, must join the run, not host another)."""
    await node.ep.start()
    node.server.start()
    assert await node.client.discover(timeout=1.5) is not None
    await node.join_run()


@pytest.mark.parametrize("strategy,options,victim", [("ssp", {"s": 2}, 2), ("elastic_bsp", {"R": 3}, 2),
                                                     ("bsp", {}, 0)])
async def test_a_failed_node_rejoins_the_store_exactly_and_all_three_train_to_the_end(monkeypatch, strategy,
                                                                                     options, victim):
    """Node 2 under ``ssp`` and ``elastic_bsp``; under ``bsp`` (rounds) node 0, the coordinator:
    node 1 takes over, and node 0's new process joins the run node 1 coordinates."""
    before, after = _spy(monkeypatch)
    topo = ring(3, base_port=free_port())
    failover = victim == topo.coordinator
    async with cluster(topo, strategy, options=options, failover=failover) as nodes:
        joiner = Node(topo, victim, strategy, options=options, failover=failover)
        try:
            await _train(nodes, 10_000, warm=6, stop=lambda: joiner.steps >= 12)
            survivors = await _crash(nodes, victim)
            await until(lambda: all(n.strategy.reshards == 1 for n in survivors), 30, "the survivors to re-shard")
            counts = {n.id: n.strategy.count for n in survivors}
            for n in survivors:  # a schedule moved the members' learning rate: the joiner takes it
                assert n.path is not None  # (a job on the node's training thread)
                await n.path.gate.run(lambda n=n: n.trainer.optimizer.param_groups[0].update(lr=0.07))
            await _restart(joiner)
            assert joiner.strategy.ctx.joining
            joined_at = joiner.strategy.count
            assert joiner.trainer.optimizer.param_groups[0]["lr"] == 0.07
            joiner.go(10_000)
            everyone = sorted([*survivors, joiner], key=lambda n: n.id)
            ends = await _finish(everyone)
            params = await _params(everyone)
            stores = [n.strategy.store for n in everyone]
            reshards = {n.id: n.strategy.reshards for n in everyone}
            coord = survivors[0]
            svc = coord.server.handlers[f"{strategy}.pushed"].__self__  # type: ignore[attr-defined]
            coordinating = coord.host.coordinating if coord.host is not None else coord.service is not None
            new_inc, old_inc = joiner.ep.incarnation, nodes[victim].ep.incarnation
        finally:
            await joiner.close()
    owners = [n.id for n in survivors]
    numel = params[0].size
    epoch = joiner.strategy.store.epoch  # the join's re-shard (nothing changed since)
    assert all(s.epoch == epoch and s.members == [0, 1, 2] for s in stores)
    assert sorted(i for i, e in before if e == epoch) == owners  # the owners: the survivors
    assert sorted(i for i, e in after if e == epoch) == [0, 1, 2]
    want_w, want_st = _whole([before[i, epoch] for i in owners], numel)
    got_w, got_st = _whole([after[i, epoch] for i in (0, 1, 2)], numel)
    assert [after[i, epoch][:2] for i in (0, 1, 2)] == [shard_bounds(numel, [0, 1, 2])[i] for i in (0, 1, 2)]
    assert np.isfinite(want_w).all() and got_w.tobytes() == want_w.tobytes()  # bitwise
    assert np.isfinite(want_st).all() and np.array_equal(got_st, want_st)
    assert reshards == {**{i: 2 for i in owners}, victim: 1}, reshards
    # the joiner started at the slowest survivor's count, then trained with the others to the end
    assert min(counts.values()) <= joined_at <= max(n.strategy.count for n in survivors), (counts, joined_at)
    assert joiner.steps >= 12 and all(n.task is not None and n.task.done() for n in everyone), ends
    assert isinstance(svc, SchedulerService) and svc.rejected == 0 and set(svc.sched.counts) == {0, 1, 2}
    assert new_inc != old_inc and coordinating  # node 1 coordinates when node 0 was the victim
    if strategy == "elastic_bsp":  # the joiner waits at barriers with the others: released from some
        assert any(r.get("barrier") for r in joiner.reports), joiner.reports
    if strategy == "bsp":  # rounds go on in lockstep with the joiner: every OK a barrier at gap 0
        oks = [r for r in joiner.reports if r.get("gap") is not None]
        assert oks and all(r["gap"] == 0 and r["barrier"] for r in oks), oks
    for p in params[1:]:
        assert p.tobytes() == params[0].tobytes()  # every node ends with the same weights
    assert np.isfinite(params[0]).all()


async def test_a_join_admitted_while_the_run_stops_moves_the_store_before_the_end_barrier(caplog):
    """The run stops as node 2's new process joins: node 0 got STOP and waits in the end
    barrier for node 1 (a slow step) when the view admitting node 2 arrives; it leaves the
    barrier for the join's re-shard (node 2 waits in it), and the three end together, with
    one model, node 2 after one step."""
    caplog.set_level(logging.INFO, logger="p2psync.strategies")
    topo = ring(3, base_port=free_port())
    stop = {"now": False}
    async with cluster(topo, "ssp", options={"s": 2}) as nodes:
        joiner = Node(topo, 2, "ssp", options={"s": 2})
        try:
            await _train(nodes, 10_000, warm=6, stop=lambda: stop["now"])
            survivors = await _crash(nodes, 2)
            await until(lambda: all(n.strategy.reshards == 1 for n in survivors), 30, "the survivors to re-shard")
            in_end = asyncio.Event()
            end = nodes[0].strategy._end

            async def spy_end() -> np.ndarray:
                in_end.set()
                return await end()
            nodes[0].strategy._end = spy_end
            nodes[1].trainer.slowdown = parse_profiles(step_time="1:2.0")[1]  # from its next step on
            slow_from = nodes[1].steps + 1
            await until(lambda: nodes[1].steps > slow_from, 20, "node 1 in a slow step")
            stop["now"] = True
            await asyncio.wait_for(in_end.wait(), 20)
            await _restart(joiner)
            joiner.go(10_000, lambda: stop["now"])
            everyone = [*survivors, joiner]
            await _finish(everyone)
            params = await _params(everyone)
            reshards = [n.strategy.reshards for n in everyone]
        finally:
            await joiner.close()
    assert joiner.steps == 1 and reshards == [2, 2, 1], (joiner.steps, reshards)
    assert "node 0: ssp leaves the end barrier of store epoch" in caplog.text
    for p in params[1:]:
        assert p.tobytes() == params[0].tobytes()

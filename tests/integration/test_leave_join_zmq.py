"""Nodes that leave and join (issue 10 item 5) over real ZeroMQ, in one process.

Every node is built the way a node process builds it (transport, RPC, membership client, the
membership service and coordinator services on the coordinator, a real Trainer, the strategy
wired to ``listeners`` and ``view_listeners``). A crash is simulated by cancelling a node's
training and closing its membership client, RPC server and endpoint at once: its peers see
silence, the coordinator declares it failed and publishes a new view.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any, AsyncIterator

import numpy as np
import pytest

from p2psync.collectives import Collectives
from p2psync.coordinator import MembershipClient, MembershipService, RpcClient, RpcServer
from p2psync.coordinator.failover import CoordinatorHost
from p2psync.errors import PeerFailure
from p2psync.strategies import StrategyContext, get_strategy
from p2psync.strategies.asgd import ASGD
from p2psync.topology import Topology, ring
from p2psync.training.hetero import parse_profiles
from p2psync.transport import ZmqEndpoint
from tests.helpers import GatePath, free_port, make_trainer, until

pytestmark = pytest.mark.timeout(120)

HB, FAIL = 0.2, 1.0  # heartbeat interval, failure-detector floor (s)
STEP_S = 0.03  # emulated step time: the run lasts long enough to crash and join in it


class Node:
    def __init__(self, topo: Topology, i: int, strategy: str, *, on_failure: str = "continue",
                 options: dict[str, Any] | None = None, failover: bool = False,
                 trainer: dict[str, Any] | None = None) -> None:
        """``trainer``: :func:`~tests.helpers.make_trainer` keywords (its learning rate and
        optimizer)."""
        self.topo, self.id, self.name, self.on_failure = topo, i, strategy, on_failure
        self.options = dict(options or {})
        self.ep = ZmqEndpoint(topology=topo, node_id=i, default_timeout=10.0)
        self.server = RpcServer(self.ep)
        self.rpc = RpcClient(self.ep, local=self.server)
        self.client = MembershipClient(transport=self.ep, rpc=self.rpc, coordinator=topo.coordinator,
                                       heartbeat_interval=HB, failure_timeout=FAIL)
        #: ``failover``: every node hosts membership and the strategy's services when it
        #: coordinates (a node process's CoordinatorHost), so the coordinator may die
        self.host = (CoordinatorHost(server=self.server, membership=self.client, expected=topo.ids,
                                     services=lambda srv: get_strategy(strategy).coordinator_services(
                                         srv, topo, self.options),
                                     start_timeout=30, failure_timeout=FAIL, heartbeat_interval=HB,
                                     run_info={"run_id": "t"}, allow_join=on_failure == "continue")
                     if failover else None)
        self.service = (MembershipService(server=self.server, expected=topo.ids, start_timeout=30,
                                          failure_timeout=FAIL, heartbeat_interval=HB,
                                          allow_join=on_failure == "continue")
                        if i == topo.coordinator and not failover else None)
        lr = 0.05 if strategy == "asgd" else 0.1
        self.trainer = make_trainer(topo, i, **{"lr": lr, **(trainer or {})})
        self.trainer.slowdown = parse_profiles(step_time=f"{i}:{STEP_S}")[i]
        #: the trainer's model on the gate path (its loop starts when the node joins the run)
        self.path: GatePath | None = None
        self.strategy: Any = None
        self.steps = 0  # run_step calls done
        self.reports: list[dict[str, Any]] = []  # every step report's ``extra``
        self.step = 0  # the loop's step
        self.task: asyncio.Task[int] | None = None
        self.closed = False

    async def start(self) -> None:
        await self.ep.start()
        if self.service is not None:
            self.service.start()
            get_strategy(self.name).coordinator_services(self.server, self.topo, self.options)
        if self.host is not None and self.id == self.topo.coordinator:
            self.host.host()
        self.server.start()

    async def restart(self) -> None:
        """A new process for this node (same id and port, a newer incarnation): start, then join
        the run going on."""
        await self.start()
        await self.join_run()

    async def join_run(self) -> None:
        info = await self.client.register("fp", timeout=30)
        self.client.start()
        self.path = GatePath(self.trainer)
        self.path.go()
        ctx = StrategyContext(node_id=self.id, topology=self.topo, transport=self.ep, rpc=self.rpc,
                              rpc_server=self.server, membership=self.client, replica=self.path.replica,
                              collectives=Collectives(self.ep, timeout=10.0), peer_timeout=10.0,
                              options=self.options, on_failure=self.on_failure,
                              joining=bool(info.get("joined")))
        self.strategy = self.path.drive(get_strategy(self.name)(ctx))
        self.client.listeners.append(self.strategy.on_peer_failure)
        self.client.view_listeners.append(self.strategy.on_view)
        await self.strategy.start()
        self.step = self.strategy.start_step

    async def train(self, steps: int, stop: Any = lambda: False) -> int:
        """The training loop's logic; returns the step it ended at."""
        while True:
            rep = await self.strategy.run_step(self.step, self.step + 1 >= steps or stop())
            self.reports.append(rep.extra)
            self.step = self.step + 1 if rep.next_step is None else rep.next_step
            self.steps += 1
            if rep.stop or self.steps > 3 * steps:
                return self.step

    def go(self, steps: int, stop: Any = lambda: False) -> None:
        self.task = asyncio.ensure_future(self.train(steps, stop))

    async def crash(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        if self.strategy is not None:
            await self.strategy.close()
        await self.client.close()
        if self.service is not None:
            await self.service.close()
        if self.host is not None:
            await self.host.close()
        await self.server.close(grace=0.1)
        await self.ep.close()
        if self.path is not None:
            await self.path.close()


@contextlib.asynccontextmanager
async def cluster(topo: Topology, strategy: str, **kw: Any) -> AsyncIterator[dict[int, Node]]:
    nodes = {i: Node(topo, i, strategy, **kw) for i in topo.ids}
    try:
        for n in nodes.values():
            await n.start()
        await asyncio.gather(*(n.join_run() for n in nodes.values()))
        yield nodes
    finally:
        for n in nodes.values():
            await n.close()


async def _train(nodes: dict[int, Node], steps: int, *, warm: int = 5, stop: Any = lambda: False) -> None:
    """Every node trains towards ``steps`` (or until ``stop()``); returns once each has done
    ``warm`` steps."""
    for n in nodes.values():
        n.go(steps, stop)
    await until(lambda: all(n.steps >= warm for n in nodes.values()), 60, "every node to train")


async def _crash(nodes: dict[int, Node], victim: int) -> list[Node]:
    """Node ``victim`` crashes; the survivors, in id order."""
    await nodes[victim].crash()
    return [n for i, n in nodes.items() if i != victim]


async def _finish(nodes: list[Node], timeout: float = 60) -> list[int]:
    tasks = [n.task for n in nodes if n.task is not None]
    done = await asyncio.wait_for(asyncio.gather(*tasks), timeout)
    return list(done)


async def _params(nodes: list[Node]) -> list[np.ndarray]:
    return [await n.strategy.ctx.replica.get_params() for n in nodes]


@pytest.mark.parametrize("strategy", ["ssgd", "esync"])
async def test_crash_mid_run_survivors_reform_and_finish_identical(strategy):
    topo = ring(4, base_port=free_port())
    steps = 40 if strategy == "ssgd" else 20
    async with cluster(topo, strategy) as nodes:
        await _train(nodes, steps)
        loop = asyncio.get_running_loop()
        t_kill = loop.time()
        survivors = await _crash(nodes, 2)
        await until(lambda: all(n.strategy.regroup.reformations >= 1 for n in survivors), 30, "re-formed")
        print(f"{strategy}: kill -> every survivor re-formed in {loop.time() - t_kill:.2f}s "
              f"(failure detection floor {FAIL}s)")
        ends = await _finish(survivors)
        params = await _params(survivors)
        reforms = [n.strategy.regroup.reformations for n in survivors]
    assert ends == [steps] * 3, ends
    assert all(p.tobytes() == params[0].tobytes() for p in params)  # bitwise identical
    assert all(r >= 1 for r in reforms), reforms
    assert all(n.client.view is not None and n.client.view.members == (0, 1, 3) for n in survivors)


async def test_asgd_crash_survivors_finish():
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "asgd") as nodes:
        await _train(nodes, 40)
        survivors = await _crash(nodes, 1)
        ends = await _finish(survivors)
        await until(lambda: all(n.strategy.alive == {0, 2, 3} for n in survivors), 10, "trees over survivors")
    assert ends == [40] * 3


async def test_on_failure_stop_keeps_fail_stop_naming_the_node():
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "ssgd", on_failure="stop") as nodes:
        await _train(nodes, 10_000, warm=3)
        await nodes[3].crash()
        for i in (0, 1, 2):
            with pytest.raises(PeerFailure) as ei:
                await asyncio.wait_for(nodes[i].task, 30)  # type: ignore[arg-type]
            assert 3 in ei.value.peers and "synchronous training cannot continue" in str(ei.value)


@pytest.mark.parametrize("strategy", ["ssgd", "esync"])
async def test_restarted_node_rejoins_with_the_same_parameters(strategy):
    topo = ring(4, base_port=free_port())
    async with cluster(topo, strategy) as nodes:
        joiner = Node(topo, 3, strategy)
        await _train(nodes, 10_000, stop=lambda: joiner.steps >= 6)
        survivors = await _crash(nodes, 3)
        await until(lambda: all(n.strategy.regroup.reformations >= 1 for n in survivors), 30, "re-formed")
        crashed_at = max(n.step for n in survivors)
        try:
            await joiner.restart()
            assert joiner.strategy.ctx.joining and joiner.strategy.start_step >= crashed_at
            joiner.go(10_000)
            ends = await _finish([*survivors, joiner])
            params = await _params([*survivors, joiner])
            views = [n.client.view for n in [*survivors, joiner]]
        finally:
            await joiner.close()
    assert len(set(ends)) == 1, ends
    assert all(p.tobytes() == params[0].tobytes() for p in params)
    assert all(v is not None and v.members == (0, 1, 2, 3) for v in views), views
    assert np.isfinite(params[0]).all()


async def test_asgd_restarted_node_rejoins_the_flooding_trees():
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "asgd") as nodes:
        await _train(nodes, 200)
        survivors = await _crash(nodes, 3)
        await until(lambda: all(n.strategy.alive == {0, 1, 2} for n in survivors), 30, "trees over survivors")
        joiner = Node(topo, 3, "asgd")
        try:
            await joiner.restart()
            assert joiner.strategy.ctx.joining and joiner.strategy.start_step > 0
            await until(lambda: all(n.strategy.alive == {0, 1, 2, 3} for n in survivors), 30,
                        "the joiner back in every tree")
            joiner.go(200)
            ends = await _finish([*survivors, joiner])
            await until(lambda: joiner.strategy.applied_remote > 0, 10, "gradients reach the joiner")
            acc = (await joiner.path.evaluate())[1]
        finally:
            await joiner.close()
    assert ends == [200] * 4
    assert acc > 0.4, acc  # it started from a trained replica, not from scratch


async def test_asgd_takes_each_gradient_once_while_a_crash_and_a_rejoin_spread(monkeypatch):
    """Nodes train through two view changes (node 3 crashes, a new process of it joins), each
    reaching the nodes at its own time, so for a while they forward along different views'
    trees. Every process takes (applies and forwards) each gradient ``(origin, incarnation,
    step)`` at most once, and once the joiner is in every view no gradient is lost."""
    taken: Counter = Counter()  # (node, its incarnation, origin, origin's incarnation, step)
    take = ASGD._take

    def recording_take(self, msg):
        got = take(self, msg)
        if got is not None:
            taken[(self.ctx.node_id, self.ctx.transport.incarnation, got[0], got[1], msg.header.step)] += 1
        return got

    monkeypatch.setattr(ASGD, "_take", recording_take)
    steps = 200
    topo = ring(6, base_port=free_port())
    async with cluster(topo, "asgd") as nodes:
        await _train(nodes, steps)
        survivors = await _crash(nodes, 3)
        await until(lambda: all(n.strategy.alive == {0, 1, 2, 4, 5} for n in survivors), 30, "trees over survivors")
        joiner = Node(topo, 3, "asgd")
        try:
            await joiner.restart()
            await until(lambda: all(n.strategy.alive == set(topo.ids) for n in survivors), 30,
                        "the joiner back in every tree")
            joined_at = max(n.step for n in survivors)
            joiner.go(steps)
            await _finish([*survivors, joiner])
            procs = {(n.id, n.ep.incarnation) for n in [*survivors, joiner]}
            everyone = [*survivors, joiner]
            # the last gradients are on their way while the loops end
            await until(lambda: all(n.strategy.applied_remote >= sum(
                1 for k in taken if k[:2] == (n.id, n.ep.incarnation)) for n in everyone), 10, "applied")
            duplicates = sum(n.strategy.duplicates for n in everyone)
        finally:
            await joiner.close()
    assert taken and max(taken.values()) == 1, taken.most_common(3)
    takers: dict = {}
    for node, inc, origin, oinc, step in taken:
        takers.setdefault((origin, oinc, step), set()).add((node, inc))
    missed = [(g, sorted(procs - who - {g[:2]})) for g, who in takers.items()
              if g[:2] in procs and joined_at + 10 <= g[2] <= steps - 10 and who | {g[:2]} != procs]
    assert not missed, missed[:5]
    print(f"asgd: {len(taken)} gradients taken, {duplicates} copies dropped")


async def test_dts_crash_mid_run_survivors_resync_and_finish_with_one_model():
    """DTS (issue 12): a crash while windows are in flight drops them unapplied, the survivors
    average their whole state over the new view and go on; every survivor ends at the same
    step with the same model (the final flush), no hang."""
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "dts", options={"t": 2, "p": 2}) as nodes:
        await _train(nodes, 40, warm=6)
        survivors = await _crash(nodes, 2)
        ends = await _finish(survivors)
        params = await _params(survivors)
        resyncs = [n.strategy.resyncs for n in survivors]
    assert len(set(ends)) == 1 and ends[0] >= 40, ends
    assert all(r >= 1 for r in resyncs), resyncs
    for p in params[1:]:
        np.testing.assert_allclose(p, params[0], rtol=1e-5, atol=1e-6)


async def test_dts_restarted_node_rejoins_and_ends_with_the_same_model():
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "dts", options={"t": 1, "p": 2}) as nodes:
        joiner = Node(topo, 3, "dts", options={"t": 1, "p": 2})
        await _train(nodes, 10_000, stop=lambda: joiner.steps >= 8)
        survivors = await _crash(nodes, 3)
        await until(lambda: all(n.strategy.resyncs >= 1 for n in survivors), 30, "re-synced")
        try:
            await joiner.restart()
            assert joiner.strategy.ctx.joining
            joiner.go(10_000)
            ends = await _finish([*survivors, joiner])
            params = await _params([*survivors, joiner])
        finally:
            await joiner.close()
    assert len(set(ends)) == 1, ends
    for p in params[1:]:
        np.testing.assert_allclose(p, params[0], rtol=1e-5, atol=1e-6)


async def test_preduce_crash_mid_run_survivors_go_on_and_end_with_one_model():
    """P-Reduce (issue 13): a crashed worker never freezes a group: a reduce it was part of is
    aborted at its failure (its members keep their own models), the controller drops it at the
    next view, the survivors keep forming groups, and the final average re-forms over them."""
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "preduce", options={"P": 2}) as nodes:
        await _train(nodes, 60, warm=6)
        survivors = await _crash(nodes, 2)
        ops_at_crash = [n.strategy.ops for n in survivors]
        ends = await _finish(survivors)
        params = await _params(survivors)
        ops = [n.strategy.ops for n in survivors]
    assert max(ends) == 60 and min(ends) > 6, ends
    assert all(b > a for a, b in zip(ops_at_crash, ops)), (ops_at_crash, ops)  # grouped after the crash
    for p in params[1:]:
        np.testing.assert_allclose(p, params[0], rtol=1e-6, atol=1e-7)


async def test_preduce_restarted_node_rejoins_the_queue_and_ends_with_the_same_model():
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "preduce", options={"P": 2}) as nodes:
        joiner = Node(topo, 3, "preduce", options={"P": 2})
        await _train(nodes, 10_000, stop=lambda: joiner.steps >= 10)
        survivors = await _crash(nodes, 3)
        await until(lambda: all(n.client.view is not None and n.client.view.members == (0, 1, 2)
                                for n in survivors), 30, "the view without node 3")
        try:
            await joiner.restart()
            assert joiner.strategy.ctx.joining and joiner.strategy.start_step > 0
            joiner.go(10_000)
            await _finish([*survivors, joiner])
            params = await _params([*survivors, joiner])
            joined_ops = joiner.strategy.ops
        finally:
            await joiner.close()
    assert joined_ops >= 1  # the joiner entered the queue and was grouped
    for p in params[1:]:
        np.testing.assert_allclose(p, params[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("strategy", ["ssp", "elastic_bsp"])
async def test_store_crash_survivors_reshard_and_end_with_one_model(strategy):
    """The parameter-store family (issue 14): a crashed worker's shard is restored from the
    freshest pulled copy and re-split over the survivors (exact allreduces), the scheduler drops
    it (nobody is held back by its count, ElasticBSP's barrier is recomputed), the survivors go
    on and end with identical weights."""
    topo = ring(4, base_port=free_port())
    async with cluster(topo, strategy) as nodes:
        await _train(nodes, 60, warm=6)
        survivors = await _crash(nodes, 2)
        counts_at_crash = [n.strategy.count for n in survivors]
        ends = await _finish(survivors)
        params = await _params(survivors)
        stores = [n.strategy.store for n in survivors]
    assert max(ends) == 60 and all(e > c for e, c in zip(ends, counts_at_crash)), (counts_at_crash, ends)
    assert all(n.strategy.reshards == 1 for n in survivors)
    assert all(s.members == [0, 1, 3] and s.epoch > 0 for s in stores)
    for p in params[1:]:
        assert p.tobytes() == params[0].tobytes()
    assert np.isfinite(params[0]).all()


async def test_canary_crash_survivors_replan_and_a_restarted_node_rejoins():
    """Issue 15: a dead worker's bits never block a colayer (its pending answers are aborted,
    native mode takes them as empty packets); the survivors average their state and re-plan
    the exchange over the new view; a restarted node joins with a member's state; everyone
    ends with one model."""
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "canary") as nodes:
        joiner = Node(topo, 2, "canary")
        await _train(nodes, 10_000, stop=lambda: joiner.steps >= 8)
        survivors = await _crash(nodes, 2)
        await until(lambda: all(n.strategy.resyncs >= 1 and n.strategy.exchange is not None
                                and n.strategy.exchange.layout.group == (0, 1, 3) for n in survivors),
                    30, "the survivors to re-plan")
        try:
            await joiner.restart()
            assert joiner.strategy.ctx.joining
            joiner.go(10_000)
            await _finish([*survivors, joiner])
            params = await _params([*survivors, joiner])
        finally:
            await joiner.close()
    assert all(p.tobytes() == params[0].tobytes() for p in params)
    assert np.isfinite(params[0]).all()

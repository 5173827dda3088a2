"""Receive loops stay up however long their peers are quiet (real ZeroMQ).

Regression: the RPC server, the membership client's view events and ASGD's gradient receiver
waited with ``Transport.recv(tag, timeout=None)``, which means the transport's *default*
timeout (``--peer-timeout``, 30 s), not "forever". A node that got no RPC request for 30 s
(every node but the coordinator, in any run longer than that) lost its RPC server silently;
when the coordinator then died, the node that took over could answer nobody: every member
timed out on it, deposed it, and the run fell apart in a cascade of false detections
(bench/faults.py). Here the default timeout is 0.3 s and every loop is idle for 1 s first.
"""

from __future__ import annotations

import asyncio

import pytest

from p2psync.coordinator import MembershipClient, RpcClient, RpcServer
from p2psync.coordinator.membership_state import EVENT_VIEW
from p2psync.coordinator.views import View
from p2psync.errors import TransportError
from p2psync.topology import mesh
from tests.helpers import close_strategies, free_port, start_strategies, until, zmq_cluster

pytestmark = pytest.mark.timeout(60)

IDLE = 0.3  # the transports' default timeout; every loop idles for longer


async def _echo(caller: int, args: object, arrays: object) -> object:
    return {"caller": caller}


async def test_rpc_server_answers_after_idling_longer_than_the_default_timeout() -> None:
    topo = mesh(2, base_port=free_port())
    async with zmq_cluster(topo, timeout=IDLE) as eps:
        server = RpcServer(eps[1])
        server.register("echo", _echo)
        server.start()
        try:
            await asyncio.sleep(1.0)
            assert server.serving  # its receive loop outlived the transport's default timeout
            rep = await RpcClient(eps[0]).call(1, "echo", timeout=5)
            assert rep == {"caller": 0}
        finally:
            await server.close(grace=0.1)


async def test_view_events_are_applied_after_idling() -> None:
    topo = mesh(2, base_port=free_port())
    async with zmq_cluster(topo, timeout=IDLE) as eps:
        server = RpcServer(eps[1])
        client = MembershipClient(transport=eps[1], rpc=RpcClient(eps[1], local=server), coordinator=0)
        client.start()
        try:
            await asyncio.sleep(1.0)
            view = View(epoch=3, members=(0, 1), incarnations={0: 0, 1: 0}, coordinator=0)
            await eps[0].send(1, EVENT_VIEW, kind="event", meta=view.to_wire(), timeout=5)
            await until(lambda: client.view is not None and client.view.epoch == 3, 5, "the view")
        finally:
            await client.close()


async def test_asgd_receiver_applies_gradients_after_idling() -> None:
    topo = mesh(2, base_port=free_port())
    async with zmq_cluster(topo, timeout=IDLE) as eps:
        strats = await start_strategies(eps, topo, "asgd")
        try:
            await strats[1].run_step(0, False)  # (a node applies peers' gradients from its first step)
            await asyncio.sleep(1.0)
            before = strats[1].applied_remote
            await strats[0].run_step(0, False)
            await until(lambda: strats[1].applied_remote > before, 10, "node 1 to apply node 0's gradient")
        finally:
            await close_strategies(strats)


async def test_listen_ends_when_the_transport_closes() -> None:
    topo = mesh(2, base_port=free_port())
    async with zmq_cluster(topo, timeout=IDLE) as eps:
        waiting = asyncio.ensure_future(eps[1].listen("never"))
        await asyncio.sleep(2 * IDLE)
        assert not waiting.done()
        await eps[1].close()
        with pytest.raises(TransportError):
            await asyncio.wait_for(waiting, 5)


async def test_asgd_applies_no_peer_gradient_before_its_first_step() -> None:
    """A gradient that arrives before a node's first iteration is forwarded but applied only
    once that iteration arrives: until then the model is the run's identical start (what
    ``attach`` returned)."""
    topo = mesh(2, base_port=free_port())
    async with zmq_cluster(topo, timeout=IDLE) as eps:
        strats = await start_strategies(eps, topo, "asgd")
        try:
            await strats[0].run_step(0, False)
            await asyncio.sleep(1.0)
            assert strats[1].applied_remote == 0
            await strats[1].run_step(0, False)
            await until(lambda: strats[1].applied_remote >= 1, 10, "node 1 to apply node 0's gradient")
        finally:
            await close_strategies(strats)

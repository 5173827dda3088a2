"""An RPC call to a node that dies (or loses its coordinator role) ends at once, not at its
deadline (real ZeroMQ, in-process shaper).

Regression (bench/faults.py, ESync): a node's ``esync.query`` to the coordinator was in flight
when the coordinator was killed. The node took over, deposed the old coordinator (declared
dead, calls to it aborted), but the call was between two attempts, so the abort missed it; with
a shaper a send to a dead node is accepted (and only dropped on delivery), so the call went on
resending until its own 10 s deadline, which was the whole budget of ``call_coordinator``: the
node failed with "RPC esync.query to node 0: no reply within 10s" instead of asking itself.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from p2psync.coordinator import RpcClient, RpcServer
from p2psync.errors import PeerFailure
from p2psync.topology import mesh
from p2psync.transport.shaping import InprocShaper, LinkSpec
from tests.helpers import free_port, zmq_cluster

pytestmark = pytest.mark.timeout(60)


async def _never(caller: int, args: object, arrays: object) -> object:
    await asyncio.Event().wait()  # a long poll that never answers
    return None


@pytest.mark.parametrize("how", ["declared_dead", "aborted"])
async def test_call_to_a_node_that_dies_ends_within_one_retransmission(how: str) -> None:
    topo = mesh(2, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        eps[0].shaper = InprocShaper({1: LinkSpec(latency_s=0.05)})
        server = RpcServer(eps[1])
        server.register("never", _never)
        server.start()
        client = RpcClient(eps[0])
        try:
            call = asyncio.ensure_future(client.call(1, "never", timeout=20))
            await asyncio.sleep(1.5)  # past the first retransmission: between two attempts
            t0 = time.monotonic()
            if how == "declared_dead":
                eps[0].mark_dead(1)
            else:
                client.abort_calls(1, PeerFailure("node 1 was deposed", peers=(1,)))
            with pytest.raises(PeerFailure):
                await asyncio.wait_for(call, 10)
            assert time.monotonic() - t0 < 5  # at the next attempt at the latest, not after 20 s
        finally:
            await server.close(grace=0.1)

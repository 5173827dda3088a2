"""A rendezvous that gets no answer says why it might not, over real ZeroMQ: whether this
node's links to the coordinator ever came up and what it dropped on arrival, so that a
registration lost on a live link is told from a coordinator that is not there."""

from __future__ import annotations

import pytest

from p2psync.coordinator import MembershipClient, RpcClient, RpcServer
from p2psync.errors import PeerTimeout
from p2psync.topology import ring
from p2psync.transport import ZmqEndpoint
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(60)


async def _register_error(*, coordinator_up: bool, timeout: float) -> str:
    """The PeerTimeout text of node 1's rendezvous with node 0 of a 2-node ring, node 0's
    endpoint up (connecting and accepting, serving no RPC) or not there at all."""
    topo = ring(2, base_port=free_port())
    silent = ZmqEndpoint(topology=topo, node_id=0, default_timeout=2.0) if coordinator_up else None
    ep = ZmqEndpoint(topology=topo, node_id=1, default_timeout=2.0)
    if silent is not None:
        await silent.start()
    await ep.start()
    server = RpcServer(ep)
    server.start()
    client = MembershipClient(transport=ep, rpc=RpcClient(ep, local=server), coordinator=0,
                              heartbeat_interval=0.2, failure_timeout=1.0)
    try:
        with pytest.raises(PeerTimeout) as err:
            await client.register("fp", timeout=timeout)
    finally:
        await client.close()
        await server.close(grace=0.1)
        await ep.close()
        if silent is not None:
            await silent.close()
    return str(err.value)


async def test_a_rendezvous_with_no_coordinator_reports_its_links():
    text = await _register_error(coordinator_up=False, timeout=1.5)
    assert "rendezvous with coordinator 0 failed" in text, text
    assert "control link to node 0 down, bulk link down" in text, text
    assert "messages rejected here: none" in text, text


async def test_a_rendezvous_unanswered_over_a_live_link_says_so_and_counts_its_attempts():
    """The request goes out and is resent, and nothing answers."""
    text = await _register_error(coordinator_up=True, timeout=2.5)
    assert "no reply within" in text and "attempts)" in text, text
    assert "control link to node 0 up" in text, text


async def test_the_link_state_names_a_node_that_is_not_adjacent():
    topo = ring(4, base_port=free_port())
    ep = ZmqEndpoint(topology=topo, node_id=0, default_timeout=2.0)
    await ep.start()
    try:
        assert ep.link_state(2).startswith("node 2 is not adjacent")
        assert ep.link_state(1).startswith("control link to node 1 down")
    finally:
        await ep.close()

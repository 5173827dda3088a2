"""Error edges of the rendezvous: what a coordinator's refusal looks like on the registering node."""

from __future__ import annotations

import asyncio

import pytest

from p2psync.coordinator import MembershipClient, MembershipService, RpcClient, RpcServer
from p2psync.errors import ConfigError, RemoteError
from p2psync.topology import ring
from p2psync.tasks import cancel_all
from p2psync.transport import MemoryHub
from tests.helpers import until


async def test_a_different_configuration_is_a_config_error_naming_it_not_a_timeout():
    """The coordinator refuses a node whose configuration fingerprint differs from the first
    registrant's: the refused node raises ConfigError with the coordinator's message (it used to
    surface as a PeerTimeout 'rendezvous failed')."""
    hub = MemoryHub(ring(3))
    eps = {i: hub.endpoint(i) for i in range(3)}
    for e in eps.values():
        await e.start()
    server = RpcServer(eps[0])
    service = MembershipService(server=server, expected=range(3), start_timeout=5.0)
    server.start()
    service.start()
    clients = {i: MembershipClient(transport=eps[i], rpc=RpcClient(eps[i], local=server if i == 0 else None),
                                   coordinator=0) for i in range(3)}
    try:
        # the first registrant sets the fingerprint (it waits for the others: the rendezvous)
        first = asyncio.ensure_future(clients[0].register("same", timeout=5.0))
        await until(lambda: 0 in service.state.registered, 5.0, "node 0 registered")
        with pytest.raises(ConfigError, match="refused the registration.*different configuration") as got:
            await clients[1].register("other", timeout=5.0)
        assert isinstance(got.value.__cause__, RemoteError) and got.value.__cause__.kind == "ConfigError"
    finally:
        await cancel_all([first])
        for c in clients.values():
            await c.close()
        await service.close()
        await server.close()
        for e in eps.values():
            await e.close()

"""RPC over the in-memory transport on a ring whose relay died and is not declared dead yet:
the requester goes around it (its retries take the other first hop) and the reply comes back
the way the request came, instead of down the responder's shortest path into the dead relay."""

from __future__ import annotations

import asyncio
from typing import Any, Mapping, Sequence

from p2psync.coordinator import RpcClient, RpcServer
from p2psync.topology import ring
from p2psync.transport.memory import MemoryHub, MemoryTransport


async def _echo(caller: int, args: Mapping[str, Any], arrays: Sequence[Any]) -> Any:
    return {"caller": caller, **args}


async def test_calls_across_a_dead_undeclared_relay_are_answered_around_it() -> None:
    hub = MemoryHub(ring(8))
    eps: dict[int, MemoryTransport] = {i: hub.endpoint(i, default_timeout=2) for i in range(8)}
    for e in eps.values():
        await e.start()
    server = RpcServer(eps[0])
    server.register("echo", _echo)
    server.start()
    rpc = {i: RpcClient(eps[i], local=None) for i in (3, 4)}
    try:
        # before: node 3 reaches node 0 through 2 and 1, node 4 both ways (a tie)
        assert await rpc[3].call(0, "echo", {"x": 1}, timeout=1.0) == {"caller": 3, "x": 1}
        await eps[2].close()  # node 2 dies; nobody marks it dead (no membership here)
        assert not any(2 in e.dead for e in eps.values())
        loop = asyncio.get_running_loop()
        for _ in range(5):  # every call answered, each within a few retransmission timeouts
            t0 = loop.time()
            assert await rpc[3].call(0, "echo", {"x": 2}, timeout=1.5) == {"caller": 3, "x": 2}
            assert loop.time() - t0 < 1.0
        assert eps[0].router.back[3] == 7  # the reply went back the long way round: 0-7-6-5-4-3
        assert await rpc[4].call(0, "echo", timeout=1.5) == {"caller": 4}
    finally:
        await server.close(grace=0.1)
        for i, e in eps.items():
            if i != 2:
                await e.close()

"""RPC over the in-memory transport on a ring whose relay died and is not declared dead yet:
the requester goes around it (its retries take the other first hop) and the reply comes back
the way the request came, instead of down the responder's shortest path into the dead relay."""

from __future__ import annotations

import asyncio
from typing import Any, Mapping, Sequence

from p2psync.coordinator import RpcClient, RpcServer
from p2psync.coordinator.rpc import attempt_wait
from p2psync.topology import ring
from p2psync.transport.memory import MemoryHub, MemoryTransport


async def _echo(caller: int, args: Mapping[str, Any], arrays: Sequence[Any]) -> Any:
    return {"caller": caller, **args}


async def _ring8_echo() -> tuple[dict[int, MemoryTransport], RpcServer]:
    """Eight in-memory endpoints on a ring, started, and node 0 serving ``echo``."""
    hub = MemoryHub(ring(8))
    eps: dict[int, MemoryTransport] = {i: hub.endpoint(i, default_timeout=2) for i in range(8)}
    for e in eps.values():
        await e.start()
    server = RpcServer(eps[0])
    server.register("echo", _echo)
    server.start()
    return eps, server


async def _close(server: RpcServer, eps: dict[int, MemoryTransport], *, dead: int) -> None:
    await server.close(grace=0.1)
    for i, e in eps.items():
        if i != dead:  # closed by the test (it died)
            await e.close()


async def test_calls_across_a_dead_undeclared_relay_are_answered_around_it() -> None:
    eps, server = await _ring8_echo()
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
        await _close(server, eps, dead=2)


def test_the_first_attempt_of_a_relayed_call_waits_at_most_half_its_timeout() -> None:
    # a probe (0.54 s) to a destination not measured yet (initial RTO 1 s): two attempts
    assert attempt_wait(rto=1.0, left=0.54, timeout=0.54, attempt=0, relayed=True) == 0.27
    assert attempt_wait(rto=1.0, left=0.27, timeout=0.54, attempt=1, relayed=True) == 0.27  # the rest
    assert attempt_wait(rto=1.0, left=0.54, timeout=0.54, attempt=0, relayed=False) == 0.54  # one link
    assert attempt_wait(rto=0.25, left=2.0, timeout=2.0, attempt=0, relayed=True) == 0.25  # the RTO first
    assert attempt_wait(rto=0.25, left=-0.1, timeout=2.0, attempt=3, relayed=True) == 0.0


async def test_a_call_shorter_than_the_rto_tries_a_second_first_hop() -> None:
    # node 3's last call to node 0 ended on its second first hop (4, the long way round: a
    # partition cut the short way then); node 7 on that way is dead now. A call shorter than
    # the initial RTO must not make that one attempt only and give up (a probe would pass over
    # a live successor): it resends over node 2 after half its timeout
    eps, server = await _ring8_echo()
    rpc = RpcClient(eps[3], local=None)
    try:
        await eps[7].close()
        rpc._path[0] = 1
        assert rpc.estimator(0).rto() == 1.0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await rpc.call(0, "echo", {"x": 1}, timeout=0.6, measure=True) == {"caller": 3, "x": 1}
        assert 0.3 <= loop.time() - t0 < 0.6
        assert rpc.estimator(0).rto() == 1.0  # an early resend is no RTO expiry: no backoff
        assert rpc._path[0] == 2  # the reply names the copy it answers: the one sent over node 2
    finally:
        await _close(server, eps, dead=7)

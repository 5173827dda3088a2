"""RPC over the in-memory transport: calls, relayed calls, remote errors, timeouts."""

from __future__ import annotations

import pytest

from p2psync.coordinator import RpcClient
from p2psync.errors import ConfigError, PeerTimeout, RemoteError


async def test_rpc_over_memory_transport(memory_server):
    eps, server = await memory_server(4)

    async def add(caller, args, arrays):
        if args.get("fail"):
            raise ConfigError("bad args")
        return {"sum": args["a"] + args["b"], "caller": caller}

    server.register("math.add", add)
    server.start()
    client = RpcClient(eps[2])  # not adjacent to 0 on a ring: relayed
    assert await client.call(0, "math.add", {"a": 2, "b": 3}) == {"sum": 5, "caller": 2}
    with pytest.raises(RemoteError, match="bad args"):
        await client.call(0, "math.add", {"fail": True})
    with pytest.raises(RemoteError, match="UnknownMethod"):
        await client.call(0, "nope")
    with pytest.raises(PeerTimeout):
        await RpcClient(eps[1]).call(3, "math.add", {"a": 1, "b": 1}, timeout=0.2)  # no server on 3
    local = RpcClient(eps[0], local=server)
    assert (await local.call(0, "math.add", {"a": 1, "b": 1}))["sum"] == 2
    with pytest.raises(ValueError):
        server.register("math.add", add)


async def test_remote_error_keeps_the_remote_type_name_and_message_as_fields(memory_server):
    eps, server = await memory_server(2)

    async def fail(caller, args, arrays):
        raise ConfigError("a: b: c")  # colons in the message survive the round trip

    server.register("t.fail", fail)
    server.start()
    with pytest.raises(RemoteError) as got:
        await RpcClient(eps[1]).call(0, "t.fail", {})
    assert (got.value.kind, got.value.message) == ("ConfigError", "a: b: c")
    assert str(got.value) == "ConfigError: a: b: c"


async def test_requests_beyond_the_in_flight_cap_are_dropped_counted_and_resent(memory_server, monkeypatch):
    """A flood of requests cannot grow the server's tasks without bound: over ``MAX_INFLIGHT``
    handlers running, new requests are dropped and counted; their callers' resends are served
    once handlers finish."""
    import asyncio

    from p2psync.coordinator import rpc

    monkeypatch.setattr(rpc, "MAX_INFLIGHT", 3)
    eps, server = await memory_server(2)
    gate = asyncio.Event()

    async def slow(caller, args, arrays):
        await gate.wait()
        return args["i"]

    server.register("t.slow", slow)
    server.start()
    client = RpcClient(eps[1])
    calls = [asyncio.create_task(client.call(0, "t.slow", {"i": i}, timeout=10)) for i in range(5)]
    for _ in range(50):
        await asyncio.sleep(0.01)
        if server.overloaded >= 2:
            break
    assert server.overloaded == 2 and len(server._inflight) == 3
    gate.set()
    assert sorted(await asyncio.gather(*calls)) == [0, 1, 2, 3, 4]  # the dropped two were resent
    assert client.retries >= 2 and server.serving
    await server.close()
    assert not server.serving

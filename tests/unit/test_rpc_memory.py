"""RPC over the in-memory transport: calls, relayed calls, remote errors, timeouts."""

from __future__ import annotations

import pytest

from p2psync.coordinator import RpcClient
from p2psync.errors import ConfigError, PeerTimeout, RemoteError
from tests.helpers import until


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


async def test_requests_beyond_a_callers_in_flight_cap_are_dropped_counted_and_resent(memory_server, monkeypatch):
    """A flood of requests cannot grow the server's tasks without bound: over
    ``MAX_INFLIGHT_PER_CALLER`` handlers running for one caller, its new requests are dropped and
    counted; its resends are served once handlers finish. Other callers are not affected."""
    import asyncio

    from p2psync.coordinator import rpc

    monkeypatch.setattr(rpc, "MAX_INFLIGHT_PER_CALLER", 3)
    eps, server = await memory_server(3)
    gate = asyncio.Event()

    async def slow(caller, args, arrays):
        await gate.wait()
        return args["i"]

    async def quick(caller, args, arrays):
        return caller

    server.register("t.slow", slow)
    server.register("t.quick", quick)
    server.start()
    client = RpcClient(eps[1])
    calls = [asyncio.create_task(client.call(0, "t.slow", {"i": i}, timeout=10)) for i in range(5)]
    await until(lambda: server.overloaded >= 2, 5, "two requests dropped")
    assert server.overloaded == 2 and len(server._inflight) == 3
    assert await RpcClient(eps[2]).call(0, "t.quick", timeout=2) == 2  # another caller is served
    gate.set()
    assert sorted(await asyncio.gather(*calls)) == [0, 1, 2, 3, 4]  # the dropped two were resent
    assert client.retries >= 2 and server.serving and not server._busy
    await server.close()
    assert not server.serving


async def test_a_rendezvous_of_more_callers_than_the_cap_completes(memory_server, monkeypatch):
    """Long polls take one slot of each caller: a barrier that holds every caller's request
    until all have come completes however many callers there are (a global cap deadlocked
    once the callers outnumbered it)."""
    import asyncio

    from p2psync.coordinator import rpc

    monkeypatch.setattr(rpc, "MAX_INFLIGHT_PER_CALLER", 1)
    eps, server = await memory_server(5)
    arrived: set = set()
    everyone = asyncio.Event()

    async def register(caller, args, arrays):
        arrived.add(caller)
        if len(arrived) == 4:
            everyone.set()
        await everyone.wait()
        return caller

    server.register("t.register", register)
    server.start()
    got = await asyncio.gather(*(RpcClient(eps[i]).call(0, "t.register", timeout=5) for i in range(1, 5)))
    assert got == [1, 2, 3, 4] and server.overloaded == 0


def test_start_outside_a_running_loop_takes_nothing(memory_server):
    """``start()`` needs the event loop for its handlers: outside one it raises before taking
    any queued request, and the server is not serving."""
    from p2psync.coordinator import RpcServer
    from p2psync.topology import ring
    from p2psync.transport import MemoryHub

    ep = MemoryHub(ring(2)).endpoint(0)
    ep.mailbox.deliver(_request())
    server = RpcServer(ep)
    with pytest.raises(RuntimeError):
        server.start()
    assert not server.serving and ep.mailbox.pending == 1


def _request():
    from p2psync.wire import decode, encode

    return decode(encode(kind="rpc", src=1, tag="rpc.call", meta={"id": 1, "method": "x", "args": {}}))


async def test_the_reply_cache_keeps_only_the_calls_a_caller_still_waits_for(memory_server):
    """Each request names the lowest call its caller still waits for: the server forgets the
    replies below it, so sequential calls leave one cached reply however many were made."""
    eps, server = await memory_server(3)

    async def echo(caller, args, arrays):
        return args["x"]

    server.register("t.echo", echo)
    server.start()
    client = RpcClient(eps[1])
    for x in range(300):
        assert await client.call(0, "t.echo", {"x": x}) == x
    assert server.cached_replies() <= 1


async def test_the_reply_cache_is_bounded_per_caller_and_a_given_up_call_is_not_run_again(memory_server):
    """A caller that never names its lowest call keeps at most REPLY_CACHE_PER_CALLER replies;
    a request below a caller's lowest call is dropped (counted ``stale``), not run again."""
    from p2psync.coordinator import rpc as rpc_mod

    eps, server = await memory_server(3)
    runs: list[int] = []

    async def count(caller, args, arrays):
        runs.append(args["x"])
        return args["x"]

    server.register("t.count", count)
    server.start()
    n = rpc_mod.REPLY_CACHE_PER_CALLER + 40
    for rid in range(1, n + 1):  # raw requests without "low" (an older client)
        await eps[1].send(0, rpc_mod.CALL_TAG, kind="rpc", meta={"id": rid, "method": "t.count", "args": {"x": rid}})
        await eps[1].recv(f"{rpc_mod.REPLY_PREFIX}{rid}", timeout=5)
    assert server.cached_replies() == rpc_mod.REPLY_CACHE_PER_CALLER
    # the caller now waits for nothing below n + 1: a late duplicate of call 5 runs nothing
    await eps[1].send(0, rpc_mod.CALL_TAG, kind="rpc",
                      meta={"id": n + 1, "low": n + 1, "method": "t.count", "args": {"x": n + 1}})
    await eps[1].recv(f"{rpc_mod.REPLY_PREFIX}{n + 1}", timeout=5)
    assert server.cached_replies() == 1
    await eps[1].send(0, rpc_mod.CALL_TAG, kind="rpc", meta={"id": 5, "method": "t.count", "args": {"x": 5}})
    await until(lambda: server.stale == 1, 5, "the stale request counted")
    assert runs.count(5) == 1


async def test_a_reply_to_a_nodes_previous_process_is_not_taken_for_its_new_process_call(memory_server):
    """A restarted process numbers its calls from 1 again: a reply to its previous process's
    call 1 that arrives after the restart is dropped (``foreign``), not taken for the reply to
    its own call 1."""
    import asyncio

    from p2psync.transport import MemoryHub

    eps, server = await memory_server(3)
    release = {"old": asyncio.Event(), "new": asyncio.Event()}
    started = {"old": asyncio.Event(), "new": asyncio.Event()}

    async def slow(caller, args, arrays):
        started[args["key"]].set()
        await release[args["key"]].wait()
        return {"key": args["key"]}

    server.register("t.slow", slow)
    server.start()
    eps[1].incarnation = 10
    old = asyncio.ensure_future(RpcClient(eps[1]).call(0, "t.slow", {"key": "old"}, timeout=5.0))
    await asyncio.wait_for(started["old"].wait(), 5)
    hub: MemoryHub = eps[0].hub
    await eps[1].close()
    new_ep = hub.endpoint(1)
    new_ep.incarnation = 11
    await new_ep.start()
    eps[1] = new_ep  # (closed by the fixture)
    client = RpcClient(new_ep)
    new = asyncio.ensure_future(client.call(0, "t.slow", {"key": "new"}, timeout=5.0))
    await asyncio.wait_for(started["new"].wait(), 5)
    release["old"].set()  # its reply goes to node 1, now the new process
    await until(lambda: client.foreign > 0, 5, "the old call's reply to reach the new process")
    release["new"].set()
    assert await new == {"key": "new"}
    assert client.foreign == 1
    old.cancel()
    await asyncio.gather(old, return_exceptions=True)

"""Fixtures that track what they create and close it at teardown (as pyzmq's do), whatever the
test did: a test asks for a factory, calls it as often as it needs, and never writes the
cleanup itself::

    async def test_something(zmq_endpoints, strategies):
        topo = ring(3, base_port=free_port())
        eps = await zmq_endpoints(topo)
        strats = await strategies(eps, topo, "ssgd")
        ...  # strategies, their RPC servers and replicas, then the endpoints close afterwards
"""

from __future__ import annotations

import os
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Iterator

import pytest
import zmq

from p2psync.coordinator import RpcServer
from p2psync.topology import Topology, ring
from p2psync.transport import MemoryHub, ZmqEndpoint
from tests.helpers import close_strategies, start_strategies, zmq_endpoints_for


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow (soaks; P2PSYNC_SLOW=1 does the same)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (long soaks, each with a shorter equivalent that runs by default)
    are skipped unless asked for: the default suite stays within its time budget."""
    if config.getoption("--slow") or os.environ.get("P2PSYNC_SLOW"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture
async def zmq_endpoints() -> AsyncIterator[Callable[..., Awaitable[dict[int, ZmqEndpoint]]]]:
    """``await zmq_endpoints(topo, ids=None, timeout=10.0, keys=None, start=True, **options)``: an
    endpoint per node of ``ids`` (default: every node of ``topo``), started unless ``start`` is
    false (the keywords of :func:`tests.helpers.zmq_endpoints_for`); all closed at teardown::

        node1 = (await zmq_endpoints(topo, [1], keys=keys))[1]  # node 0 comes later
    """
    made: list[ZmqEndpoint] = []

    async def make(topo: Topology, ids: Iterable[int] | None = None, *, start: bool = True,
                   **kw: Any) -> dict[int, ZmqEndpoint]:
        eps = zmq_endpoints_for(topo, ids, **kw)
        made.extend(eps.values())
        if start:
            for e in eps.values():
                await e.start()
        return eps

    yield make
    for e in made:
        await e.close()


@pytest.fixture
def zmq_context() -> Iterator["zmq.Context[Any]"]:
    """A ZeroMQ context for a test's raw sockets (an impostor, a hand-driven hub); destroyed with
    linger 0 at teardown, whatever sockets are still open on it."""
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
async def strategies() -> AsyncIterator[Callable[..., Awaitable[list[Any]]]]:
    """``await strategies(transports, topo, name, **kw)``: :func:`tests.helpers.start_strategies`,
    whose strategies (RPC servers and replicas included) are closed at teardown."""
    made: list[list[Any]] = []

    async def make(*args: Any, **kw: Any) -> list[Any]:
        strats = await start_strategies(*args, **kw)
        made.append(strats)
        return strats

    yield make
    for strats in made:
        await close_strategies(strats)


@pytest.fixture
async def memory_server():
    """``make(n)``: endpoints of an n-node in-memory ring, all started, and an RPC server on
    node 0 (not started: register handlers first); closed after the test."""
    made: list = []

    async def make(n: int):
        hub = MemoryHub(ring(n))
        eps = {i: hub.endpoint(i) for i in range(n)}
        for e in eps.values():
            await e.start()
        server = RpcServer(eps[0])
        made.append((eps, server))
        return eps, server

    yield make
    for eps, server in made:
        await server.close()
        for e in eps.values():
            await e.close()

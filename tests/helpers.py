"""Shared test helpers (not fixtures): free ports, endpoint groups."""

from __future__ import annotations

import contextlib
import socket
from typing import AsyncIterator

from p2psync.topology import Topology
from p2psync.transport import ZmqEndpoint


def free_port() -> int:
    """A TCP port that is free on loopback right now (each NIC has its own 127.x address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def zmq_cluster(topo: Topology, *, timeout: float = 10.0) -> AsyncIterator[dict[int, ZmqEndpoint]]:
    eps = {i: ZmqEndpoint(topology=topo, node_id=i, default_timeout=timeout) for i in topo.ids}
    try:
        for e in eps.values():
            await e.start()
        yield eps
    finally:
        for e in eps.values():
            await e.close()

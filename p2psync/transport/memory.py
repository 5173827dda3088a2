"""In-memory transport with the same interface as :class:`ZmqEndpoint`, for unit tests of logic.

Messages still go through the wire encoder and the strict decoder (payloads are copied, as a
network would), so logic tested here sees exactly what it would see over ZeroMQ. Flow-control
windows, mailbox budgets and shaping (``transport.shaper``) work as for ZeroMQ; a send is
handed off at once, so the control/bulk split only matters with a shaper.
"""

from __future__ import annotations

from typing import Any

from p2psync.topology import Route, Topology
from p2psync.transport.base import NotReady, Transport
from p2psync.wire import DEFAULT_LIMITS, WireLimits, placed


class MemoryHub:
    """The shared medium: a registry of started in-memory endpoints."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.endpoints: dict[int, MemoryTransport] = {}

    def endpoint(self, node_id: int, **kwargs: Any) -> "MemoryTransport":
        return MemoryTransport(hub=self, node_id=node_id, **kwargs)

    def leave(self, transport: "MemoryTransport") -> None:
        """``transport``'s node leaves the medium (its process ended): the others see it
        :meth:`~p2psync.transport.base.Transport.gone`."""
        if self.endpoints.get(transport.node_id) is transport:
            del self.endpoints[transport.node_id]
            node = transport.node_id
            for t in list(self.endpoints.values()):
                if t._gone_waiters and t.watches_gone(node):
                    t._peers_changed()


class MemoryTransport(Transport):
    def __init__(self, *, hub: MemoryHub, node_id: int, limits: WireLimits = DEFAULT_LIMITS,
                 default_timeout: float = 5.0, **options: Any) -> None:
        """``options``: the :class:`Transport` keywords (``window_bytes``, ``mailbox_budget_bytes``,
        ``mailbox_ttl``, ``max_pending``, ``max_control_pending``, ``shaper``,
        ``relay_budget_bytes``)."""
        super().__init__(topology=hub.topology, node_id=node_id, limits=limits,
                         default_timeout=default_timeout, **options)
        self.hub = hub

    async def start(self) -> None:
        self.hub.endpoints[self.node_id] = self

    async def _close_io(self) -> None:
        self.hub.leave(self)

    def gone(self, peer: int) -> bool:
        """Not on the medium (not started yet, or ended), or both links down."""
        return self.hub.endpoints.get(peer) is None or super().gone(peer)

    def half_down(self, peer: int) -> bool:
        return self.hub.endpoints.get(peer) is None or super().half_down(peer)

    def _transmit(self, peer: int, route: Route, frames: list[Any], *, bulk: bool = False,
                  unordered: bool = False) -> None:
        # one medium for both classes: delivery is immediate, so control never waits for bulk
        target = self.hub.endpoints.get(peer)
        if target is None:
            raise NotReady
        copied = [bytes(f) for f in placed(frames)]
        target._ingest(route.remote_nic, self.node_id, f"{self.node_id}/{route.local_nic}", copied)

"""One node's membership stack over its transport: the RPC server and client, the membership
client, and the coordinator host that hosts the membership service when this node coordinates.
Real runs (:class:`p2psync.api.runtime.NodeRuntime`) and the simulator
(:mod:`p2psync.sim.cluster`) build it the same way, with :func:`membership_stack`; the caller
starts and closes the parts (the transport first, the membership last)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from p2psync.coordinator.failover import CoordinatorHost
from p2psync.coordinator.membership_client import MembershipClient
from p2psync.coordinator.rpc import RpcClient, RpcServer
from p2psync.coordinator.votes import VoteStore
from p2psync.topology import Topology
from p2psync.transport.base import Transport


@dataclass(frozen=True)
class MembershipStack:
    server: RpcServer
    rpc: RpcClient
    membership: MembershipClient
    host: CoordinatorHost


def membership_stack(transport: Transport, topology: Topology, *, heartbeat: float, failure_timeout: float,
                     phi_threshold: float, quorum_timeout: float, start_timeout: float,
                     run_info: Mapping[str, Any], services: Callable[[RpcServer], None] | None = None,
                     check_interval: float = 0.1, allow_join: bool = True,
                     votes: VoteStore | None = None) -> MembershipStack:
    """The stack of the node ``transport`` belongs to, with the run's membership timings
    (``--heartbeat``, ``--failure-timeout``, ``--phi-threshold``, ``--quorum-timeout``,
    ``--start-timeout``); ``services``, ``run_info``, ``check_interval`` and ``allow_join``
    are the coordinator host's (:class:`CoordinatorHost`); ``votes``: where the node's votes
    outlive its process (:mod:`p2psync.coordinator.votes`)."""
    server = RpcServer(transport)
    rpc = RpcClient(transport, local=server)
    membership = MembershipClient(transport=transport, rpc=rpc, coordinator=topology.coordinator,
                                  heartbeat_interval=heartbeat, failure_timeout=failure_timeout,
                                  phi_threshold=phi_threshold, quorum_timeout=quorum_timeout, votes=votes)
    host = CoordinatorHost(server=server, membership=membership, expected=topology.ids, services=services,
                           start_timeout=start_timeout, failure_timeout=failure_timeout, heartbeat_interval=heartbeat,
                           phi_threshold=phi_threshold, check_interval=check_interval, run_info=run_info,
                           allow_join=allow_join)
    return MembershipStack(server, rpc, membership, host)

"""Coordinator services hosted by one peer (small msgpack messages only, never tensors)."""

from p2psync.coordinator.membership import (MembershipClient, MembershipService,
                                            MembershipState)
from p2psync.coordinator.rpc import RpcClient, RpcServer

__all__ = ["MembershipClient", "MembershipService", "MembershipState", "RpcClient", "RpcServer"]

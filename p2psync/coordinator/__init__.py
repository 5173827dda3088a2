"""Coordinator services hosted by one peer (small msgpack messages only, never tensors)."""

from p2psync.coordinator.membership import MembershipService
from p2psync.coordinator.membership_client import MembershipClient
from p2psync.coordinator.membership_state import MembershipState
from p2psync.coordinator.rpc import RpcClient, RpcServer
from p2psync.coordinator.views import View, ViewTracker

__all__ = ["MembershipClient", "MembershipService", "MembershipState", "RpcClient", "RpcServer", "View",
           "ViewTracker"]

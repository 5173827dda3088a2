"""Transport layer: ZeroMQ endpoint (one ROUTER per NIC plus a control connection), mailbox tag
matching with bounded memory, per-peer flow-control windows for bulk, counters."""

from p2psync.transport.base import DEFAULT_TIMEOUT, NicStats, Transport, all_finite
from p2psync.transport.finite import diverged, sum_diverged
from p2psync.transport.flow import ByteWindow
from p2psync.transport.mailbox import Mailbox, Scope
from p2psync.transport.memory import MemoryHub, MemoryTransport
from p2psync.transport.socket_options import SocketOptions
from p2psync.transport.zmq_endpoint import ZmqEndpoint

__all__ = ["DEFAULT_TIMEOUT", "ByteWindow", "Mailbox", "MemoryHub", "MemoryTransport", "NicStats", "Scope",
           "SocketOptions", "Transport", "ZmqEndpoint", "all_finite", "diverged", "sum_diverged"]

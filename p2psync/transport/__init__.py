"""Transport layer: ZeroMQ endpoint (one ROUTER per NIC), mailbox tag matching, counters."""

from p2psync.transport.base import DEFAULT_TIMEOUT, NicStats, Transport
from p2psync.transport.mailbox import Mailbox
from p2psync.transport.memory import MemoryHub, MemoryTransport
from p2psync.transport.zmq_endpoint import SocketOptions, ZmqEndpoint

__all__ = ["DEFAULT_TIMEOUT", "Mailbox", "MemoryHub", "MemoryTransport", "NicStats",
           "SocketOptions", "Transport", "ZmqEndpoint"]

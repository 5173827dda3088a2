"""The ZeroMQ socket settings of a :class:`~p2psync.transport.zmq_endpoint.ZmqEndpoint`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SocketOptions:
    #: messages queued per bulk pipe before a send is retried (backpressure)
    sndhwm: int = 64
    rcvhwm: int = 1000
    heartbeat_ivl_ms: int = 500
    heartbeat_timeout_ms: int = 2000
    reconnect_ivl_ms: int = 20
    reconnect_ivl_max_ms: int = 500
    io_threads: int = 1
    #: on close, how long queued outgoing messages may still be flushed (ms); messages to a
    #: peer that is gone are never queued (IMMEDIATE), so this only delays a live send
    close_linger_ms: int = 2000
    #: kernel socket buffer sizes in bytes (0: the OS default)
    sndbuf: int = 0
    rcvbuf: int = 0
    #: send queue of the control socket (messages per pipe)
    control_sndhwm: int = 1000
    #: send bulk frames of >= 64 KiB to peers on this host through shared memory
    #: (:mod:`p2psync.transport.shm`), and the collectives' pieces to them as datagrams
    #: (:mod:`p2psync.transport.local`); not with keys
    shm: bool = False


__all__ = ["SocketOptions"]

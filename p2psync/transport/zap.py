"""The ZAP handler of a keyed endpoint: a CurveZMQ public key -> the node id it belongs to.

ZeroMQ asks the ZAP handler of a socket's context (RFC 27, a REP socket bound at
``inproc://zeromq.zap.01``) whether a client that completed a CURVE handshake may connect.
This handler answers from the topology's public keys: a known key is accepted with the node
id as its *user id* (ZeroMQ then stamps it on every message of that connection as the
``User-Id`` property, which the endpoint compares with the routing id the peer claims); any
other key, or another mechanism, is refused, and ``on_refused`` is told (the endpoint counts
and logs it). Every request gets a reply: an error while answering refuses the handshake. Requests are served on the event loop, like the endpoint's sockets (the REP
socket's descriptor is watched with ``add_reader``); ``ZAP_ENFORCE_DOMAIN`` on the endpoint's
sockets makes a handshake fail rather than pass unchecked if this handler is not bound.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Mapping, cast

import zmq
from zmq.utils import z85

log = logging.getLogger("p2psync.transport")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
#: the ZAP domain of every keyed socket: ``p2psync/<nic>`` (tells the handler which NIC)
DOMAIN_PREFIX = "p2psync/"


class ZapHandler:
    def __init__(self, *, context: "zmq.Context[Any]", nodes: Mapping[str, int],
                 on_refused: Callable[[str, str, str], None]) -> None:
        """``nodes``: Z85 public key -> node id; ``on_refused(nic, address, key)``."""
        self.context = context
        self.nodes = dict(nodes)
        self.on_refused = on_refused
        self.accepted = 0
        self.refused = 0
        #: requests refused because answering them raised (a bug; fail closed)
        self.errors = 0
        self._sock: "zmq.Socket[Any] | None" = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind the handler (before any keyed socket binds or connects) and serve on ``loop``."""
        sock: zmq.Socket[Any] = self.context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ZAP_ENDPOINT)
        self._sock, self._loop = sock, loop
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        loop.add_reader(self._fd, self._serve)
        loop.call_soon(self._serve)

    def _serve(self) -> None:
        """Answer every waiting request (loop callback; never raises). Every request received
        is answered, also when :meth:`answer` fails: a REP socket that received and did not
        reply would take no further request, and every later handshake would hang."""
        sock = self._sock
        while sock is not None and not sock.closed:
            try:
                if not cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return
                request = sock.recv_multipart(zmq.NOBLOCK)
                sock.send_multipart(self._answer_safely(request), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                if not sock.closed:
                    log.warning("ZAP handler: %s", exc)
                return

    def _answer_safely(self, request: list[bytes]) -> list[bytes]:
        """:meth:`answer`, or a refusal (500, fail closed) if it raised; the first error is
        logged with its traceback, all are counted in :attr:`errors`."""
        try:
            return self.answer(request)
        except Exception:
            self.errors += 1
            if self.errors == 1:
                log.exception("ZAP handler: internal error (the handshake is refused; logged once)")
            rid = request[1] if len(request) > 1 else b""
            return [ZAP_VERSION, rid, b"500", b"internal error", b"", b""]

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The reply frames to one ZAP request."""
        if len(request) < 6 or request[0] != ZAP_VERSION:
            rid = request[1] if len(request) > 1 else b""
            return [ZAP_VERSION, rid, b"500", b"malformed ZAP request", b"", b""]
        _version, rid, domain, address, _identity, mechanism, *credentials = request
        nic = domain.decode(errors="replace").removeprefix(DOMAIN_PREFIX)
        peer = address.decode(errors="replace")
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            self.refused += 1
            self.on_refused(nic, peer, f"<{mechanism.decode(errors='replace')[:16]} mechanism>")
            return [ZAP_VERSION, rid, b"400", b"CURVE only", b"", b""]
        key = z85.encode(credentials[0]).decode()
        node = self.nodes.get(key)
        if node is None:
            self.refused += 1
            self.on_refused(nic, peer, key)
            return [ZAP_VERSION, rid, b"400", b"unknown key", b"", b""]
        self.accepted += 1
        return [ZAP_VERSION, rid, b"200", b"OK", str(node).encode(), b""]

    def close(self) -> None:
        if self._loop is not None and self._fd is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._fd = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


__all__ = ["DOMAIN_PREFIX", "ZAP_ENDPOINT", "ZapHandler"]

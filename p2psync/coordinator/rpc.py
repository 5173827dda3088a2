"""A small request/response RPC over the transport; coordinator services plug into it.

Request: kind ``rpc``, tag ``rpc.call``, meta ``{"id": int, "method": str, "args": {...}}``
(optional arrays). Reply: kind ``reply``, tag ``rpc.ret.<id>``, meta ``{"ok": value}`` or
``{"err": {"kind": str, "message": str}}``. Requests to non-adjacent nodes are relayed by the
transport. A call to the local node runs the handler in-process. A call that fails or times out
retires its reply tag in the mailbox, so a reply that comes late is dropped (counted as
``retired``) instead of piling up. Handlers may wait (long
polls such as a rendezvous): each request runs in its own task.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Awaitable, Callable, Mapping, Sequence

import numpy as np

from p2psync.errors import P2PSyncError, PeerTimeout, RemoteError, TransportError
from p2psync.transport import Transport
from p2psync.wire import Message

log = logging.getLogger("p2psync.rpc")

#: handler(caller node id, args, arrays) -> JSON-like result (msgpack-able)
Handler = Callable[[int, Mapping[str, Any], Sequence[np.ndarray]], Awaitable[Any]]

CALL_TAG = "rpc.call"


class RpcServer:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.handlers: dict[str, Handler] = {}
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self.bad_requests = 0

    def register(self, method: str, handler: Handler) -> None:
        if method in self.handlers:
            raise ValueError(f"RPC method {method!r} is already registered")
        self.handlers[method] = handler

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._serve(), name=f"rpc-server-{self.transport.node_id}")

    async def invoke(self, caller: int, method: str, args: Mapping[str, Any],
                     arrays: Sequence[np.ndarray] = ()) -> Any:
        handler = self.handlers.get(method)
        if handler is None:
            raise RemoteError("UnknownMethod", f"no RPC method {method!r} on node {self.transport.node_id}")
        return await handler(caller, args, arrays)

    async def _serve(self) -> None:
        while True:
            try:
                msg = await self.transport.recv(CALL_TAG, timeout=None)
            except TransportError:
                return  # transport closed
            t = asyncio.create_task(self._handle(msg))
            self._inflight.add(t)
            t.add_done_callback(self._inflight.discard)

    async def _handle(self, msg: Message) -> None:
        meta = msg.meta
        rid, method, args = meta.get("id"), meta.get("method"), meta.get("args", {})
        if type(rid) is not int or not isinstance(method, str) or not isinstance(args, dict):
            self.bad_requests += 1
            log.warning("node %d: malformed RPC request from node %d", self.transport.node_id, msg.src)
            return
        try:
            reply: dict[str, Any] = {"ok": await self.invoke(msg.src, method, args, msg.arrays)}
        except RemoteError as exc:
            reply = {"err": {"kind": exc.kind, "message": str(exc).split(": ", 1)[-1]}}
        except P2PSyncError as exc:
            reply = {"err": {"kind": type(exc).__name__, "message": str(exc)}}
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a handler bug must not kill the server
            log.exception("RPC handler %s failed", method)
            reply = {"err": {"kind": "InternalError", "message": repr(exc)[:500]}}
        try:
            await self.transport.send(msg.src, f"rpc.ret.{rid}", kind="reply", meta=reply, timeout=10.0)
        except P2PSyncError as exc:
            log.info("node %d: could not reply to node %d: %s", self.transport.node_id, msg.src, exc)

    async def close(self, grace: float = 2.0) -> None:
        """Stop serving; replies already being computed get ``grace`` seconds to go out."""
        if self._task is not None:
            self._task.cancel()
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=grace)
        for t in [self._task, *self._inflight]:
            if t is not None:
                t.cancel()
        for t in [self._task, *self._inflight]:
            if t is not None:
                try:
                    await t
                except (asyncio.CancelledError, Exception):
                    pass
        self._task = None


class RpcClient:
    def __init__(self, transport: Transport, local: RpcServer | None = None) -> None:
        self.transport = transport
        self.local = local
        self._ids = itertools.count(1)

    async def call(self, node: int, method: str, args: Mapping[str, Any] | None = None, *,
                   arrays: Sequence[Any] = (), timeout: float = 10.0) -> Any:
        """Call ``method`` on ``node``; raises RemoteError, PeerTimeout or PeerUnreachable."""
        args = dict(args or {})
        if node == self.transport.node_id and self.local is not None:
            return await asyncio.wait_for(
                self.local.invoke(node, method, args, [np.asarray(a) for a in arrays]), timeout)
        rid = next(self._ids)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        tag = f"rpc.ret.{rid}"
        try:
            await self.transport.send(node, CALL_TAG, arrays, kind="rpc",
                                      meta={"id": rid, "method": method, "args": args}, timeout=timeout)
            rep = await self.transport.recv(tag, timeout=max(0.0, deadline - loop.time()))
        except PeerTimeout:
            self.transport.mailbox.retire(tag, exact=True)  # a late reply is dropped on arrival
            raise PeerTimeout(f"RPC {method} to node {node}: no reply within {timeout:g}s") from None
        except BaseException:
            self.transport.mailbox.retire(tag, exact=True)
            raise
        if "err" in rep.meta:
            err = rep.meta["err"]
            raise RemoteError(str(err.get("kind", "Error")), str(err.get("message", "")))
        return rep.meta.get("ok")

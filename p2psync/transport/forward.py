"""Data messages to any node, forwarded by the application hop by hop over direct links.

Control messages are relayed by the transport itself (:meth:`Transport.send_control`), and so
is data whose sender asks for it (``Transport.send(..., relay=True)``: the collectives, on
every live node, members or not). A :class:`Forwarder` is the older, application-level way: a
``data`` message to a node that is not adjacent goes to the first hop of a shortest live path,
wrapped as ``<name>.fwd`` (its real tag and meta inside), and every hop that runs the same
forwarder re-sends it the same way until it reaches its destination, each hop counted on the
NIC it leaves by and flow-controlled like any bulk send. Users: the parameter store (pieces to
and from non-adjacent owners) and Canary's mesh exchange over groups that are not cliques.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Sequence

import numpy as np

from p2psync.errors import P2PSyncError, PeerFailure, TransportError
from p2psync.transport.base import Transport
from p2psync.wire import Message

log = logging.getLogger("p2psync.transport")


class Forwarder:
    """Send ``data`` messages to any node; relay the ones that pass through this node.

    ``accept(dst, tag)`` says which forwarded messages this node relays or takes (others are
    rejected and counted in :attr:`malformed`; ``on_reject`` hears about each)."""

    def __init__(self, *, transport: Transport, name: str, timeout: float,
                 accept: Callable[[int, str], bool],
                 on_reject: Callable[[Message, str], None] | None = None) -> None:
        self.transport, self.name, self.timeout = transport, name, timeout
        self.accept = accept
        self.on_reject = on_reject
        self.tag = f"{name}.fwd"
        #: messages this node passed on for others
        self.forwarded = 0
        self.malformed = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"{self.tag}-{self.transport.node_id}")

    async def close(self) -> None:
        t, self._task = self._task, None
        if t is not None:
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)

    async def send(self, dst: int, tag: str, arrays: Sequence[np.ndarray], meta: dict[str, Any],
                   timeout: float | None = None) -> bool:
        """Send to ``dst`` (directly when adjacent); True when it went through a relay.
        PeerFailure when no live path exists."""
        tr = self.transport
        budget = self.timeout if timeout is None else timeout
        if tr.topology.routes(tr.node_id, dst):
            await tr.send(dst, tag, arrays, meta=meta, timeout=budget)
            return False
        hops = tr.next_hops(dst)
        if not hops:
            raise PeerFailure(f"{self.name}: no live path from node {tr.node_id} to node {dst}", peers=(dst,))
        await tr.send(hops[0], self.tag, arrays, meta={"to": dst, "tag": tag, "m": meta}, timeout=budget)
        return True

    async def _loop(self) -> None:
        while True:
            try:
                msg = await self.transport.listen(self.tag)
            except TransportError:
                return
            except P2PSyncError as exc:  # a message refused at ingest (e.g. non-finite): go on relaying
                self.malformed += 1
                log.info("node %d: %s: forwarded message refused: %s", self.transport.node_id, self.name, exc)
                continue
            to, tag, meta = msg.meta.get("to"), msg.meta.get("tag"), msg.meta.get("m")
            if (type(to) is not int or to == self.transport.node_id or not isinstance(tag, str)
                    or not isinstance(meta, dict) or not self.accept(to, tag)):
                self.malformed += 1
                if self.on_reject is not None:
                    self.on_reject(msg, "bad forward")
                continue
            try:
                await self.send(to, tag, list(msg.arrays), meta)
                self.forwarded += 1
            except P2PSyncError as exc:  # the origin's wait for an answer reports it
                log.info("node %d: %s message for node %d not forwarded: %s", self.transport.node_id, self.name,
                         to, exc)


__all__ = ["Forwarder"]

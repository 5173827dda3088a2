"""The sequencer of ``--strategy diloco-async``: numbers the members' pseudo-gradients so every
node applies them in one total order.

One method, ``<name>.seq``: a member that finished an inner phase asks with ``{epoch, coord,
req}`` (its stream's view epoch, that view's coordinator, and its own request number) and gets
``{"seq": k}``, the next number of that epoch (0, 1, 2, ... per epoch), or ``{"stale": true}``
when the epoch is older than one this service has numbered, or names another coordinator.

Why per epoch and per coordinator: the numbers live only as long as one view. At every new view
the members re-form and adopt one state, so numbering restarts at 0 there and nobody needs the
old counter. A node that takes over as coordinator registers a fresh service that knows nothing
of the numbers its predecessor gave; it refuses every request naming another coordinator, so it
never numbers the old view's stream a second time (a member that asks it before the new view
reaches it hears ``stale`` and waits for that view). ``req`` makes a retried request (a lost
reply) get the number it was given before, not a second one. The messages are a few bytes; no
tensor passes through the coordinator. Remote bad input is a ProtocolError.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from p2psync.coordinator.calls import int_arg
from p2psync.coordinator.rpc import RpcServer
from p2psync.errors import ProtocolError


class Sequencer:
    """Pure: the numbering (see the module docstring)."""

    def __init__(self, node: int | None) -> None:
        #: the node hosting it: requests naming another coordinator are stale (None: any)
        self.node = node
        self.epoch = -1
        self.next = 0
        self._given: dict[int, tuple[int, int, int]] = {}  # caller -> (epoch, req, number)

    def number(self, caller: int, epoch: int, req: int, coord: int | None) -> int | None:
        """The number of ``caller``'s request ``req`` in ``epoch``; None when stale."""
        if (coord is not None and self.node is not None and coord != self.node) or epoch < self.epoch:
            return None
        if epoch > self.epoch:
            self.epoch, self.next = epoch, 0
            self._given.clear()
        given = self._given.get(caller)
        if given is not None and given[:2] == (epoch, req):
            return given[2]
        k = self.next
        self.next += 1
        self._given[caller] = (epoch, req, k)
        return k


class SequencerService:
    """The RPC shell of :class:`Sequencer` on the coordinator."""

    def __init__(self, server: RpcServer, *, name: str) -> None:
        self.seq = Sequencer(server.transport.node_id)
        self.name = name
        server.register(f"{name}.seq", self._number)

    async def _number(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        who = f"{self.name} sequencer"
        epoch, req = int_arg(args, "epoch", who=who), int_arg(args, "req", who=who)
        coord = args.get("coord")
        if coord is not None and type(coord) is not int:
            raise ProtocolError(who, "coord must be an integer")
        k = self.seq.number(caller, epoch, req, coord)
        return {"stale": True} if k is None else {"seq": k}


__all__ = ["Sequencer", "SequencerService"]

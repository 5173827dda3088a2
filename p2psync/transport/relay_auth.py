"""The origin of a relayed message, verifiable by its destination (keyed clusters).

Why: CurveZMQ authenticates the two ends of one connection, so for a message (control, or a
tensor piece a collective relays) relayed hop by hop the destination only knows which neighbour handed it over; a relay (or a forged
message claiming to be relayed) could name any origin. The origin therefore signs what it
sends: an HMAC-SHA256 (Python's ``hmac``, no custom crypto) under the 32-byte key it shares with
the destination alone (``relay`` keys, :mod:`p2psync.transport.keys`), over every header field a
relay must not change (kind, origin, destination, tag, step, run id, incarnation, counter,
frame specs, meta) and the payload bytes; the hop count is left out (relays increment it).
Relays forward the digest unchanged (header ``auth``); the destination recomputes it and
rejects a mismatch (``relay_auth``). The digest is computed from the decoded header on both
sides, so it does not depend on how msgpack laid the bytes out.

Replays: a valid signed message could be captured by a relay and handed over again (a second
``peer_failed`` event, a second RPC). The origin numbers what it signs (header ``ctr``, one
counter per process and *lane*, so per incarnation: control messages and relayed ``data``
pieces count separately, because control overtakes data queued behind a busy link and would
otherwise push the counters of that data out of the window) and the destination keeps a
:class:`ReplayWindow` per origin and lane: the highest counter seen and a bitmap of the
:data:`WINDOW` counters below it, so a counter seen before, or older than the window, is
dropped (``relay_replay``) while messages that overtake each other on different paths still
pass. The digest covers the kind, so nothing moves a message into the other lane. Memory: two
entries per origin node whose digest verified (at most twice the topology's nodes), whatever a
peer sends.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Mapping, Sequence

import msgpack

from p2psync.errors import ProtocolError
from p2psync.wire import Header

#: counters below the highest one seen from an origin that are still accepted once each
WINDOW = 1024


def relay_digest(key: bytes, header: Header, payload: Sequence[Any]) -> bytes:
    """The origin's digest of a relayed message (``payload``: the raw payload frames)."""
    fields = [header.kind, header.src, header.dst, header.tag, header.step, header.run, header.inc, header.ctr,
              [[f.dtype, list(f.shape), f.codec, f.nbytes] for f in header.frames], dict(header.meta)]
    mac = hmac.new(key, msgpack.packb(fields, use_bin_type=True), hashlib.sha256)
    for frame in payload:
        mac.update(frame)
    return mac.digest()


def verify(key: bytes, header: Header, payload: Sequence[Any]) -> bool:
    return header.auth is not None and hmac.compare_digest(header.auth, relay_digest(key, header, payload))


class ReplayWindow:
    """Which (origin, incarnation, counter) a destination has accepted, within a window."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        #: (origin, lane) -> (incarnation, highest counter, bitmap: bit i = counter highest - i seen)
        self._seen: dict[tuple[int, int], tuple[int, int, int]] = {}

    def accept(self, origin: int, inc: int, ctr: int, lane: int = 0) -> bool:
        """True (and remembered) the first time; False for a replay, a counter older than the
        window, or an incarnation older than the newest one seen from ``origin``. ``lane``:
        which of the origin's counters (0 control, 1 data) numbered the message."""
        key = (origin, lane)
        cur = self._seen.get(key)
        if cur is None or inc > cur[0]:
            self._seen[key] = (inc, ctr, 1)
            return True
        known_inc, top, bits = cur
        if inc < known_inc:
            return False
        if ctr > top:
            shift = ctr - top
            bits = ((bits << shift) | 1) & ((1 << self.window) - 1) if shift < self.window else 1
            self._seen[key] = (inc, ctr, bits)
            return True
        back = top - ctr
        if back >= self.window or bits >> back & 1:
            return False
        self._seen[key] = (inc, top, bits | 1 << back)
        return True


class OriginAuth:
    """The destination's side of relayed-message authentication in a keyed cluster: whether
    the origin a relayed message names is proven. Holds this node's :class:`ReplayWindow`."""

    def __init__(self, node_id: int, keys: Mapping[int, bytes], window: int = WINDOW) -> None:
        """``keys``: the key this node shares with each other node."""
        self.node_id = node_id
        self.keys = keys
        self.replays = ReplayWindow(window)

    def proven(self, header: Header, payload: Sequence[Any]) -> bool:
        """For a message whose origin is not the neighbour that handed it over (``payload``: its
        raw payload frames): it must carry its origin's digest and counter, and one for this
        node must verify and be new (its counter is remembered). True: the origin is proven;
        False: it is for another node (its destination checks it). Raises
        :class:`~p2psync.errors.ProtocolError` (``relay_auth``, ``relay_replay``) otherwise."""
        if header.auth is None or header.ctr is None:
            raise ProtocolError("relay_auth", f"relayed message from node {header.src} without its origin's digest")
        if header.dst != self.node_id:
            return False
        key = self.keys.get(header.src)
        if key is None or not verify(key, header, payload):
            raise ProtocolError("relay_auth", f"relayed message claiming origin node {header.src}: its digest "
                                "does not verify (forged or altered on the way)")
        if not self.replays.accept(header.src, header.inc, header.ctr, lane=int(header.kind == "data")):
            raise ProtocolError("relay_replay", f"relayed message {header.tag!r} from node {header.src} "
                                f"(incarnation {header.inc}, counter {header.ctr}) was delivered before, or is "
                                "too old")
        return True


__all__ = ["WINDOW", "OriginAuth", "ReplayWindow", "relay_digest", "verify"]

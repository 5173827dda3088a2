"""The origin of a relayed control message, verifiable by its destination (keyed clusters).

Why: CurveZMQ authenticates the two ends of one connection, so for a control message relayed
hop by hop the destination only knows which neighbour handed it over; a relay (or a forged
message claiming to be relayed) could name any origin. The origin therefore signs what it
sends: an HMAC-SHA256 (Python's ``hmac``, no custom crypto) under the 32-byte key it shares with
the destination alone (``relay`` keys, :mod:`p2psync.transport.keys`), over every header field a
relay must not change (kind, origin, destination, tag, step, run id, incarnation, frame specs,
meta) and the payload bytes; the hop count is left out (relays increment it). Relays forward
the digest unchanged (header ``auth``); the destination recomputes it and rejects a mismatch
(``relay_auth``). The digest is computed from the decoded header on both sides, so it does
not depend on how msgpack laid the bytes out.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Sequence

import msgpack  # type: ignore[import-untyped]

from p2psync.wire import Header


def relay_digest(key: bytes, header: Header, payload: Sequence[Any]) -> bytes:
    """The origin's digest of a relayed message (``payload``: the raw payload frames)."""
    fields = [header.kind, header.src, header.dst, header.tag, header.step, header.run, header.inc,
              [[f.dtype, list(f.shape), f.codec, f.nbytes] for f in header.frames], dict(header.meta)]
    mac = hmac.new(key, msgpack.packb(fields, use_bin_type=True), hashlib.sha256)
    for frame in payload:
        mac.update(frame)
    return mac.digest()


def verify(key: bytes, header: Header, payload: Sequence[Any]) -> bool:
    return header.auth is not None and hmac.compare_digest(header.auth, relay_digest(key, header, payload))


__all__ = ["relay_digest", "verify"]

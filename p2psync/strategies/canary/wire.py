"""Canary's messages: headers, slot entries and payloads, packed and checked (pure).

Every exchange message (a push, its reply, a bsp push) carries a header — the sender, the view
epoch and plan it was routed for, colayer / thread / step, the sender's iteration ``it``, the
newest iteration it knows of anywhere (``zt``, Canary's ζ, and ``zn``, the node that reported
it: ζ spreads to every worker hop by hop, §4.3 of the spec), whether it stops, and the codec of
its payloads — and one entry per slot it holds data for: ``[slot, count, mask (little-endian
bytes), newest, oldest, stop, arrays]`` followed by the slot's codec arrays. No entries: an
*empty packet* (spec §6.5). Entries are checked as a whole before anything is used: a slot
the sender may not send at that step, a slot twice, a count below 0, a payload of the wrong
size or codec, or non-finite values make the whole message a ProtocolError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from p2psync.strategies.canary.flow import Datum
from p2psync.strategies.canary.plan import Slot
from p2psync.compress import Codec
from p2psync.errors import ProtocolError

_INT_FIELDS = ("o", "e", "pl", "z", "th", "k", "it", "zt", "zn")


@dataclass(frozen=True)
class Header:
    origin: int
    epoch: int
    plan: int
    z: int
    th: int
    k: int
    it: int
    zeta: int
    zeta_node: int
    stop: bool
    codec: str

    def meta(self) -> dict[str, Any]:
        return {"o": self.origin, "e": self.epoch, "pl": self.plan, "z": self.z, "th": self.th, "k": self.k,
                "it": self.it, "zt": self.zeta, "zn": self.zeta_node, "st": self.stop, "c": self.codec}


def parse_header(meta: Mapping[str, Any], src: int) -> Header:
    vals = [meta.get(f) for f in _INT_FIELDS]
    stop, codec = meta.get("st"), meta.get("c")
    if not all(type(v) is int and v >= 0 for v in vals) or not isinstance(stop, bool) or not isinstance(codec, str):
        raise ProtocolError("canary", f"node {src}: malformed header")
    o, e, pl, z, th, k, it, zt, zn = (int(v) for v in vals)  # type: ignore[arg-type]
    return Header(o, e, pl, z, th, k, it, zt, zn, stop, codec)


def pack(items: Sequence[tuple[Slot, Datum]], codec: Codec) -> tuple[list[list[Any]], list[np.ndarray],
                                                                    list[tuple[Slot, np.ndarray]]]:
    """Entries and arrays for ``items``; with a lossy codec also what each slot's encoding
    dropped (``vec − decode(encode(vec))``: the caller sends it with the next data)."""
    entries: list[list[Any]] = []
    arrays: list[np.ndarray] = []
    residuals: list[tuple[Slot, np.ndarray]] = []
    for slot, d in items:
        vec = np.ascontiguousarray(d.vec, dtype=np.float32)
        enc = codec.encode(vec)
        if codec.lossy:
            residuals.append((slot, vec - codec.decode(enc, vec.size)))
        entries.append([slot.index, d.count, mask_bytes(d.mask), d.newest, d.oldest, d.stop, len(enc)])
        arrays += enc
    return entries, arrays, residuals


def unpack(entries: Any, arrays: Sequence[np.ndarray], allowed: Mapping[int, Slot], codec: Codec,
           src: int) -> list[tuple[Slot, Datum]]:
    """The (slot, datum) pairs of a message, all checked first (ProtocolError, nothing used)."""
    if not isinstance(entries, list):
        raise ProtocolError("canary", f"node {src}: malformed slot list")
    out: list[tuple[Slot, Datum]] = []
    seen: set[int] = set()
    pos = 0
    for e in entries:
        if not (isinstance(e, list) and len(e) == 7 and all(type(v) is int for v in (*e[:2], *e[3:5], e[6]))
                and isinstance(e[2], bytes) and isinstance(e[5], bool)):
            raise ProtocolError("canary", f"node {src}: malformed slot entry")
        idx, count, mask_b, newest, oldest, stop, narr = e
        slot = allowed.get(idx)
        if slot is None or idx in seen or count < 1 or narr < 1 or pos + narr > len(arrays):
            raise ProtocolError("canary", f"node {src}: slot {idx} is not one it may send here (or sent twice)")
        seen.add(idx)
        vec = codec.decode(arrays[pos:pos + narr], slot.size)
        pos += narr
        if not np.all(np.isfinite(vec)):
            raise ProtocolError("canary", f"node {src}: non-finite values in slot {idx}")
        out.append((slot, Datum(np.array(vec, dtype=np.float32, copy=True), count,
                                int.from_bytes(mask_b, "little"), newest, oldest, stop)))
    if pos != len(arrays):
        raise ProtocolError("canary", f"node {src}: {len(arrays) - pos} arrays too many")
    return out


def mask_bytes(mask: int) -> bytes:
    return mask.to_bytes(max(1, (mask.bit_length() + 7) // 8), "little")


__all__ = ["Header", "mask_bytes", "pack", "parse_header", "unpack"]

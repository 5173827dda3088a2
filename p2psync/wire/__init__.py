"""Wire format: versioned msgpack header + raw zero-copy tensor frames (pure, no sockets)."""

from p2psync.wire.codec import Message, decode, encode, frame_len, frames_len, parse_header
from p2psync.wire.fill import Fill, placed
from p2psync.wire.schema import (
    CODECS,
    DEFAULT_LIMITS,
    DTYPES,
    KINDS,
    MAX_HOPS,
    PATH_KEPT,
    RELAY_KINDS,
    SCHEMA_VERSION,
    FrameSpec,
    Header,
    MessageKind,
    WireCodec,
    WireLimits,
)

__all__ = [
    "CODECS",
    "DEFAULT_LIMITS",
    "DTYPES",
    "Fill",
    "KINDS",
    "MAX_HOPS",
    "PATH_KEPT",
    "RELAY_KINDS",
    "SCHEMA_VERSION",
    "FrameSpec",
    "Header",
    "Message",
    "MessageKind",
    "WireCodec",
    "WireLimits",
    "decode",
    "encode",
    "frame_len",
    "frames_len",
    "parse_header",
    "placed",
]

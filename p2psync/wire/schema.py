"""Wire schema: the header of every p2psync message, its limits and allow-lists. Pure.

A message is multipart: ``[header, payload_0, ..., payload_{k-1}]``. The header is a msgpack
map with exactly these keys (``meta`` optional)::

    {"v": 2, "kind": str, "src": int, "tag": str, "step": int, "run": int, "inc": int,
     "frames": [[dtype, [dim, ...], codec, nbytes], ...], "meta": {str: value},
     "dst": int, "hops": int}

``dst``/``hops`` appear only on messages relayed to a node that is not adjacent: control
messages (:data:`RELAY_KINDS`, which the transport relays on its own) and ``data`` messages a
sender asked to relay (a collective over a group whose members are not adjacent);
``auth`` (32 bytes, only with ``dst``) is the origin's HMAC of a relayed message in a keyed
cluster (see :mod:`p2psync.transport.relay_auth`): the destination checks it, so a relay
cannot forge or alter what it forwards. ``ctr`` (only with ``dst``; signed with the rest) is
the origin's message counter, increasing within one incarnation (one counter for ``data``,
one for control): the destination drops a counter it has already seen (a replay). ``path``
(only with ``dst``, not signed): the nodes a relayed control message passed before its
sender, which no relay passes it on to (:attr:`Header.path`).

Version 2 added the required keys ``run`` and ``inc``: the run id (an unsigned
64-bit integer every node of one run derives the same way, see
:func:`p2psync.api.runtime.wire_run_id`) and the sender's incarnation (an unsigned 64-bit
integer, the process start time in ns, so a restarted node has a larger one). A relayed
message keeps its origin's ``run``/``inc``. Receivers drop traffic of another run
(``wrong_run``) or of an older incarnation of a node than the one the membership knows
(``stale_incarnation``); see :meth:`p2psync.transport.base.Transport._ingest`. Version 1
headers (no run id) are rejected as ``version``: old and new processes never talk.

Payload frames are the raw little-endian bytes of C-contiguous arrays.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, get_args

SCHEMA_VERSION = 2

#: Message kinds the runtime knows. ``data``: tensors between peers; ``rpc``/``reply``: the
#: coordinator RPC; ``event``: one-way notifications (membership, failures); ``hb``: heartbeats.
MessageKind = Literal["data", "rpc", "reply", "event", "hb"]
KINDS: frozenset[str] = frozenset(get_args(MessageKind))

#: Only plain numeric dtypes may travel. No object, string, void or datetime dtypes, ever.
DTYPES: frozenset[str] = frozenset(
    {
        "bool",
        "uint8",
        "int8",
        "uint16",
        "int16",
        "uint32",
        "int32",
        "uint64",
        "int64",
        "float16",
        "float32",
        "float64",
    }
)

#: Payload codecs a frame may declare (see ``p2psync.compress``). ``raw`` = not a tensor codec.
#: ``topk`` frames are (indices, values) of a sparsified tensor (ASGD's gradients; the sparse
#: allreduce itself travels as plain ``none`` byte frames through the allgather).
WireCodec = Literal["none", "fp16", "int8", "sketch8", "sketch8p", "topk", "e3m0", "raw"]
CODECS: frozenset[str] = frozenset(get_args(WireCodec))

HEADER_KEYS_REQUIRED = frozenset({"v", "kind", "src", "tag", "step", "run", "inc", "frames"})
HEADER_KEYS_OPTIONAL = frozenset({"meta", "dst", "hops", "auth", "ctr", "path"})
#: length of the ``auth`` digest (HMAC-SHA256)
AUTH_BYTES = 32

#: control kinds: relayed hop by hop to a node that is not adjacent whenever they are sent
#: there (``data`` is relayed only when its sender asks: ``Transport.send(..., relay=True)``)
RELAY_KINDS: frozenset[str] = frozenset({"rpc", "reply", "event", "hb"})
#: the most hops a relayed message takes: a shortest path across the largest topology the
#: builders make (4096 nodes; a ring of N needs N/2 hops), so it only ends a routing loop
MAX_HOPS = 4096
#: the most nodes a relayed control message's ``path`` lists (the latest ones it passed): a
#: relay never passes it on to one of them, so no routing loop shorter than this is possible
PATH_KEPT = 16
#: run ids and incarnations are unsigned 64-bit integers
MAX_U64 = (1 << 64) - 1

_TAG_RE = re.compile(r"^[A-Za-z0-9_.:/@#\-]{1,128}$")
#: run ids name folders: a short safe charset, no separators, no leading dot
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+\-]{0,127}$")


@dataclass(frozen=True)
class WireLimits:
    """Caps applied when decoding untrusted bytes."""

    max_header_bytes: int = 64 * 1024
    max_frames: int = 64
    max_ndim: int = 8
    max_elements: int = 1 << 31
    max_frame_bytes: int = 1 << 30
    max_total_bytes: int = 1 << 31
    max_meta_depth: int = 6
    max_container_len: int = 4096
    max_node_id: int = (1 << 20) - 1
    max_step: int = (1 << 62)

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 1:
                raise ValueError(f"WireLimits.{name} must be >= 1")


DEFAULT_LIMITS = WireLimits()


@dataclass(frozen=True)
class FrameSpec:
    """Describes one payload frame."""

    dtype: str
    shape: tuple[int, ...]
    codec: str = "none"
    nbytes: int = 0


@dataclass(frozen=True)
class Header:
    """Decoded, validated message header."""

    kind: str
    src: int
    tag: str
    step: int = 0
    frames: tuple[FrameSpec, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)
    #: final destination of a relayed control message (None: the receiving node)
    dst: int | None = None
    hops: int = 0
    #: run id of the sender's run and the sender's incarnation (of the origin when relayed)
    run: int = 0
    inc: int = 0
    #: the origin's digest of a relayed message (keyed clusters), else None
    auth: bytes | None = None
    #: the origin's counter of a signed relayed message (per incarnation), else None
    ctr: int | None = None
    #: relayed control messages: the nodes that held it before its sender (origin first, the
    #: latest :data:`PATH_KEPT`), never its next hops (not signed: a relay could only make it
    #: take another way, or drop it, which it can anyway)
    path: tuple[int, ...] = ()


def valid_tag(tag: object) -> bool:
    return isinstance(tag, str) and _TAG_RE.match(tag) is not None


def valid_run_id(run_id: object) -> bool:
    """A run id that is safe as one folder name: 1-128 characters of ``A-Z a-z 0-9 _ . + -``,
    not starting with a dot, never ``..``, so no path separator, no absolute path, no parent."""
    return isinstance(run_id, str) and _RUN_ID_RE.match(run_id) is not None and ".." not in run_id

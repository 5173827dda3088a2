"""Encode and strictly decode p2psync messages. Pure: bytes in, bytes out; never pickle.

``encode`` returns a list of frames (the header as ``bytes`` plus zero-copy ``memoryview``s of
the arrays) ready for ``send_multipart(copy=False)``. ``decode`` takes the frames of an
untrusted message and either returns a :class:`Message` whose arrays are read-only views on the
received buffers (``numpy.frombuffer``), or raises :class:`~p2psync.errors.ProtocolError`
naming the violated rule. No other exception escapes ``decode``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, cast

import msgpack
import numpy as np

from p2psync.errors import ProtocolError
from p2psync.wire.fill import Fill
from p2psync.wire.schema import (
    AUTH_BYTES,
    CODECS,
    DEFAULT_LIMITS,
    DTYPES,
    HEADER_KEYS_OPTIONAL,
    HEADER_KEYS_REQUIRED,
    KINDS,
    MAX_HOPS,
    MessageKind,
    MAX_U64,
    PATH_KEPT,
    SCHEMA_VERSION,
    FrameSpec,
    Header,
    WireLimits,
    valid_tag,
)

Buffer = bytes | bytearray | memoryview

#: allowed dtypes, little-endian, by wire name and back (``dtype.name`` is slow in numpy)
_DTYPE_BY_NAME: dict[str, np.dtype] = {n: np.dtype(n).newbyteorder("<") for n in DTYPES}
_NAME_BY_DTYPE: dict[np.dtype, str] = {dt: n for n, dt in _DTYPE_BY_NAME.items()}
_NAME_BY_DTYPE.update({np.dtype(n): n for n in DTYPES})  # native order (== "<" on x86/arm)


@dataclass
class Message:
    """A decoded message: validated header plus one array per payload frame."""

    header: Header
    arrays: list[np.ndarray] = field(default_factory=list)
    #: name of the local NIC the message arrived on (set by the transport)
    nic: str | None = None
    #: set by the transport when the arrays are lent views of memory it must get back (shared
    #: memory, :meth:`p2psync.transport.base.Transport.lend`): something with ``release()``
    lease: Any = field(default=None, repr=False, compare=False)

    def release(self) -> None:
        """Give back the memory the arrays view, if they were lent (else nothing happens; more
        calls do nothing). A borrower calls it once it has read them, and reads them no more."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()

    @property
    def src(self) -> int:
        return self.header.src

    @property
    def tag(self) -> str:
        return self.header.tag

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.header.meta

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.header.frames)


# ---------------------------------------------------------------------------------- encode


def _as_wire_array(arr: Any) -> tuple[np.ndarray, str]:
    """numpy view of ``arr`` (numpy array or CPU torch tensor), C-contiguous, little-endian,
    and its wire dtype name."""
    if type(arr) is np.ndarray and arr.flags.c_contiguous:
        name = _NAME_BY_DTYPE.get(arr.dtype)
        if name is not None and arr.dtype.byteorder != ">":
            return arr, name
    if not isinstance(arr, np.ndarray):
        detach = getattr(arr, "detach", None)
        if detach is None:
            raise TypeError(f"payload must be a numpy array or torch tensor, not {type(arr).__name__}")
        t = detach()
        if t.device.type != "cpu":
            raise ValueError("stage device tensors to host memory before sending")
        arr = t.contiguous().numpy()
    if arr.dtype.name not in DTYPES:
        raise ValueError(f"dtype {arr.dtype} is not allowed on the wire")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = arr if arr.flags.c_contiguous else arr.copy(order="C")  # keeps 0-d arrays 0-d
    return arr, _NAME_BY_DTYPE[arr.dtype]


def encode(
    *,
    kind: MessageKind,
    src: int,
    tag: str,
    step: int = 0,
    arrays: Sequence[Any] = (),
    codecs: Sequence[str] | None = None,
    meta: Mapping[str, Any] | None = None,
    dst: int | None = None,
    hops: int = 0,
    run: int = 0,
    inc: int = 0,
    auth: bytes | None = None,
    ctr: int | None = None,
    path: Sequence[int] = (),
) -> list[Buffer | Fill]:
    """Build the frames of one message. Raises ``ValueError`` for a bad local argument. An
    array may be a :class:`~p2psync.wire.fill.Fill`: its frame is that Fill, placed (computed)
    by the transport that sends it.

    ``run``/``inc``: the run id and the sender's incarnation (unsigned 64-bit); a transport
    always passes its own (see :class:`p2psync.transport.base.Transport`). ``path`` (relayed
    messages only): the nodes that held the message before its sender, at most
    :data:`~p2psync.wire.schema.PATH_KEPT` (see :attr:`~p2psync.wire.schema.Header.path`).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown message kind {kind!r}")
    if not valid_tag(tag):
        raise ValueError(f"bad tag {tag!r}")
    if type(run) is not int or not 0 <= run <= MAX_U64:
        raise ValueError(f"run id must be an unsigned 64-bit int, got {run!r}")
    if type(inc) is not int or not 0 <= inc <= MAX_U64:
        raise ValueError(f"incarnation must be an unsigned 64-bit int, got {inc!r}")
    if codecs is not None and len(codecs) != len(arrays):
        raise ValueError("codecs must have one entry per array")
    payload: list[Buffer | Fill] = []
    specs: list[list[Any]] = []
    for i, a in enumerate(arrays):
        fill = a if type(a) is Fill else None
        if fill is not None and kind != "data":
            raise ValueError("only data messages carry Fills (control is never computed on the way)")
        arr, dname = _as_wire_array(a if fill is None else fill.like)
        if fill is not None and arr is not fill.like:
            raise ValueError("a Fill's array must be C-contiguous and of a wire dtype, in little-endian order")
        codec = "none" if codecs is None else codecs[i]
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}")
        specs.append([dname, list(arr.shape), codec, arr.nbytes])
        # a Fill stays one until it is placed (computed where it is sent from: p2psync.wire.fill)
        payload.append(b"" if not arr.size else fill if fill is not None else arr.reshape(-1).data.cast("B"))
    header: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "kind": kind,
        "src": int(src),
        "tag": tag,
        "step": int(step),
        "run": run,
        "inc": inc,
        "frames": specs,
    }
    if meta:
        header["meta"] = dict(meta)
    if dst is not None:
        header["dst"] = int(dst)
        header["hops"] = int(hops)
    if auth is not None:
        if dst is None or len(auth) != AUTH_BYTES:
            raise ValueError(f"auth is a {AUTH_BYTES}-byte digest of a relayed message")
        header["auth"] = bytes(auth)
    if ctr is not None:
        if dst is None or type(ctr) is not int or not 0 <= ctr <= MAX_U64:
            raise ValueError("ctr is an unsigned 64-bit counter of a relayed message")
        header["ctr"] = ctr
    if path:
        if dst is None or len(path) > PATH_KEPT:
            raise ValueError(f"path lists at most {PATH_KEPT} nodes of a relayed message")
        header["path"] = [int(n) for n in path]
    return [msgpack.packb(header, use_bin_type=True), *payload]


# ---------------------------------------------------------------------------------- decode


def _unpack_header(raw: Buffer, limits: WireLimits) -> Any:
    if len(raw) > limits.max_header_bytes:
        raise ProtocolError("header_too_large", f"{len(raw)} > {limits.max_header_bytes} bytes")
    n = limits.max_container_len
    try:
        return msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=limits.max_header_bytes,
            max_bin_len=limits.max_header_bytes,
            max_array_len=n,
            max_map_len=n,
            max_ext_len=0,
        )
    except (RecursionError, MemoryError) as exc:
        raise ProtocolError("header_msgpack", type(exc).__name__) from None
    except Exception as exc:  # msgpack raises a zoo of types; all mean "not a valid header"
        raise ProtocolError("header_msgpack", f"{type(exc).__name__}: {exc}"[:200]) from None


# integers are checked as ``type(x) is int`` throughout: bool is not int here, on purpose
_HEADER_KEYS = HEADER_KEYS_REQUIRED | HEADER_KEYS_OPTIONAL


def _check_meta(value: Any, limits: WireLimits, depth: int, path: str) -> None:
    """Raise :class:`ProtocolError` naming the first bad value of ``meta`` and its path (the
    slow path: :func:`_meta_ok` has already found that there is one)."""
    if depth > limits.max_meta_depth:
        raise ProtocolError("meta_too_deep", path)
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ProtocolError("meta_float", f"{path}: {value!r} (NaN and infinity are refused)")
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_meta(v, limits, depth + 1, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ProtocolError("meta_key_type", f"{path}: key {type(k).__name__}")
            _check_meta(v, limits, depth + 1, f"{path}.{k}")
        return
    raise ProtocolError("meta_type", f"{path}: {type(value).__name__}")


#: meta values that are valid at any depth within the limit (exact types: msgpack makes no subclasses)
_META_SCALARS = frozenset({type(None), bool, int, str, bytes})


def _meta_ok(value: Any, max_depth: int, depth: int) -> bool:
    """True when :func:`_check_meta` would accept ``value`` (checked without building paths,
    which cost more than the check: this runs for every message). False sends the caller to
    :func:`_check_meta` for the error; anything unusual answers False and lets it decide."""
    if depth > max_depth:
        return False
    t = type(value)
    if t is dict:
        items: Any = value.items()
    elif t is list:
        items = enumerate(value)
    elif t in _META_SCALARS:
        return True
    else:
        return t is float and math.isfinite(value)
    if depth >= max_depth and value:  # its items would lie too deep
        return False
    for k, v in items:
        if t is dict and type(k) is not str:
            return False
        if type(v) not in _META_SCALARS and not _meta_ok(v, max_depth, depth + 1):
            return False
    return True


def _frozen(cls: type[Any], fields: dict[str, Any]) -> Any:
    """An instance of the frozen dataclass ``cls`` with every one of its ``fields`` given.
    Its generated ``__init__`` sets each field through ``object.__setattr__``, which took 4 µs
    for a :class:`Header` (more than the rest of its validation); this fills ``__dict__`` at once."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def _parse_frame_spec(i: int, spec: Any, limits: WireLimits) -> FrameSpec:
    if not isinstance(spec, list) or len(spec) != 4:
        raise ProtocolError("frame_spec", f"frames[{i}] must be [dtype, shape, codec, nbytes]")
    dtype, shape, codec, nbytes = spec
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ProtocolError("dtype", f"frames[{i}]: {dtype!r} not allowed")
    if not isinstance(codec, str) or codec not in CODECS:
        raise ProtocolError("codec", f"frames[{i}]: {codec!r} unknown")
    if not isinstance(shape, list) or len(shape) > limits.max_ndim:
        raise ProtocolError("shape", f"frames[{i}]: shape must be a list of <= {limits.max_ndim} dims")
    count = 1
    for d in shape:
        if type(d) is not int or d < 0 or d > limits.max_elements:
            raise ProtocolError("shape", f"frames[{i}]: bad dimension {d!r}")
        count *= d
        if count > limits.max_elements:
            raise ProtocolError("too_many_elements", f"frames[{i}]: > {limits.max_elements}")
    if type(nbytes) is not int or nbytes < 0 or nbytes > limits.max_frame_bytes:
        raise ProtocolError("frame_too_large", f"frames[{i}]: nbytes {nbytes!r}")
    itemsize = _DTYPE_BY_NAME[dtype].itemsize
    if count * itemsize != nbytes:
        raise ProtocolError("nbytes_mismatch", f"frames[{i}]: {count}x{itemsize} != {nbytes}")
    return cast(FrameSpec, _frozen(FrameSpec, {"dtype": dtype, "shape": tuple(shape), "codec": codec,
                                               "nbytes": nbytes}))


def parse_header(raw: Buffer, limits: WireLimits = DEFAULT_LIMITS) -> Header:
    """Decode and validate a header frame."""
    obj = _unpack_header(raw, limits)
    if not isinstance(obj, dict):
        raise ProtocolError("header_type", f"header must be a map, got {type(obj).__name__}")
    keys = obj.keys()
    if not (HEADER_KEYS_REQUIRED <= keys and keys <= _HEADER_KEYS):
        missing = HEADER_KEYS_REQUIRED - keys
        if missing:
            raise ProtocolError("header_keys", f"missing {sorted(missing)}")
        raise ProtocolError("header_keys", f"unexpected {sorted(map(str, keys - _HEADER_KEYS))}")
    v = obj["v"]
    if v != SCHEMA_VERSION or type(v) is not int:
        raise ProtocolError("version", f"unsupported schema version {v!r}")
    kind = obj["kind"]
    if not isinstance(kind, str) or kind not in KINDS:
        raise ProtocolError("kind", f"unknown kind {kind!r}"[:100])
    src = obj["src"]
    if type(src) is not int or not 0 <= src <= limits.max_node_id:
        raise ProtocolError("src", f"bad source node {src!r}"[:100])
    tag = obj["tag"]
    if not valid_tag(tag):
        raise ProtocolError("tag", f"bad tag {tag!r}"[:100])
    step = obj["step"]
    if type(step) is not int or not -limits.max_step <= step <= limits.max_step:
        raise ProtocolError("step", f"bad step {step!r}"[:100])
    run = obj["run"]
    if type(run) is not int or not 0 <= run <= MAX_U64:
        raise ProtocolError("run", f"bad run id {run!r}"[:100])
    inc = obj["inc"]
    if type(inc) is not int or not 0 <= inc <= MAX_U64:
        raise ProtocolError("incarnation", f"bad incarnation {inc!r}"[:100])
    frames = obj["frames"]
    if not isinstance(frames, list) or len(frames) > limits.max_frames:
        raise ProtocolError("frames", f"frames must be a list of <= {limits.max_frames}")
    specs = tuple(_parse_frame_spec(i, s, limits) for i, s in enumerate(frames)) if frames else ()
    if specs and sum(s.nbytes for s in specs) > limits.max_total_bytes:
        raise ProtocolError("message_too_large", f"> {limits.max_total_bytes} bytes")
    meta = obj["meta"] if "meta" in obj else {}
    if not isinstance(meta, dict):
        raise ProtocolError("meta_type", "meta must be a map")
    if meta and not _meta_ok(meta, limits.max_meta_depth, 0):
        _check_meta(meta, limits, 0, "meta")
    dst = obj.get("dst")
    hops = obj.get("hops", 0)
    if ("dst" in obj) != ("hops" in obj):
        raise ProtocolError("relay", "dst and hops go together")
    if dst is not None:
        if type(dst) is not int or not 0 <= dst <= limits.max_node_id:
            raise ProtocolError("relay", f"bad dst {dst!r}"[:100])
        if type(hops) is not int or not 0 <= hops <= MAX_HOPS:
            raise ProtocolError("relay", f"bad hops {hops!r}"[:100])
    auth = obj.get("auth")
    if auth is not None and (dst is None or not isinstance(auth, bytes) or len(auth) != AUTH_BYTES):
        raise ProtocolError("relay", f"auth must be a {AUTH_BYTES}-byte digest on a relayed message")
    ctr = obj.get("ctr")
    if ctr is not None and (dst is None or type(ctr) is not int or not 0 <= ctr <= MAX_U64):
        raise ProtocolError("relay", f"ctr must be an unsigned 64-bit counter on a relayed message, got {ctr!r}"[:120])
    path = obj.get("path", ())
    if path != () and (dst is None or not isinstance(path, list) or not 0 < len(path) <= PATH_KEPT
                       or not all(type(n) is int and 0 <= n <= limits.max_node_id for n in path)):
        raise ProtocolError("relay", f"path must list 1 to {PATH_KEPT} node ids on a relayed message"[:120])
    return cast(Header, _frozen(Header, {
        "kind": kind, "src": src, "tag": tag, "step": step, "frames": specs,
        "meta": meta, "dst": dst, "hops": hops, "run": run,
        "inc": inc, "auth": auth, "ctr": ctr, "path": tuple(path)}))


def frame_len(buf: Any) -> int:
    """Bytes in one frame: a ``memoryview`` (its ``nbytes``; ``len`` counts items) or a bytes-like."""
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def frames_len(frames: Sequence[Any]) -> int:
    """Bytes in a message's frames (a plain loop: a generator under ``sum`` costs more for the
    two or three frames of a message, and this runs for every message sent and received)."""
    n = 0
    for f in frames:
        n += f.nbytes if type(f) is memoryview else len(f)
    return n


def decode(frames: Sequence[Any], limits: WireLimits = DEFAULT_LIMITS) -> Message:
    """Decode an untrusted multipart message (``bytes``/``memoryview``/buffer objects)."""
    if not frames:
        raise ProtocolError("frame_count", "empty message")
    try:  # (a try block costs nothing until it raises; the ``with`` did, on every message)
        bufs = [f if isinstance(f, (bytes, bytearray)) else memoryview(f) for f in frames]
    except TypeError:
        raise ProtocolError("frame_type", "frames must be byte buffers") from None
    header = parse_header(bufs[0], limits)
    if len(bufs) - 1 != len(header.frames):
        raise ProtocolError(
            "frame_count", f"header declares {len(header.frames)} payload frames, got {len(bufs) - 1}"
        )
    arrays: list[np.ndarray] = []
    for i, (spec, buf) in enumerate(zip(header.frames, bufs[1:])):
        n = frame_len(buf)
        if n != spec.nbytes:
            raise ProtocolError("nbytes_mismatch", f"frames[{i}]: declared {spec.nbytes}, got {n}")
        dt = _DTYPE_BY_NAME[spec.dtype]
        if isinstance(buf, memoryview) and buf.format != "B":
            buf = buf.cast("B")
        arr = np.frombuffer(buf, dtype=dt, count=math.prod(spec.shape)).reshape(spec.shape)
        arrays.append(arr)
    return Message(header=header, arrays=arrays)

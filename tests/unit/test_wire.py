"""Wire: round trips for every dtype/shape, strict rejection of malformed input, fuzz."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from p2psync.errors import ProtocolError
from p2psync.wire import DTYPES, PATH_KEPT, WireLimits, decode, encode, parse_header

dtypes = st.sampled_from(sorted(DTYPES)).map(np.dtype)
arrays = dtypes.flatmap(lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)))


@settings(max_examples=200, deadline=None)
@given(st.lists(arrays, max_size=4), st.integers(0, 1000), st.integers(-(2**40), 2**40))
def test_roundtrip_every_dtype_and_shape(arrs, src, step):
    frames = encode(kind="data", src=src, tag="t.1", step=step, arrays=arrs, meta={"k": [1, 2.5, "x"]})
    msg = decode([bytes(f) for f in frames])
    assert msg.src == src and msg.header.step == step and msg.tag == "t.1"
    assert msg.meta == {"k": [1, 2.5, "x"]}
    assert len(msg.arrays) == len(arrs)
    for a, b in zip(arrs, msg.arrays):
        assert b.dtype == a.dtype and b.shape == a.shape
        np.testing.assert_array_equal(a, b)


def test_torch_tensor_and_noncontiguous_and_bigendian():
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous
    be = np.arange(5, dtype=">i4")
    msg = decode(encode(kind="data", src=0, tag="a", arrays=[t, be]))
    np.testing.assert_array_equal(msg.arrays[0], t.numpy())
    np.testing.assert_array_equal(msg.arrays[1], be)


def _valid() -> list[bytes]:
    return [bytes(f) for f in encode(kind="data", src=1, tag="x", arrays=[np.arange(6, dtype=np.float32)])]


def _header(**over):
    h = {"v": 2, "kind": "data", "src": 1, "tag": "x", "step": 0, "run": 7, "inc": 9,
         "frames": [["float32", [6], "none", 24]]}
    h.update(over)
    return msgpack.packb(h)


PAYLOAD = np.arange(6, dtype=np.float32).tobytes()


@pytest.mark.parametrize(
    "frames,reason",
    [
        ([], "frame_count"),
        ([b"\xc1"], "header_msgpack"),  # never-used msgpack byte
        ([b"\x92\x01"], "header_msgpack"),  # truncated
        ([msgpack.packb({1: 2})], "header_msgpack"),  # integer map key
        ([b"\x91" * 5000 + b"\x00"], "header_msgpack"),  # deep nesting
        ([msgpack.packb(msgpack.ExtType(5, b"xx"))], "header_msgpack"),  # ext type
        ([msgpack.packb([1, 2])], "header_type"),
        ([b"\x00" * (70 * 1024)], "header_too_large"),
        ([_header(v=1), PAYLOAD], "version"),
        ([_header(v=3), PAYLOAD], "version"),
        ([_header(run="r1"), PAYLOAD], "run"),
        ([_header(run=-1), PAYLOAD], "run"),
        ([_header(run=True), PAYLOAD], "run"),
        ([_header(run=1.0), PAYLOAD], "run"),
        ([_header(inc="x"), PAYLOAD], "incarnation"),
        ([_header(inc=-5), PAYLOAD], "incarnation"),
        ([_header(inc=None), PAYLOAD], "incarnation"),
        ([msgpack.packb({k: v for k, v in msgpack.unpackb(_header()).items() if k != "run"}), PAYLOAD],
         "header_keys"),
        ([msgpack.packb({k: v for k, v in msgpack.unpackb(_header()).items() if k != "inc"}), PAYLOAD],
         "header_keys"),
        ([_header(kind="evil"), PAYLOAD], "kind"),
        ([_header(src=-1), PAYLOAD], "src"),
        ([_header(src=True), PAYLOAD], "src"),
        ([_header(tag="a b"), PAYLOAD], "tag"),
        ([_header(step=1.5), PAYLOAD], "step"),
        ([_header(extra=1), PAYLOAD], "header_keys"),
        ([_header(frames=[["object", [6], "none", 48]]), PAYLOAD], "dtype"),
        ([_header(frames=[["float32", [6], "zip", 24]]), PAYLOAD], "codec"),
        ([_header(frames=[["float32", [2**20, 2**20, 2**20], "none", 0]]), PAYLOAD], "too_many_elements"),
        ([_header(frames=[["float32", [6], "none", 2**62]]), PAYLOAD], "frame_too_large"),
        ([_header(frames=[["float32", [6], "none", 20]]), PAYLOAD], "nbytes_mismatch"),
        ([_header(frames=[["float32", [1] * 9, "none", 4]]), PAYLOAD], "shape"),
        ([_header(frames=[["float32", [-6], "none", 24]]), PAYLOAD], "shape"),
        ([_header(frames=[["float32", [6], "none"]]), PAYLOAD], "frame_spec"),
        ([_header()], "frame_count"),  # declared 1 payload, got 0
        ([_header(), PAYLOAD, PAYLOAD], "frame_count"),
        ([_header(), PAYLOAD[:-4]], "nbytes_mismatch"),
        ([_header(meta=[1])], "meta_type"),
        ([_header(meta={"a": {"b": {"c": {"d": {"e": {"f": {"g": 1}}}}}}}), PAYLOAD], "meta_too_deep"),
        ([_header(meta={"srtt": float("nan")}), PAYLOAD], "meta_float"),
        ([_header(meta={"w": [1.0, float("-inf")]}), PAYLOAD], "meta_float"),
        ([_header(kind="event", frames=[], dst=2, hops=1, ctr=-1)], "relay"),
        ([_header(kind="event", frames=[], dst=2, hops=1, ctr=1.5)], "relay"),
        ([_header(kind="event", frames=[], ctr=3)], "relay"),  # a counter only on a relayed message
        ([_header(kind="event", frames=[], path=[1])], "relay"),  # a path only on a relayed message
        ([_header(kind="event", frames=[], dst=2, hops=1, path=[])], "relay"),
        ([_header(kind="event", frames=[], dst=2, hops=1, path=[-1])], "relay"),
        ([_header(kind="event", frames=[], dst=2, hops=1, path=[True])], "relay"),
        ([_header(kind="event", frames=[], dst=2, hops=1, path=3)], "relay"),
        ([_header(kind="event", frames=[], dst=2, hops=17, path=list(range(17)))], "relay"),  # > PATH_KEPT
    ],
)
def test_rejects_with_reason(frames, reason):
    with pytest.raises(ProtocolError) as ei:
        decode(frames)
    assert ei.value.reason == reason


def test_a_relayed_message_carries_the_nodes_it_passed():
    h = decode(encode(kind="rpc", src=1, tag="x", dst=5, hops=2, path=[1, 3])).header
    assert h.path == (1, 3) and decode(encode(kind="rpc", src=1, tag="x", dst=5, hops=1)).header.path == ()
    with pytest.raises(ValueError):
        encode(kind="rpc", src=1, tag="x", path=[1])  # not relayed
    with pytest.raises(ValueError):
        encode(kind="rpc", src=1, tag="x", dst=5, hops=2, path=range(PATH_KEPT + 1))


def test_limits_are_configurable():
    tight = WireLimits(max_frames=1)
    frames = encode(kind="data", src=0, tag="a", arrays=[np.zeros(1), np.zeros(1)])
    with pytest.raises(ProtocolError, match="frames"):
        decode(frames, tight)
    with pytest.raises(ValueError):
        WireLimits(max_frames=0)


def test_encode_rejects_bad_local_input():
    with pytest.raises(ValueError):
        encode(kind="data", src=0, tag="a", arrays=[np.array(["x"], dtype=object)])
    with pytest.raises(ValueError):
        encode(kind="nope", src=0, tag="a")
    with pytest.raises(ValueError):
        encode(kind="data", src=0, tag="has space")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_mutations_only_raise_protocol_error(data):
    frames = [bytearray(f) for f in _valid()]
    which = data.draw(st.integers(0, len(frames) - 1))
    f = frames[which]
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "cut", "grow"]))
        if op == "flip" and f:
            i = data.draw(st.integers(0, len(f) - 1))
            f[i] = data.draw(st.integers(0, 255))
        elif op == "cut" and f:
            del f[data.draw(st.integers(0, len(f) - 1)):]
        else:
            f.extend(data.draw(st.binary(max_size=16)))
    try:
        decode([bytes(x) for x in frames])
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=256), max_size=4))
def test_fuzz_arbitrary_bytes_only_raise_protocol_error(frames):
    try:
        decode(frames)
    except ProtocolError:
        pass


def test_run_id_and_incarnation_round_trip_and_local_checks():
    h = parse_header(bytes(encode(kind="hb", src=3, tag="h", run=2**64 - 1, inc=123456789)[0]))
    assert (h.run, h.inc) == (2**64 - 1, 123456789)
    h = parse_header(bytes(encode(kind="rpc", src=3, tag="h", dst=5, hops=1, run=4, inc=5)[0]))
    assert (h.run, h.inc, h.dst, h.hops) == (4, 5, 5, 1)
    for bad in ({"run": -1}, {"run": 2**64}, {"inc": "x"}, {"inc": True}):
        with pytest.raises(ValueError):
            encode(kind="data", src=0, tag="a", **bad)


def test_a_relayed_data_message_keeps_its_route_signature_and_payload():
    """Data may carry ``dst``/``hops`` (and ``auth``/``ctr``) like control: a collective's piece
    relayed to a node that is not adjacent."""
    x = np.arange(6, dtype=np.float32)
    msg = decode(encode(kind="data", src=1, tag="op.rs0.1.0", dst=3, hops=2, arrays=[x], auth=b"\7" * 32, ctr=9,
                        run=4, inc=5))
    h = msg.header
    assert (h.kind, h.src, h.dst, h.hops, h.auth, h.ctr) == ("data", 1, 3, 2, b"\7" * 32, 9)
    np.testing.assert_array_equal(msg.arrays[0], x)


def test_parse_header_accepts_rpc_meta():
    h = parse_header(bytes(encode(kind="rpc", src=2, tag="rpc.req", meta={"m": "q", "a": {"x": [1, None, True]}})[0]))
    assert h.kind == "rpc" and h.meta["a"]["x"] == [1, None, True]


meta_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=3)
    | st.binary(max_size=3),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=2) | st.binary(max_size=2) | st.integers(0, 3), inner, max_size=3),
    max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(meta_values, st.integers(1, 4))
def test_fast_meta_check_agrees_with_the_checker_that_names_the_path(value, max_depth):
    """``_meta_ok`` (no paths, runs for every message) accepts exactly what ``_check_meta``
    (names the bad value's path) accepts, at every depth limit."""
    from p2psync.wire.codec import _check_meta, _meta_ok

    limits = WireLimits(max_meta_depth=max_depth)
    try:
        _check_meta(value, limits, 0, "meta")
        accepted = True
    except ProtocolError:
        accepted = False
    assert _meta_ok(value, max_depth, 0) == accepted


def test_meta_depth_limit_is_exact():
    """A value at the deepest allowed level passes; one level deeper is ``meta_too_deep``."""
    deepest = {"a": {"b": {"c": {"d": {"e": {"f": 1}}}}}}  # the int at depth 6 = max_meta_depth
    assert parse_header(_header(meta=deepest)).meta == deepest
    for too_deep in ({"a": {"b": {"c": {"d": {"e": {"f": [1]}}}}}}, {"a": {"b": {"c": {"d": {"e": {"f": {"g": 1}}}}}}}):
        with pytest.raises(ProtocolError) as e:
            parse_header(_header(meta=too_deep))
        assert e.value.reason == "meta_too_deep"
    assert parse_header(_header(meta={"a": {"b": {"c": {"d": {"e": {"f": []}}}}}})).meta  # empty: nothing deeper


def test_parsed_headers_are_real_frozen_headers():
    """Headers and frame specs are filled in without their ``__init__`` (for speed); they are
    still equal to constructed ones, hashable and frozen."""
    import dataclasses

    from p2psync.wire import Header
    from p2psync.wire.schema import FrameSpec

    h = parse_header(_header(meta={"k": [1]}, dst=3, hops=1, kind="rpc", frames=[["float32", [2, 3], "none", 24]]))
    want = Header(kind="rpc", src=1, tag="x", step=0, frames=(FrameSpec("float32", (2, 3), "none", 24),),
                  meta={"k": [1]}, dst=3, hops=1, run=7, inc=9, auth=None, ctr=None)
    assert h == want and type(h) is Header and type(h.frames[0]) is FrameSpec
    # every field is set on the instance (a field left out would read its class default)
    assert vars(h).keys() == {f.name for f in dataclasses.fields(Header)}
    assert vars(h.frames[0]).keys() == {f.name for f in dataclasses.fields(FrameSpec)}
    assert dataclasses.asdict(h) == dataclasses.asdict(want)
    assert hash(h.frames[0]) == hash(want.frames[0])
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.src = 2  # type: ignore[misc]
    assert parse_header(_header(frames=[])).meta == {}

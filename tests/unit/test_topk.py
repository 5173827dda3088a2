"""The topk codec: spec parsing, O(n) selection with deterministic ties, payload checks, error
feedback over many rounds of the sparse allreduce (in-memory transport), the dense fallback,
and the CLI's --codec."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.helpers import memory_collectives as memory
from p2psync.collectives.sparse import THREAD_MIN, gather_sum, pack, unpack, use_sparse
from p2psync.compress import DEFAULT_FRACTION, TopK, get_codec
from p2psync.compress.topk import check_sparse, select_topk, topk_count
from p2psync.errors import ConfigError, PeerFailure, ProtocolError
from p2psync.topology import mesh, ring
from p2psync.training.config import RunConfig

pytestmark = pytest.mark.timeout(60)


# -- spec parsing ------------------------------------------------------------------------------

def test_parse_specs():
    assert isinstance(get_codec("topk"), TopK) and get_codec("topk").fraction == DEFAULT_FRACTION == 0.01
    assert get_codec("topk:0.01").fraction == 0.01 and get_codec("topk:1").fraction == 1.0
    assert get_codec("topk:5e-3").spec == "topk:0.005"
    assert get_codec("none").spec == "none"


@pytest.mark.parametrize("bad", ["topk:0", "topk:2", "topk:x", "topk:", "topk:-0.1", "topk:nan", "topk:inf"])
def test_bad_fractions_name_the_value(bad):
    with pytest.raises(ConfigError, match=f"'{bad.split(':', 1)[1]}'") as e:
        get_codec(bad)
    assert "0 < f <= 1" in str(e.value)


def test_other_bad_specs():
    with pytest.raises(ConfigError, match="takes no parameter"):
        get_codec("int8:3")
    with pytest.raises(ConfigError, match=r"topk\[:FRACTION\]"):  # the listing names every codec
        get_codec("topq:0.1")
    with pytest.raises(ConfigError):
        TopK(fraction=0)
    with pytest.raises(ConfigError, match="topk:abc"):
        RunConfig(topology="-", codec="topk:abc")
    assert RunConfig(topology="-", codec="topk:0.05").codec == "topk:0.05"


def test_k_is_ceil_of_the_fraction_as_written():
    assert topk_count(100, 0.07) == 7  # 0.07 * 100 == 7.000000000000001 in binary floating point
    assert topk_count(1001, 0.01) == 11
    assert topk_count(10, 0.001) == 1  # at least one entry
    assert topk_count(10, 1.0) == 10 and topk_count(0, 0.5) == 0


# -- selection ---------------------------------------------------------------------------------

# small integer-valued floats: many ties in magnitude (+-v, repeated values)
tied = hnp.arrays(np.float32, st.integers(1, 400), elements=st.integers(-6, 6).map(float))
wide = hnp.arrays(np.float32, st.integers(1, 400),
                  elements=st.floats(-1e6, 1e6, width=32, allow_nan=False, allow_infinity=False))


@settings(max_examples=150, deadline=None)
@given(st.one_of(tied, wide), st.floats(1e-3, 1.0))
def test_selection_picks_exactly_the_k_largest_magnitudes(x, f):
    k = topk_count(x.size, f)
    idx = select_topk(x, k)
    assert idx.dtype == np.int32 and idx.size == k
    assert (np.diff(idx) > 0).all()  # increasing, no repeats
    a = np.abs(x)
    rest = np.setdiff1d(np.arange(x.size), idx)
    if rest.size:
        t = a[idx].min()
        assert t >= a[rest].max()  # nothing left out is larger than anything kept
        # ties at the threshold go to the lowest indices
        kept_ties, left_ties = idx[a[idx] == t], rest[a[rest] == t]
        if left_ties.size:
            assert kept_ties.max() < left_ties.min()
    ref = np.sort(np.argsort(-a, kind="stable")[:k])  # stable sort: the same tie rule, O(n log n)
    np.testing.assert_array_equal(idx, ref)


def test_nan_counts_as_largest_and_roundtrip():
    x = np.array([1.0, np.nan, -3.0, np.inf, 2.0, np.nan], np.float32)
    np.testing.assert_array_equal(select_topk(x, 3), [1, 3, 5])
    c = TopK(fraction=0.3)
    y = np.array([0.5, -4.0, 0.1, 3.0, -0.2, 0.0, 1.0, 0.3, -0.4, 0.05], np.float32)
    np.testing.assert_array_equal(c.roundtrip(y), [0, -4.0, 0, 3.0, 0, 0, 1.0, 0, 0, 0])


def test_malformed_sparse_payloads_are_protocol_errors():
    c = TopK(fraction=0.25)  # n = 8 -> k = 2
    ok = [np.array([1, 5], np.int32), np.array([1.0, 2.0], np.float32)]
    assert c.decode(ok, 8)[5] == 2.0
    bad = {
        "out of range": [np.array([1, 8], np.int32), ok[1]],
        "negative": [np.array([-1, 5], np.int32), ok[1]],
        "repeated": [np.array([5, 5], np.int32), ok[1]],
        "unsorted": [np.array([5, 1], np.int32), ok[1]],
        "too many": [np.array([1, 2, 5], np.int32), np.ones(3, np.float32)],
        "index dtype": [np.array([1, 5], np.int64), ok[1]],
        "value dtype": [ok[0], np.array([1.0, 2.0], np.float64)],
        "one array": [ok[0]],
    }
    for what, arrays in bad.items():
        with pytest.raises(ProtocolError):
            c.decode(arrays, 8)
            pytest.fail(what)
    with pytest.raises(ProtocolError, match="out of range"):
        check_sparse(np.array([0, 2**31 - 1], np.int32), ok[1], 8, 2, "peer")
    row = pack(*ok)
    i, v = unpack(row, 8, 2, "peer")
    np.testing.assert_array_equal(i, ok[0])
    np.testing.assert_array_equal(v, ok[1])
    for wrong in (row[:-1], np.concatenate([row, row[:4]]), row.view(np.int32)):
        with pytest.raises(ProtocolError):
            unpack(wrong, 8, 2, "peer")


def test_fallback_rule():
    # sparse while the gathered parts (members * k * 8 bytes) are no larger than the vector (n * 4)
    assert use_sparse(10_000, 100, 4) and use_sparse(10_000, 1250, 4) and not use_sparse(10_000, 1251, 4)
    assert not use_sparse(10_000, 10, 1)  # a group of one is exact, as for every codec
    assert not use_sparse(0, 0, 4)


# -- the allreduce on the in-memory transport --------------------------------------------------



async def test_error_feedback_sum_of_sent_tracks_sum_of_inputs():
    """Over many rounds, sum(results) == sum(inputs) - sum(final residuals), and the residual
    stays bounded; without error feedback the running sums drift apart."""
    n, rounds, f = 2000, 120, 0.02
    rng = np.random.default_rng(4)
    c = TopK(fraction=f)
    async with memory(ring(4), codec=f"topk:{f}") as cs:  # error_feedback=False: topk keeps it under the key anyway
        true_sum = np.zeros(n)
        sent = np.zeros(n)
        no_fb = np.zeros(n)
        norms = []
        for t in range(rounds):
            xs = {i: (rng.standard_normal(n) * 1e-2 + 2e-3).astype(np.float32) for i in cs}  # biased
            outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag=f"ef.{t}", feedback="ef") for i in cs))
            assert all(o.tobytes() == outs[0].tobytes() for o in outs)
            sent += outs[0]
            true_sum += sum(xs.values())
            no_fb += sum(c.roundtrip(x) for x in xs.values())
            norms.append(max(np.linalg.norm(cs[i].sparse_feedback.residual[("topk", "ef", n)]) for i in cs))
        residual = sum(cs[i].sparse_feedback.residual[("topk", "ef", n)].astype(np.float64) for i in cs)
    np.testing.assert_allclose(sent + residual, true_sum, atol=2e-3)
    assert max(norms[rounds // 2:]) < 1.5 * max(norms[:rounds // 2])  # bounded, not growing
    assert np.linalg.norm(sent - true_sum) < 0.25 * np.linalg.norm(no_fb - true_sum)  # measured: 0.16


async def test_dense_fallback_is_exact_and_flushes_the_residual():
    n = 400
    async with memory(mesh(3)) as cs:
        xs = {i: np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in cs}
        # k = 4 of 400: sparse, leaves a residual
        await asyncio.gather(*(cs[i].allreduce(xs[i], tag="fb.1", codec="topk:0.01", feedback="fb") for i in cs))
        res = {i: cs[i].sparse_feedback.residual[("topk", "fb", n)].copy() for i in cs}
        assert cs[0].stats_for("fb.1").codec == "topk:0.01"
        # k = 200 of 400 with 3 members: 3 * 200 * 8 > 400 * 4 -> exact dense allreduce of x + residual
        outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag="fb.2", codec="topk:0.5", feedback="fb") for i in cs))
        assert all(("topk", "fb", n) not in cs[i].sparse_feedback.residual for i in cs)
        assert cs[0].stats_for("fb.2").codec == "none"
    ref = sum(xs[i] + res[i] for i in cs)
    np.testing.assert_allclose(outs[0], ref, rtol=1e-5, atol=1e-5)
    assert all(o.tobytes() == outs[0].tobytes() for o in outs)


async def test_large_vectors_empty_vectors_and_one_member():
    n = THREAD_MIN  # sparsified in a worker thread
    codec = TopK(fraction=0.001)
    async with memory(mesh(2), codec="topk:0.001") as cs:
        xs = {i: np.random.default_rng(10 + i).standard_normal(n).astype(np.float32) for i in cs}
        outs = await asyncio.gather(*(cs[i].allreduce(xs[i], tag="big") for i in cs))
        ref = np.zeros(n, np.float32)
        for i in sorted(cs):
            idx, vals = codec.sparsify(xs[i])
            ref[idx] += vals
        np.testing.assert_array_equal(outs[0], ref)
        assert outs[1].tobytes() == outs[0].tobytes()
        empty = await asyncio.gather(*(cs[i].allreduce(np.zeros(0, np.float32), tag="empty") for i in cs))
        assert all(e.shape == (0,) for e in empty)
        one = await cs[0].allreduce(xs[0], group=[0], tag="solo")  # a group of one is exact
        np.testing.assert_array_equal(one, xs[0])


async def test_aborted_exchange_keeps_the_old_residual_and_other_ops():
    async with memory(mesh(2), codec="topk:0.1") as cs:
        for c in cs.values():
            c.timeout = 0.3
        x = np.arange(100, dtype=np.float32)
        await asyncio.gather(*(cs[i].allreduce(x, tag="ab.1", feedback="ab") for i in cs))
        before = cs[0].sparse_feedback.residual[("topk", "ab", 100)].copy()
        with pytest.raises(PeerFailure):  # node 1 does not take part: the allgather times out
            await cs[0].allreduce(x, tag="ab.2", feedback="ab")
        np.testing.assert_array_equal(cs[0].sparse_feedback.residual[("topk", "ab", 100)], before)
        with pytest.raises(ConfigError, match="allreduce only"):
            await cs[0].reduce_scatter(x, tag="rs")
        with pytest.raises(ConfigError, match="float32"):
            await cs[0].allreduce(np.arange(100), tag="int")
        # allgather and broadcast stay exact; the flag allreduce of mean_and_agree uses codec none
        g = await asyncio.gather(*(cs[i].allgather(np.full(3, i, np.int64), tag="ag") for i in cs))
        assert [int(a[0]) for a in g[0]] == [0, 1]
        one = await asyncio.gather(*(cs[i].allreduce(np.ones(1, np.float32), tag="flag", codec="none") for i in cs))
        assert one[0][0] == 2.0


async def test_malformed_part_from_a_peer_is_a_protocol_error_in_memory():
    n, k = 1000, 10
    async with memory(mesh(3)) as cs:
        good = (np.arange(k, dtype=np.int32) * 7, np.ones(k, np.float32))
        bad = (np.arange(k, dtype=np.int32) + n - 5, np.ones(k, np.float32))  # past the end
        res = await asyncio.gather(gather_sum(cs[0], *bad, (0, 1, 2), n, "mal"),
                                   *(gather_sum(cs[i], *good, (0, 1, 2), n, "mal") for i in (1, 2)),
                                   return_exceptions=True)
    for r in res:
        assert isinstance(r, ProtocolError) and "node 0" in str(r) and "out of range" in str(r), r


# -- the CLI -----------------------------------------------------------------------------------

def test_cli_codec_option(capsys):
    from p2psync.cli.main import build_parser, parse_args
    from p2psync.cli.run_cmd import config_from_args

    p = build_parser()
    args = parse_args(p, ["run", "topologies/ring-4.json", "--codec", "topk:0.05", "--steps", "2"])
    assert config_from_args(args).codec == "topk:0.05"
    assert parse_args(p, ["run", "t.json", "--codec", "topk"]).codec == "topk"
    with pytest.raises(SystemExit) as e:
        parse_args(p, ["run", "t.json", "--codec", "topk:abc"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--codec" in err and "'abc'" in err and "0 < f <= 1" in err
    with pytest.raises(SystemExit):
        parse_args(p, ["run", "t.json", "--codec", "zip"])
    assert "topk[:FRACTION]" in capsys.readouterr().err  # the known codecs are listed
    with pytest.raises(SystemExit):
        parse_args(p, ["run", "--help"])
    out = capsys.readouterr().out
    assert "topk[:FRACTION]" in out and "sketch8" in out

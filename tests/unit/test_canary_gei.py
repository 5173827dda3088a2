"""Canary's GEI, staleness decision and colayers against the paper's examples and the spec's
test vectors (../shared/specs/canary.md §8: C1-C12, C19; §10 invariants)."""

from __future__ import annotations

import math
import random

import pytest

from p2psync.errors import ConfigError
from p2psync.model import Layer
from p2psync.strategies.canary.colayers import group, parse_counts
from p2psync.strategies.canary.gei import (Branch, GEIMatrix, calc_proportion, calc_staleness, check_proportion,
                                           decide, decode_workers, encode_workers, full_mask,
                                           literal_check_proportion, members_mask, node_bit, own_bit, validate)


def test_fig_16b_example_233_is_workers_1_4_6_7_8():
    assert decode_workers(233) == {1, 4, 6, 7, 8}  # C1
    assert encode_workers({1, 4, 6, 7, 8}) == 233  # C2
    assert own_bit(4) == 8 == 0b0000_1000  # C3
    assert 233 | own_bit(4) == 233  # C4: OR is idempotent
    assert 233 + own_bit(4) == 241  # the paper's "+" would double count


def test_full_masks():
    assert full_mask(9) == 511 and full_mask(34) == 17_179_869_183  # C5
    assert encode_workers(range(1, 35)) == full_mask(34)
    assert members_mask([0, 1, 2]) == 7 and node_bit(3) == 8 == own_bit(4)  # node i is worker i + 1
    with pytest.raises(ValueError):
        encode_workers([0])


@pytest.mark.parametrize("seed", range(5))
def test_encode_decode_roundtrip_and_or_is_order_independent(seed):
    rng = random.Random(seed)
    workers = set(rng.sample(range(1, 200), 30))
    assert decode_workers(encode_workers(workers)) == workers
    bits = [own_bit(w) for w in workers] * 2
    rng.shuffle(bits)
    q = GEIMatrix(3)
    for b in bits:
        q.record(5, 1, b)
    assert q.row(5)[1] == encode_workers(workers)


def test_proportion_bitmap_and_count():
    row = [7, 7, 5, 0]  # n = 3, k = 4
    assert calc_proportion(row, full_mask(3)) == 0b0011  # C6: colayers 0 and 1 complete
    assert calc_proportion(row, own_bit(1)) == 0b0111  # C7: worker 1's own bit in colayers 0-2
    assert check_proportion(0b0011, 2) and not check_proportion(0b0011, 3)
    assert literal_check_proportion(0b0011, 6) == 2  # C11: "true" with 2 of 6: the printed line 22 is wrong


@pytest.mark.parametrize("s,p,branch", [(1, 3, Branch.OVERTIME), (1, 2, Branch.STALE_APPLY), (2, 3, Branch.APPLY)])
def test_decision_branches(s, p, branch):
    """C8-C10: ζ = 12, t = 10, two complete colayers."""
    row = [7, 7, 5, 0]
    d = decide(zeta=12, t=10, row=row, mask=full_mask(3), s=s, p=p)
    assert d.branch is branch and d.staleness == 2 and d.complete == 2


def test_decision_invariants():
    rng = random.Random(7)
    for _ in range(500):
        k = rng.randint(1, 6)
        row = [rng.randint(0, 7) for _ in range(k)]
        zeta, t = rng.randint(0, 40), rng.randint(0, 40)
        zeta = max(zeta, t)
        s, p = rng.randint(0, 10), rng.randint(0, k)
        d = decide(zeta=zeta, t=t, row=row, mask=7, s=s, p=p)
        assert d.staleness == calc_staleness(zeta, t) >= 0
        # monotone: a larger s or a smaller p never turns "go on" into overtime
        if d.branch is not Branch.OVERTIME:
            assert decide(zeta=zeta, t=t, row=row, mask=7, s=s + 1, p=p).branch is not Branch.OVERTIME
            assert decide(zeta=zeta, t=t, row=row, mask=7, s=s, p=max(0, p - 1)).branch is not Branch.OVERTIME
        # p = 0 or s = inf: never overtime; the fastest (t = ζ) never overtime
        assert decide(zeta=zeta, t=t, row=row, mask=7, s=s, p=0).branch is not Branch.OVERTIME
        assert decide(zeta=zeta, t=t, row=row, mask=7, s=math.inf, p=k).branch is Branch.APPLY
        assert decide(zeta=t, t=t, row=row, mask=7, s=0, p=k).branch is Branch.APPLY


def test_matrix_zeta_and_forgetting():
    q = GEIMatrix(2)
    q.row(3)
    q.see(9)
    q.record(4, 0, 1)
    assert q.zeta == 9 and set(q.rows) == {3, 4}
    q.forget_before(4)
    assert set(q.rows) == {4}
    with pytest.raises(ValueError):
        q.record(4, 2, 1)


def test_zeta_and_the_fastest_worker_from_headers():
    """ζ = max(own, every header's iteration and relayed ζ); the node at ζ is the lowest id of
    those seen there (spec §5.4), so neither depends on the order headers arrive in (the
    shuffled rounds: test_canary_arrivals)."""
    q = GEIMatrix(2, me=3)
    q.see(4)
    assert (q.zeta, q.zeta_node) == (4, 3)
    q.heard(origin=5, it=4, zeta=6, zeta_node=2)  # node 5 relays: node 2 reached 6
    assert (q.zeta, q.zeta_node) == (6, 2)
    q.heard(origin=1, it=6, zeta=6, zeta_node=1)  # a tie at ζ
    assert (q.zeta, q.zeta_node) == (6, 1)
    q.heard(origin=0, it=5, zeta=6, zeta_node=2)
    q.see(6)
    assert (q.zeta, q.zeta_node) == (6, 1) and not q.rows  # headers set no GEI bit


def test_paper_configuration_is_valid():
    validate(s=18, p=6, colayers=10)  # C19
    for bad in ({"s": -1, "p": 1, "colayers": 2}, {"s": 1, "p": 3, "colayers": 2}):
        with pytest.raises(ValueError):
            validate(**bad)


def _vgg19() -> list[Layer]:
    """VGG-19: 16 CONV and 3 FC layers (input to output)."""
    layers, off = [], 0
    for i in range(19):
        kind = "conv" if i < 16 else "fc"
        n = 1000 if kind == "conv" else 1300
        layers.append(Layer(f"l{i}", kind, off, n, (i,)))
        off += n
    return layers


def test_vgg19_colayers_of_the_paper():
    """C12: c^[0] = FC3..FC1 (3), c^[1..2] = 4 CONV each, c^[3] = 8 CONV: 19 layers."""
    cols = group(_vgg19(), layers_per_colayer=parse_counts("3,4,4,8"))
    assert [len(c.layers) for c in cols] == [3, 4, 4, 8]
    assert [layer.name for layer in cols[0].layers] == ["l18", "l17", "l16"]  # backprop order
    assert cols[0].hi == 19_900 and cols[3].lo == 0  # contiguous ranges, output layers first
    for a, b in zip(cols, cols[1:]):
        assert b.hi == a.lo
    auto = group(_vgg19(), max_bytes=4 * 4000)
    assert len(auto[0].layers) == 3 and all(layer.kind == "conv" for c in auto[1:] for layer in c.layers)
    assert [len(c.layers) for c in auto[1:]] == [4, 4, 4, 4]  # 4 x 1000 floats = the cap


@pytest.mark.parametrize("count", [1, 2, 3, 7, 19])
def test_a_number_of_colayers_of_nearly_equal_size(count):
    cols = group(_vgg19(), count=count)
    assert len(cols) == count and sum(len(c.layers) for c in cols) == 19
    assert all(c.layers for c in cols)


def test_bad_groupings_are_clear_errors():
    with pytest.raises(ConfigError, match="adding up"):
        group(_vgg19(), layers_per_colayer=(3, 4))
    with pytest.raises(ConfigError, match="between 1"):
        group(_vgg19(), count=20)
    with pytest.raises(ConfigError, match="comma"):
        parse_counts("3;4")

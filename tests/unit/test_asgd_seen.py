"""ASGD's record of the gradients a node took (p2psync/strategies/asgd.py ``SeenGradients``):
each ``(origin, incarnation, step)`` is new once, then a duplicate; memory stays bounded."""

from __future__ import annotations

import random

import pytest

from p2psync.strategies.asgd import DUPLICATE, NEW, TOO_OLD, SeenGradients


def test_a_gradient_is_new_once_then_a_duplicate() -> None:
    seen = SeenGradients(window=8)
    assert seen.take(4, 1, 120) == NEW
    assert seen.take(4, 1, 120) == DUPLICATE
    assert seen.take(4, 1, 121) == NEW
    assert seen.take(5, 1, 120) == NEW  # another origin counts apart
    assert seen.take(4, 1, 121) == DUPLICATE and seen.take(5, 1, 120) == DUPLICATE


def test_check_records_nothing_and_add_records() -> None:
    seen = SeenGradients(window=8)
    assert seen.check(0, 1, 3) == NEW and seen.check(0, 1, 3) == NEW
    seen.add(0, 1, 3)
    assert seen.check(0, 1, 3) == DUPLICATE


def test_late_and_reordered_gradients_within_the_window_are_taken_once() -> None:
    seen = SeenGradients(window=16)
    steps = list(range(100, 116))
    random.Random(3).shuffle(steps)
    assert [seen.take(2, 1, s) for s in steps] == [NEW] * 16
    assert [seen.take(2, 1, s) for s in steps] == [DUPLICATE] * 16
    assert seen.take(2, 1, 99) == TOO_OLD  # 16 behind the newest: no longer told apart


def test_gaps_never_taken_stay_new_until_they_fall_out_of_the_window() -> None:
    seen = SeenGradients(window=8)
    for s in (10, 12, 14):
        seen.add(7, 1, s)
    assert seen.take(7, 1, 11) == NEW and seen.take(7, 1, 13) == NEW
    seen.add(7, 1, 20)  # top 20: 13..20 remembered
    assert seen.check(7, 1, 13) == DUPLICATE
    assert seen.check(7, 1, 15) == NEW
    assert seen.check(7, 1, 12) == TOO_OLD


def test_a_restarted_origin_is_counted_apart_from_its_old_process() -> None:
    """A new process of node 3 may take a step its old process already sent (it adopts a
    neighbour's step, which may be behind): its gradients are new, not copies."""
    seen = SeenGradients(window=8)
    for s in range(40, 50):
        seen.add(3, 1, s)
    assert seen.take(3, 2, 45) == NEW
    assert seen.take(3, 2, 45) == DUPLICATE
    assert seen.take(3, 1, 49) == DUPLICATE  # the old process's copies still known
    assert seen.take(3, 1, 50) == NEW  # and a late one of it still taken once
    seen.add(3, 3, 60)  # a third process: the oldest is forgotten
    assert seen.check(3, 1, 51) == TOO_OLD
    assert seen.check(3, 2, 46) == NEW and seen.check(3, 3, 61) == NEW


def test_an_incarnation_older_than_those_remembered_is_new_while_there_is_room() -> None:
    seen = SeenGradients(window=8, keep=2)
    seen.add(1, 5, 0)
    assert seen.take(1, 4, 0) == NEW  # room for two processes
    assert seen.check(1, 3, 0) == TOO_OLD  # older than both remembered


def test_memory_is_bounded_by_the_window_whatever_the_steps() -> None:
    seen = SeenGradients(window=64, keep=2)
    for s in range(0, 100_000, 3):
        seen.add(0, 1, s)
    w = seen._seen[0][1]
    assert w.top == 99_999 and w.mask.bit_length() <= 64
    seen.add(0, 1, 10**9)  # a far jump
    assert seen._seen[0][1].mask == 1
    assert seen.check(0, 1, 99_999) == TOO_OLD


def test_window_and_keep_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SeenGradients(window=0)
    with pytest.raises(ValueError):
        SeenGradients(keep=0)


def test_the_spanning_trees_kept_are_those_of_the_current_live_set() -> None:
    """ASGD (and diloco-async) flood each message down its origin's spanning tree over the live nodes. The trees
    were kept per (origin, live set) for the whole run: one more set of them for every view."""
    from types import SimpleNamespace

    from p2psync.strategies.flood import Flood
    from p2psync.topology import ring

    a = Flood.__new__(Flood)
    a.ctx = SimpleNamespace(topology=ring(8), node_id=0)  # type: ignore[assignment]
    a._trees, a._trees_over = {}, frozenset()
    for k in range(50):  # 50 views, each without another node
        a.alive = set(range(8)) - {1 + k % 7}
        kids = {o: a.children(o) for o in a.alive}
        assert len(a._trees) == len(a.alive)
        assert kids[0] == sorted(set(a.ctx.topology.neighbors(0)) & a.alive)  # the root's children: its live links
    a.alive = set(range(8))
    assert a.children(4) == [] and set(a._trees) == {4}  # node 0 is a leaf of 4's tree on a full ring

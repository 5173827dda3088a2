"""Membership decision logic (pure state): registration, fingerprints, failure detection, finish."""

from __future__ import annotations

import pytest

from p2psync.coordinator import MembershipState
from p2psync.errors import ConfigError


def test_membership_state_register_and_fingerprints():
    st = MembershipState(expected=frozenset({0, 1, 2}), failure_timeout=2.0)
    st.register(0, "abc", now=0.0)
    assert st.missing == [1, 2] and not st.complete
    with pytest.raises(ConfigError, match="different configuration"):
        st.register(1, "xyz", now=0.1)
    with pytest.raises(ConfigError, match="not in the topology"):
        st.register(7, "abc", now=0.1)
    st.register(1, "abc", now=0.1)
    st.register(2, "abc", now=0.1)
    assert st.complete


def test_membership_state_failure_detection_and_finish():
    st = MembershipState(expected=frozenset({0, 1, 2}), failure_timeout=2.0)
    for n in (0, 1, 2):
        st.register(n, "f", now=0.0)
    st.heartbeat(0, 1.9)
    st.heartbeat(1, 1.9)
    assert st.check(2.0) == []
    assert st.check(2.01) == [2]  # silent for more than 2 s
    # everyone silent now: 0 hosts the state, and 0 alone is no majority of [0, 1, 2]
    assert st.check(5.0) == [] and st.blocked == [1] and not st.has_quorum(5.0)
    st.heartbeat(1, 5.1)
    assert st.check(5.2) == [] and st.has_quorum(5.2)  # heard again: 2 is not reported twice
    st2 = MembershipState(expected=frozenset({0, 1, 2}), failure_timeout=1.0)
    for n in (0, 1, 2):
        st2.register(n, "f", 0.0)
    st2.finish(1, {"acc": 1}, depart=False)  # an agreed stop: finished, still a member
    assert st2.check(10.0) == [2]  # a finished node is never declared failed
    assert not st2.all_finished
    st2.finish(0, {"acc": 1})
    assert st2.all_finished  # finished or failed: the barrier can release


def test_redo_moves_the_epoch_once_when_every_named_peer_lives():
    """A member's operation failed waiting for live peers: one new epoch (same members) per
    failed epoch; never for an old epoch, a suspected peer, a non-member, or without a majority."""
    st = MembershipState(expected=frozenset({0, 1, 2}), failure_timeout=2.0)
    for n in (0, 1, 2):
        st.register(n, "f", now=0.0)
    st.heartbeat(1, 0.5)
    st.heartbeat(2, 0.5)
    e = st.epoch
    assert st.redo(1, e, [2], 1.0) and st.epoch == e + 1
    assert st.view().members == (0, 1, 2)
    assert not st.redo(2, e, [1], 1.0) and st.epoch == e + 1  # the same failed epoch: moved past
    assert not st.redo(7, e + 1, [1], 1.0)  # not a member
    st.heartbeat(1, 2.4)
    assert not st.redo(1, e + 1, [2], 2.6)  # 2 is suspected: the detector decides, not the report
    assert st.check(2.6) == [2] and st.epoch == e + 2
    assert not st.redo(1, e + 2, [0], 10.0)  # 1 silent meanwhile: no majority of the agreed view

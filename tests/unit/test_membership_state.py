"""Membership decision logic (pure state): registration, fingerprints, failure detection, finish."""

from __future__ import annotations

import pytest

from p2psync.coordinator import MembershipState
from p2psync.errors import ConfigError, RunEnded


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
    for t in (0.5, 1.0, 1.5, 1.9):  # 1 heard throughout: with 0, a majority (a member silent
        st.heartbeat(0, t)            # for more than two intervals is not heard lately)
        st.heartbeat(1, t)
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
    assert not st.redo(1, e + 1, [7], 1.0) and st.epoch == e + 1  # a peer that is no member
    for t in (1.0, 1.5, 2.0, 2.4):  # 1 heard throughout: with 0, a majority
        st.heartbeat(1, t)
    assert not st.redo(1, e + 1, [2], 2.6)  # 2 is suspected: the detector decides, not the report
    assert st.check(2.6) == [2] and st.epoch == e + 2
    assert not st.redo(1, e + 2, [0], 10.0)  # 1 silent meanwhile: no majority of the agreed view


def _five_heard_until_10() -> MembershipState:
    """Coordinator 0 of five members (failure timeout 2 s), every other member heard every
    half second up to 10.0."""
    st = MembershipState(expected=frozenset(range(5)), failure_timeout=2.0, heartbeat_interval=0.5)
    for n in range(5):
        st.register(n, "f", now=0.0)
    for i in range(1, 21):
        for n in (1, 2, 3, 4):
            st.heartbeat(n, 0.5 * i)
    return st


def test_silence_counts_against_a_member_only_while_the_coordinator_holds_a_majority():
    """A coordinator that lost the majority and hears it again declares a member failed only
    after a full detection window from then: while it had none, its members deposed it and
    followed a candidate, and they heartbeat it again only once it is re-elected above that
    candidate's term. A member heard within the window stays; one silent through it is failed."""
    st = _five_heard_until_10()
    # everyone silent from 10 s on: 0 alone is no majority of five, nobody is declared
    assert st.check(13.0) == [] and st.blocked == [1, 2, 3, 4] and not st.has_quorum(13.0)
    for t in (15.0, 15.5, 16.0, 16.5, 17.0, 17.5):  # 1 and 2 heard again: a majority with 0
        st.heartbeat(1, t)
        st.heartbeat(2, t)
        if t == 15.0:
            # 3 and 4 silent for 5 s, but only now does the coordinator hold the majority
            assert st.check(15.1) == [] and st.blocked == [] and st.has_quorum(15.1)
        if t == 16.5:
            assert st.check(16.6) == []  # within the window (the detection timeout, 2 s)
            st.heartbeat(3, 16.8)  # 3 follows this coordinator again (its re-election reached it)
    assert st.check(17.2) == [4] and st.alive_nodes == [0, 1, 2, 3] and st.spared == {}


def test_a_reelected_coordinator_spares_the_members_that_did_not_vote_for_it():
    """Re-elected in a new term, the coordinator declares a member that did not vote for it
    only after a full detection window from then: it followed another candidate (or could not
    answer) and heartbeats this coordinator only once it applies the new term's view. Its
    voters are judged as before."""
    st = _five_heard_until_10()
    for t in (10.5, 11.0, 11.5):
        for n in (1, 2):
            st.heartbeat(n, t)
    # 3 last heard at 10.0 (it follows a candidate since), 4 too (it died)
    st.reelected(2, st.epoch + 1, {0, 1, 2}, 11.6)
    assert st.term == 2 and st.view().term == 2
    for t in (12.0, 12.5, 13.0, 13.5):
        for n in (1, 2):
            st.heartbeat(n, t)
        assert st.check(t + 0.05) == []  # 3 and 4 silent for 2 s and more, but spared
    st.heartbeat(3, 13.4)  # 3 applied the new view and follows this coordinator
    assert st.check(13.7) == [4] and st.alive_nodes == [0, 1, 2, 3]


def test_a_majority_lost_and_regained_before_anyone_was_suspected_still_spares_the_far_side():
    """A split shorter than the failure timeout: the coordinator hears no majority through it,
    but suspects nobody (no silence is long enough yet), so nothing blocks. A member of the far
    side heard again a moment after the others (a longer path back) is not declared failed:
    its silence counts only from when the majority was heard again. One silent with a majority
    heard throughout is declared as before."""
    st = _five_heard_until_10()
    # 1, 2 and 3 cut off from 10.0 to 11.7: the coordinator hears only 4 (no majority of five)
    for t in (10.5, 11.0, 11.5):
        st.heartbeat(4, t)
        assert st.check(t + 0.05) == [] and st.blocked == []
    for t in (11.7, 12.2):
        st.heartbeat(1, t)
        st.heartbeat(2, t)
        st.heartbeat(4, t)
    assert st.check(12.25) == [] and 3 in st.spared  # 3 silent 2.25 s, but the majority is back since 11.7
    st.heartbeat(3, 12.3)
    assert st.check(12.35) == [] and st.alive_nodes == [0, 1, 2, 3, 4]
    # 4 dies; the majority 0-3 is heard throughout: declared after the usual silence
    for t in (12.7, 13.2, 13.7, 14.2, 14.7):
        for n in (1, 2, 3):
            st.heartbeat(n, t)
    assert st.check(14.75) == [4]


def test_majority_regained_is_when_enough_of_the_far_side_was_heard_again():
    from p2psync.coordinator.membership_state import majority_regained
    from p2psync.coordinator.quorum import holds_majority

    def quorum(heard: object) -> bool:
        return holds_majority(set(heard) | {0}, set(range(5)))  # type: ignore[call-overload]

    out = {0: None, 1: (10.0, 11.7), 2: (10.0, 11.8), 4: None}
    assert majority_regained(10.0, out, quorum) == 11.7  # 0 and 4 throughout, 1 back at 11.7: three of five
    assert majority_regained(12.0, out, quorum) is None  # the outages ended before that silence began
    assert majority_regained(10.0, {0: None, 1: None, 2: (10.0, 11.8), 4: None}, quorum) is None  # heard throughout
    assert majority_regained(10.0, {0: None, 1: (10.0, 11.7)}, quorum) is None  # no majority even now


def _run_of_four_with_node_3_rejoining() -> MembershipState:
    """Nodes 0-3 registered; 3 failed and its new process registered again (a join)."""
    st = MembershipState(expected=frozenset({0, 1, 2, 3}), failure_timeout=2.0, heartbeat_interval=0.5)
    for n in range(4):
        st.register(n, "f", 0.0, incarnation=1)
    st.started = True
    st.failed.add(3)
    assert st.register(3, "f", 5.0, incarnation=2)  # a join
    return st


def test_once_the_members_stopped_no_failed_or_departed_node_rejoins():
    st = _run_of_four_with_node_3_rejoining()
    st.finish(1, {"node": 1}, depart=True)  # a loop that ended first: the run goes on
    st.finish(0, {"node": 0}, depart=False, now=7.0)  # node 0 stops; node 2 trains on (ASGD stops one by one)
    assert not st.stopping
    st.failed.add(3)
    assert st.register(3, "f", 7.5, incarnation=3)  # admitted: a member still trains
    st.finish(2, {"node": 2}, depart=False, now=8.0)  # every member but the joiner 3 stopped
    assert st.stopping
    st.failed.add(3)
    with pytest.raises(RunEnded, match="run is ending"):
        st.register(3, "f", 8.5, incarnation=4)
    with pytest.raises(RunEnded, match="run is ending"):  # a departed node's new process too
        st.register(1, "f", 8.5, incarnation=2)
    assert st.register(0, "f", 8.5, incarnation=1) is False  # the same process again: answered


def test_the_finish_barrier_departs_a_joiner_still_joining_once_every_other_node_is_done():
    st = _run_of_four_with_node_3_rejoining()
    assert st.joining == {3}
    grace = st.failure_timeout + 2 * st.heartbeat_interval
    st.finish(0, None, depart=False, now=10.0)
    st.finish(1, None, depart=False, now=10.1)
    assert st.end_joiners(20.0, grace) == []  # node 2 has not finished: the run waits for it
    st.finish(2, None, depart=False, now=10.2)
    st.heartbeat(3, 10.5, joining=True)  # still joining after the last finish
    assert st.end_joiners(10.2 + grace - 0.01, grace) == []  # a joiner that joined says so first
    epoch = st.epoch
    assert st.end_joiners(10.2 + grace, grace) == [3] and st.all_finished and st.ended == {3}
    assert st.view().departed == (3,) and 3 not in st.view().members and st.epoch == epoch + 1
    assert st.end_joiners(30.0, grace) == []  # once
    assert 3 not in st.check(60.0)  # the detector forgot it: never declared failed after


def test_a_joiner_is_departed_only_on_a_joining_heartbeat_heard_after_the_last_finish():
    st = _run_of_four_with_node_3_rejoining()
    for n in range(3):
        st.finish(n, None, depart=False, now=10.0)
    assert st.end_joiners(20.0, 3.0) == []  # its last word (registration, 5 s) is older: wait
    st.heartbeat(3, 20.5, joining=True)
    assert st.end_joiners(21.0, 3.0) == [3]


def test_a_joiner_whose_strategy_joined_the_training_is_waited_for():
    st = _run_of_four_with_node_3_rejoining()
    st.heartbeat(3, 6.0, joining=True)
    assert st.joining == {3}
    st.heartbeat(3, 6.5)  # its strategy started: it takes part in the stop
    st.heartbeat(3, 6.6, joining=True)  # a late copy of an older heartbeat changes nothing
    assert st.joining == set()
    for n in range(3):
        st.finish(n, None, depart=False, now=10.0)
    assert st.end_joiners(60.0, 3.0) == [] and not st.all_finished
    st.finish(3, None, depart=False, now=61.0)
    assert st.all_finished


def test_the_coordinator_itself_is_never_ended_as_a_joiner():
    st = _run_of_four_with_node_3_rejoining()
    st.coordinator = 3  # (it rejoined, then won a takeover)
    for n in range(3):
        st.finish(n, None, depart=False, now=10.0)
    st.heartbeat(3, 10.5, joining=True)
    assert st.end_joiners(20.0, 3.0) == []

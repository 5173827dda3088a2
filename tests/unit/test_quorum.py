"""Majority quorum, terms and votes (coordinator/quorum.py), pure: a table of scenarios, with
the message orders that used to split the run (a paused member, a frozen coordinator, a 2|2 and
a 3|1 partition, late and reordered views and votes)."""

from __future__ import annotations

import random

import pytest

from p2psync.coordinator.quorum import (Agreement, Ballot, Candidacy, VoteRequest, holds_majority, majority,
                                        view_key)
from p2psync.coordinator.takeover import Succession
from p2psync.coordinator.views import View


def test_majority_sizes():
    assert [majority(n) for n in range(7)] == [1, 1, 2, 2, 3, 3, 4]
    assert holds_majority({0, 1}, {0, 1, 2}) and not holds_majority({0, 1}, {0, 1, 2, 3})
    assert holds_majority({0, 1, 2, 9}, {0, 1, 2, 3}) and not holds_majority({9, 8, 7}, {0, 1, 2})
    assert holds_majority(set(), set())  # every voter left the run (departed)


@pytest.mark.parametrize("alive, base, may", [
    ({0, 1, 2}, {0, 1, 2, 3}, True),      # 3|1 partition: the three go on
    ({0, 1}, {0, 1, 2, 3}, False),        # 2|2: neither half
    ({2, 3}, {0, 1, 2, 3}, False),
    ({0}, {0, 1}, False),                 # two nodes survive no failure
    ({1, 2}, {1, 2, 3}, True),            # after an agreed shrink, one more may go
    ({1, 2, 3}, {0, 1, 2, 3, 4}, True),
])
def test_a_coordinator_removes_nodes_only_keeping_a_majority_of_the_agreed_view(alive, base, may):
    a = Agreement(me=min(alive), members=frozenset(base), epoch=5)
    assert a.may_remove(alive) is may
    assert a.quorum(alive) is may


def test_the_agreed_view_moves_once_a_majority_of_it_applied_the_new_one():
    a = Agreement(me=0, members=frozenset({0, 1, 2, 3, 4}), epoch=5)
    a.publish(6, {0, 1, 2})  # 3 and 4 declared failed
    assert a.pending and a.members == {0, 1, 2, 3, 4}
    assert not a.acknowledge(1, 6)  # 0 and 1: two of five
    # an acknowledgement of an older epoch counts for nothing, and reordering does not matter
    assert not a.acknowledge(2, 5)
    assert a.acknowledge(2, 6) and a.members == {0, 1, 2} and a.epoch == 6 and not a.pending
    # now two of three suffice to remove one more
    assert a.may_remove({0, 1}) and not a.may_remove({0})


def test_a_change_before_the_last_is_agreed_is_counted_against_the_older_view():
    """The split Raft's commit rule prevents: view 6 (3 and 4 out) is published but node 2 pauses
    before applying it; 0 must not go on to {0, 1} (two of the agreed five)."""
    a = Agreement(me=0, members=frozenset({0, 1, 2, 3, 4}), epoch=5)
    a.publish(6, {0, 1, 2})
    a.acknowledge(1, 6)
    assert not a.may_remove({0, 1})  # 2 never acknowledged: {2, 3, 4} could still elect a coordinator


def test_departures_shrink_the_voters():
    a = Agreement(me=0, members=frozenset({0, 1, 2, 3}), epoch=1)
    a.depart(2)
    a.depart(3)
    assert a.members == {0, 1} and a.quorum({0, 1}) and not a.quorum({0})
    a.depart(1)
    assert a.quorum(set())  # the last one
    # a departure also leaves the view still pending: agreeing on it later does not bring it back
    b = Agreement(me=0, members=frozenset({0, 1, 2}), epoch=1)
    b.publish(2, {0, 2})  # 1 departed
    b.depart(2)
    b.acknowledge(1, 2)
    assert b.members == {0} and b.quorum(set())


def _req(candidate: int, term: int, view: tuple[int, int]) -> VoteRequest:
    return VoteRequest(candidate=candidate, term=term, view=view)


def test_one_vote_per_term_and_only_for_a_view_as_new_as_ours():
    b = Ballot(me=3)
    mine = view_key(0, 7)
    assert b.decide(_req(1, 1, (0, 7)), mine=mine, coordinating_with_quorum=False, hears_coordinator=None).granted
    assert b.promised == 1
    # the same candidate again (a retried request): granted again; another one: refused
    assert b.decide(_req(1, 1, (0, 7)), mine=mine, coordinating_with_quorum=False, hears_coordinator=None).granted
    no = b.decide(_req(2, 1, (0, 7)), mine=mine, coordinating_with_quorum=False, hears_coordinator=None)
    assert not no.granted and "voted for node 1" in no.reason and no.voted_term == 1
    # a candidate that missed view 7 cannot win our vote, whatever its term
    stale = b.decide(_req(2, 5, (0, 6)), mine=mine, coordinating_with_quorum=False, hears_coordinator=None)
    assert not stale.granted and "older" in stale.reason
    # a term at or below our view's term is no election
    assert not b.decide(_req(2, 0, (0, 7)), mine=mine, coordinating_with_quorum=False,
                        hears_coordinator=None).granted
    # a lower term than one we voted in: refused (requests reordered on the way)
    b.decide(_req(2, 4, (0, 7)), mine=mine, coordinating_with_quorum=False, hears_coordinator=None)
    assert b.promised == 4
    assert not b.decide(_req(1, 3, (0, 7)), mine=mine, coordinating_with_quorum=False,
                        hears_coordinator=None).granted


def test_a_node_that_hears_its_coordinator_or_coordinates_a_majority_votes_for_nobody():
    """A node woken from a pause asks for votes: the healthy majority ignores it."""
    mine = (2, 9)
    b = Ballot(me=1)
    no = b.decide(_req(3, 3, (2, 9)), mine=mine, coordinating_with_quorum=False, hears_coordinator=0)
    assert not no.granted and "still hears" in no.reason and b.promised == -1
    assert b.decide(_req(0, 3, (2, 9)), mine=mine, coordinating_with_quorum=False, hears_coordinator=0).granted
    c = Ballot(me=0)
    assert not c.decide(_req(2, 3, (2, 9)), mine=mine, coordinating_with_quorum=True,
                        hears_coordinator=None).granted


def test_at_most_one_winner_per_term_under_any_order_of_requests():
    """Three candidates of one term, five voters who would each grant any of them: in 500
    random orders of the requests, at most one candidate holds a majority."""
    rng = random.Random(7)
    voters = frozenset(range(5))
    pairs = [(v, c) for v in range(5) for c in (0, 2, 4)]
    for _ in range(500):
        rng.shuffle(pairs)
        ballots = {v: Ballot(me=v) for v in voters}
        cands = {c: Candidacy(me=c, term=1, voters=voters) for c in (0, 2, 4)}
        for v, c in pairs:
            cands[c].record(v, ballots[v].decide(_req(c, 1, (0, 3)), mine=(0, 3), coordinating_with_quorum=False,
                                                 hears_coordinator=None))
        assert sum(c.won for c in cands.values()) <= 1


def test_a_candidate_needs_a_majority_of_its_view_and_counts_only_voters():
    c = Candidacy(me=2, term=1, voters=frozenset({0, 1, 2, 3}))
    c.record(2, Ballot(me=2).decide(_req(2, 1, (0, 4)), mine=(0, 4), coordinating_with_quorum=False,
                                    hears_coordinator=None))
    c.record(3, Ballot(me=3).decide(_req(2, 1, (0, 4)), mine=(0, 4), coordinating_with_quorum=False,
                                    hears_coordinator=None))
    assert not c.won  # 2|2: two of four
    c.record(9, Ballot(me=9).decide(_req(2, 1, (0, 4)), mine=(0, 4), coordinating_with_quorum=False,
                                    hears_coordinator=None))
    assert not c.won  # not a voter of this view
    c.record(1, None)  # no answer
    assert not c.won and c.answered == {2, 3}
    c.record(0, Ballot(me=0).decide(_req(2, 1, (0, 4)), mine=(0, 4), coordinating_with_quorum=False,
                                    hears_coordinator=None))
    assert c.won  # healed: the old coordinator, without a majority itself, votes


def _view(term: int, epoch: int, members: tuple[int, ...], coord: int) -> View:
    return View(epoch=epoch, members=members, coordinator=coord, term=term)


def test_views_are_ordered_by_term_then_epoch_and_never_below_a_promised_term():
    s = Succession(me=3, coordinator=0)
    assert s.accepts(_view(0, 4, (0, 1, 2, 3), 0))
    s.adopt(_view(0, 4, (0, 1, 2, 3), 0))
    s.suspect(0, _view(0, 4, (0, 1, 2, 3), 0))
    # a late view of the deposed coordinator in the same term: ignored
    assert not s.accepts(_view(0, 6, (0, 1, 3), 0))
    # the elected successor's first view: a higher term, a lower epoch is impossible but the
    # term decides anyway
    assert s.accepts(_view(1, 5, (1, 2, 3), 1))
    # promised a higher term in a vote: an older term's view is refused
    assert not s.accepts(_view(1, 7, (1, 2, 3), 1), promised=2)
    s.adopt(_view(1, 5, (1, 2, 3), 1))
    assert s.coordinator == 1 and s.key == (1, 5)
    # the old coordinator re-elected in a newer term is followed again
    assert s.accepts(_view(2, 9, (0, 1, 2, 3), 0))
    s.adopt(_view(2, 9, (0, 1, 2, 3), 0))
    assert s.coordinator == 0 and 0 not in s.deposed
    assert View.from_wire(_view(2, 9, (0, 1), 0).to_wire()).key == (2, 9)


def test_a_candidate_asks_again_within_the_round_only_a_voter_that_may_still_grant():
    from p2psync.coordinator.failover import ask_again
    from p2psync.coordinator.quorum import VoteAnswer
    req = VoteRequest(candidate=1, term=3, view=(2, 18))
    # it still heard its coordinator: its own detector may suspect it a moment later
    hears = VoteAnswer(granted=False, reason="this node still hears its coordinator 0", view=(2, 18), voted_term=2)
    assert ask_again(hears, req, waiting=True)
    assert not ask_again(hears, req, waiting=False)  # the round's first requests all ended
    assert not ask_again(None, req, waiting=True)  # no answer: the next round asks it
    assert not ask_again(VoteAnswer(granted=True, reason="granted", view=(2, 18), voted_term=3), req, waiting=True)
    newer = VoteAnswer(granted=False, reason="older view", view=(3, 19), voted_term=3)
    assert not ask_again(newer, req, waiting=True)  # it follows a coordinator that won
    other = VoteAnswer(granted=False, reason="voted for node 2 in term 3", view=(2, 18), voted_term=3)
    assert not ask_again(other, req, waiting=True)  # it never grants this term
    # the voter's ballot agrees: refused while it hears its coordinator, granted once it does not
    b = Ballot(me=4)
    assert not b.decide(req, mine=(2, 18), coordinating_with_quorum=False, hears_coordinator=0).granted
    assert b.decide(req, mine=(2, 18), coordinating_with_quorum=False, hears_coordinator=None).granted

"""A node's votes outlive its process (p2psync/coordinator/votes.py): a restarted process never
grants a second vote in a term its earlier process voted in, and a vote that cannot be kept is
not granted."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

import pytest

from p2psync.coordinator.quorum import Ballot, VoteRequest
from p2psync.coordinator.votes import KEPT_TERMS, VOTES_FILE, FileVotes, MemoryVotes

MINE = (0, 5)  # the voter's last view: term 0, epoch 5


def _ask(b: Ballot, candidate: int, term: int) -> bool:
    return b.decide(VoteRequest(candidate=candidate, term=term, view=MINE), mine=MINE,
                    coordinating_with_quorum=False, hears_coordinator=None).granted


def test_a_restarted_process_does_not_vote_twice_in_a_term_its_earlier_process_voted_in() -> None:
    disk = MemoryVotes()
    first = Ballot(me=3, voted=disk.load(), keep=disk.keep)
    assert _ask(first, 1, term=1)
    assert disk.votes == {1: 1}
    # without the kept votes, a fresh ballot grants node 2 the same term: two majorities possible
    assert _ask(Ballot(me=3), 2, term=1)
    second = Ballot(me=3, voted=disk.load(), keep=disk.keep)
    assert not _ask(second, 2, term=1)
    assert _ask(second, 1, term=1)  # the same candidate again: granted, as before
    assert _ask(second, 2, term=2) and disk.votes == {1: 1, 2: 2}
    own = Ballot(me=3, voted=disk.load(), keep=disk.keep)
    assert _ask(own, 3, term=4) and disk.votes[4] == 3  # its own vote is kept too


def test_a_vote_that_cannot_be_kept_is_not_granted() -> None:
    def full(_: Mapping[int, int]) -> None:
        raise OSError(28, "No space left on device")

    b = Ballot(me=3, keep=full)
    ans = b.decide(VoteRequest(candidate=1, term=1, view=MINE), mine=MINE, coordinating_with_quorum=False,
                   hears_coordinator=None)
    assert not ans.granted and "kept" in ans.reason and b.voted == {}
    assert not _ask(b, 3, term=1) and b.voted == {}


def test_the_file_keeps_the_newest_terms_and_reads_what_a_process_wrote(tmp_path: Path) -> None:
    store = FileVotes(tmp_path / "node-3")
    assert store.load() == {}  # no earlier process
    b = Ballot(me=3, voted=store.load(), keep=store.keep)
    for t in range(1, KEPT_TERMS + 5):
        assert _ask(b, t % 4, term=t)
    again = FileVotes(tmp_path / "node-3").load()
    assert sorted(again) == list(range(5, KEPT_TERMS + 5)) and again[KEPT_TERMS + 4] == (KEPT_TERMS + 4) % 4
    (tmp_path / "node-3" / VOTES_FILE).write_text("{not json")
    assert FileVotes(tmp_path / "node-3").load() == {}  # unreadable: said, counted as none


def _ask_view(b: Ballot, candidate: int, term: int, view: tuple[int, int], mine: tuple[int, int]) -> bool:
    return b.decide(VoteRequest(candidate=candidate, term=term, view=view), mine=mine,
                    coordinating_with_quorum=False, hears_coordinator=None).granted


def test_a_restarted_process_refuses_a_candidate_that_missed_the_view_its_earlier_process_applied() -> None:
    # a view (0, 7) was agreed by a bare majority, this node among them; it restarts, and a
    # candidate that missed that view asks the new process before it has applied any view
    disk = MemoryVotes()
    first = Ballot(me=3, voted=disk.load(), keep=disk.keep, keep_view=disk.keep_view)
    first.saw((0, 5))
    first.saw((0, 7))
    first.saw((0, 6))  # (an older one: nothing changes)
    assert disk.view == (0, 7) and first.seen == (0, 7)
    # without the key kept, the new process grants it: the agreed view's majority no longer holds it
    assert _ask_view(Ballot(me=3), 1, term=1, view=(0, 5), mine=(0, -1))
    second = Ballot(me=3, voted=disk.load(), keep=disk.keep, seen=disk.load_view() or (0, -1),
                    keep_view=disk.keep_view)
    ans = second.decide(VoteRequest(candidate=1, term=1, view=(0, 5)), mine=(0, -1),
                        coordinating_with_quorum=False, hears_coordinator=None)
    assert not ans.granted and ans.view == (0, 7) and "older" in ans.reason
    assert _ask_view(second, 2, term=1, view=(0, 7), mine=(0, -1))  # a candidate that has it: granted


def test_the_file_keeps_the_view_key_with_the_votes_and_reads_an_earlier_format(tmp_path: Path) -> None:
    store = FileVotes(tmp_path / "node-3")
    assert store.load_view() is None
    store.keep({1: 2})
    store.keep_view((1, 9))
    again = FileVotes(tmp_path / "node-3")
    assert again.load() == {1: 2} and again.load_view() == (1, 9)
    again.keep({1: 2, 2: 3})  # the votes keep the view key, and the other way round
    third = FileVotes(tmp_path / "node-3")
    assert third.load() == {1: 2, 2: 3} and third.load_view() == (1, 9)
    (tmp_path / "node-3" / VOTES_FILE).write_text('{"4": 1}')  # votes only, as written before
    old = FileVotes(tmp_path / "node-3")
    assert old.load() == {4: 1} and old.load_view() is None


def test_a_view_key_that_cannot_be_kept_is_said_once_and_the_view_counts(caplog: pytest.LogCaptureFixture) -> None:
    def full(_: tuple[int, int]) -> None:
        raise OSError(28, "No space left on device")

    b = Ballot(me=3, keep_view=full)
    with caplog.at_level(logging.WARNING, logger="p2psync.membership"):
        b.saw((0, 4))
        b.saw((0, 5))
    assert b.seen == (0, 5)
    assert sum("could not be kept" in r.getMessage() for r in caplog.records) == 1


def test_every_simulated_node_keeps_the_key_of_the_newest_view_it_applied() -> None:
    # the real membership client over the simulated medium: a kill, and the view that removes it
    from p2psync.sim.cluster import SimCluster, SimOptions
    from p2psync.sim.faults import parse_faults
    from p2psync.sim.loop import VirtualLoop, run
    from p2psync.topology import ring

    async def main() -> tuple[dict[int, tuple[int, int] | None], dict[int, tuple[int, int]]]:
        topo = ring(6)
        async with SimCluster(topo, faults=parse_faults("kill:4@3", topo.ids), opts=SimOptions()) as c:
            await c.run(10.0)
            kept = {n: c.hub.votes[n].load_view() for n in topo.ids}
            applied = {n: node.membership.view.key for n, node in c.nodes.items()
                       if node.membership.view is not None}
            return kept, applied

    kept, applied = run(main(), loop=VirtualLoop())
    assert len(applied) == 6 and all(kept[n] == key for n, key in applied.items())
    survivors = {kept[n] for n in applied if n != 4}
    assert len(survivors) == 1 and survivors.pop() > kept[4]  # the view that removed node 4


def test_a_bad_view_key_in_the_file_leaves_the_votes_and_a_key_never_goes_back(tmp_path: Path) -> None:
    folder = tmp_path / "node-3"
    folder.mkdir()
    (folder / VOTES_FILE).write_text('{"votes": {"2": 1}, "view": ["x"]}')
    store = FileVotes(folder)
    assert store.load() == {2: 1} and store.load_view() is None  # the votes still refuse a second one
    (folder / VOTES_FILE).write_text('{"votes": {"2": 1}, "view": null}')
    assert FileVotes(folder).load() == {2: 1} and FileVotes(folder).load_view() is None
    store = FileVotes(folder)
    store.keep_view((1, 4))
    store.keep_view((0, 9))  # (an older key: the newer one stays)
    assert FileVotes(folder).load_view() == (1, 4)


def test_the_coordinator_keeps_a_views_key_before_it_counts_itself_as_having_applied_it() -> None:
    from p2psync.coordinator.membership_state import MembershipState

    st = MembershipState(expected=frozenset({0, 1, 2}), coordinator=0)
    for n in (0, 1, 2):
        st.register(n, "fp", 0.0)
    seen: list[tuple[tuple[int, int], int]] = []
    assert st.agreement is not None
    agreement = st.agreement
    st.on_publish = lambda key: seen.append((key, agreement.acked.get(0, -1)))
    st.failed.add(2)
    st.epoch += 1
    view = st.view()
    assert seen == [(view.key, -1)] and agreement.acked[0] == view.epoch  # kept first, counted after
    st.view()
    assert len(seen) == 1  # published once

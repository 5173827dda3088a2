"""A node's votes outlive its process (p2psync/coordinator/votes.py): a restarted process never
grants a second vote in a term its earlier process voted in, and a vote that cannot be kept is
not granted."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

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

"""diloco-async's sequencer: numbers per view epoch from 0, a retried request keeps its number,
an older epoch or another coordinator's view is stale (a node that takes over never numbers its
predecessor's stream a second time)."""

from p2psync.coordinator.sequencer import Sequencer


def test_numbers_per_epoch_retries_and_stale_views() -> None:
    s = Sequencer(node=0)
    assert [s.number(1, 5, 1, 0), s.number(2, 5, 1, 0), s.number(1, 5, 2, 0)] == [0, 1, 2]
    assert s.number(1, 5, 2, 0) == 2  # the same request again (a lost reply): the same number
    assert s.number(3, 6, 1, 0) == 0  # a new epoch starts again at 0
    assert s.number(1, 5, 3, 0) is None  # an older epoch: stale
    assert s.number(1, 6, 4, 7) is None  # a view another coordinator published: stale
    assert s.number(1, 6, 4, None) == 1  # (no coordinator named: the stop policy's fixed view)


def test_a_fresh_sequencer_after_a_takeover_refuses_the_old_coordinators_view() -> None:
    old, new = Sequencer(node=0), Sequencer(node=1)
    assert old.number(2, 4, 1, 0) == 0
    assert new.number(3, 4, 1, 0) is None  # epoch 4 belonged to node 0: never numbered twice
    assert new.number(3, 5, 2, 1) == 0

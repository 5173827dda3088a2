"""The launcher's decision for a node whose process ended (``cli.launch.on_node_end``, pure):
restart a fenced node, leave it out once the run is over, count other failures."""

from __future__ import annotations

from p2psync.cli.exit_codes import EXIT_FENCED
from p2psync.cli.launch import NodeEnd, on_node_end


def end(code: int, fenced: str | None = None, *, over: bool = False, may_restart: bool = True,
        restarted: bool = False, wrote: bool = False) -> NodeEnd:
    return on_node_end(code, fenced, over=over, may_restart=may_restart, restarted=restarted,
                       wrote_since_restart=wrote)


def test_a_fenced_node_is_started_again_while_the_run_goes_on_and_restarts_are_left() -> None:
    assert end(EXIT_FENCED, "fenced") == NodeEnd(restart=True)
    assert end(EXIT_FENCED, "fenced", may_restart=False) == NodeEnd(failure=True)  # --on-failure stop, or none left


def test_a_fenced_node_is_left_out_once_the_run_is_over() -> None:
    got = end(EXIT_FENCED, "paused 15 s", over=True)
    assert not got.restart and not got.failure and got.left_out is not None and "paused 15 s" in got.left_out


def test_a_new_life_that_found_the_run_over_without_a_record_is_left_out_not_failed() -> None:
    got = end(1, over=True, restarted=True, wrote=False)
    assert got.left_out is not None and "new process found the run over" in got.left_out and not got.failure
    assert end(1, over=True, restarted=True, wrote=True) == NodeEnd(failure=True)  # it trained, then failed
    assert end(1, over=True, restarted=False) == NodeEnd(failure=True)


def test_a_clean_exit_is_nothing_and_any_other_is_a_failure() -> None:
    assert end(0, over=True) == NodeEnd()
    assert end(0) == NodeEnd()
    assert end(1) == NodeEnd(failure=True)
    assert end(-9, over=True) == NodeEnd(failure=True)


def test_a_node_that_came_back_as_the_run_ended_is_left_out_whatever_its_exit_status() -> None:
    # its session left the reason (RunEnded): the built-in job exits 0, a script may raise
    for code in (0, 1, EXIT_FENCED):
        got = on_node_end(code, None, over=False, may_restart=True, restarted=True, wrote_since_restart=False,
                          ended="node 3 left the run as it ended")
        assert got.left_out is not None and "came back as the run ended" in got.left_out
        assert not got.restart and not got.failure

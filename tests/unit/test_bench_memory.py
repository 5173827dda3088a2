"""bench.memory's arithmetic: a node's excess over the script alone, in flat model copies."""

from __future__ import annotations

from bench.memory import MiB, row, script_argv


def test_a_row_gives_the_largest_nodes_excess_in_flat_copies() -> None:
    nodes = {"0": {"peak_rss_bytes": 500 * MiB, "model_bytes": 40 * MiB},
             "1": {"peak_rss_bytes": 580 * MiB, "model_bytes": 40 * MiB}}
    assert row("ssgd", nodes, 460 * MiB) == ["ssgd", "580 (500-580)", "+120", "+3.0", "40.0"]


def test_a_run_that_failed_is_a_row_with_its_reason() -> None:
    assert row("dts", "failed: needs plain SGD", 1) == ["dts", "failed: needs plain SGD", "", "", ""]


def test_the_script_gets_the_models_shape() -> None:
    argv = script_argv("lm-small", 6)
    assert argv[argv.index("--width") + 1] == "320" and argv[argv.index("--context") + 1] == "256"
    assert argv[argv.index("--batch-size") + 1] == "8"

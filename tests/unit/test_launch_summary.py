"""The launcher's end-of-run table names what its columns count (ESync's steps are rounds); its
reading of a fenced node's marker."""

from __future__ import annotations

import json

import pytest

from p2psync.cli.launch import _Tail, print_summary
from p2psync.strategies import REGISTRY, get_strategy


def _table(tmp_path, capsys, monkeypatch, unit: str) -> str:
    monkeypatch.setenv("COLUMNS", "200")
    nodes = {str(i): {"steps": 3, "local_steps": 17 + i, "final_accuracy": 0.5, "wall_s": 2.0,
                      "samples_per_s": 10.0, "bytes_sent": 10**6} for i in range(2)}
    (tmp_path / "summary.json").write_text(json.dumps({"nodes": nodes}))
    print_summary(tmp_path, {i: _Tail(tmp_path / f"node-{i}.jsonl") for i in range(2)}, 2.0, unit)
    return capsys.readouterr().out


def test_esync_counts_rounds_and_shows_the_local_steps(tmp_path, capsys, monkeypatch):
    assert get_strategy("esync").step_unit == "round"
    out = _table(tmp_path, capsys, monkeypatch, get_strategy("esync").step_unit)
    assert "rounds" in out and "local steps" in out and " steps " not in out.replace("local steps", ""), out
    assert "17" in out and "18" in out


@pytest.mark.parametrize("name", sorted(set(REGISTRY) - {"esync"}))
def test_other_strategies_count_local_steps(name, tmp_path, capsys, monkeypatch):
    assert get_strategy(name).step_unit == "step"
    out = _table(tmp_path, capsys, monkeypatch, "step")
    assert "steps" in out and "rounds" not in out and "local steps" not in out, out


def test_the_launcher_reads_a_fence_marker_only_once_the_node_ended(tmp_path):
    """Regression: the launcher polled (and removed) a running node's marker, so the reason was
    gone when the node exited 75 ('removed from the run (fenced)'), and a fenced node that
    exited otherwise was not started again."""
    from p2psync.cli.exit_codes import EXIT_FENCED
    from p2psync.cli.launch import _fenced, fenced_marker

    fenced_marker(tmp_path, 3).write_text("node 3 was removed from the run: view 6 (term 2) ...\n")
    assert _fenced(tmp_path, 3, None) is None and fenced_marker(tmp_path, 3).exists()
    assert _fenced(tmp_path, 3, EXIT_FENCED) == "node 3 was removed from the run: view 6 (term 2) ..."
    assert not fenced_marker(tmp_path, 3).exists()
    assert _fenced(tmp_path, 3, EXIT_FENCED) == "fenced"  # no marker: the exit status says it
    fenced_marker(tmp_path, 1).write_text("why\n")
    assert _fenced(tmp_path, 1, 1) == "why"  # fenced, then failed otherwise: still restarted
    assert _fenced(tmp_path, 2, 1) is None and _fenced(tmp_path, 2, 0) is None

"""The launcher's end-of-run table names what its columns count (ESync's steps are rounds)."""

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

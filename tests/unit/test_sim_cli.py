"""``p2psync sim`` (p2psync/cli/sim_cmd.py) through the CLI's entry point."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from p2psync.cli.main import main
from p2psync.errors import ConfigError
from p2psync.cli.sim_cmd import topology_arg


def test_sim_writes_a_summary_and_its_replay_runs_the_same_events(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "mesh:12", "--faults", "kill:3@4,pause:5@6+5", "--virtual-seconds", "16",
               "--out", str(tmp_path / "a")])
    assert rc == 0
    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert s["nodes"] == 12 and s["virtual_s"] == 16 and s["wall_s"] > 0
    assert set(s["invariants"].values()) == {"held"}
    assert [d["fault"] for d in s["detections"]] == ["kill:3@4", "pause:5@6+5"]
    assert s["killed"] == [3] and list(s["fenced"]) == ["5"] and s["exited"] == []
    assert set(s["messages"]) == {str(i) for i in range(12)} and s["messages"]["0"]["recv"] > 0
    assert "every invariant held" in capsys.readouterr().out
    replay = shlex.split(s["replay"])
    assert replay[:2] == ["p2psync", "sim"]
    assert main([*replay[1:], "--out", str(tmp_path / "b")]) == 0
    again = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert again["digest"] == s["digest"] and again["declared"] == s["declared"]


def test_random_faults_come_from_the_seed(tmp_path: Path) -> None:
    for out in ("a", "b"):
        assert main(["sim", "mesh:6", "--faults", "random:2", "--seed", "3", "--virtual-seconds", "12",
                     "--out", str(tmp_path / out)]) in (0, 1)
    a, b = (json.loads((tmp_path / o / "summary.json").read_text()) for o in ("a", "b"))
    assert len(a["faults"]) == 2 and a["faults"] == b["faults"] and a["digest"] == b["digest"]


def test_bad_input_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "mesh:4", "--faults", "kill:9@1", "--out", str(tmp_path)]) == 2
    assert "not in the topology" in capsys.readouterr().err
    assert main(["sim", "nowhere.json", "--out", str(tmp_path)]) == 2
    assert main(["sim", "mesh:4", "--virtual-seconds", "0", "--out", str(tmp_path)]) == 2
    assert topology_arg("bcube:2x3").size == 8 and topology_arg("ring:5").kind == "ring"
    with pytest.raises(ConfigError):
        topology_arg("ring:x")


def test_chaos_runs_are_seeded_and_each_failing_run_is_printed_with_its_replay(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["sim", "mesh:8,ring:8", "--runs", "2", "--seed", "5", "--faults", "random:2", "--virtual-seconds", "20"]
    rc = main([*args, "--out", str(tmp_path / "a")])
    a = json.loads((tmp_path / "a" / "chaos.json").read_text())
    assert [(r["topology"], r["seed"]) for r in a] == [("mesh:8", 5), ("ring:8", 6)]
    assert rc == (1 if any(r["broken"] for r in a) else 0)
    out = capsys.readouterr()
    assert "| runs | topologies |" in out.out and (tmp_path / "a" / "chaos.md").read_text() in out.out
    assert main([*args, "--out", str(tmp_path / "b")]) == rc
    b = json.loads((tmp_path / "b" / "chaos.json").read_text())
    assert [r["digest"] for r in a] == [r["digest"] for r in b]  # same seeds: same events
    for r in a:  # each run's replay runs the same events
        assert main([*shlex.split(r["replay"])[1:], "--out", str(tmp_path / "c")]) == (1 if r["broken"] else 0)
        assert json.loads((tmp_path / "c" / "summary.json").read_text())["digest"] == r["digest"]
    assert main(["sim", "mesh:8", "--runs", "2", "--faults", "kill:1@2", "--out", str(tmp_path)]) == 2


def test_the_command_leaves_the_loggers_as_it_found_them(tmp_path) -> None:
    """Quiet while it runs (every simulated node would log each failure it sees), then the
    ``p2psync`` logger's level is what it was: other code in the process still logs."""
    import logging

    from p2psync.cli.main import main

    log = logging.getLogger("p2psync")
    before = log.level
    main(["sim", "ring:4", "--virtual-seconds", "2", "--out", str(tmp_path)])
    assert log.level == before

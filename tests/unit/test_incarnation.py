"""A node's incarnation grows with every process started as that node in a run folder, whatever
the wall clock does (a clock stepped back must not make a restarted node look like a message
of its previous life to its peers)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from p2psync.api.runtime import NodeRuntime
from p2psync.files import WriteFailures
from p2psync.topology import mesh, save
from p2psync.training.config import RunConfig
from p2psync.transport.incarnation import INCARNATION_FILE, next_incarnation
from tests.helpers import free_port

T0 = 1_700_000_000_000_000_000  # ns: a plausible wall clock


def test_a_clock_stepped_back_still_gives_a_larger_incarnation(tmp_path: Path) -> None:
    clock = iter([T0, T0 - 3_600 * 10**9, T0 - 7_200 * 10**9, T0 + 10])  # back one hour, two, then ahead
    folder = tmp_path / "run" / "node-3"
    got = [next_incarnation(folder, clock=lambda: next(clock)) for _ in range(4)]
    assert got == [T0, T0 + 1, T0 + 2, T0 + 10]
    assert (folder / INCARNATION_FILE).read_text().strip() == str(T0 + 10)


def test_without_a_folder_or_a_writable_one_the_clock_decides(tmp_path: Path, caplog) -> None:
    assert next_incarnation(None, clock=lambda: 42) == 42
    blocked = tmp_path / "file"
    blocked.write_text("")  # a folder below a regular file can never be created, even by root
    failures = WriteFailures("node 1")
    with caplog.at_level(logging.WARNING, "p2psync.files"):
        assert next_incarnation(blocked / "node-1", clock=lambda: 7, failures=failures) == 7
    assert failures.as_dict() == {"incarnation record": 1}
    assert f"cannot write the incarnation record {blocked / 'node-1' / INCARNATION_FILE}" in caplog.text
    assert "Not a directory (ENOTDIR)" in caplog.text


def test_a_malformed_record_is_said_and_the_clock_decides(tmp_path: Path, caplog) -> None:
    (tmp_path / INCARNATION_FILE).write_text("yesterday")
    with caplog.at_level(logging.WARNING, "p2psync.transport"):
        assert next_incarnation(tmp_path, clock=lambda: 5) == 5
    assert "does not hold an incarnation" in caplog.text
    assert next_incarnation(tmp_path, clock=lambda: 1) == 6


def test_a_restarted_node_with_its_clock_stepped_back_gets_a_newer_incarnation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime of a node restarted in the same run folder with its clock an hour behind
    still outranks its previous process (it used to take the clock's value: older, and every
    peer rejected it as stale_incarnation for the rest of the run)."""
    topo_path = tmp_path / "mesh2.json"
    topo = mesh(2, base_port=free_port())
    save(topo, topo_path)
    cfg = RunConfig(topology=str(topo_path), out=str(tmp_path), run_id="r", start_timeout=5, peer_timeout=5)
    incs = []
    for now in (T0, T0 - 3_600 * 10**9):
        monkeypatch.setattr(time, "time_ns", lambda now=now: now)
        rt = NodeRuntime(cfg=cfg, topo=topo, node_id=1)
        incs.append(rt.transport.incarnation)
        asyncio.run(rt.close())
    assert incs[0] == T0 and incs[1] > incs[0]
    assert (tmp_path / "r" / "node-1" / INCARNATION_FILE).read_text().strip() == str(incs[1])

"""The launcher's forked nodes (p2psync.cli.fork_nodes): the child runs ``p2psync ARGV`` into its
log with its exit code; ForkedNode answers poll/wait like subprocess.Popen; the launcher forks
only when the warm-up left it safe to (the whole runs: tests/e2e/test_cli_run.py)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest

from p2psync import __version__
from p2psync.cli import fork_nodes, launch
from p2psync.errors import ConfigError
from p2psync.training.config import RunConfig


def _fork(tmp_path, argv):
    log = tmp_path / "node.log"
    with log.open("wb") as f:
        node = fork_nodes.fork_node(argv, dict(os.environ), f.fileno(), [], "test-node")
    return node, log


def test_child_runs_p2psync_into_its_log_with_its_exit_code(tmp_path):
    node, log = _fork(tmp_path, ["--version"])
    assert node.wait(timeout=60) == 0 and node.poll() == 0 and node.returncode == 0
    assert log.read_text().strip() == f"p2psync {__version__}"
    node, log = _fork(tmp_path, ["run"])  # argparse's usage error: SystemExit(2)
    assert node.wait(timeout=60) == 2
    assert "the following arguments are required: topology" in log.read_text()


def _blocked_child():
    """A child of this process that exits 3 when the pipe's write end closes."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(w)
            os.read(r, 1)
        finally:
            os._exit(3)
    os.close(r)
    return fork_nodes.ForkedNode(pid, ["child"]), w


def test_forked_node_polls_and_waits_like_popen():
    node, w = _blocked_child()
    assert node.poll() is None and node.returncode is None
    with pytest.raises(subprocess.TimeoutExpired):
        node.wait(timeout=0.05)
    os.close(w)
    assert node.wait(timeout=60) == 3 and node.poll() == 3
    node, w = _blocked_child()
    os.kill(node.pid, signal.SIGTERM)
    assert node.wait() == -signal.SIGTERM
    os.close(w)


def test_warm_up_refuses_when_an_import_starts_a_thread(tmp_path, monkeypatch):
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading\nstop = threading.Event()\nthread = threading.Thread(target=stop.wait)\nthread.start()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(fork_nodes, "NODE_MODULES", ("starts_a_thread",))
    try:
        assert fork_nodes.warm_up() == "importing the nodes' modules started 1 thread(s)"
    finally:
        sys.modules["starts_a_thread"].stop.set()
        sys.modules["starts_a_thread"].thread.join()
    monkeypatch.setattr(fork_nodes, "NODE_MODULES", ("json",))
    assert fork_nodes.warm_up() is None


def test_launcher_forks_only_when_asked_and_safe(monkeypatch, caplog):
    cfg = RunConfig(topology="t.json")
    calls = []
    monkeypatch.setattr(launch, "warm_up", lambda: calls.append(1) or None)
    monkeypatch.delenv(fork_nodes.ENV_LAUNCH, raising=False)
    assert launch._forks(cfg) and calls == [1]
    monkeypatch.setenv(fork_nodes.ENV_LAUNCH, "exec")
    assert not launch._forks(cfg) and calls == [1]  # no warm-up either
    monkeypatch.setenv(fork_nodes.ENV_LAUNCH, "fork")
    assert not launch._forks(RunConfig(topology="t.json", shaper="netem"))  # `ip netns exec` each node
    monkeypatch.setenv(fork_nodes.ENV_LAUNCH, "spawn")
    with pytest.raises(ConfigError, match="P2PSYNC_LAUNCH=spawn"):
        launch._forks(cfg)
    monkeypatch.setenv(fork_nodes.ENV_LAUNCH, "fork")
    monkeypatch.setattr(launch, "warm_up", lambda: "something started a thread")
    with caplog.at_level(logging.WARNING, logger="p2psync.cli"):
        assert not launch._forks(cfg)
    assert "something started a thread: starting the nodes with exec" in caplog.text


def test_child_closes_the_descriptors_the_launcher_inherited_only():
    """As exec with close_fds would: an inheritable descriptor (given to the launcher by its
    parent) is closed in the child, Python's own non-inheritable ones are left to their objects."""
    r, own = os.pipe()
    inherited = os.dup(own)
    os.set_inheritable(inherited, True)
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            fork_nodes._close_inherited()
            code = 2 * _is_open(inherited) + _is_open(own)
        finally:
            os._exit(code)
    node = fork_nodes.ForkedNode(pid, ["child"])
    for fd in (r, own, inherited):
        os.close(fd)
    assert node.wait(timeout=60) == 1  # own open, inherited closed


def _is_open(fd):
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True

"""A warm parent for the e2e tests' node processes: ``p2psync run ... --node I`` forked the way
the launcher forks the built-in job's nodes (:func:`p2psync.cli.fork_nodes.fork_node`), from a
process that imported what every node imports once (:func:`~p2psync.cli.fork_nodes.warm_up`:
torch and torch._dynamo alone take 3-5 s of CPU per process on the 2-core machine).

Each forked node is a process of its own, as on a separate host: its own pid, signals, exit
status, ZeroMQ context and event loop; it runs :func:`p2psync.cli.main.main` with its own
argument list and environment, from the first line of the command on. What it does not do is
import the modules again.

Server (``python -m tests.e2e.zygote``): reads one JSON request per line on stdin (``argv``,
``env``, ``log``: the file that takes the node's stdout and stderr), answers ``{"pid": P}``, and
reports ``{"exit": P, "code": C}`` when a node ends (C as ``Popen.returncode`` gives it). It ends
when stdin closes; its nodes get SIGTERM then (``die_with_parent``).

Client (:func:`spawn_node`): one server per test process, started on first use; the handle it
returns (:class:`Node`) has what the tests use of ``subprocess.Popen``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def serve() -> None:
    import numpy  # noqa: F401  (its OpenBLAS pool, as in the launcher: see p2psync.cli.fork_nodes)

    from p2psync.cli.fork_nodes import fork_node, warm_up

    why = warm_up()
    out = sys.stdout
    out.write(json.dumps({"ready": why is None, "why": why}) + "\n")
    out.flush()
    if why is not None:
        return
    stdin = sys.stdin.fileno()
    children: dict[int, int] = {}  # pidfd -> pid: readable once the node has ended
    buf = b""
    while True:
        readable, _, _ = select.select([stdin, *children], [], [])
        for fd in readable:
            if fd == stdin:
                continue
            pid = children.pop(fd)
            os.close(fd)
            _, status = os.waitpid(pid, 0)
            out.write(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")
            out.flush()
        if stdin in readable:
            chunk = os.read(stdin, 1 << 16)
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    node = fork_node(req["argv"], req["env"], fd, [], req.get("name", "p2psync-node"))
                finally:
                    os.close(fd)
                children[os.pidfd_open(node.pid)] = node.pid
                out.write(json.dumps({"pid": node.pid}) + "\n")
                out.flush()


class _Server:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=ROOT, text=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        hello = json.loads(self.proc.stdout.readline() or '{"ready": false, "why": "it died"}')
        if not hello["ready"]:
            raise RuntimeError(f"the node zygote cannot fork: {hello['why']}")
        self.codes: dict[int, int] = {}
        self.pids: list[int] = []
        self.cond = threading.Condition()
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.cond:
                if "pid" in msg:
                    self.pids.append(msg["pid"])
                else:
                    self.codes[msg["exit"]] = msg["code"]
                self.cond.notify_all()
        with self.cond:  # the server is gone: so are its nodes (SIGTERM, die_with_parent)
            self.codes.setdefault(-1, -1)
            self.cond.notify_all()

    def fork(self, argv: list[str], env: dict[str, str], log: Path) -> int:
        assert self.proc.stdin is not None
        with self.lock, self.cond:
            n = len(self.pids)
            self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "log": str(log)}) + "\n")
            self.proc.stdin.flush()
            if not self.cond.wait_for(lambda: len(self.pids) > n or -1 in self.codes, 60):
                raise RuntimeError("the node zygote did not answer within 60 s")
            if len(self.pids) == n:
                raise RuntimeError("the node zygote died")
            return self.pids[n]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_server: _Server | None = None


def _get() -> _Server:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
        atexit.register(_server.close)
    return _server


class Node:
    """A forked node, with what the tests use of ``subprocess.Popen`` (text mode): ``pid``,
    ``returncode``, ``poll()``, ``wait(timeout)``, ``communicate(timeout)`` (stdout is empty:
    both streams go to the node's log, returned as stderr), ``send_signal``, ``kill``."""

    def __init__(self, server: _Server, pid: int, argv: list[str], log: Path) -> None:
        self._server = server
        self.pid = pid
        self.args = ["p2psync", *argv]
        self.log = log
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with self._server.cond:
                self.returncode = self._server.codes.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._server.cond:
            if not self._server.cond.wait_for(lambda: self.pid in self._server.codes or -1 in self._server.codes,
                                              timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.returncode = self._server.codes.get(self.pid, -signal.SIGTERM)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return "", self.log.read_text(errors="replace")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def spawn_node(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Node:
    """``p2psync ARGV`` (a ``run ... --node I`` of the built-in job) forked from the warm parent;
    its stdout and stderr appended to ``log``."""
    server = _get()
    full_env = {**os.environ, **(env or {})}
    pid = server.fork(argv, full_env, log)
    return Node(server, pid, argv, log)


if __name__ == "__main__":
    serve()

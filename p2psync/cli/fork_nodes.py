"""The built-in job's nodes forked from one warm launcher.

Why: every node process of ``p2psync run TOPOLOGY`` imports the same modules, torch and
torch._dynamo alone 2-3 s of CPU each (``torch.optim.Optimizer.__init__`` imports torch._dynamo),
and all nodes do it at once on a host's shared cores. So the launcher, once the run's
configuration is valid (a usage error stays fast and imports no torch), imports them once
(:func:`warm_up`) and forks one child per node (:func:`fork_node`). A child becomes exactly what
``python -m p2psync run TOPOLOGY --node I ...`` would be: the same argv (through
:func:`p2psync.cli.main.main`), environment, log file on stdout/stderr, stdin from /dev/null, a
process group of its own, the parent-death signal, default signal handlers and exit code; it
never returns into the launcher's code (``os._exit``).

Fork safety: the launcher runs no tensor op and creates no ZeroMQ context, event loop or thread
before forking. :func:`warm_up` checks that importing started no thread and left CUDA
uninitialized; if not, the launcher execs the nodes as before (and says why). The one thread
the launcher may already have, numpy's OpenBLAS pool (started when numpy is imported, for
validation), is stopped by OpenBLAS's own fork handler and restarted in each child on use.
Each node sets its torch threads and seeds torch and its data order itself
(:func:`p2psync.training.node.build_trainer`), as when exec'd; Python's ``random`` reseeds
itself at fork and the child reseeds numpy's global generator from the OS, like a fresh process.

``P2PSYNC_LAUNCH=exec`` in the launcher's environment execs every node as before (``fork``,
the default, forks the built-in job's nodes; users' commands and ``--shaper netem`` are exec'd).
"""

from __future__ import annotations

import ctypes
import fcntl
import importlib
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Iterable, NoReturn, Protocol, Sequence

#: ``exec``: start every node with fork + exec (the launcher imports no torch); ``fork``: fork the
#: built-in job's nodes from the warm launcher (the default)
ENV_LAUNCH = "P2PSYNC_LAUNCH"
LAUNCH_MODES = ("fork", "exec")

#: what a node of the built-in job imports beyond what validating its configuration did
#: (``python -X importtime``); importing them starts no thread
NODE_MODULES = ("torch", "torch._dynamo", "numpy.ma", "uvloop", "p2psync.cli.builtin_job",
                "p2psync.training.node", "p2psync.training.nets")

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15



class NodeProcess(Protocol):
    """What the launcher uses of a node's process (``subprocess.Popen`` has it)."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def die_with_parent() -> None:
    """This process gets SIGTERM when the process that started it ends (``PR_SET_PDEATHSIG``)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def threads() -> int:
    """This process's threads."""
    return len(os.listdir("/proc/self/task"))


def warm_up() -> str | None:
    """Import what every node imports (:data:`NODE_MODULES`); why forking is not safe now, or None."""
    before = threads()
    for name in NODE_MODULES:
        importlib.import_module(name)
    started = threads() - before
    if started > 0:
        return f"importing the nodes' modules started {started} thread(s)"
    import torch

    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return "CUDA is initialized in the launcher"
    return None


class ForkedNode:
    """A node forked from the launcher, with ``subprocess.Popen``'s ``pid``, ``returncode``,
    ``poll()`` and ``wait(timeout)`` (``subprocess.TimeoutExpired`` when it runs past it)."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._reap(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self.returncode is None:
                self._reap(0)
            return self.returncode
        deadline, delay = time.monotonic() + timeout, 0.0005
        while (code := self.poll()) is None:  # as Popen.wait(timeout) does
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            delay = min(delay * 2, remaining, 0.05)
            time.sleep(delay)
        return code

    def _reap(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped elsewhere: its status is lost (Popen says 0 too)
            self.returncode = 0
            return
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)


def fork_node(argv: Sequence[str], env: dict[str, str], log_fd: int, close_fds: Sequence[int],
              name: str) -> ForkedNode:
    """Fork the launcher into ``p2psync ARGV`` (:func:`p2psync.cli.main.main`) with environment
    ``env`` and stdout/stderr on ``log_fd``; ``close_fds``: the launcher's descriptors the child
    must not hold (other nodes' logs). ``name``: the child's name in ``ps -o comm``."""
    launcher = os.getpid()
    sys.stdout.flush()  # not written again by the child
    sys.stderr.flush()
    # a SIGINT/SIGTERM before the child has reset the launcher's handlers stays pending until then
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        pid = os.fork()
        if pid == 0:
            _child(list(argv), env, log_fd, close_fds, name, launcher, mask)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:  # here too: the launcher may signal the group before the child has run at all
        os.setpgid(pid, pid)
    except OSError:  # the child did it, or is gone already
        pass
    return ForkedNode(pid, ["p2psync", *argv])


def _child(argv: list[str], env: dict[str, str], log_fd: int, close_fds: Sequence[int], name: str,
           launcher: int, mask: Iterable[int]) -> NoReturn:
    code = 1
    try:
        os.setpgid(0, 0)
        die_with_parent()
        if os.getppid() != launcher:  # the launcher died before the line above
            os._exit(1)
        # copies above 2 first: a launcher started with 0-2 closed may have its logs there
        devnull = os.open(os.devnull, os.O_RDONLY)
        copies = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3) for fd in (devnull, log_fd, log_fd)]
        for target, fd in enumerate(copies):
            os.dup2(fd, target)
        for fd in {devnull, log_fd, *close_fds, *copies}:
            if fd > 2:
                os.close(fd)
        _close_inherited()
        _std_streams()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_NAME, name.encode()[:15])
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [sys.argv[0], *argv]
        root = logging.getLogger()
        for handler in root.handlers[:]:  # the node configures logging for itself (main)
            root.removeHandler(handler)
        import numpy

        numpy.random.seed()  # fresh from the OS, like a new process's (Python's random reseeds itself)
        from p2psync.cli.main import main

        code = main(argv)
    except SystemExit as exc:  # argparse, or sys.exit: what the interpreter would make of it
        code = _exit_code(exc)
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        try:
            from p2psync.cli.main import hard_exit

            hard_exit(code)
        finally:
            os._exit(code)


def _close_inherited() -> None:
    """Close the descriptors the launcher was given by its own parent (e.g. a pipe that someone
    reads to its end), as the exec of a node would (``close_fds``). Python opens its own
    descriptors non-inheritable (PEP 446), so these belong to no object here."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd > 2 and os.get_inheritable(fd):
                os.close(fd)
        except OSError:  # listdir's own, closed by now
            pass


def _std_streams() -> None:
    """sys.stdin/stdout/stderr on descriptors 0-2 (now /dev/null and the log), buffered as in a
    fresh interpreter whose output is a file (the launcher's may be a terminal, or replaced)."""
    for name, fd, mode, buffering in (("stdin", 0, "r", -1), ("stdout", 1, "w", -1), ("stderr", 2, "w", 1)):
        old = getattr(sys, f"__{name}__") or getattr(sys, name)
        setattr(sys, name, open(fd, mode, buffering, encoding=getattr(old, "encoding", None),
                                errors=getattr(old, "errors", None), closefd=False))


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


__all__ = ["ENV_LAUNCH", "LAUNCH_MODES", "NODE_MODULES", "ForkedNode", "NodeProcess", "die_with_parent",
           "fork_node", "threads", "warm_up"]

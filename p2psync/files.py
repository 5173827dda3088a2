"""Files p2psync writes: created without following planted links, replaced atomically, and —
for what a node can train without (checkpoints, metrics records, the run's records) — written
on a best-effort basis.

* :func:`open_new`: a file created afresh, exclusively, never through a link (key files and
  checkpoints: others must not redirect them).
* :func:`write_atomic`: a temporary file in the same folder, flushed and fsynced, renamed over
  the target (``os.replace``, atomic on POSIX), then the folder fsynced. A process killed at any
  moment, or a write that fails (a full disk, a read-only folder), leaves the previous file
  intact, never a torn one.
* :class:`WriteFailures`: a node's disk errors on the writes it can do without. Each is logged
  with the path and the reason the first time its kind fails (``checkpoint``, ``metrics``,
  ``summary``, ...), later ones of that kind are only counted (a full disk under
  ``--checkpoint-every`` warns once, not every step), and the run goes on. The counts go into the
  node's stats (``write_failures``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from p2psync.errors import ConfigError

log = logging.getLogger("p2psync.files")


def open_new(path: str | Path, mode: int) -> BinaryIO:
    """Create ``path`` afresh for writing, with permissions ``mode``: a file left there (a
    temporary file of a writer that was killed) is removed first, and the new one is created
    exclusively without following a symbolic link (``O_CREAT | O_EXCL | O_NOFOLLOW``), so a
    link planted at that name cannot make the writer overwrite another file."""
    p = Path(path)
    try:
        p.unlink()  # removes a link itself, never its target
    except FileNotFoundError:
        pass
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    except FileExistsError:
        raise ConfigError(f"{p}: created by someone else while p2psync was writing it") from None
    os.fchmod(fd, mode)
    return os.fdopen(fd, "wb")


class _Recorded:
    """A file whose ``write`` remembers the first ``OSError`` it raised: ``torch.save`` turns a
    failed write (a full disk) into a RuntimeError that names neither the file nor the reason."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def write_atomic(path: str | Path, write: Callable[[BinaryIO], object], *, mode: int = 0o600) -> None:
    """Replace ``path`` with what ``write(file)`` writes, atomically (see the module docstring);
    its folder is created if missing. Raises the ``OSError`` of a write that failed, even when
    ``write`` turned it into another exception (``torch.save`` does); the previous file is then
    untouched and the temporary one removed."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # there, but not a folder: say that, not "File exists"
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(p.parent)) from None
    tmp = p.with_name(f".{p.name}.tmp")
    try:
        with open_new(tmp, mode) as f:
            rec = _Recorded(f)
            try:
                write(rec)  # type: ignore[arg-type]  # a BinaryIO in all that writers use
            except Exception:
                if rec.error is not None:
                    raise rec.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fd = os.open(p.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_or_warn(path: str | Path, text: str, *, what: str, failures: WriteFailures | None = None) -> bool:
    """Write ``text`` to ``path`` atomically (:func:`write_atomic`, mode 0644); a file that
    cannot be written (a read-only folder, a full disk) is logged with its path and reason
    (through ``failures`` when given: once per ``what``) and False is returned: losing
    ``what`` must not end the run."""
    try:
        write_atomic(path, lambda f: f.write(text.encode()), mode=0o644)
        return True
    except OSError as exc:
        if failures is not None:
            failures.failed(what, path, exc)
        else:
            log.warning("cannot write the %s %s: %s", what, path, reason(exc))
        return False


def node_marker(run_dir: Path, node: int, kind: str) -> Path:
    """Where a node's session leaves, for the launcher, why its process ends: ``fenced`` (it
    was removed from the run: start it again) or ``ended`` (the run ended without it: leave
    it out)."""
    return run_dir / f"node-{node}.{kind}"


def reason(exc: BaseException) -> str:
    """A disk error in words: ``No space left on device (ENOSPC)``; another error's message."""
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        return f"{exc.strerror or os.strerror(exc.errno)} ({name})"
    return f"{type(exc).__name__}: {exc}"


class WriteFailures:
    """The writes one node can do without, and how many of each kind failed (see the module
    docstring). ``who`` starts each log line (``node 3``)."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.counts: Counter[str] = Counter()

    def failed(self, kind: str, path: str | Path, exc: BaseException, consequence: str = "") -> None:
        """Record a failed write of ``kind`` to ``path``: logged (path and reason) if it is the
        first of its kind, counted either way. ``consequence``: what the run does without it."""
        self.counts[kind] += 1
        if self.counts[kind] == 1:
            log.warning("%s: cannot write the %s %s: %s; %sthe run goes on (said once: further %s write "
                        "failures are only counted, in the node's stats)", self.who, kind, path, reason(exc),
                        f"{consequence}; " if consequence else "", kind)

    @contextlib.contextmanager
    def guard(self, kind: str, path: str | Path, consequence: str = "") -> Iterator[None]:
        """Run the block; an ``OSError`` in it is :meth:`failed` instead of raised::

            with failures.guard("summary", path):
                path.write_text(text)
        """
        try:
            yield
        except OSError as exc:
            self.failed(kind, path, exc, consequence)

    def as_dict(self) -> dict[str, int]:
        """Failed writes per kind (for the node's stats; empty when none failed)."""
        return dict(sorted(self.counts.items()))


__all__ = ["WriteFailures", "open_new", "reason", "write_atomic", "write_text_or_warn"]

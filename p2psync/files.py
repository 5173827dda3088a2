"""Files p2psync writes that others must not redirect (key files, checkpoints), and files
whose loss must not end a run (records, markers, the summary)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("p2psync.files")

from p2psync.errors import ConfigError


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


def write_text_or_warn(path: str | Path, text: str, *, what: str) -> bool:
    """Write ``text`` to ``path`` atomically (a temporary file beside it, then a rename: a
    reader sees the old file or the new one, never half of one). A file that cannot be
    written (read-only folder, full disk) is logged with its path and reason, and False is
    returned: losing ``what`` must not end the run."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, p)
        return True
    except OSError as exc:
        log.warning("could not write the %s %s: %s", what, p, exc.strerror or exc)
        try:
            tmp.unlink()
        except OSError:
            pass
        return False


__all__ = ["open_new", "write_text_or_warn"]

"""Files p2psync writes that others must not redirect: key files and checkpoints."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

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


__all__ = ["open_new"]

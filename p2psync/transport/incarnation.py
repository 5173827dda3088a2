"""A node's incarnation: a number that grows with every process started as that node.

Every header carries the sender's incarnation, and a peer rejects messages of an incarnation
older than the one it registered for that node (``stale_incarnation``): that is how the
messages of a dead process are told from those of its restart. The wall clock alone does not
give a growing number: a node restarted after its clock was stepped back (NTP, a VM restored)
would start with a smaller one and be rejected by every peer for as long as the run lasts.

So a node of a run with a folder keeps its last incarnation in ``<run>/node-<id>/incarnation``
(replaced atomically) and takes ``max(wall clock in ns, last + 1)``: larger than every earlier
incarnation of that node in that folder, whatever the clock did, and still larger than any
earlier one taken from the clock alone. Without a folder it could write (none given, read-only,
full) it falls back to the wall clock, and says so.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from p2psync.files import WriteFailures, write_atomic
from p2psync.wire.schema import MAX_U64

log = logging.getLogger("p2psync.transport")

#: the file of a node's folder that holds its last incarnation
INCARNATION_FILE = "incarnation"


def clock_incarnation(clock: Callable[[], int] | None = None) -> int:
    """The wall clock in ns (``clock``, default ``time.time_ns``): an incarnation without a folder."""
    return (clock or time.time_ns)() & MAX_U64


def last_incarnation(path: Path) -> int | None:
    """The incarnation recorded at ``path``; None if there is none or it is unreadable or
    malformed (said in the log: the clock decides alone then)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read the last incarnation in %s (%s): the clock alone decides this process's",
                    path, exc.strerror)
        return None
    try:
        value = int(text.strip())
    except ValueError:
        value = -1
    if not 0 <= value < MAX_U64:
        log.warning("%s does not hold an incarnation (%r): the clock alone decides this process's", path,
                    text[:40])
        return None
    return value


def next_incarnation(folder: str | Path | None, *, clock: Callable[[], int] | None = None,
                     failures: WriteFailures | None = None) -> int:
    """This process's incarnation as node of the run whose node folder is ``folder``
    (``<run>/node-<id>``): ``max(clock(), last + 1)``, recorded in ``folder/incarnation``
    before it is used. ``folder`` None: the clock's. A record that cannot be written goes to
    ``failures`` (or the log); the value is still the larger of the two."""
    now = clock_incarnation(clock)
    if folder is None:
        return now
    path = Path(folder) / INCARNATION_FILE
    last = last_incarnation(path)
    value = now if last is None else max(now, last + 1)
    try:
        write_atomic(path, lambda f: f.write(f"{value}\n".encode()), mode=0o644)
    except OSError as exc:
        consequence = ("this process's incarnation is not recorded (a later restart of this node with its clock "
                       "stepped back would be refused by its peers)")
        if failures is not None:
            failures.failed("incarnation record", path, exc, consequence)
        else:
            log.warning("cannot record the incarnation in %s (%s); %s", path, exc.strerror, consequence)
    return value


__all__ = ["INCARNATION_FILE", "clock_incarnation", "last_incarnation", "next_incarnation"]

"""Per-node metrics: one JSON object per line in ``runs/<run-id>/node-<id>.jsonl``.

Common fields: step, time (s since training start), loss, test_loss / accuracy (when evaluated),
compute_s / comm_s / wait_s (cumulative), samples, samples_per_s, nics ({name: {sent, recv}} in
bytes, cumulative). A strategy adds its own fields (staleness, local iterations, ...).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Mapping, TextIO

from p2psync.files import WriteFailures


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if hasattr(v, "item"):  # numpy scalars
        return _clean(v.item())
    return v


class MetricsWriter:
    """Appends one node's records to ``path`` (JSON lines), flushed at least every
    ``flush_every_s``. With ``failures`` the records are best effort: a disk error (opening,
    writing, flushing, closing) is said once (:class:`p2psync.files.WriteFailures`, kind
    ``metrics record``) and counted, and training goes on; records that could not be written
    are lost, the later ones are still tried. Without it such an error is raised."""

    def __init__(self, path: str | Path, *, flush_every_s: float = 0.5, failures: WriteFailures | None = None) -> None:
        self.path = Path(path)
        self._failures = failures
        self._flush_every = flush_every_s
        self._last_flush = 0.0
        self.last: dict[str, Any] = {}
        self._f: TextIO | None = None
        with self._guard():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = self.path.open("a", buffering=1 << 16)

    def _guard(self) -> contextlib.AbstractContextManager[None]:
        if self._failures is None:
            return contextlib.nullcontext()
        return self._failures.guard("metrics record", self.path, "records are lost until it can be written")

    def write(self, record: Mapping[str, Any], *, flush: bool = False) -> None:
        rec = _clean(dict(record))
        self.last = rec
        if self._f is None:
            if self._failures is not None:
                self._failures.counts["metrics record"] += 1
            return
        with self._guard():
            self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            now = time.monotonic()
            if flush or now - self._last_flush >= self._flush_every:
                self._last_flush = now
                self._f.flush()

    def close(self) -> None:
        f, self._f = self._f, None
        if f is None or f.closed:
            return
        try:
            with self._guard():
                f.flush()
        finally:
            with contextlib.suppress(OSError) if self._failures is not None else contextlib.nullcontext():
                f.close()  # what the failed flush left in the buffer: given up


def bytes_sent(record: Mapping[str, Any]) -> int:
    """Bytes a node sent over all its NICs, from a metrics record (0 if it has none)."""
    return sum(v.get("sent", 0) for v in record.get("nics", {}).values())


def peak_rss_bytes() -> int:
    """The most resident memory this process has held so far, in bytes (``getrusage``'s
    ``ru_maxrss``: KiB on Linux, bytes on macOS); 0 where the platform has no ``resource``."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    out = []
    with Path(path).open() as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a line still being written
    return out

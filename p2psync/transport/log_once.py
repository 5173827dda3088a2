"""Log a rejection once per (sender, reason), in bounded memory.

A transport counts every message it rejects and logs the first of each (sender, reason). The
sender label can be chosen by whoever sends (a routing id that is no node, a fresh CurveZMQ key
per attempt), so the set of labels already logged must not grow without bound, nor the log: past
``limit`` labels, each reason is logged once more (saying so) and then only counted. Callers that
already know the label is the attacker's choice log under a fixed one (the NIC) instead.
"""

from __future__ import annotations

DEFAULT_LIMIT = 1024
OVERFLOW_NOTE = " (more senders rejected than the log tracks: further new ones are only counted)"


class LogOnce:
    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._seen: set[tuple[str, str]] = set()
        self._overflow: set[str] = set()  # reasons logged once more after ``_seen`` filled up

    def __len__(self) -> int:
        return len(self._seen) + len(self._overflow)

    def check(self, who: str, reason: str) -> str | None:
        """None if (``who``, ``reason``) was logged already (do not log); otherwise what to
        append to the log line: "" or, once per reason after the table filled up,
        :data:`OVERFLOW_NOTE`."""
        key = (who, reason)
        if key in self._seen:
            return None
        if len(self._seen) < self.limit:
            self._seen.add(key)
            return ""
        if reason in self._overflow or len(self._overflow) >= self.limit:
            return None
        self._overflow.add(reason)
        return OVERFLOW_NOTE


__all__ = ["DEFAULT_LIMIT", "LogOnce", "OVERFLOW_NOTE"]

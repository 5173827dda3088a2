"""The transport's log-once table (p2psync/transport/log_once.py): bounded however many senders."""

from __future__ import annotations

from p2psync.transport.log_once import OVERFLOW_NOTE, LogOnce


def test_once_per_sender_and_reason_then_once_per_reason_when_full() -> None:
    once = LogOnce(limit=3)
    assert once.check("a", "bad") == "" and once.check("a", "bad") is None
    assert once.check("a", "other") == "" and once.check("b", "bad") == ""
    assert once.check("b", "bad") is None
    # full: each reason once more (saying so), then only counted by the caller
    assert [once.check(f"fresh{i}", "bad") for i in range(100)] == [OVERFLOW_NOTE] + [None] * 99
    assert once.check("fresh", "other") == OVERFLOW_NOTE and once.check("x", "other") is None
    assert once.check("a", "bad") is None  # still remembered
    assert len(once) == 5
    for i in range(100):  # the reasons' table is bounded too
        once.check("y", f"reason{i}")
    assert len(once) <= 6

"""OpId names an operation the way the wire has always named it."""

from __future__ import annotations

import pytest

from p2psync.collectives import OpId
from p2psync.transport import Mailbox


@pytest.mark.parametrize("op,tag", [
    (OpId("ssgd", 12, 3), "ssgd.12.e3"),
    (OpId("dts.win", (2, 7), 0), "dts.win.2.7.e0"),
    (OpId("preduce", (1, 40), 5), "preduce.1.40.e5"),
    (OpId("preduce.end", 0, 2), "preduce.end.0.e2"),
    (OpId("esync", "sync", 9), "esync.sync.e9"),
    (OpId("audit", "end", 1), "audit.end.e1"),
])
def test_tags_are_the_wire_names(op, tag):
    assert op.tag == str(op) == tag
    assert op.root == tag + "." and op.sub("flag") == tag + ".flag"


def test_the_root_covers_the_operation_and_its_parts_only():
    mb = Mailbox()
    sc = mb.scope(OpId("ssgd", 5, 3).root)
    assert sc.covers(OpId("ssgd", 5, 3).sub("flag")) and sc.covers("ssgd.5.e3.rs0.1.2")
    assert not sc.covers(OpId("ssgd", 5, 30).tag + ".rs0.1.2")  # epoch 30 is another operation
    assert not sc.covers(OpId("ssgd", 55, 3).root)

"""The sans-IO ingest pipeline against a table of cases: each stage's rejection and its reason,
routing (deliver / forward), what a message proves about who is alive, and the revival of a
node marked dead surfaced as an output (the pipeline itself changes nothing)."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest

from p2psync.transport.ingest import Decision, Deliver, Forward, Ingest, Reject, Revive
from p2psync.transport.relay_auth import OriginAuth, relay_digest
from p2psync.wire import DEFAULT_LIMITS, MAX_HOPS, encode, parse_header

ME, RUN = 0, 0x5EED
NODES = frozenset(range(5))
KEY = {n: bytes([n]) * 32 for n in range(5)}  # the key node 0 shares with node n


def frames(**kw: Any) -> list[Any]:
    """A message's frames (defaults: a control event from node 1 of this run)."""
    fields: dict[str, Any] = dict(kind="event", src=1, tag="t", run=RUN, inc=10)
    fields.update(kw)
    return list(encode(**fields))


def signed(key: bytes, **kw: Any) -> list[Any]:
    """A relayed message with its origin's digest under ``key`` (counter ``ctr``)."""
    fields: dict[str, Any] = dict(kind="event", src=3, tag="t", run=RUN, inc=30, dst=ME, hops=1, ctr=1)
    fields.update(kw)
    raw = encode(**fields)
    digest = relay_digest(key, parse_header(cast(bytes, raw[0]), DEFAULT_LIMITS), raw[1:])
    return list(encode(auth=digest, **fields))


def pipeline(*, keyed: bool = False, incarnations: dict[int, int] | None = None,
             dead: set[int] | None = None) -> Ingest:
    return Ingest(node_id=ME, nodes=NODES, limits=DEFAULT_LIMITS, incarnations=incarnations or {},
                  dead=dead or set(), auth=OriginAuth(ME, KEY) if keyed else None)


def reject(d: Decision) -> tuple[str, str]:
    assert isinstance(d, Reject), d
    return d.reason, d.stage


# (name, pipeline options, frames, peer, expected (reason, stage))
REJECTED: list[tuple[str, dict[str, Any], list[Any], int | None, tuple[str, str]]] = [
    ("unknown sender", {}, frames(), None, ("unknown_peer", "sender")),
    ("malformed header", {}, [b"\xc1not msgpack"], 1, ("header_msgpack", "decode")),
    ("no frames", {}, [], 1, ("frame_count", "decode")),
    ("origin is not the neighbour", {}, frames(src=2), 1, ("src_mismatch", "authenticate")),
    ("relayed but no hop taken", {}, frames(src=2, dst=ME, hops=0), 1, ("src_mismatch", "authenticate")),
    ("another run", {}, frames(run=RUN + 1), 1, ("wrong_run", "admit")),
    ("older incarnation", {"incarnations": {1: 11}}, frames(), 1, ("stale_incarnation", "admit")),
    ("relayed older incarnation", {"incarnations": {3: 31}}, frames(src=3, dst=ME, hops=1), 1,
     ("stale_incarnation", "admit")),
    ("keyed relay without digest", {"keyed": True}, frames(src=3, dst=ME, hops=1), 1, ("relay_auth", "authenticate")),
    ("keyed relay for another node without digest", {"keyed": True}, frames(src=3, dst=2, hops=1), 1,
     ("relay_auth", "authenticate")),
    ("keyed relay with a forged digest", {"keyed": True}, signed(b"x" * 32), 1, ("relay_auth", "authenticate")),
    ("keyed relay altered on the way", {"keyed": True},
     signed(KEY[3], kind="data", arrays=[np.zeros(2, np.float32)])[:1] + [np.ones(2, np.float32).tobytes()], 1,
     ("relay_auth", "authenticate")),
    ("keyed relay from another run", {"keyed": True}, signed(KEY[3], run=RUN + 1), 1, ("wrong_run", "admit")),
    ("hop limit", {}, frames(src=3, dst=2, hops=MAX_HOPS), 1, ("relay", "route")),
    ("unknown destination", {}, frames(dst=9, hops=0), 1, ("relay", "route")),
]


@pytest.mark.parametrize("opts, fr, peer, expected", [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_rejected(opts: dict[str, Any], fr: list[Any], peer: int | None, expected: tuple[str, str]) -> None:
    d = pipeline(**opts).admit(fr, peer, RUN)
    assert reject(d) == expected
    assert (d.message is None) == (expected[1] in ("sender", "decode") and expected[0] != "src_mismatch")


def test_malformed_payload_keeps_the_decoders_reason() -> None:
    fr = frames(kind="data", arrays=[np.arange(4, dtype=np.float32)])
    d = pipeline().admit([fr[0], b"123"], 1, RUN)  # 3 bytes for 16
    assert reject(d) == ("nbytes_mismatch", "decode")
    assert isinstance(d, Reject) and "declared 16, got 3" in d.detail


# (name, pipeline options, frames, peer, expected decision type, alive, revive)
ADMITTED: list[tuple[str, dict[str, Any], list[Any], int, type, tuple[int, ...], Revive | None]] = [
    ("from the neighbour, nothing registered", {}, frames(), 1, Deliver, (1,), None),
    ("registered incarnation", {"incarnations": {1: 10}}, frames(), 1, Deliver, (1,), None),
    ("newer incarnation of a live node proves nothing of the registered one", {"incarnations": {1: 9}}, frames(), 1,
     Deliver, (), None),
    ("newer incarnation of a dead node revives it", {"incarnations": {1: 9}, "dead": {1}}, frames(), 1, Deliver, (),
     Revive(1, 10)),
    ("registered incarnation of a dead node does not revive it", {"incarnations": {1: 10}, "dead": {1}}, frames(), 1,
     Deliver, (1,), None),
    ("relayed to this node: origin and neighbour alive", {}, frames(src=3, inc=30, dst=ME, hops=1), 1, Deliver, (3, 1),
     None),
    ("addressed to this node by the neighbour itself", {}, frames(dst=ME, hops=0), 1, Deliver, (1,), None),
    ("for another node: forwarded", {}, frames(src=3, inc=30, dst=2, hops=1), 1, Forward, (3, 1), None),
    ("first hop for another node", {}, frames(dst=2, hops=0), 1, Forward, (1,), None),
    ("keyed relay verified", {"keyed": True}, signed(KEY[3]), 1, Deliver, (3, 1), None),
    ("keyed relay verified revives a dead origin", {"keyed": True, "incarnations": {3: 29}, "dead": {3}},
     signed(KEY[3]), 1, Deliver, (1,), Revive(3, 30)),
    ("keyed relay for another node: origin unproven", {"keyed": True}, signed(KEY[2], dst=2), 1, Forward, (1,), None),
    ("keyed relay for another node never revives", {"keyed": True, "incarnations": {3: 29}, "dead": {3}},
     signed(KEY[2], dst=2), 1, Forward, (1,), None),
    ("keyed cluster, message from the neighbour itself", {"keyed": True}, frames(), 1, Deliver, (1,), None),
]


@pytest.mark.parametrize("opts, fr, peer, kind, alive, revive", [c[1:] for c in ADMITTED],
                         ids=[c[0] for c in ADMITTED])
def test_admitted(opts: dict[str, Any], fr: list[Any], peer: int, kind: type, alive: tuple[int, ...],
                  revive: Revive | None) -> None:
    incarnations = dict(opts.pop("incarnations", {}))
    dead = set(opts.pop("dead", set()))
    before = (dict(incarnations), set(dead))
    d = pipeline(incarnations=incarnations, dead=dead, **opts).admit(fr, peer, RUN)
    assert type(d) is kind and d.alive == alive and d.revive == revive
    assert d.message is not None and d.message.header.tag == "t"
    if isinstance(d, Forward):
        assert d.came_from == peer
    assert (incarnations, dead) == before  # a decision, not an action: the caller acts on it


def test_a_rejection_at_the_route_stage_still_reports_what_it_proves() -> None:
    d = pipeline(incarnations={3: 29}, dead={3}).admit(frames(src=3, inc=30, dst=2, hops=MAX_HOPS), 1, RUN)
    assert reject(d) == ("relay", "route") and d.alive == (1,) and d.revive == Revive(3, 30)


def test_a_neighbour_seen_in_a_newer_life_proves_nothing_of_its_registered_process_by_relaying() -> None:
    # node 1 restarted (incarnation 11; 10 registered): it relays at once, and what it relays
    # must not keep its previous process alive (the coordinator declares that one failed
    # before it admits the new one); once 11 is registered its relaying counts again
    incarnations = {1: 10}
    p = pipeline(incarnations=incarnations)
    assert p.admit(frames(src=3, inc=30, dst=ME, hops=1), 1, RUN).alive == (3, 1)
    assert p.admit(frames(inc=11), 1, RUN).alive == ()
    assert p.admit(frames(src=3, inc=30, dst=ME, hops=1), 1, RUN).alive == (3,)
    assert p.admit(frames(src=3, inc=30, dst=2, hops=1), 1, RUN).alive == (3,)
    incarnations[1] = 11
    assert p.admit(frames(src=3, inc=30, dst=ME, hops=1), 1, RUN).alive == (3, 1)


def test_a_replayed_relay_is_rejected_once_its_counter_was_seen() -> None:
    p = pipeline(keyed=True)
    first = signed(KEY[3], ctr=7)
    assert isinstance(p.admit(first, 1, RUN), Deliver)
    assert reject(p.admit(first, 2, RUN)) == ("relay_replay", "authenticate")  # again, by another way
    assert isinstance(p.admit(signed(KEY[3], ctr=6), 1, RUN), Deliver)  # overtaken, not seen: passes
    assert isinstance(p.admit(signed(KEY[3], ctr=7, kind="data"), 1, RUN), Deliver)  # the data lane counts apart


def test_the_run_id_is_the_callers_at_each_message() -> None:
    p, fr = pipeline(), frames(run=7)
    assert reject(p.admit(fr, 1, RUN)) == ("wrong_run", "admit")
    assert isinstance(p.admit(fr, 1, 7), Deliver)

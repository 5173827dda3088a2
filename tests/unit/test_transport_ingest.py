"""What the transport does with the ingest pipeline's decision (the in-memory transport's real
``_ingest``): rejections counted by reason, arrival times recorded, a proven restart of a dead
node registered and routed through again, forwarding and delivery; and its router."""

from __future__ import annotations

from typing import Any, AsyncIterator, cast

import pytest

from p2psync.topology import ring
from p2psync.transport.memory import MemoryHub, MemoryTransport
from p2psync.transport.router import Router
from p2psync.transport.ingest import hop_limit
from p2psync.wire import MAX_HOPS, encode

RUN = 0x77


@pytest.fixture
async def ring4() -> AsyncIterator[dict[int, MemoryTransport]]:
    hub = MemoryHub(ring(4))
    eps = {i: hub.endpoint(i, default_timeout=2) for i in range(4)}
    for e in eps.values():
        e.run_id = RUN
        await e.start()
    yield eps
    for e in eps.values():
        await e.close()


def _frames(**kw: Any) -> list[Any]:
    fields: dict[str, Any] = dict(kind="event", src=1, tag="t", run=RUN, inc=10)
    fields.update(kw)
    return [bytes(cast(bytes, f)) for f in encode(**fields)]


def _nic(t: MemoryTransport) -> str:
    return t.node.nics[0].name


async def test_rejections_are_counted_by_reason_and_deliver_nothing(ring4: dict[int, MemoryTransport]) -> None:
    t = ring4[0]
    t.peer_incarnations[1] = 11
    for fr, peer in ((_frames(), 1), (_frames(run=RUN + 1), 1), (_frames(src=3), 1), ([b"\xc1"], 1), (_frames(), None)):
        t._ingest(_nic(t), peer, "1/n", fr)
    assert t.rejected == {"stale_incarnation": 1, "wrong_run": 1, "src_mismatch": 1, "header_msgpack": 1,
                          "unknown_peer": 1}
    assert t.nic_stats[_nic(t)].rejected == 5 and t.nic_stats[_nic(t)].msgs_recv == 5
    assert t.recv_nowait("t") is None and t.last_arrival == {}


async def test_an_accepted_message_records_its_origin_and_neighbour_alive(ring4: dict[int, MemoryTransport]) -> None:
    t = ring4[0]
    t._ingest(_nic(t), 1, "1/n", _frames(src=2, inc=20, dst=0, hops=1))  # relayed by 1 from 2
    msg = t.recv_nowait("t")
    assert msg is not None and msg.src == 2 and msg.nic == _nic(t)
    assert set(t.last_arrival) == {1, 2}


async def test_a_proven_restart_of_a_dead_node_is_registered_and_routed_through(
        ring4: dict[int, MemoryTransport]) -> None:
    t = ring4[0]
    t.peer_incarnations[1] = 9
    t.mark_dead(1)
    assert t.next_hops(2) == [3]
    t._ingest(_nic(t), 1, "1/n", _frames(inc=10))
    assert t.peer_incarnations[1] == 10 and 1 not in t.dead and sorted(t.next_hops(2)) == [1, 3]
    assert 1 not in t.last_arrival  # a new life proves nothing about the registered process
    assert t.recv_nowait("t") is not None  # and it is delivered


async def test_a_restart_heard_before_its_old_process_is_declared_keeps_the_node_routed_through(
        ring4: dict[int, MemoryTransport]) -> None:
    """A proven message of a newer process of node 1 arrives while its registered process is
    not marked dead yet (it proves nothing then); when that process is declared failed later,
    node 1 is not routed around: the newer incarnation is registered, as a message arriving
    after the declaration would (never lowering a newer registered one). A declaration of that
    newer process marks it dead."""
    t = ring4[0]
    t.peer_incarnations[1] = 9
    t._ingest(_nic(t), 1, "1/n", _frames(inc=10))
    assert 1 not in t.last_arrival and t.peer_incarnations[1] == 9
    t.mark_dead(1)  # the registered process (9) failed
    assert 1 not in t.dead and t.peer_incarnations[1] == 10 and sorted(t.next_hops(2)) == [1, 3]
    t.mark_dead(1, 9)  # a declaration of process 9 that comes later changes nothing either
    assert 1 not in t.dead and t.peer_incarnations[1] == 10
    t.mark_dead(1, 10)  # the newer process failed too
    assert 1 in t.dead and t.next_hops(2) == [3]
    t.peer_incarnations[3] = 5
    t._ingest(_nic(t), 3, "3/n", _frames(src=3, inc=6))
    t.peer_incarnations[3] = 7  # registered since, by the membership: never lowered
    t.mark_dead(3, 5)
    assert 3 not in t.dead and t.peer_incarnations[3] == 7
    t.peer_incarnations[2] = 4
    t.mark_dead(2, 4)  # nothing heard from a newer process: marked dead
    assert 2 in t.dead


async def test_a_message_for_another_node_is_forwarded(ring4: dict[int, MemoryTransport]) -> None:
    t = ring4[1]  # 0 -> 1 -> 2 on ring-4
    t._ingest(_nic(t), 0, "0/n", _frames(src=0, inc=1, dst=2, hops=0))
    got = await ring4[2].recv("t", timeout=2)
    assert got.src == 0 and got.header.hops == 1
    assert t.relayed == 1 and t.recv_nowait("t") is None


async def test_a_message_past_its_hop_limit_is_rejected_but_proves_its_neighbour_alive(
        ring4: dict[int, MemoryTransport]) -> None:
    t = ring4[1]
    t._ingest(_nic(t), 0, "0/n", _frames(src=3, inc=1, dst=2, hops=MAX_HOPS))
    assert t.rejected == {"relay": 1} and t.relayed == 0 and set(t.last_arrival) == {0, 3}
    # the limit is the topology's size (no simple path is longer): a 5th hop on ring-4 has looped
    t._ingest(_nic(t), 0, "0/n", _frames(src=3, inc=1, dst=2, hops=4))
    assert t.rejected == {"relay": 2} and t.relayed == 0 and hop_limit(4) == 4 and hop_limit(10**6) == MAX_HOPS
    t._ingest(_nic(t), 0, "0/n", _frames(src=3, inc=1, dst=2, hops=3))  # the 4th hop: still taken
    assert (await ring4[2].recv("t", timeout=2)).header.hops == 4 and t.relayed == 1


def test_the_router_recomputes_paths_when_a_node_dies_or_revives() -> None:
    r = Router(ring(4), 0)
    assert sorted(r.next_hops(2)) == [1, 3]
    r.mark_dead(1)
    assert r.next_hops(2) == [3] and r.distances(0).get(1) is None
    r.revive(1)
    assert sorted(r.next_hops(2)) == [1, 3] and r.distances(0)[1] == 1


def test_a_neighbour_whose_only_way_leads_back_through_this_node_is_no_next_hop() -> None:
    """Ring-8 with 4 dead is a line 5-6-7-0-1-2-3: from 6, neighbour 5 reaches 0 only back
    through 6, so a resend over another first hop (rotate) takes 7 again instead of running
    into the line's dead end at 5; towards 5 itself, 5 stays the next hop."""
    r = Router(ring(8), 6)
    assert r.next_hops(0) == [7, 5] and r.next_hops(0, rotate=1) == [5, 7]  # both ways round
    r.mark_dead(4)
    assert r.next_hops(0) == [7] and r.next_hops(0, rotate=1) == [7]
    assert r.next_hops(0, exclude=7) == [] and r.next_hops(5) == [5]
    assert r.distances(6)[5] == 1 and 6 not in r.distances(7)  # this node's own distances pass through it


def test_a_reply_goes_back_first_through_the_neighbour_its_origin_was_last_heard_through() -> None:
    r = Router(ring(8), 0)
    assert r.reply_hops(3) == [1, 7]  # nothing heard from 3 yet: shortest first
    r.heard(1, 1)  # a direct message sets nothing
    r.heard(3, 7)  # 3's latest relayed message came the long way round (through 7)
    assert r.back == {3: 7} and r.reply_hops(3) == [7, 1]
    assert r.reply_hops(3, exclude=7) == [1]  # never back where the reply came from
    r.mark_dead(7)
    assert r.reply_hops(3) == [1]
    r.revive(7)
    r.heard(3, 4)  # not a neighbour: ignored
    assert r.reply_hops(3) == [7, 1] and r.next_hops(3) == [1, 7]  # other control keeps its paths
    r.heard(1, 7)  # 1's latest relayed message came the long way round, but 1 is adjacent and live
    assert r.reply_hops(1) == [1, 7]
    assert r.reply_hops(3, avoid=(7,)) == [1]  # never to a node the reply passed already


async def test_a_relayed_message_teaches_the_way_back_to_its_origin(ring4: dict[int, MemoryTransport]) -> None:
    t = ring4[0]
    t._ingest(_nic(t), 3, "3/n", _frames(src=2, inc=20, dst=0, hops=1))  # relayed by 3 from 2
    assert t.router.back == {2: 3}
    ring4[1]._ingest(_nic(ring4[1]), 0, "0/n", _frames(src=3, inc=1, dst=2, hops=1))  # forwarded by 1
    assert ring4[1].router.back == {3: 0}


def test_the_resend_number_of_a_relayed_message_is_its_attempt() -> None:
    from p2psync.transport.relay import resend_number

    assert resend_number({"kind": "rpc", "meta": {"att": 3, "method": "m"}}) == 3
    assert resend_number({"kind": "rpc", "meta": {"att": "3"}}) == 0 and resend_number({"meta": None}) == 0
    assert resend_number({"kind": "event", "meta": {}}) == 0 and resend_number({"meta": {"att": -2}}) == 0

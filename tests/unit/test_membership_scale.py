"""What a heartbeat costs the coordinator does not grow with the run: its reply carries the
view only to a member that has not applied it, and the view is built once per change."""

from __future__ import annotations

import time

import msgpack

from p2psync.coordinator import MembershipService, RpcServer
from p2psync.coordinator.failover import rebuild_state
from p2psync.coordinator.views import View
from p2psync.topology import ring
from p2psync.transport import MemoryHub


async def _heartbeat_replies(n: int) -> tuple[int, int, View]:
    """The packed sizes of the replies to an up-to-date member's heartbeat and to a stale
    member's, on a coordinator (node 0) of ``n`` members."""
    hub = MemoryHub(ring(n))
    v = View(epoch=3, members=tuple(range(n)), incarnations={i: 1 for i in range(n)}, coordinator=0)
    st = rebuild_state(expected=range(n), view=v, failed=(), me=0, fingerprint="fp", now=time.monotonic(), grace=2.0)
    svc = MembershipService(server=RpcServer(hub.endpoint(0)), expected=range(n), state=st, rpc_methods=False)
    hb = svc.handlers["membership.heartbeat"]
    cur = st.view()
    fresh = await hb(1, {"epoch": cur.epoch, "coord": cur.coordinator, "term": cur.term}, [])
    stale = await hb(2, {"epoch": cur.epoch - 1, "coord": cur.coordinator, "term": cur.term}, [])
    assert "view" not in fresh and View.from_wire(stale["view"]) == cur
    assert st.view() is cur  # built once per change, not per heartbeat
    return len(msgpack.packb(fresh)), len(msgpack.packb(stale)), cur


async def test_a_heartbeat_reply_to_an_up_to_date_member_has_one_size_whatever_the_run():
    small, small_stale, _ = await _heartbeat_replies(4)
    large, large_stale, _ = await _heartbeat_replies(512)
    assert small == large < 32
    assert large_stale > 10 * small_stale  # (the view itself grows with the members)


async def test_a_new_view_is_sent_in_the_next_heartbeat_reply_and_then_no_more():
    hub = MemoryHub(ring(5))
    v = View(epoch=3, members=tuple(range(5)), incarnations={i: 1 for i in range(5)}, coordinator=0)
    st = rebuild_state(expected=range(5), view=v, failed=(), me=0, fingerprint="fp", now=time.monotonic(), grace=2.0)
    svc = MembershipService(server=RpcServer(hub.endpoint(0)), expected=range(5), state=st, rpc_methods=False)
    hb = svc.handlers["membership.heartbeat"]
    before = st.view()
    args = {"epoch": before.epoch, "coord": 0, "term": before.term}
    assert "view" not in await hb(1, args, [])
    assert st.declare_failed([4]) == [4]  # a change: a new epoch
    rep = await hb(1, args, [])
    after = View.from_wire(rep["view"])
    assert after.epoch == before.epoch + 1 and after.members == (0, 1, 2, 3)
    assert "view" not in await hb(1, {"epoch": after.epoch, "coord": 0, "term": after.term}, [])
    # another coordinator's view of the same epoch (a takeover's) is not ours: ours is sent
    assert "view" in await hb(1, {"epoch": after.epoch + 5, "coord": 3, "term": after.term}, [])

"""Routing through a peer judged failed again once it is heard from (membership client)."""

from __future__ import annotations

from p2psync.coordinator.peer_status import heard_again


def test_a_member_judged_failed_and_heard_since_is_routed_through_again() -> None:
    marked = {1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0, 5: 10.0}
    arrivals = {1: 12.0, 2: 10.0, 3: 12.0, 4: 12.0}
    members = {0, 1, 2, 3, 5, 6}
    dead = {1, 2, 4, 5}
    # 1: a member heard after it was marked; 2: heard only at that instant (sent before);
    # 3: routed through already; 4: heard, but no member (a view removed it); 5: never heard
    assert heard_again(marked, arrivals, members, dead) == [1]
    assert heard_again({}, arrivals, members, dead) == []

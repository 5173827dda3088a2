"""Which nodes linger after the finish barrier: those that relay for others."""

from __future__ import annotations

from p2psync.topology import ring


def test_relay_nodes_linger_after_the_finish_barrier():
    from p2psync.topology import mesh, star
    from p2psync.api.runtime import relays_for_others

    assert [relays_for_others(ring(4), i) for i in range(4)] == [False, True, False, True]
    assert not any(relays_for_others(mesh(4), i) for i in range(4))
    assert not any(relays_for_others(star(5), i) for i in range(5))

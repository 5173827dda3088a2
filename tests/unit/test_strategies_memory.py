"""Strategy logic over the in-memory transport (real trainers, no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from p2psync.errors import PeerFailure
from p2psync.strategies import get_strategy
from p2psync.topology import mesh, ring
from p2psync.transport import MemoryHub
from tests.helpers import close_replica, gate_replicas, make_context, make_trainer, until

pytestmark = pytest.mark.timeout(60)


async def _nodes(topo, name, **opts):
    hub = MemoryHub(topo)
    out = []
    replicas = gate_replicas({i: make_trainer(topo, i) for i in topo.ids})
    for i in topo.ids:
        t = hub.endpoint(i, default_timeout=10)
        await t.start()
        ctx = make_context(topo, t, replicas[i], options=opts)
        s = get_strategy(name)(ctx)
        await s.start()
        out.append(s)
    return out


async def _close(strats):
    for s in strats:
        await s.close()
        await close_replica(s.ctx.replica)
        await s.ctx.transport.close()


async def test_ssgd_keeps_replicas_identical_and_agrees_on_stop():
    strats = await _nodes(ring(3), "ssgd")
    for step in range(4):
        reps = await asyncio.gather(*(s.run_step(step, want_stop=(s.ctx.node_id == 1 and step == 3))
                                      for s in strats))
        assert all(r.stop == (step == 3) for r in reps)  # one node's wish stops everyone
    params = [await s.ctx.replica.get_params() for s in strats]
    assert all(p.tobytes() == params[0].tobytes() for p in params)
    await _close(strats)


async def test_ssgd_peer_failure_aborts_with_named_peer():
    strats = await _nodes(mesh(3), "ssgd")
    await strats[2].ctx.transport.close()  # node 2 is gone
    idle = [s.ctx.transport.mailbox.waiting for s in strats[:2]]
    task = asyncio.gather(strats[0].run_step(0, False), strats[1].run_step(0, False))
    await until(lambda: all(s.ctx.transport.mailbox.waiting > n for s, n in zip(strats, idle)), 5.0,
                "both survivors waiting for the step's pieces")
    for s in strats[:2]:  # what the membership client does on a failure event
        s.ctx.transport.mark_dead(2)
        s.on_peer_failure(2)
    with pytest.raises(PeerFailure) as ei:
        await task
    assert ei.value.peers == (2,)
    with pytest.raises(PeerFailure, match=r"peer\(s\) \[2\] failed"):
        await strats[0].run_step(1, False)
    await _close(strats)


async def test_asgd_applies_every_gradient_once_everywhere():
    topo = ring(5)  # forwarding needed: not every pair is adjacent
    strats = await _nodes(topo, "asgd")
    steps = 6
    await asyncio.gather(*(_run(s, steps) for s in strats))
    expected = (topo.size - 1) * steps
    await until(lambda: all(s.applied_remote == expected for s in strats), 4.0, "every gradient applied")
    assert [s.applied_remote for s in strats] == [expected] * topo.size
    await _close(strats)


async def _run(s, steps):
    for k in range(steps):
        await s.run_step(k, k == steps - 1)


async def test_asgd_members_joined_only_through_other_nodes_still_get_every_gradient():
    """Ring-4 whose view holds nodes 1 and 3 only (0 and 2 departed, still up): the flooding
    tree of 1 and 3 spans their relay link, so each applies every gradient of the other."""
    from p2psync.coordinator import View

    strats = await _nodes(ring(4), "asgd")
    pair = [strats[1], strats[3]]
    for s in pair:
        s.on_view(View(epoch=2, members=(1, 3)))
    await asyncio.gather(*(_run(s, 4) for s in pair))
    await until(lambda: all(s.applied_remote == 4 for s in pair), 4.0, "every gradient applied")
    assert strats[0].applied_remote == strats[2].applied_remote == 0
    relayed = strats[0].ctx.transport.relayed + strats[2].ctx.transport.relayed
    assert relayed == 8 and all(s.dropped_sends == 0 for s in pair)
    await _close(strats)


async def test_asgd_continues_without_failed_peer():
    strats = await _nodes(mesh(3), "asgd", send_timeout=0.3)
    await strats[2].ctx.transport.close()
    for s in strats[:2]:
        s.on_peer_failure(2)
    await asyncio.gather(*(_run(s, 3) for s in strats[:2]))
    assert all(s.alive == {0, 1} for s in strats[:2])
    await _close(strats)


async def test_an_abandoned_attempt_retires_its_steps_sync_state_and_operation_only():
    """Regroup's scope of one attempt covers the tags of that step's sync, state transfer and
    operation over that view; retiring it drops their late pieces and nothing else."""
    from p2psync.coordinator import View
    from p2psync.wire import decode, encode

    strats = await _nodes(mesh(2), "ssgd")
    try:
        regroup, tr = strats[0].regroup, strats[0].ctx.transport
        attempt = regroup._scope(View(epoch=3, members=(0, 1)), 7)
        late = ["ssgd.sync.e3.ag0.1.0", "ssgd.state.e3.ag0.1.0", "ssgd.7.e3.rs0.1.0", "ssgd.7.e3.flag.rs0.1.0"]
        kept = ["ssgd.7.e30.rs0.1.0", "ssgd.8.e3.rs0.1.0", "ssgd.sync.e4.ag0.1.0", "ssgd.77.e3.rs0.1.0"]
        assert all(attempt.covers(t) for t in late) and not any(attempt.covers(t) for t in kept)
        attempt.retire()
        before = tr.mailbox.pending
        for t in late + kept:
            tr.mailbox.deliver(decode(encode(kind="data", src=1, tag=t)))
        assert tr.mailbox.pending == before + len(kept)
        assert all(tr.recv_nowait(t) is not None for t in kept)
    finally:
        await _close(strats)

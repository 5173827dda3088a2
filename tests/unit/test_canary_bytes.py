"""Canary's bytes per iteration against its own schedule (spec ../shared/specs/canary.md §6.3,
C15-C16): in ``mode=bsp`` every NIC of every node carries exactly ``(β + 1)(α − 1)`` pieces
of ``G/(α·β)`` per colayer per iteration (the exact message count per NIC of one bare round is
pinned over ZeroMQ in tests/integration/test_canary_zmq.py and by ``Layout.nic_sends`` in
test_canary_plan.py); here through the whole strategy, over the in-memory transport's NIC
counters, so anything else a training iteration sends (a second copy, fp32 where the codec
applies, a model pull, a stop) would show."""

from __future__ import annotations

import asyncio

import pytest

from p2psync.topology import bcube
from tests.helpers import memory_strategies

#: bytes of a message's envelope and Canary header beyond its payload (measured: 160-200)
HEADER_MAX = 300


def _nics(strats) -> dict[int, dict[str, tuple[int, int]]]:
    return {s.ctx.node_id: {n: (st.bytes_sent, st.msgs_sent) for n, st in s.ctx.transport.nic_stats.items()}
            for s in strats}


def _schedule_bytes(ex, me: int) -> dict[int, int]:
    """Payload bytes ``me`` sends per level (NIC) in one synchronous round of every colayer,
    from the plan's slots (fp32)."""
    lay, out = ex.layout, {}
    for flow in ex.flows:
        for t in range(lay.levels):
            for k in range(lay.steps):
                for y in lay.peers(me, t, k):
                    lvl = lay.level(t, k)
                    out[lvl] = out.get(lvl, 0) + 4 * sum(s.size for s in flow.send_slots(t, k, y))
    return out


@pytest.mark.parametrize("alpha", [2, 3])
@pytest.mark.parametrize("codec", ["none", "sketch8", "sketch8:5", "sketch8:auto"])
async def test_a_bsp_iteration_sends_the_schedules_bytes_on_every_nic(alpha, codec):
    beta, iters = 2, 3
    topo = bcube(alpha, beta)
    opts = {"mode": "bsp", "colayers": "2", "sketch": str(codec != "none").lower()}
    if codec == "sketch8:auto":
        opts["sketch_bits"] = "0"  # a width per piece
    elif codec == "sketch8":
        opts["sketch_bits"] = "8"  # the paper's width (sketch8:5, 5 bits, is Canary's default)
    # release=False: an iteration's colayers leave during its backward, which then runs inside
    # the step that takes it, so the window below holds exactly ``iters`` iterations' sends
    async with memory_strategies(topo, "canary", opts, release=False) as strats:
        await asyncio.gather(*(s.run_step(0, False) for s in strats))  # warm up
        before = _nics(strats)
        for step in range(1, 1 + iters):
            await asyncio.gather(*(s.run_step(step, False) for s in strats))
        after = _nics(strats)
        sizes = strats[0].exchange.sizes
        for s in strats:
            me, ex = s.ctx.node_id, s.exchange
            want = _schedule_bytes(ex, me)
            per_nic = (beta + 1) * (alpha - 1)  # C16
            for lvl in range(beta):
                # the plan's slots are the formula's G/(α·β) pieces, up to rounding
                assert abs(want[lvl] - per_nic * 4 * sum(sizes) / (alpha * beta)) <= per_nic * 4 * len(sizes)
                nic = f"l{lvl}"
                sent = after[me][nic][0] - before[me][nic][0]
                msgs = after[me][nic][1] - before[me][nic][1]
                assert msgs == iters * per_nic * len(sizes), (me, nic)
                pieces = per_nic * len(sizes)  # every slot one piece here
                if codec == "none":
                    payload = iters * want[lvl]
                elif codec in ("sketch8", "sketch8:5"):  # BITS per value, 2**BITS representatives per piece
                    bits = 8 if codec == "sketch8" else 5
                    assert s.codec.spec == codec
                    payload = iters * (want[lvl] // 4 * bits // 8 + 4 * 2 ** bits * pieces)
                    # each piece's codes end on a whole byte
                    assert payload <= sent <= payload + iters * pieces + msgs * HEADER_MAX, (me, nic, sent, payload)
                    continue
                else:  # 2 to 8 bits per value and 2**bits representatives per piece
                    least = iters * (want[lvl] // 16 + 4 * 4 * pieces)
                    most = iters * (want[lvl] // 4 + 4 * 256 * pieces)
                    # the MLP's gradients need fewer than 8 bits (5-6 measured): not the fixed width
                    assert least <= sent <= 0.9 * most, (me, nic, sent, least, most)
                    continue
                assert payload <= sent <= payload + msgs * HEADER_MAX, (me, nic, sent, payload)


@pytest.mark.parametrize("strategy,opts,want", [("canary", {}, "sketch8:5"), ("canary", {"sketch": "false"}, "none"),
                                                ("ssgd", {}, "none")])
async def test_the_runtime_warms_the_codecs_the_strategy_names(strategy, opts, want):
    """Strategy.codecs (what NodeRuntime.start_strategy warms before start): Canary's own
    sketch, else the collectives' --codec."""
    async with memory_strategies(bcube(2, 2), strategy, opts) as strats:
        assert [[c.spec for c in s.codecs()] for s in strats] == [[want]] * len(strats)

"""In-process link shaping over real ZeroMQ: delay, pipelining, bandwidth, isolation, order."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from p2psync.errors import ConfigError
from p2psync.topology import mesh
from p2psync.transport.shaping import InprocShaper, LinkSpec, load_wan_profile, make_shaper
from tests.helpers import free_port, zmq_cluster

pytestmark = pytest.mark.timeout(60)


async def _arrivals(ep, tag, n, timeout=10):
    out = []
    for _ in range(n):
        m = await ep.recv(tag, timeout=timeout)
        out.append((time.monotonic(), int(m.header.step)))
    return out


async def test_one_way_delay_and_pipelining():
    topo = mesh(2, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        await eps[0].send(1, "warm")
        await eps[1].recv("warm", timeout=5)
        eps[0].shaper = InprocShaper({1: LinkSpec(latency_s=0.1)})
        t0 = time.monotonic()
        await eps[0].send(1, "one", [np.ones(4)])
        await eps[1].recv("one", timeout=5)
        assert 0.095 <= time.monotonic() - t0 <= 0.105 + 0.02  # ±5 % (+ scheduling slack)
        t0 = time.monotonic()
        for i in range(10):  # back to back
            await eps[0].send(1, "burst", [np.ones(4)], step=i)
        assert time.monotonic() - t0 < 0.05  # the sender is not held up by propagation delay
        arr = await _arrivals(eps[1], "burst", 10)
        assert arr[-1][0] - t0 <= 0.13  # all arrive ~100 ms after the first send, not 1 s
        assert [s for _, s in arr] == list(range(10))


async def test_bandwidth_token_bucket():
    topo = mesh(2, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        data = np.ones(10_000_000 // 8, dtype=np.float64)  # 10 MB

        async def transfer(tag: str) -> float:
            t0 = time.monotonic()
            for piece in np.array_split(data, 10):
                await eps[0].send(1, tag, [piece])
            await _arrivals(eps[1], tag, 10)
            return time.monotonic() - t0

        plain = await transfer("plain")  # the same bytes unshaped: this machine's own cost now
        eps[0].shaper = InprocShaper({1: LinkSpec(bandwidth_bps=50e6)})
        shaped = await transfer("bw")
        # 80 Mbit at 50 Mb/s is 1.6 s: never faster than the bucket allows (-10 %), and no slower
        # than the bucket plus what the unshaped transfer costs here (a loaded machine adds to both)
        assert 1.6 * 0.9 <= shaped <= 1.6 * 1.1 + 2 * plain, (shaped, plain)


async def test_slow_link_does_not_slow_another():
    topo = mesh(3, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        eps[0].shaper = InprocShaper({1: LinkSpec(latency_s=0.5, bandwidth_bps=8e6)})
        t0 = time.monotonic()
        slow = asyncio.create_task(eps[0].send(1, "slow", [np.ones(200_000)]))  # 1.6 MB at 1 MB/s
        await eps[0].send(2, "fast", [np.ones(10)])
        await eps[2].recv("fast", timeout=5)
        assert time.monotonic() - t0 < 0.1
        await slow
        await eps[1].recv("slow", timeout=10)
        assert time.monotonic() - t0 > 0.5


async def test_jitter_keeps_order_and_loss_delays():
    topo = mesh(2, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        eps[0].shaper = InprocShaper({1: LinkSpec(latency_s=0.02, jitter_s=0.015)}, seed=3)
        for i in range(30):
            await eps[0].send(1, "j", step=i)
        arr = await _arrivals(eps[1], "j", 30)
        assert [s for _, s in arr] == list(range(30))
        eps[0].shaper = InprocShaper({1: LinkSpec(latency_s=0.01, loss=0.999, rto_s=0.3)}, seed=1)
        t0 = time.monotonic()
        await eps[0].send(1, "lost")
        await eps[1].recv("lost", timeout=5)
        assert time.monotonic() - t0 >= 0.3  # retransmission delay


def test_wan_profile(tmp_path):
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    topo = mesh(4)
    specs = load_wan_profile(root / "topologies" / "wan-4-regions.json", topo)
    # node 0 Tokyo, 1 London, 2 Oregon, 3 Ohio: London-Tokyo 210 ms RTT -> 105 ms one way
    assert specs[(0, 1)].latency_s == pytest.approx(0.105)
    assert specs[(3, 2)].latency_s == pytest.approx(0.025)
    shaper = make_shaper("inproc", topo, 0, wan=str(root / "topologies" / "wan-4-regions.json"))
    assert set(shaper.links) == {1, 2, 3}
    bad = tmp_path / "w.json"
    bad.write_text(json.dumps({"regions": {"a": [0, 1], "b": [2]}, "rtt_ms": {"a-b": 10}}))
    with pytest.raises(ConfigError, match=r"nodes \[3\] have no region"):
        load_wan_profile(bad, topo)
    bad.write_text(json.dumps({"regions": {"a": [0, 1], "b": [2, 3]}, "rtt_ms": {"a-c": 10}}))
    with pytest.raises(ConfigError) as ei:
        load_wan_profile(bad, topo)
    assert ei.value.field == "rtt_ms.a-c"
    assert make_shaper("none", topo, 0) is None
    with pytest.raises(ConfigError):
        make_shaper("tc", topo, 0)


async def test_control_messages_already_sent_survive_the_senders_close():
    """Regression: a coordinator answering the finish barrier and exiting at once lost its
    replies in the shaper's delay queue; the others waited out a 35 s timeout."""
    topo = mesh(2, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        await eps[0].send(1, "warm")
        await eps[1].recv("warm", timeout=5)
        eps[0].shaper = InprocShaper({1: LinkSpec(latency_s=0.2)})
        await eps[0].send(1, "last.words", kind="event", meta={"bye": 1})
        await eps[0].close()  # right after sending, as a node that exits
        msg = await eps[1].recv("last.words", timeout=5)
        assert msg.meta["bye"] == 1


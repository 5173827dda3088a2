"""What a relay may do with the control messages it forwards in a keyed cluster (issue 16
review), over real ZeroMQ on loopback: a relayed message it cannot verify changes nothing it
records about the message's origin, and a signed message it hands over twice is delivered once."""

from __future__ import annotations

from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq

from p2psync.topology import Topology, ring, star
from p2psync.transport.keys import NodeKeys
from p2psync.wire import encode
from p2psync.wire.schema import MAX_U64
from tests.helpers import free_port, keyed, until, zmq_cluster

pytestmark = pytest.mark.timeout(60)


async def test_a_forged_relayed_message_does_not_revive_a_dead_node_at_the_relay() -> None:
    """Node 0 (a key holder) hands relay node 1 a message "relayed from dead node 3" with the
    largest incarnation and a digest node 1 cannot check (it is for node 2). Node 1 neither
    records that incarnation nor revives node 3, so the real restarted node 3 (a newer
    incarnation than its dead one) is still accepted there, not stale."""
    topo, keys = keyed(ring(4, base_port=free_port()))
    async with zmq_cluster(topo, keys=keys) as eps:
        relay, old = eps[1], eps[3].incarnation
        relay.peer_incarnations[3] = old
        relay.mark_dead(3)
        forged = encode(kind="event", src=3, dst=2, hops=1, tag="event.x", run=relay.run_id, inc=MAX_U64,
                        auth=b"\1" * 32, ctr=1)
        await eps[0]._send_direct(1, eps[0].route(1), 5.0, forged)
        await until(lambda: eps[2].rejected["relay_auth"] >= 1, 10, "the forged message dropped at node 2")
        assert relay.peer_incarnations[3] == old and 3 in relay.dead
        eps[3].incarnation = old + 1  # node 3 restarted
        await eps[3].send(1, "back", kind="event")  # relayed by node 0 or 2, verified by node 1
        assert (await relay.recv("back", timeout=10)).src == 3
        assert relay.peer_incarnations[3] == old + 1 and 3 not in relay.dead
        assert not relay.rejected["stale_incarnation"]


def _hub(ctx: "zmq.Context[Any]", topo: Topology, key: NodeKeys) -> dict[str, "zmq.Socket[Any]"]:
    """Node 0, the hub of a star, played by raw ROUTER sockets holding node 0's keys: a relay
    that does what it likes with what passes through it."""
    socks = {}
    for nic in topo.node(0).nics:
        s: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.CURVE_SERVER, 1)
        s.setsockopt(zmq.CURVE_PUBLICKEY, key.public)
        s.setsockopt(zmq.CURVE_SECRETKEY, key.secret)
        s.bind(nic.endpoint)
        socks[nic.name] = s
    return socks


async def _take(sock: "zmq.Socket[Any]") -> list[bytes]:
    await until(lambda: sock.poll(0) != 0, 10, "a message at the hub")
    return sock.recv_multipart(zmq.NOBLOCK)


def _one_hop_on(frames: list[bytes]) -> list[bytes]:
    """What a relay forwards: the same header, one hop further."""
    header = msgpack.unpackb(frames[0], raw=False)
    header["hops"] += 1
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


async def test_a_relay_handing_over_a_signed_message_twice_gets_it_delivered_once(zmq_context,
                                                                                  zmq_endpoints) -> None:
    """Node 1 sends node 2 a signed event through the hub (the only path). The hub forwards
    the genuine bytes twice: node 2 takes the first and drops the replay; node 1's next
    message still passes."""
    topo, keys = keyed(star(3, base_port=free_port()))
    hub = _hub(zmq_context, topo, keys[0])
    eps = await zmq_endpoints(topo, [1, 2], keys=keys)
    n1, n2 = eps[1], eps[2]
    await n2.send(0, "hello", kind="event")  # the hub learns node 2's control connection
    to_2 = (await _take(hub["leaf2"]))[0]
    for tag in ("event.x", "event.y"):
        await n1.send(2, tag, kind="event", meta={"failed": [0]})
        relayed = [to_2, *_one_hop_on((await _take(hub["leaf1"]))[1:])]
        hub["leaf2"].send_multipart(relayed)
        got = await n2.recv(tag, timeout=10)
        assert got.src == 1 and got.header.hops == 1
        hub["leaf2"].send_multipart(relayed)  # the replay
        await until(lambda: n2.rejected["relay_replay"] >= (1 if tag == "event.x" else 2), 10,
                    "the replay dropped")
        assert n2.recv_nowait(tag) is None
    assert n2.rejected["relay_replay"] == 2 and not n2.rejected["relay_auth"]

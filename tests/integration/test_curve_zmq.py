"""Keyed clusters over real ZeroMQ on loopback (issue 16): CurveZMQ on every socket, a ZAP
handler mapping keys to node ids, claimed sources checked against them, relayed messages
verified end to end, impostors refused and counted."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import pytest
import zmq

from p2psync.collectives import Collectives
from p2psync.topology import Topology, mesh, ring
from p2psync.wire import encode
from tests.helpers import free_port, keyed, until, zmq_cluster

pytestmark = pytest.mark.timeout(60)


def _impostor(ctx: "zmq.Context[Any]", topo: Topology, *, claims: str, target: int,
              key: tuple[bytes, bytes] | None = None) -> "zmq.Socket[Any]":
    """A raw ROUTER socket that claims the routing id ``claims`` and connects to node
    ``target``'s first NIC as a CURVE client (a random key pair unless ``key``)."""
    pub, sec = key if key is not None else zmq.curve_keypair()
    s: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, claims.encode())
    s.setsockopt(zmq.RECONNECT_IVL, -1)  # one attempt: a deterministic number of handshakes
    s.setsockopt(zmq.CURVE_PUBLICKEY, pub)
    s.setsockopt(zmq.CURVE_SECRETKEY, sec)
    s.setsockopt(zmq.CURVE_SERVERKEY, (topo.node(target).curve_public or "").encode())
    nic = topo.node(target).nics[0]
    s.setsockopt(zmq.CONNECT_ROUTING_ID, f"{target}/{nic.name}".encode())
    s.connect(nic.endpoint)
    return s


def _forged(run: int, tag: str, *, kind: str = "data", arrays: Any = (), **kw: Any) -> list[Any]:
    return encode(kind=kind, src=0, tag=tag, arrays=arrays, run=run, inc=1, **kw)


async def test_every_socket_runs_curve_and_relayed_control_is_signed() -> None:
    topo, keys = keyed(ring(4, base_port=free_port()))
    async with zmq_cluster(topo, keys=keys) as eps:
        for ep in eps.values():
            mech = ep.socket_mechanisms()
            assert mech and set(mech.values()) == {zmq.CURVE}, mech
        x = np.arange(1000, dtype=np.float32)
        await eps[0].send(1, "bulk", [x])
        np.testing.assert_array_equal((await eps[1].recv("bulk", timeout=10)).arrays[0], x)
        await eps[0].send(2, "ctl", kind="event", meta={"hello": 2})  # 0 and 2 are not adjacent
        msg = await eps[2].recv("ctl", timeout=10)
        assert msg.src == 0 and msg.header.hops == 1 and msg.header.auth is not None
        await eps[3].send(1, "back", kind="rpc", meta={"n": 1})
        assert (await eps[1].recv("back", timeout=10)).src == 3
        await until(lambda: sum(ep.relayed for ep in eps.values()) == 2, 10, "two relayed messages")
        assert not any(ep.rejected for ep in eps.values()), [ep.rejected for ep in eps.values()]


async def test_routing_id_impostor_with_unknown_key_delivers_nothing(zmq_context, zmq_endpoints) -> None:
    """The issue's impostor: a socket claiming node 0's routing id connects to node 1 before the
    real node 0 and sends a forged piece and a forged failure event. Keyed, its handshake is
    refused (counted), nothing of it is delivered, and the real node 0 then gets node 1's
    traffic and is believed; a collective under the forged tag sums the real values only."""
    topo, keys = keyed(mesh(2, base_port=free_port()))
    node1 = (await zmq_endpoints(topo, [1], keys=keys))[1]
    imp = _impostor(zmq_context, topo, claims="0/eth0", target=1)
    forged_piece = _forged(node1.run_id, "ssgd.7.rs0.0.0", arrays=[np.full(4, np.nan, np.float32)])
    imp.send_multipart([b"1/eth0", *forged_piece])
    imp.send_multipart([b"1/eth0", *_forged(node1.run_id, "event.peer_failed", kind="event",
                                            meta={"failed": [1]})])
    await until(lambda: node1.rejected["unknown_key"] >= 1, 10, "the impostor's handshake refused")
    node0 = (await zmq_endpoints(topo, [0], keys=keys))[0]
    await node1.send(0, "for-0", [np.ones(3, np.float32)])
    got = await node0.recv("for-0", timeout=10)  # the real node 0 gets node 1's traffic
    assert got.src == 1
    colls = [Collectives(ep, timeout=10, piece_bytes=16) for ep in (node0, node1)]
    vals = [np.arange(8, dtype=np.float32), np.full(8, 2.0, np.float32)]
    out = await asyncio.gather(*(c.allreduce(v, tag="ssgd.7") for c, v in zip(colls, vals)))
    for o in out:  # exactly the real sum: the forged piece never reached the collective
        np.testing.assert_array_equal(o, vals[0] + vals[1])
    assert node1.recv_nowait("event.peer_failed") is None
    assert node1.rejected["unknown_key"] == 1 and not node1.offences
    assert imp.poll(0) == 0  # and nothing went to the impostor


async def test_member_claiming_another_nodes_routing_ids_gets_nothing_and_blocks_nothing(
        zmq_context, zmq_endpoints) -> None:
    """A process holding node 2's valid key connects to node 1 before the real node 0, claiming
    node 0's routing ids (bulk and control). Its handshakes pass (the key is known) but every
    message it sends is rejected (identity mismatch); node 1's traffic for node 0, bulk and
    control, reaches the real node 0 and never the impostor, and the real node 0's traffic
    still reaches node 1 (its connection is not shadowed by the impostor's)."""
    topo, keys = keyed(mesh(3, base_port=free_port()))
    node1 = (await zmq_endpoints(topo, [1], keys=keys))[1]
    claims = ("0/eth0", "0/eth0/c", "0/eth0/b", "0/eth0/c#0", "1/eth0")
    imps = [_impostor(zmq_context, topo, claims=c, target=1, key=(keys[2].public, keys[2].secret)) for c in claims]
    for i, imp in enumerate(imps):
        imp.send_multipart([b"1/eth0", *_forged(node1.run_id, f"x.{i}", kind="event")])
    # a claim that is the name of one of node 1's own connections is ignored by ZeroMQ (a
    # duplicate routing id); the others are read, and rejected
    await until(lambda: node1.rejected["identity_mismatch"] >= 3, 10, "the forged messages rejected")
    node0 = (await zmq_endpoints(topo, [0], keys=keys))[0]
    for kind in ("data", "event"):
        arrays = [np.ones(3, np.float32)] if kind == "data" else []
        await node1.send(0, f"to-0.{kind}", arrays, kind=kind)
        await node0.send(1, f"to-1.{kind}", arrays, kind=kind)
    for kind in ("data", "event"):
        assert (await node0.recv(f"to-0.{kind}", timeout=10)).src == 1
        assert (await node1.recv(f"to-1.{kind}", timeout=10)).src == 0
    assert all(node1.recv_nowait(f"x.{i}") is None for i in range(len(imps)))
    assert not node0.rejected
    for imp in imps:  # node 1 sent nothing on the impostors' connections
        assert imp.poll(50) == 0


async def test_forged_relayed_failure_event_is_rejected() -> None:
    """Node 2, a member with a valid key, hands node 1 a message claiming to be relayed from
    node 0 (a forged ``event.peer_failed``): without node 0's digest, or with a wrong one, it
    is rejected; without keys the same message is accepted, which is what the issue found."""
    topo, keys = keyed(ring(4, base_port=free_port()))
    async with zmq_cluster(topo, keys=keys) as eps:
        two = eps[2]
        for auth in (None, b"\0" * 32):
            frames = encode(kind="event", src=0, dst=1, hops=1, tag="event.peer_failed", meta={"failed": [3]},
                            run=two.run_id, inc=1, auth=auth)
            await two._send_direct(1, two.route(1), 5.0, frames)
        await until(lambda: eps[1].rejected["relay_auth"] >= 2, 10, "both forged events rejected")
        assert eps[1].recv_nowait("event.peer_failed") is None
        # the genuine article: node 3 relays node 0's signed event... to node 2 (not adjacent)
        await eps[0].send(2, "event.peer_failed", kind="event", meta={"failed": []})
        assert (await eps[2].recv("event.peer_failed", timeout=10)).src == 0
    plain = ring(4, base_port=free_port())
    async with zmq_cluster(plain) as eps:
        frames = encode(kind="event", src=0, dst=1, hops=1, tag="event.peer_failed", meta={}, run=0, inc=1)
        await eps[2]._send_direct(1, eps[2].route(1), 5.0, frames)
        assert (await eps[1].recv("event.peer_failed", timeout=10)).src == 0  # unkeyed: believed


async def test_unknown_keys_each_counted_logged_once(caplog: pytest.LogCaptureFixture, zmq_context,
                                                     zmq_endpoints) -> None:
    """An attacker presenting a fresh key pair per attempt: every refused handshake is counted,
    one line is logged (per NIC and reason, not per key), and what the endpoint remembers for
    its log does not grow with the keys."""
    topo, keys = keyed(mesh(2, base_port=free_port()))
    node1 = (await zmq_endpoints(topo, [1], keys=keys))[1]
    with caplog.at_level(logging.INFO, logger="p2psync.transport"):
        imps = [_impostor(zmq_context, topo, claims=f"0/eth0/x{i}", target=1) for i in range(6)]
        await until(lambda: node1.rejected["unknown_key"] >= 6, 10, "six refused handshakes")
    assert node1._zap is not None and node1.rejected["unknown_key"] == node1._zap.refused == 6
    logged = [r.getMessage() for r in caplog.records if "unknown_key" in r.getMessage()]
    assert len(logged) == 1, logged
    assert len(node1._log_once) == 1 and len(imps) == 6


async def test_zap_handler_error_refuses_that_handshake_and_serves_the_next(
        caplog: pytest.LogCaptureFixture, zmq_context, zmq_endpoints) -> None:
    """An exception while answering one ZAP request (here: the endpoint's refusal callback)
    refuses that handshake (fail closed) and is logged once; the handler still answers the next
    requests (it used to leave its REP socket waiting for a reply: every later handshake hung)."""
    topo, keys = keyed(mesh(2, base_port=free_port()))
    node1 = (await zmq_endpoints(topo, [1], keys=keys, start=False))[1]
    counted = node1._refused
    calls = []

    def refused(nic: str, address: str, key: str) -> None:
        calls.append(key)
        if len(calls) <= 2:
            raise RuntimeError("bug in a refusal callback")
        counted(nic, address, key)

    node1._refused = refused  # type: ignore[method-assign]  # read by start()
    await node1.start()
    with caplog.at_level(logging.WARNING, logger="p2psync.transport"):
        imps = [_impostor(zmq_context, topo, claims=f"0/eth0/x{i}", target=1) for i in range(3)]
        await until(lambda: node1.rejected["unknown_key"] >= 1, 10, "the third handshake refused")
    zap = node1._zap
    assert zap is not None and (zap.errors, zap.refused, zap.accepted) == (2, 3, 0), len(imps)
    assert sum("internal error" in r.getMessage() for r in caplog.records) == 1
    node0 = (await zmq_endpoints(topo, [0], keys=keys))[0]  # its handshakes with node 1 are accepted
    await node0.send(1, "hello", kind="event", meta={"n": 1})
    assert (await node1.recv("hello", timeout=10)).src == 0
    assert zap.accepted >= 1 and node1.rejected["unknown_key"] == 1

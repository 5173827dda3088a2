"""A node's membership client keeps the key of each newer view it applies with its votes, and a
new process starts from what its earlier one kept (p2psync/coordinator/votes.py, real ZeroMQ)."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2psync.coordinator import MembershipClient, RpcClient, RpcServer
from p2psync.coordinator.membership_state import EVENT_VIEW
from p2psync.coordinator.views import View
from p2psync.coordinator.votes import FileVotes
from p2psync.topology import mesh
from tests.helpers import free_port, until, zmq_cluster

pytestmark = pytest.mark.timeout(60)


async def test_a_new_process_votes_with_the_view_key_its_earlier_one_applied(tmp_path: Path) -> None:
    FileVotes(tmp_path).keep_view((0, 7))  # what an earlier process of node 1 kept
    topo = mesh(2, base_port=free_port())
    async with zmq_cluster(topo, timeout=5.0) as eps:
        server = RpcServer(eps[1])
        client = MembershipClient(transport=eps[1], rpc=RpcClient(eps[1], local=server), coordinator=0,
                                  votes=FileVotes(tmp_path))
        assert client.view is None and client.ballot.seen == (0, 7)
        client.start()
        try:
            view = View(epoch=9, members=(0, 1), incarnations={0: 0, 1: 0}, coordinator=0)
            await eps[0].send(1, EVENT_VIEW, kind="event", meta=view.to_wire(), timeout=5)
            await until(lambda: client.view is not None and client.view.epoch == 9, 5, "the view")
            assert client.ballot.seen == (0, 9) and FileVotes(tmp_path).load_view() == (0, 9)
        finally:
            await client.close()

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
from tests.helpers import HostNode, free_port, member_cluster, until, zmq_cluster

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


async def test_a_new_launch_in_the_same_folder_forgets_the_earlier_launchs_terms(tmp_path: Path) -> None:
    # an earlier launch with the same run id (the same folders) elected coordinators up to term
    # 3. Node 1 kept a vote and a view, node 2 only a view: kept, node 1's vote made it refuse the
    # new launch's views (term 0) until the coordinator was re-elected above it, and node 2's
    # view made it refuse every candidate of the new launch (their views are older): with
    # enough such nodes, no coordinator could ever be elected again
    one, two = FileVotes(tmp_path / "node-1"), FileVotes(tmp_path / "node-2")
    one.keep({3: 1})
    one.keep_view((3, 40))
    two.keep_view((3, 40))
    topo = mesh(3, base_port=free_port())
    stores = {1: FileVotes(tmp_path / "node-1"), 2: FileVotes(tmp_path / "node-2")}
    async with member_cluster(topo, lambda i: HostNode(topo, i, votes=stores.get(i))) as nodes:
        await until(lambda: all(n.client.view is not None and len(n.client.view.members) == 3
                                for n in nodes.values()), 10, "every node's first view")
        for i in (1, 2):
            b = nodes[i].client.ballot
            assert b.voted == {} and b.seen == nodes[i].client.view.key and b.seen[0] == 0
            kept = FileVotes(tmp_path / f"node-{i}")
            assert kept.load() == {} and kept.load_view() == b.seen

"""Error edges of the rendezvous: what a coordinator's refusal looks like on the registering node."""

from __future__ import annotations

import asyncio

import pytest

from p2psync.coordinator import MembershipClient, MembershipService, RpcClient, RpcServer, membership_client
from p2psync.coordinator.membership_state import UNREACHABLE
from p2psync.coordinator.views import View
from p2psync.errors import ConfigError, Fenced, PeerTimeout, RemoteError
from p2psync.topology import ring
from p2psync.tasks import cancel_all
from p2psync.transport import MemoryHub
from tests.helpers import until


async def test_a_different_configuration_is_a_config_error_naming_it_not_a_timeout():
    """The coordinator refuses a node whose configuration fingerprint differs from the first
    registrant's: the refused node raises ConfigError with the coordinator's message (it used to
    surface as a PeerTimeout 'rendezvous failed')."""
    hub = MemoryHub(ring(3))
    eps = {i: hub.endpoint(i) for i in range(3)}
    for e in eps.values():
        await e.start()
    server = RpcServer(eps[0])
    service = MembershipService(server=server, expected=range(3), start_timeout=5.0)
    server.start()
    service.start()
    clients = {i: MembershipClient(transport=eps[i], rpc=RpcClient(eps[i], local=server if i == 0 else None),
                                   coordinator=0) for i in range(3)}
    try:
        # the first registrant sets the fingerprint (it waits for the others: the rendezvous)
        first = asyncio.ensure_future(clients[0].register("same", timeout=5.0))
        await until(lambda: 0 in service.state.registered, 5.0, "node 0 registered")
        with pytest.raises(ConfigError, match="refused the registration.*different configuration") as got:
            await clients[1].register("other", timeout=5.0)
        assert isinstance(got.value.__cause__, RemoteError) and got.value.__cause__.kind == "ConfigError"
    finally:
        await cancel_all([first])
        for c in clients.values():
            await c.close()
        await service.close()
        await server.close()
        for e in eps.values():
            await e.close()


class _Refusing:
    """An RPC client whose coordinator refuses ``refusals`` registrations as unreachable, then
    admits the node (its neighbour came back)."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.calls = 0

    async def call(self, peer: int, method: str, args: object, timeout: float) -> dict[str, object]:
        self.calls += 1
        if self.calls <= self.refusals:
            raise RemoteError(UNREACHABLE, "no live path leads from node 0 to node 2: its neighbours [1, 3] "
                                           "are removed from the run")
        return {"joined": True, "elapsed": 1.0}


@pytest.mark.parametrize("refusals", [2, 10**6])
async def test_a_joiner_refused_as_unreachable_asks_again_until_admitted_or_its_start_timeout(
        monkeypatch: pytest.MonkeyPatch, refusals: int) -> None:
    """A coordinator that reaches a joiner only through removed nodes refuses it as
    ``Unreachable``: the joiner asks again (it is admitted once a neighbour rejoined), and at
    its start timeout it fails with the coordinator's reason, not a silent rendezvous timeout."""
    monkeypatch.setattr(membership_client, "PROBE_EVERY_S", 0.01)
    hub = MemoryHub(ring(4))
    ep = hub.endpoint(2)
    await ep.start()
    rpc = _Refusing(refusals)
    client = MembershipClient(transport=ep, rpc=rpc, coordinator=0)  # type: ignore[arg-type]
    try:
        if refusals == 2:
            info = await client.register("fp", timeout=5.0)
            assert info["joined"] is True and rpc.calls == 3
        else:
            with pytest.raises(PeerTimeout, match="could not admit it in time: no live path leads from node 0"):
                await client.register("fp", timeout=0.2)
            assert rpc.calls > 3
    finally:
        await client.close()
        await ep.close()


class _Deposed:
    """An RPC client whose coordinator 0, deposed in term 1 without knowing it, admits node 2
    in its view of term 0; then node 0, no coordinator any more, answers heartbeats with the
    view of term 1 of coordinator 3, which does not name node 2."""

    def __init__(self, real: RpcClient) -> None:
        self.real = real
        self.admitted = View(epoch=5, members=(0, 1, 2, 3), coordinator=0, term=0)
        self.newer = View(epoch=6, members=(0, 1, 3), coordinator=3, term=1)

    async def call(self, peer: int, method: str, args: object, timeout: float, **_: object) -> dict[str, object]:
        if method == "membership.register":
            return {"joined": True, "elapsed": 1.0, "view": self.admitted.to_wire()}
        return {"redirect": True, "view": self.newer.to_wire()}

    def estimator(self, node: int) -> object:
        return self.real.estimator(node)

    def abort_calls(self, node: int, exc: Exception) -> int:
        return self.real.abort_calls(node, exc)  # type: ignore[arg-type]


async def test_a_joiner_admitted_in_a_view_it_did_not_apply_is_fenced_by_a_newer_view_without_it() -> None:
    """A restarted process whose earlier one voted in term 1 registers with a coordinator still
    in term 0: it applies none of that coordinator's views and waits for a newer one. The newer
    view that comes does not name it (the run elected another coordinator and declared this
    node failed): it is fenced, to rejoin as a new process, and does not start from that view
    as its first one (its strategy would start in a view without it)."""
    hub = MemoryHub(ring(4))
    ep = hub.endpoint(2)
    await ep.start()
    rpc = _Deposed(RpcClient(ep))
    client = MembershipClient(transport=ep, rpc=rpc, coordinator=0)  # type: ignore[arg-type]
    client.ballot.voted[1] = 1  # the earlier process's vote in term 1
    try:
        await client.register("fp", timeout=5.0)
        assert client.view is None and client.fenced is None  # (term 0 is below the term it voted in)
        client.start()
        with pytest.raises(Fenced, match="view 6 \\(term 1\\) of coordinator 3 does not name it") as got:
            await client.first_view(timeout=5.0)
        assert got.value.rejoin and client.fenced is got.value and client.view is None
        assert client.newest_view == rpc.newer  # what it answers probes with
    finally:
        await client.close()
        await ep.close()

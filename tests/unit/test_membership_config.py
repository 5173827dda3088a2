"""Membership decision logic, RPC over the in-memory transport, RunConfig."""

from __future__ import annotations


import pytest

from p2psync.cli.main import build_parser
from p2psync.cli.run_cmd import config_from_args
from p2psync.coordinator import MembershipState, RpcClient, RpcServer
from p2psync.errors import ConfigError, PeerTimeout, RemoteError
from p2psync.topology import ring
from p2psync.training.config import RunConfig
from p2psync.transport import MemoryHub


def test_membership_state_register_and_fingerprints():
    st = MembershipState(expected=frozenset({0, 1, 2}), failure_timeout=2.0)
    st.register(0, "abc", now=0.0)
    assert st.missing == [1, 2] and not st.complete
    with pytest.raises(ConfigError, match="different configuration"):
        st.register(1, "xyz", now=0.1)
    with pytest.raises(ConfigError, match="not in the topology"):
        st.register(7, "abc", now=0.1)
    st.register(1, "abc", now=0.1)
    st.register(2, "abc", now=0.1)
    assert st.complete


def test_membership_state_failure_detection_and_finish():
    st = MembershipState(expected=frozenset({0, 1, 2}), failure_timeout=2.0)
    for n in (0, 1, 2):
        st.register(n, "f", now=0.0)
    st.heartbeat(0, 1.9)
    st.heartbeat(1, 1.9)
    assert st.check(2.0) == []
    assert st.check(2.01) == [2]  # silent for more than 2 s
    assert st.check(5.0) == [1]  # everyone silent now; 2 is not reported twice, 0 hosts the state
    st2 = MembershipState(expected=frozenset({0, 1, 2}), failure_timeout=1.0)
    for n in (0, 1, 2):
        st2.register(n, "f", 0.0)
    st2.finish(1, {"acc": 1})
    assert st2.check(10.0) == [2]  # a finished node is never declared failed
    assert not st2.all_finished
    st2.finish(0, {"acc": 1})
    assert st2.all_finished  # finished or failed: the barrier can release


async def test_rpc_over_memory_transport():
    hub = MemoryHub(ring(4))
    eps = {i: hub.endpoint(i) for i in range(4)}
    for e in eps.values():
        await e.start()
    server = RpcServer(eps[0])

    async def add(caller, args, arrays):
        if args.get("fail"):
            raise ConfigError("bad args")
        return {"sum": args["a"] + args["b"], "caller": caller}

    server.register("math.add", add)
    server.start()
    client = RpcClient(eps[2])  # not adjacent to 0 on a ring: relayed
    assert await client.call(0, "math.add", {"a": 2, "b": 3}) == {"sum": 5, "caller": 2}
    with pytest.raises(RemoteError, match="bad args"):
        await client.call(0, "math.add", {"fail": True})
    with pytest.raises(RemoteError, match="UnknownMethod"):
        await client.call(0, "nope")
    with pytest.raises(PeerTimeout):
        await RpcClient(eps[1]).call(3, "math.add", {"a": 1, "b": 1}, timeout=0.2)  # no server on 3
    local = RpcClient(eps[0], local=server)
    assert (await local.call(0, "math.add", {"a": 1, "b": 1}))["sum"] == 2
    with pytest.raises(ValueError):
        server.register("math.add", add)
    await server.close()
    for e in eps.values():
        await e.close()


def _args(*argv):
    ns = build_parser().parse_args(["run", "topologies/ring-4.json", *argv])
    return ns


def test_config_from_cli_and_back():
    cfg = config_from_args(_args("--strategy", "asgd", "--steps", "7", "--lr", "0.2", "--opt",
                                 "max_inflight=4", "--time", "3", "--eval-seconds", "2.5",
                                 "--codec", "sketch8", "--error-feedback", "--slowdown", "0:2"))
    assert cfg.strategy == "asgd" and cfg.steps == 7 and cfg.time_limit == 3 and cfg.eval_seconds == 2.5
    assert cfg.error_feedback and cfg.codec == "sketch8" and cfg.slowdown == "0:2"
    again = config_from_args(_args(*cfg.to_argv()))
    assert again == cfg
    default = config_from_args(_args())
    assert default.epochs == 20.0  # default budget
    assert default.fingerprint() != cfg.fingerprint()
    from dataclasses import replace
    assert replace(default, device="cpu", out="x", run_id="r").fingerprint() == default.fingerprint()


@pytest.mark.parametrize("argv,match", [
    (("--lr", "0"), "--lr"),
    (("--steps", "-3"), "--steps"),
    (("--momentum", "1.5"), "--momentum"),
    (("--opt", "nonsense"), "NAME=VALUE"),
    (("--opt", "zzz=1"), "unknown option"),
    (("--failure-timeout", "0.1"), "--failure-timeout"),
])
def test_config_errors(argv, match):
    with pytest.raises(ConfigError, match=match):
        config_from_args(_args(*argv))


def test_max_steps():
    c = RunConfig(topology="t", epochs=2.0, batch_size=10)
    assert c.max_steps(n_train=1000, n_nodes=4) == 50
    assert RunConfig(topology="t", steps=9).max_steps(1000, 4) == 9
    assert RunConfig(topology="t", time_limit=1.0).max_steps(1000, 4) > 10**12


def test_relay_nodes_linger_after_the_finish_barrier():
    from p2psync.topology import mesh, star
    from p2psync.api.runtime import relays_for_others

    assert [relays_for_others(ring(4), i) for i in range(4)] == [False, True, False, True]
    assert not any(relays_for_others(mesh(4), i) for i in range(4))
    assert not any(relays_for_others(star(5), i) for i in range(5))

"""A strategy on every simulated node (p2psync/sim/training.py): its real step logic and
collectives over the in-memory transport in virtual time, on the numpy replica
(p2psync/sim/replica.py), and the training invariants."""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from p2psync.cli.main import main
from p2psync.errors import Aborted, ConfigError, TrainingError
from p2psync.sim import invariants as inv
from p2psync.sim.chaos import chaos, simulate, table
from p2psync.sim.cluster import SimOptions
from p2psync.sim.faults import parse_faults
from p2psync.sim.loop import VirtualLoop, run
from p2psync.sim.replica import SimReplica
from p2psync.sim.training import (REFUSED, SIMULATED, NodeTraining, TrainingCluster, TrainingSpec, excused,
                                  finish_barrier_held, parse_step_time, same_model, strategy_finished)
from p2psync.strategies.asgd import ASGD
from p2psync.strategies.base import StepReport, StrategyContext
from p2psync.strategies.ssgd import SSGD
from p2psync.tasks import AbortEvent
from p2psync.topology import mesh, ring
from p2psync.wire import Message

OPTS = SimOptions(heartbeat=0.5, failure_timeout=2.0)


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL)  # every node logs each failure it sees


def train(topo: Any, strategy: str, faults: str, seconds: float, *, step_time: float = 0.05,
          during: Callable[[TrainingCluster], None] | None = None, steps: int | None = None,
          **options: str) -> dict[str, Any]:
    """The summary of a simulated run training ``strategy`` (``steps``: a step budget);
    ``during(cluster)`` runs once the nodes train (to tamper with them)."""
    spec = TrainingSpec(strategy=strategy, step_time=step_time, options=options, seed=7, steps=steps)

    async def go() -> dict[str, Any]:
        async with TrainingCluster(topo, training=spec, opts=OPTS, faults=parse_faults(faults, topo.ids)) as c:
            if during is None:
                return await c.run(seconds)
            task = asyncio.ensure_future(c.run(seconds))
            while not c.tasks:
                await asyncio.sleep(0.5)
            during(c)
            return await task

    return run(go(), loop=VirtualLoop())


def test_ssgd_on_a_ring_with_a_kill_ends_with_every_survivor_holding_one_model() -> None:
    # 0.05 s per iteration, then ~14 ms of allreduce around ring-8 (the 16 floats in one piece):
    # node 3 dies inside the allreduce of step 23, its iteration computed, the piece in flight
    s = train(ring(8), "ssgd", "kill:3@1.341", 4.5)
    t = s["training"]
    assert s["invariants"]["same_model_at_end"] == "held"
    assert s["invariants"]["strategy_finished"] == "held"
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    nodes = t["nodes"]
    survivors = [i for i in range(8) if i != 3]
    assert nodes["3"]["outcome"] == "killed" and 3 not in s["final_view"]["members"]
    assert all(nodes[str(i)]["outcome"] == "finished" for i in survivors)
    assert len({nodes[str(i)]["model_hash"] for i in survivors}) == 1
    assert t["steps"]["min"] == t["steps"]["max"] > nodes["3"]["step"] > 0  # one agreed stop, after the kill
    assert nodes["3"]["local_iterations"] == nodes["3"]["steps_run"] + 1  # killed mid-exchange
    assert all(nodes[str(i)]["reforms"] >= 1 for i in survivors)  # the group re-formed over the survivors
    assert all(nodes[str(i)]["audit"] == "passed" for i in survivors)  # the driver's own audit agrees
    assert t["promise"] == "every_step" and t["finished"] == 7


def test_every_node_ends_after_the_finish_barrier_with_one_reply() -> None:
    # as NodeRuntime.finish: after the agreed stop every node waits in the barrier, gets the
    # one reply (node 3 declared failed), and its process ends. The coordinator ends first
    # (nobody is behind it): its replies still sit in its links' shapers (1 ms), and its
    # transport's close sends them. When the simulated process ended without closing, they
    # were lost: every node in turn waited, took over and ended (3 s each)
    s = train(ring(8), "ssgd", "kill:3@1.341", 4.5)
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    assert s["invariants"]["finish_barrier"] == s["invariants"]["quiet_end"] == "held"
    nodes = s["training"]["nodes"]
    survivors = [i for i in range(8) if i != 3]
    assert all(nodes[str(i)]["barrier"] == {"finished": survivors, "failed": [3]} for i in survivors)
    last = max(nodes[str(i)]["finished_at"] for i in survivors)
    assert all(0 < nodes[str(i)]["barrier_at"] - last < 0.1 for i in survivors)
    assert sorted(int(n) for n in s["left"]) == survivors and s["ended_at_s"] >= 4.5
    assert max(s["left"].values()) - s["ended_at_s"] < 0.1  # the others right after the first
    assert [d["node"] for d in s["declared"]] == [3]  # nobody is declared while they end


def test_when_the_coordinator_finishes_last_every_node_still_gets_its_reply() -> None:
    # node 0 (the coordinator) computes four times slower: under ASGD it reaches the stop last,
    # so its own barrier call returns as it replies to the others. Its RPC server closes
    # before its transport, as a node runtime's (the replies computed go out first: closed
    # transport-first, they were lost and the others elected a new coordinator, chaos seeds
    # 56066 and 56091)
    spec = TrainingSpec(strategy="asgd", step_time=0.05, step_times={0: 0.2}, seed=7)

    async def go() -> dict[str, Any]:
        async with TrainingCluster(ring(6), training=spec, opts=OPTS) as c:
            return await c.run(5.0)

    s = run(go(), loop=VirtualLoop())
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    nodes = s["training"]["nodes"]
    assert max(n["finished_at"] for n in nodes.values()) == nodes["0"]["finished_at"]  # the coordinator last
    assert all(n["barrier"] == {"finished": list(range(6)), "failed": []} for n in nodes.values())
    assert max(s["left"].values()) - s["ended_at_s"] < 3.0  # (a relay's linger, a flush to a node gone)


def test_the_finish_barrier_invariant_names_what_went_wrong() -> None:
    def ended(i: int, barrier: dict[str, Any] | None, at: float = 10.2) -> NodeTraining:
        return NodeTraining(outcome="finished", finished_at=10.0 + i / 100, barrier=barrier, barrier_at=at)

    good = {"finished": [0, 1], "failed": [2]}
    runs = {0: ended(0, good), 1: ended(1, good), 2: NodeTraining(outcome="killed")}
    assert finish_barrier_held(runs, [0, 1, 2], bound=5.0) == inv.HELD
    assert finish_barrier_held({}, [0, 1, 2], bound=5.0) == inv.HELD  # nobody finished: nothing to wait for
    got = finish_barrier_held({**runs, 1: ended(1, {"finished": [0, 1], "failed": []})}, [0, 1, 2], bound=5.0)
    assert "node 1: the barrier ended without nodes [2]" in got and "the replies differ" in got
    got = finish_barrier_held({**runs, 0: ended(0, {}), 1: ended(1, None)}, [0, 1, 2], bound=5.0)
    assert "node 0: the barrier failed (no reply)" in got and "node 1: still in the barrier at the end" in got
    got = finish_barrier_held({**runs, 1: ended(1, {"finished": [1], "failed": [0, 2]})}, [0, 1, 2], bound=5.0)
    assert "node 1: the barrier's reply does not list finished nodes [0]" in got
    assert "came 6.000s after" in finish_barrier_held({**runs, 0: ended(0, good, at=16.01)}, [0, 1, 2], bound=5.0)
    # a node killed in the barrier (it finished, then its process died) waits for no reply
    assert finish_barrier_held({**runs, 1: ended(1, None)}, [0, 1, 2], bound=5.0, killed={1}) == inv.HELD


def test_a_declaration_after_the_first_process_ended_is_a_violation_unless_a_fault_came_then() -> None:
    views = [inv.ViewSeen(t=1.0, node=1, term=0, epoch=1, coordinator=0, members=(0, 1, 2)),
             inv.ViewSeen(t=14.0, node=1, term=1, epoch=2, coordinator=1, members=(1, 2))]
    assert inv.quiet_end(views, [], 20.0, bound=2.5) == inv.HELD  # (before the end: the other invariants')
    got = inv.quiet_end(views, [], 12.0, bound=2.5)
    assert inv.violated(got) and "node 0 by 1 (term 1) at 14.000s" in got
    assert inv.quiet_end(views, parse_faults("kill:0@11", [0, 1, 2]), 12.0, bound=2.5) == inv.HELD  # its fault
    assert inv.violated(inv.quiet_end(views, parse_faults("kill:2@11", [0, 1, 2]), 12.0, bound=2.5))  # another's
    assert inv.quiet_end(views, parse_faults("kill:0@5", [0, 1, 2]), 12.0, bound=2.5) != inv.HELD  # long before


@pytest.mark.parametrize("strategy", ["ssgd", "dts", "diloco"])
def test_a_step_budget_ends_every_node_at_it_and_the_run_at_once(strategy: str) -> None:
    # 100 steps of 0.05 s: the budget, not the 60 virtual seconds, ends the run
    s = train(ring(6), strategy, "", 60, steps=100)
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    t = s["training"]
    assert t["finished"] == 6 and t["steps"] == {"min": 100, "max": 100}
    assert 5.0 < s["ended_at_s"] < 8.0 and t["ended_at_s"] < 10.0  # (the summary right after)


def test_faults_after_a_run_that_reached_its_budget_never_begin_and_are_not_judged() -> None:
    s = train(ring(6), "ssgd", "pause:4@4.5+10,kill:2@9", 60, steps=100)  # (the run ends at ~7 s)
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    assert s["faults_not_begun"] == ["kill:2@9"] and s["training"]["nodes"]["2"]["outcome"] == "finished"
    # node 4, paused before the stop, is declared failed before the barrier ends (it waits for it)
    assert [d["node"] for d in s["declared"]] == [4] and s["training"]["finished"] == 5
    assert all(n["barrier"]["failed"] == [4] for i, n in s["training"]["nodes"].items() if i != "4")


def test_a_diloco_joiner_that_adopts_the_operation_carrying_the_stop_takes_no_step_past_the_budget() -> None:
    # node 3 rejoins while the members' first operation is the one at their budget (inner_steps
    # 500 > 100): it adopts that operation, which carries the stop. It ran one more inner step
    # (step 100, past the budget) and brought it into the final sync (every model held it)
    s = train(ring(6), "diloco", "kill:3@1,restart:3@3", 60, steps=100)
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    nodes = s["training"]["nodes"]
    assert {n["step"] for n in nodes.values()} == {100} and nodes["3"]["adopted"] == 1
    assert nodes["3"]["local_iterations"] == 0  # it joined at the stop: nothing left to compute
    assert all(n["local_iterations"] == 100 for i, n in nodes.items() if i != "3")


class _FailsOnNode3(SSGD):
    """SSGD whose node 3 fails at step 20 (a device that breaks) with :attr:`error`, or, with
    :attr:`after_stop`, half a second after its loop's agreed stop (others finished)."""

    error: type[Exception] = TrainingError
    after_stop = False

    async def run_step(self, step: int, want_stop: bool) -> StepReport:
        if self.ctx.node_id == 3 and step == 20 and not self.after_stop:
            raise self.error("node 3's device failed")
        rep = await super().run_step(step, want_stop)
        if self.ctx.node_id == 3 and rep.stop and self.after_stop:
            await asyncio.sleep(0.5)
            raise self.error("node 3's device failed")
        return rep


def _failing(cls: type[SSGD]) -> dict[str, Any]:
    spec = TrainingSpec(strategy="ssgd", step_time=0.05, seed=7)

    async def go() -> dict[str, Any]:
        async with TrainingCluster(ring(6), training=spec, opts=OPTS) as c:
            c.strategy_cls = cls
            return await c.run(5.0)

    return run(go(), loop=VirtualLoop())


@pytest.mark.parametrize("error", [TrainingError, ValueError])
def test_a_node_whose_strategy_fails_exits_and_the_others_re_form_without_it(error: type[Exception]) -> None:
    # as a real process: its runtime closes and it exits (a P2PSyncError), or it crashes (any
    # other error, a defect), so its peers detect it within the bound and re-form. Before, the
    # simulated node kept heartbeating with no strategy, and the others waited for it in their
    # allreduce until the end (none finished); an error other than a P2PSyncError was not even
    # recorded (the node showed as "running")
    s = _failing(type("Fails", (_FailsOnNode3,), {"error": error}))
    t = s["training"]
    assert t["nodes"]["3"]["outcome"] == "error" and "device failed" in t["nodes"]["3"]["error"]
    assert [e["node"] for e in s["exited"]] == [3] and s["killed"] == []
    # the error is the run's one violation: every other invariant holds, the exit counted as a kill
    bad = {k: v for k, v in s["invariants"].items() if inv.violated(v)}
    crash = error is not TrainingError  # (a crash is a defect of its own: no_crash)
    assert sorted(bad) == (["no_crash", "strategy_finished"] if crash else ["strategy_finished"]), bad
    assert f"3 (error at step 20: {error.__name__}: node 3's device failed)" in bad["strategy_finished"]
    if crash:
        assert bad["no_crash"].endswith("node 3 (process 1): ValueError: node 3's device failed")
    assert [d["node"] for d in s["declared"]] == [3] and 3 not in s["final_view"]["members"]
    assert [d["exit"] for d in s["detections"]] == [True]  # (the exit's detection, in the bound)
    assert t["finished"] == 5 and s["invariants"]["same_model_at_end"] == "held"
    assert all(t["nodes"][str(i)]["reforms"] >= 1 for i in (0, 1, 2, 4, 5))


def test_an_exit_after_the_others_finished_is_given_its_detection_time_before_the_summary() -> None:
    # the others' loops ended; node 3's process ends half a second later: the summary waits
    # for its detection instead of reporting it undetected
    # (promising no single model, the members run no audit at the stop, which would wait for node 3)
    s = _failing(type("FailsLate", (_FailsOnNode3,), {"after_stop": True, "identical_replicas": "never"}))
    bad = {k: v for k, v in s["invariants"].items() if inv.violated(v)}
    assert list(bad) == ["strategy_finished"], bad
    assert [d["node"] for d in s["declared"]] == [3] and s["training"]["finished"] == 5
    assert s["exited"][0]["at"] > max(n.get("finished_at", 0) for n in s["training"]["nodes"].values()
                                      if n["outcome"] == "finished")


def test_a_model_that_changes_after_its_agreed_stop_is_a_violation() -> None:
    d = [("l0.weight", b"\x01" * 8)]
    assert same_model("ssgd", "every_step", {0: d, 1: d}, later={0: d, 1: d}) == inv.HELD
    got = same_model("ssgd", "every_step", {0: d, 1: d}, later={0: d, 1: [("l0.weight", b"\x02" * 8)]})
    assert got == "node(s) [1] changed their model after the agreed stop"


def test_the_invariant_names_a_replica_that_diverged() -> None:
    def diverge(c: TrainingCluster) -> None:
        c.replicas[5].params[0] += np.float32(1e-3)  # a bit flip ssgd cannot see: it averages gradients

    s = train(ring(8), "ssgd", "", 2.0, during=diverge)
    got = s["invariants"]["same_model_at_end"]
    assert inv.violated(got) and "node(s) [5] hold a different model than node 0" in got and "l0.weight" in got
    assert s["invariants"]["strategy_finished"] == "held"
    # the driver's audit at the stop sees it too, on every member alike
    assert all(n["audit"].startswith("mismatch: replica audit at step") for n in s["training"]["nodes"].values())


@pytest.mark.parametrize("strategy", SIMULATED)
def test_every_simulated_strategy_survives_a_kill_to_an_agreed_stop(strategy: str) -> None:
    options = {"inner_steps": "5"} if strategy == "diloco" else {}
    s = train(ring(6), strategy, "kill:4@1.5", 5.0, step_time=0.1, **options)
    t = s["training"]
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    assert t["nodes"]["4"]["outcome"] == "killed" and t["finished"] == 5
    assert all(n["steps_run"] > 0 and n["local_iterations"] > 0 for n in t["nodes"].values())
    same = s["invariants"]["same_model_at_end"]
    if t["promise"] == "never":
        assert same.startswith(inv.NOT_PROMISED) and strategy in same and not inv.violated(same)
    else:
        assert same == "held"


@pytest.mark.parametrize("strategy", sorted(REFUSED))
def test_a_strategy_that_is_not_simulated_is_refused_naming_it(strategy: str) -> None:
    with pytest.raises(ConfigError, match=f"--strategy {strategy}: not simulated"):
        TrainingSpec(strategy=strategy)


def test_same_model_compares_the_digests_of_the_nodes_that_finished() -> None:
    row = [("w", b"\x01" * 8), ("b", b"\x02" * 8)]
    odd = [("w", b"\x01" * 8), ("b", b"\x03" * 8)]
    assert same_model("ssgd", "every_step", {0: row, 1: row, 4: row}) == "held"
    got = same_model("ssgd", "end", {0: row, 1: odd, 4: row})
    assert got == "node(s) [1] hold a different model than node 0 (1 of 2 tensors differ; first: 'b')"
    assert same_model("asgd", "never", {0: row, 1: odd}).startswith("not promised: asgd")
    assert inv.violated(same_model("ssgd", "every_step", {}))
    nodes = {"0": {"outcome": "finished", "step": 9}, "1": {"outcome": "error", "step": 4, "error": "NoQuorum: x"}}
    assert strategy_finished(nodes, [0]) == "held"
    assert strategy_finished(nodes, [0, 1]) == "live node(s) that did not end at an agreed stop: 1 (error at " \
                                               "step 4: NoQuorum: x)"


def test_the_replica_computes_in_virtual_time_and_stops_at_an_abort() -> None:
    async def go() -> tuple[float, float, bool]:
        rep = SimReplica(node_id=2, seed=1, step_time=0.25)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        loss, grad = await rep.compute_gradients()
        took = loop.time() - t0
        abort = AbortEvent()
        loop.call_later(0.1, abort.set)
        t1 = loop.time()
        try:
            await rep.compute_gradients(abort)
            aborted = False
        except Aborted:
            aborted = True
        assert grad.dtype == np.float32 and grad.size == rep.numel and loss > 0 and rep.iterations == 1
        return took, loop.time() - t1, aborted

    took, cut, aborted = run(go(), loop=VirtualLoop())
    assert took == 0.25 and cut == pytest.approx(0.1) and aborted


def test_step_times_parse_with_per_node_overrides() -> None:
    assert parse_step_time("0.2") == (0.2, {})
    assert parse_step_time("0.2,3:1.5,0:0") == (0.2, {3: 1.5, 0: 0.0})
    with pytest.raises(ConfigError, match="NODE:SECONDS"):
        parse_step_time("0.2,x")
    with pytest.raises(ConfigError, match="nodes \\[9\\]"):
        TrainingCluster(ring(4), training=TrainingSpec(strategy="ssgd", step_times={9: 1.0}))


def test_the_cli_trains_replays_and_chaos_takes_the_strategy(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "ring:6", "--strategy", "ssgd", "--step-time", "0.1,2:0.15", "--faults", "kill:4@1",
               "--virtual-seconds", "5", "--out", str(tmp_path / "a")])
    assert rc == 0
    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert s["training"]["strategy"] == "ssgd" and s["invariants"]["same_model_at_end"] == "held"
    assert "ssgd: 5 of 6 nodes finished" in capsys.readouterr().out
    replay = shlex.split(s["replay"])
    assert "--strategy" in replay and "0.1,2:0.15" in replay
    assert main([*replay[1:], "--out", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["digest"] == s["digest"]
    # a strategy that promises no single model: said, and no violation
    assert main(["sim", "ring:4", "--strategy", "asgd", "--virtual-seconds", "2", "--out", str(tmp_path / "c")]) == 0
    assert "same_model_at_end: NOT PROMISED: asgd" in capsys.readouterr().err
    assert main(["sim", "ring:4", "--strategy", "canary", "--out", str(tmp_path)]) == 2
    assert "--strategy canary: not simulated" in capsys.readouterr().err
    assert main(["sim", "ring:4", "--opt", "sync=step", "--out", str(tmp_path)]) == 2
    runs = chaos([("ring:4", ring(4))], runs=1, seed=3, count=1, virtual_seconds=6.0, opts=OPTS,
                 replay=lambda t, s, f, spec: f"replay {t} {s}", training=TrainingSpec(strategy="ssgd", step_time=0.1))
    assert runs[0].events > 0 and runs[0].replay == "replay ring:4 3"
    assert "crashed" not in runs[0].broken


def test_chaos_with_several_strategies_pairs_every_topology_with_every_strategy(tmp_path: Path, capsys: Any) -> None:
    specs = [TrainingSpec(strategy=n, step_time=0.1) for n in ("ssgd", "asgd")]
    seen: list[tuple[str, str | None]] = []
    runs = chaos([("ring:4", ring(4)), ("mesh:4", mesh(4))], runs=4, seed=5, count=1, virtual_seconds=4.0, opts=OPTS,
                 replay=lambda t, s, f, spec: seen.append((t, spec and spec.strategy)) or "", training=specs)
    assert seen == [("ring:4", "ssgd"), ("mesh:4", "ssgd"), ("ring:4", "asgd"), ("mesh:4", "asgd")]
    assert [r.strategy for r in runs] == ["ssgd", "ssgd", "asgd", "asgd"]
    assert "| asgd | 2 |" in table(runs)
    # the command line: a list of strategies with --runs only, and no --opt with it
    assert main(["sim", "ring:4", "--strategy", "ssgd,asgd", "--out", str(tmp_path)]) == 2
    assert "a comma list of them with --runs" in capsys.readouterr().err
    assert main(["sim", "ring:4", "--runs", "2", "--faults", "random:1", "--strategy", "ssgd,asgd",
                 "--opt", "x=1", "--out", str(tmp_path)]) == 2
    assert "--opt names one strategy's options" in capsys.readouterr().err
    assert main(["sim", "ring:4", "--runs", "2", "--faults", "random:1", "--virtual-seconds", "6",
                 "--strategy", "ssgd,asgd", "--out", str(tmp_path)]) in (0, 1)
    rows = json.loads((tmp_path / "chaos.json").read_text())
    assert [r["strategy"] for r in rows] == ["ssgd", "asgd"] and "--strategy asgd" in rows[1]["replay"]


def test_simulate_with_a_strategy_is_deterministic() -> None:
    spec = TrainingSpec(strategy="ssgd", step_time=0.1, seed=2)
    a, b = (simulate(ring(5), parse_faults("kill:1@1", range(5)), OPTS, 4.0, spec) for _ in range(2))
    assert a["digest"] == b["digest"] and a["training"]["nodes"] == b["training"]["nodes"]


def test_a_restarted_node_joins_ssgd_and_ends_with_the_others_model() -> None:
    # node 3 killed at 5 s and restarted at 12 s: its new process registers, starts SSGD as a
    # joiner (a fresh replica: the run's initial model), adopts the members' state and step
    s = train(ring(8), "ssgd", "kill:3@5,restart:3@12", 20.0, step_time=0.1)
    t = s["training"]
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    assert s["invariants"]["same_model_at_end"] == "held" and s["invariants"]["strategy_finished"] == "held"
    n3 = t["nodes"]["3"]
    assert n3["outcome"] == "finished" and n3["incarnation"] == 2 and n3["adopted"] >= 1
    assert n3["step"] == t["steps"]["min"] == t["steps"]["max"] and n3["audit"] == "passed"
    assert len({n["model_hash"] for n in t["nodes"].values()}) == 1 and t["finished"] == 8 and t["rejoined"] == [3]
    assert 12.0 < n3["joined_training_at"] < 13.0 and n3["steps_run"] < n3["step"]  # it started mid-run
    (old,) = n3["earlier"]  # the killed process: its own model and step, kept apart
    assert old["incarnation"] == 1 and old["outcome"] == "killed" and 0 < old["step"] < n3["step"]
    assert old["model_hash"] != n3["model_hash"]
    assert 3 in s["final_view"]["members"]


@pytest.mark.parametrize("strategy", ["ssgd", "diloco"])
def test_a_member_removed_while_paused_is_fenced_at_its_next_step_and_rejoins(strategy: str) -> None:
    # node 2 paused at 3 s for 6 s is removed; resumed, its step loop waits for the majority
    # (its coordinator's claim expired during the pause) and its next heartbeat's answer
    # fences it: it ends with Fenced (exit 75, started again), not with a PeerFailure of its
    # strategy, and takes no step as a member after the pause (DiLoCo's inner steps are local)
    s = train(ring(6), strategy, "pause:2@3+6", 20.0)
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    (first,) = s["training"]["nodes"]["2"]["earlier"]
    assert first["outcome"] == "fenced" and "error" not in first
    assert first["steps_run"] <= 3.0 / 0.05 + 1
    assert [(e["node"], e["fenced"]) for e in s["exited"]] == [(2, True)] and 9.0 <= s["exited"][0]["at"] < 9.5
    assert s["training"]["rejoined"] == [2] and s["training"]["nodes"]["2"]["outcome"] == "finished"


@pytest.mark.parametrize("strategy", SIMULATED)
def test_every_simulated_strategy_takes_a_restarted_node_back_as_a_joiner(strategy: str) -> None:
    # restart:2@4 kills the running process first; the new one joins the run going
    options = {"inner_steps": "5"} if strategy == "diloco" else {}
    s = train(ring(6), strategy, "restart:2@4", 10.0, step_time=0.1, **options)
    t = s["training"]
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    n2 = t["nodes"]["2"]
    assert n2["outcome"] == "finished" and n2["incarnation"] == 2 and n2["adopted"] >= 1 and n2["steps_run"] > 0
    assert t["finished"] == 6 and t["rejoined"] == [2] and "excused" not in n2
    if t["promise"] != "never":  # the joiner adopted the members' state: one model at the end
        assert s["invariants"]["same_model_at_end"] == "held" and n2["audit"] == "passed"


def test_a_node_restarted_too_late_to_join_the_training_ends_with_the_run_which_does_not_wait_for_it() -> None:
    # restarted while the members run the step at which they agree to stop (from 8 s on): it
    # registers at once (its previous process was declared failed long before), but the
    # members stop before its strategy joins the training. The barrier waited for it until its
    # timeout (30 s: every reply incomplete, a livelock of the virtual loop at its end); now,
    # once every member finished (and a failure timeout and two heartbeats more, for the
    # heartbeat of a joiner that did join), the coordinator departs it and it ends (RunEnded:
    # not started again)
    s = train(ring(6), "ssgd", "kill:1@2,restart:1@8.08", 8.0, step_time=0.1)
    t = s["training"]
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    n1 = t["nodes"]["1"]
    assert n1["outcome"] == "fenced" and n1["excused"].startswith("came back as the run ended") and n1["steps_run"] == 0
    assert t["finished"] == 5 and t["rejoined"] == [] and s["restarts"][0]["joined_after_s"] is not None
    assert "left the run as it ended" in s["exited"][0]["error"] and len(s["restarts"]) == 1  # (no relaunch)
    survivors = [0, 2, 3, 4, 5]
    assert all(t["nodes"][str(i)]["barrier"] == {"finished": survivors, "failed": [], "ended": [1]}
               for i in survivors)
    last = max(t["nodes"][str(i)]["finished_at"] for i in survivors)
    assert all(t["nodes"][str(i)]["barrier_at"] - last < 4.0 for i in survivors)  # (a relay lingers 0.5 s)


def test_excused_spares_only_a_restarted_process_that_could_not_join_before_the_stop() -> None:
    late = dict(started_at=20.0, failed=None, trained_at=None, stop=30.0, pending=False, join_s=10.0)
    assert not excused(**{**late, "started_at": None}, joined_at=None)  # a first process: never
    assert excused(**late, joined_at=25.0)  # registered within join_s of the stop, not training
    assert not excused(**late, joined_at=15.0)  # registered in time: it had to join
    assert not excused(**{**late, "trained_at": 26.0}, joined_at=25.0)  # it joined: it must finish
    assert excused(**{**late, "trained_at": 31.0}, joined_at=25.0)  # joined after the stop
    assert not excused(**{**late, "failed": "PeerTimeout: x"}, joined_at=None)  # its rendezvous failed
    assert excused(**{**late, "pending": True}, joined_at=None)  # not registered, restarted late
    assert not excused(**late, joined_at=None)  # not registered though restarted in time


def test_a_restart_just_before_the_stop_joins_and_stops_with_the_others() -> None:
    # restarted 0.1 s before the nodes want to stop: it joins within a step and takes part in
    # the agreement on the stop (one step, the members' model)
    s = train(ring(6), "ssgd", "kill:1@2,restart:1@7.9", 8.0, step_time=0.1)
    n1 = s["training"]["nodes"]["1"]
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    assert n1["outcome"] == "finished" and n1["step"] == s["training"]["steps"]["max"] and n1["adopted"] == 1
    assert s["invariants"]["same_model_at_end"] == "held"


def test_asgd_applies_each_gradient_once_across_a_rejoin(monkeypatch: pytest.MonkeyPatch) -> None:
    """While node 3's rejoin view reaches the nodes one after another, nodes holding the old
    and the new view forward node 4's gradients along different trees, so nodes 0 and 1 send
    some back and forth. Each node process takes (applies and forwards) every gradient
    ``(origin, incarnation, step)`` once and drops the copies; none is lost across the rejoin:
    from step 100 on every gradient reaches every other process training then."""
    taken: Counter[tuple[int, int, int, int, int]] = Counter()  # (node, its inc, origin, inc, step)
    strategies: list[ASGD] = []
    take, init = ASGD._take, ASGD.__init__

    def recording_take(self: ASGD, msg: Message) -> tuple[int, int, np.ndarray] | None:
        got = take(self, msg)
        if got is not None:
            taken[(self.ctx.node_id, self.ctx.transport.incarnation, got[0], got[1], msg.header.step)] += 1
        return got

    def recording_init(self: ASGD, ctx: StrategyContext) -> None:
        init(self, ctx)
        strategies.append(self)

    monkeypatch.setattr(ASGD, "_take", recording_take)
    monkeypatch.setattr(ASGD, "__init__", recording_init)
    s = train(ring(8), "asgd", "kill:3@5,restart:3@12", 14.0, step_time=0.1)
    nodes = s["training"]["nodes"]
    assert all(nodes[str(i)]["outcome"] == "finished" for i in range(8))
    # with the kill alone every loss stays under 1 (0.36 to 0.83)
    assert max(nodes[str(i)]["loss"] for i in range(8)) < 2.0
    assert taken and max(taken.values()) == 1, taken.most_common(3)
    assert sum(st.duplicates for st in strategies) > 0  # the copies came, and were dropped
    assert sum(st.too_old for st in strategies) == 0
    takers: dict[tuple[int, int, int], set[tuple[int, int]]] = {}
    for node, inc, origin, oinc, step in taken:
        takers.setdefault((origin, oinc, step), set()).add((node, inc))
    survivors = {(i, 1) for i in range(8) if i != 3}
    for (origin, oinc, step), who in takers.items():
        if step >= 100 and (origin, oinc) != (3, 2):  # the restarted process trains from step ~120 on
            assert who | {(origin, oinc)} >= survivors, (origin, oinc, step, sorted(who))
        if (origin, oinc) == (3, 2):  # the restarted process's gradients reach everyone
            assert who == survivors, (step, sorted(who))


def test_a_group_cut_apart_by_removed_nodes_waits_for_a_new_view_instead_of_redoing_at_once() -> None:
    """Chaos seed 304: once node 2's old process is declared failed, the members [0, 1, 3, 4,
    5, 6] of ring-8 are cut apart by the removed nodes 2 and 7. Each SSGD step failed at once
    and asked for a redo naming them, which the coordinator granted (they are no suspects):
    a new view, the same failure, over 200,000 views in no virtual time (the loop now ends
    such a run as a livelock). A redo naming a node that is no member is refused; the members
    wait until node 2's new process rejoins, and every invariant holds."""
    topo = ring(8)
    s = simulate(topo, parse_faults("kill:7@6.298,restart:2@14.02,kill:0@23.943", topo.ids), OPTS, 40.0,
                 TrainingSpec(strategy="ssgd", step_time=0.1))
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    t = s["training"]
    assert t["nodes"]["2"]["outcome"] == "finished" and t["nodes"]["2"]["incarnation"] == 2
    assert s["views_applied"] < 2000, s["views_applied"]


def test_esync_members_a_round_apart_after_a_kill_meet_in_the_new_views_sync() -> None:
    # node 5 dies as the aggregation of a round ends: the nodes on one side of it completed the
    # round, the others failed it. The ones ahead trained on, waiting for the State Server's
    # READY, which waits for the slowest member to start the round, while the ones behind
    # waited in the new view's state sync for them: no node ever finished (found by the
    # mixed-strategy chaos runner, seed 2). A new view now ends the local iterations.
    s = train(ring(16), "esync", "kill:5@5.0", 12.0, step_time=0.1)
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    t = s["training"]
    assert t["finished"] == 15 and s["invariants"]["strategy_finished"] == "held"
    assert sum(n.get("adopted", 0) for n in t["nodes"].values()) >= 1  # the ones behind took the round


def test_with_no_majority_left_anywhere_no_node_is_held_to_finish() -> None:
    # three kills cut ring-16 into arcs: 2-5 is cut off and removed, then 7-10 and 12-15,0 hold
    # 4 and 5 of the view's 10 members, so no member may step. No node can finish: not
    # promised, no violation
    s = train(ring(16), "preduce", "kill:1@5,kill:6@10,kill:11@15", 25.0, step_time=0.1)
    assert s["majority_at_end"] is False and s["training"]["finished"] == 0
    assert s["final_view"]["members"] == [0, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    for name in ("strategy_finished", "same_model_at_end"):
        assert s["invariants"][name].startswith(inv.NOT_PROMISED) and "no group of live nodes" in s["invariants"][name]
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}


def test_a_fenced_arc_is_started_again_and_its_joiners_wait_for_a_way_to_the_members() -> None:
    # nodes 1-5 are partitioned off and removed; as the launcher does, each fenced process is
    # started again (RELAUNCH_S later) and joins. Node 3's new process joined while its two
    # ring neighbours' new processes were not members yet: every way to the members crossed
    # them, and P-Reduce's fetch of the state failed at once ("no live member gave its state
    # (none reachable)"), so the process exited. It now asks again until a way opens. Then
    # node 11 dies: the ring keeps a majority, and every live node finishes (seed 6 of the
    # runner, which left no majority anywhere while the simulation restarted no fenced node)
    s = train(ring(16), "preduce", "partition:1-5|0.6-15@10.201+5.365,kill:11@22.815", 30.0, step_time=0.1)
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    assert sorted(e["node"] for e in s["exited"]) == [1, 2, 3, 4, 5] and all(e["fenced"] for e in s["exited"])
    assert sorted(r["node"] for r in s["restarts"] if r.get("relaunch")) == [1, 2, 3, 4, 5]
    t = s["training"]
    assert t["rejoined"] == [1, 2, 3, 4, 5] and t["finished"] == 15
    assert all(t["nodes"][str(i)]["earlier"][0]["outcome"] == "fenced" for i in range(1, 6))
    from p2psync.cli.launch import MAX_RESTARTS
    from p2psync.sim.training import RELAUNCHES

    assert RELAUNCHES == MAX_RESTARTS  # (the simulation restarts fenced nodes as the launcher does)


def test_dts_after_a_split_that_cut_the_coordinator_off_ends_at_an_agreed_stop() -> None:
    # BCube(4, 2) split 0-6 | 7-15 for 3.8 s (chaos seed 40130): the majority's nodes never
    # ended their loops (running at steps 100 and 107 long after the stop) until requests were
    # resent over every equal-cost relay (test_sim_membership's spread test): the resends of
    # their calls to the new coordinator all went into the cut
    from p2psync.topology import bcube

    # (the minority's seven fenced processes are started again and join: all 16 finish)
    s = train(bcube(4, 2), "dts", "partition:0-6|7-15@9.441+3.797", 40.0, step_time=0.1)
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    assert s["invariants"]["strategy_finished"] == "held" and s["training"]["finished"] == 16
    assert s["training"]["rejoined"] == list(range(7))


def test_a_shaped_send_waiting_for_a_cut_link_lets_virtual_time_move_on() -> None:
    # BCube(4, 2), node 3 cut off, asgd (chaos seed 50042): an RPC resent over a cut link near
    # its deadline gave the shaped send a budget below the loop's clock resolution; each wait
    # for the connection ended at once and the call was resent at once: 5 M callbacks without
    # virtual time moving on. A send waits for its connection at least a millisecond at a time.
    from p2psync.topology import bcube

    s = train(bcube(4, 2), "asgd", "partition:3|0-2.4-15@9.415+6.804", 40.0, step_time=0.1)
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}


def test_a_push_whose_acknowledgements_are_late_is_lost_not_the_end_of_training() -> None:
    # mesh-8, every link between 0-3 and 4-7 slowed 3343 times (3.3 s one way) for 6.6 s: a
    # push's acknowledgements from the far owners came after the store's 5 s timeout, and the
    # PeerTimeout ended the training of every node (chaos seed 60024, ssp; 60008 and 60009,
    # elastic_bsp). A push whose acknowledgements are late is counted lost; whether an owner
    # failed is the views' to say.
    from p2psync.topology import mesh as mesh_topo

    s = train(mesh_topo(8), "ssp", "slow:4-7|0-3@11.105+6.605x3342.9", 30.0, step_time=0.1)
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    assert s["training"]["finished"] >= 7


def _replayed(tmp_path: Path, replay: str) -> dict[str, Any]:
    """The summary of ``p2psync <replay>`` (a chaos seed's replay command), every invariant held."""
    assert main([*replay.split(), "--out", str(tmp_path)]) == 0
    s: dict[str, Any] = json.loads((tmp_path / "summary.json").read_text())
    assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
    return s


def test_a_joiner_that_heard_of_a_newer_term_waits_for_a_view_before_its_strategy_starts(tmp_path) -> None:
    # chaos seed 53148: nodes 4 and then 2 of ring:16 killed, node 2 restarted at 24.1 s. While
    # discovering the run, node 2's new process heard of a takeover's term 1; coordinator 0,
    # still in term 0, admitted it, but the joiner applied none of its term-0 views (a node
    # applies no view below a term it heard of), so its strategy started without a view, took
    # the stop policy and refused to join ("joining a running run needs --on-failure continue"):
    # the members, with node 2 in their view, waited for it forever. The joiner now waits for its
    # first view (coordinator 0 is re-elected in term 2), then joins.
    replay = ("sim ring:16 --seed 53148 --faults kill:4@8.308,kill:2@19.358,restart:2@24.118 --virtual-seconds 40 "
              "--latency-ms 1 --heartbeat 0.5 --failure-timeout 2 --strategy ssgd --step-time 0.1")
    s = _replayed(tmp_path, replay)
    t = s["training"]
    # (node 3, stranded behind the dead 2 and 4 and removed, was fenced once 2 rejoined, and
    # its new process joined too)
    assert t["rejoined"] == [2, 3] and t["finished"] == 15, t["nodes"]["2"]


def test_a_minority_cut_off_as_a_step_budget_ends_is_left_behind_not_held_to_finish(tmp_path) -> None:
    # chaos seed 56238: nodes 4-9 of BCube(4, 2) are cut off at their last step (249 of 250)
    # for 2.7 s; the majority declares them failed, finishes and ends before the heal, and
    # nobody is left to tell them: they wait for a majority (until --quorum-timeout). The
    # invariants held them to finish (and to the final view): they are left behind now
    replay = ("sim bcube:4x2 --seed 56238 --faults partition:7-11|0-6.12-15@10.06+3.359,partition:4-9|0-3.10-15"
              "@24.28+2.679 --virtual-seconds 40 --latency-ms 1 --heartbeat 0.5 --failure-timeout 2 "
              "--strategy diloco --step-time 0.1 --steps 250")
    s = _replayed(tmp_path, replay)
    assert s["left_behind"] == [4, 5, 6, 7, 8, 9] and s["training"]["finished"] == 10
    assert {int(d["node"]) for d in s["declared"]} >= set(s["left_behind"])


def test_a_restart_or_a_kill_as_a_step_budget_ends_is_judged_by_when_the_run_ended(tmp_path) -> None:
    # chaos seed 56233: node 10 restarted at 24.997 s, as the budget ended the run (~25.5 s):
    # judged by the virtual seconds (40), it had time to rejoin and finish; by the end, none
    replay = ("sim mesh:16 --seed 56233 --faults slow:12@8.529+9.658x148.3,restart:10@24.997 --virtual-seconds 40 "
              "--latency-ms 1 --heartbeat 0.5 --failure-timeout 2 --strategy dts --step-time 0.1 --steps 250")
    s = _replayed(tmp_path, replay)
    assert s["training"]["nodes"]["10"]["excused"].startswith("restarted too late") and s["ended_at_s"] < 30
    # chaos seed 56269, its last kill moved to just after the run ended (31.38 s): node 5 killed
    # at 31.5 s; the invariants held it to the view's end; a fault due once the run ended does
    # not begin
    replay = ("sim mesh:16 --seed 56269 --faults pause:9@6.664+6.896,kill:15@20.154,kill:5@31.5 "
              "--virtual-seconds 40 --latency-ms 1 --heartbeat 0.5 --failure-timeout 2 --strategy preduce "
              "--step-time 0.1 --steps 250")
    s = _replayed(tmp_path, replay)
    assert s["faults_not_begun"] == ["kill:5@31.5"] and s["training"]["nodes"]["5"]["outcome"] == "finished"


def test_a_parameter_store_worker_that_counts_a_slow_coordinator_failed_asks_for_a_new_view(tmp_path) -> None:
    # chaos seed 54106 (BCube(4, 2), here on the smaller BCube(3, 2)): coordinator 0 slowed 1218
    # times (1.2 s one way); node 1 took over, and node 0's neighbours counted it failed (a
    # deposed coordinator), so their pushes and pulls to its shard failed. Node 1 heard node 0
    # and kept it, no newer view came, and after the peer timeout they ended their training
    # ("ssp: peer 0 failed"). A worker now asks the coordinator for a new view, as the
    # re-forming strategies do: it moves the epoch on over the same members, and the workers
    # count node 0 alive again
    replay = ("sim bcube:3x2 --seed 1 --faults slow:0@3+9.5x1217.7 --virtual-seconds 16 --latency-ms 1 "
              "--heartbeat 0.5 --failure-timeout 2 --strategy ssp --step-time 0.1")
    s = _replayed(tmp_path, replay)
    assert s["training"]["finished"] == 9 and s["exited"] == [] and s["declared"] == []


def test_the_views_of_a_fenced_node_s_new_process_declare_nobody(tmp_path) -> None:
    # chaos seed 54281: nodes 6-8 of mesh-16 partitioned off, removed and fenced; their new
    # processes joined. Node 6's new process's first view did not name 7 and 8 yet, and the
    # invariants compared it with the last view of node 6's fenced process (naming them): a
    # declaration of 7 and 8 with no fault on them
    replay = ("sim mesh:16 --seed 54281 --faults kill:1@5.125,partition:6-8|0-5.9-15@17.522+9.156 "
              "--virtual-seconds 40 --latency-ms 1 --heartbeat 0.5 --failure-timeout 2 --strategy dts --step-time 0.1")
    s = _replayed(tmp_path, replay)
    assert sorted(r["node"] for r in s["restarts"] if r.get("relaunch")) == [6, 7, 8]
    assert s["training"]["rejoined"] == [6, 7, 8]


def test_spread_floor_zero_spreads_the_model_over_every_member_as_a_real_run(tmp_path) -> None:
    # the default keeps the 16-float model in one piece (cheap at thousands of nodes); with
    # --spread-floor 0 each member owns a piece, as in a real run, and a kill mid-step
    # re-forms a collective of many pieces. The replay keeps the option
    runs = {}
    for floor in (None, 0):
        out = tmp_path / str(floor)
        extra = [] if floor is None else ["--spread-floor", str(floor)]
        assert main(["sim", "ring:6", "--faults", "kill:4@1.5", "--virtual-seconds", "5", "--strategy", "ssgd",
                     *extra, "--out", str(out)]) == 0
        runs[floor] = json.loads((out / "summary.json").read_text())
    for s in runs.values():
        assert {k: v for k, v in s["invariants"].items() if inv.violated(v)} == {}
        assert s["training"]["finished"] == 5
    one, spread = (sum(m["sent"] for m in runs[f]["messages"].values()) / max(1, runs[f]["training"]["steps"]["max"])
                   for f in (None, 0))
    assert spread > 2 * one, (one, spread)  # per step: pieces travel between every pair of ring neighbours
    assert "--spread-floor 0" in runs[0]["replay"] and "--spread-floor" not in runs[None]["replay"]
    assert main(["sim", "ring:4", "--spread-floor", "-1", "--strategy", "ssgd", "--out", str(tmp_path)]) == 2


@pytest.mark.parametrize("replay", [
    "groups:4x4 --seed 54363 --faults kill:15@8.326,restart:15@11.684,partition:11-12|0-10.13-15@21.489+2.95",
    "groups:4x4 --seed 54315 --faults partition:8|0-7.9-15@6.742+4.999,pause:0@23.832+3.592",
])
def test_a_diloco_joiner_that_takes_part_in_the_operation_carrying_the_stop_stops_with_the_members(
        tmp_path, replay: str) -> None:
    # chaos seeds 54363 and 54315: nodes joined (restarted, or started again after a fence)
    # while the leader's operation 3 was in flight; they took part in it with a zero delta and
    # applied it, but its side sum carried the stop and Operations.adopt dropped that: they
    # trained 100 more steps and launched operation 4 as fragment 0 while the members ran
    # operation 4 as the final full sync. Redone view after view, none finished
    s = _replayed(tmp_path, f"sim {replay} --virtual-seconds 40 --latency-ms 1 --heartbeat 0.5 --failure-timeout 2 "
                            "--strategy diloco --step-time 0.1")
    assert s["training"]["finished"] == 16 and s["invariants"]["same_model_at_end"] == "held"


def test_a_joiner_admitted_by_a_deposed_coordinator_is_fenced_by_the_run_s_view_and_rejoins(tmp_path) -> None:
    # chaos seed 58059: coordinator 0, gateway of site 0, slowed 3986 times (1 ms -> 4 s) from
    # 9.7 s to 15.3 s; the other sites elect node 4 (term 1) and remove site 0 (0-3). The
    # new processes of 1-3 (fenced at 18.5 s, started again at 20.5 s) register with node 0,
    # still coordinating in term 0; their earlier processes voted in term 1, so they apply
    # none of its views and wait. Node 0 is fenced at 20.5 s; at 23.0 s its new process
    # answers their heartbeats with coordinator 4's view 19 (term 3), which does not name
    # them: they applied it as their first view, their strategy started in it and ended
    # ("dts: node 1 is not a member of view 19"). That view fences them now; their next
    # processes join coordinator 4
    replay = ("sim groups:4x4 --seed 58059 --faults slow:0@9.663+5.613x3985.6 --virtual-seconds 40 --latency-ms 1 "
              "--heartbeat 0.5 --failure-timeout 2 --strategy dts --step-time 0.1")
    s = _replayed(tmp_path, replay)
    assert s["training"]["finished"] == 16 and s["training"]["rejoined"] == [0, 1, 2, 3]
    fenced = {(e["node"], e["incarnation"]) for e in s["exited"] if e.get("fenced")}
    assert {(n, 2) for n in (1, 2, 3)} <= fenced

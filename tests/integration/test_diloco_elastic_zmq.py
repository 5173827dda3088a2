"""DiLoCo when nodes leave and join, over real ZeroMQ in one process (the nodes of
tests/integration/test_leave_join_zmq.py): a crash while a fragment's sum is in flight is redone
over the survivors, which end with one model and one θ_g, the redone sum the survivors' mean
of their unchanged Δ, applied once; a restarted node adopts the leader's θ_g, outer momentum,
counters and (``join_inner_state=copy``) AdamW state, bitwise, and ends with the same model; a
member behind that adopts keeps its own inner state; the stop (final sync, closing checks,
eager's completion round) is re-formed the same way."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import numpy as np
import pytest

from p2psync.errors import PeerFailure
from p2psync.strategies.diloco import FULL
from p2psync.topology import ring
from tests.helpers import free_port, until
from tests.integration.test_leave_join_zmq import Node, _crash, _finish, _params, _train, cluster

pytestmark = pytest.mark.timeout(120)

OPTS = {"inner_steps": 4, "fragments": 2, "fragment_by": "flat", "tau": 1, "outer_lr": 0.7}


async def _crash_and_rejoin(nodes: dict[int, Node], joiner: Node) -> tuple[list[Node], list[int], list[np.ndarray]]:
    """Node ``joiner.id`` crashes; once the survivors re-formed (or adopted), ``joiner`` (its
    restart) joins the run and every node trains to the end: the group, their ends and their
    parameters."""
    survivors = await _crash(nodes, joiner.id)
    await until(lambda: all(n.strategy.regroup.reformations + n.strategy.state.adoptions >= 1 for n in survivors), 30,
                "re-formed")
    await joiner.restart()
    assert joiner.strategy.ctx.joining
    joiner.go(10_000)
    group = [*survivors, joiner]
    return group, await _finish(group), await _params(group)


def _record_rounds(lead: Any) -> tuple[list[np.ndarray], dict[int, tuple[np.ndarray, float]]]:
    """Wrap the leader's ``_begin`` and its operations' ``reduce``: its θ_g at the start (appended to the first
    list) and each outer round's sums as it received them (round -> (Σ w·Δ, Σ w))."""
    begin, reduce = lead._begin, lead.ops.reduce
    start: list[np.ndarray] = []
    sums: dict[int, tuple[np.ndarray, float]] = {}

    async def begin_and_keep() -> None:
        await begin()
        start.append(lead.state.theta.copy())

    async def keep_sums(view: Any, op: Any) -> Any:
        got = await reduce(view, op)
        if op.f != FULL:
            sums[op.k] = (np.asarray(got[0], np.float64), float(got[1][0]))
        return got

    lead._begin, lead.ops.reduce = begin_and_keep, keep_sums
    return start, sums


async def _fail_once_then_finish(nodes: dict[int, Node], late: Any, target: Callable[[Any], bool],
                                 what: str) -> tuple[list[int], tuple[list[int], list[np.ndarray], list[np.ndarray]]]:
    """``late``'s first operation that ``target`` picks fails on it alone (its sums arrived,
    then a PeerFailure); every node then trains to the end. The operation that failed (empty:
    none was reached), and every node's end, parameters and θ_g."""
    reduce = late.ops.reduce
    failed: list[int] = []

    async def fail_once(view: Any, op: Any) -> Any:
        got = await reduce(view, op)
        if target(op) and not failed:
            failed.append(op.k)
            raise PeerFailure(f"test: {what} fails on node 3 alone")
        return got

    late.ops.reduce = fail_once
    await _train(nodes, 24, warm=5)
    ends = await _finish(list(nodes.values()))
    params = await _params(list(nodes.values()))
    return failed, (ends, params, [n.strategy.state.theta for n in nodes.values()])


async def _survivors_of_a_crash_end_with_one_model(nodes: dict[int, Node], dead: int,
                                                  killed: list[asyncio.Task[None]], what: str) -> None:
    """Train, node ``dead`` crashing on the way (``killed`` holds its crash once it began), then
    finish the survivors: they agree on the end, re-formed at least once, and hold one θ_g as
    their model, bitwise."""
    await _train(nodes, 24, warm=5)
    survivors = [n for i, n in nodes.items() if i != dead]
    ends = await _finish(survivors)
    assert killed, f"node {dead} never reached {what}"
    await asyncio.gather(*killed)
    params = await _params(survivors)
    thetas = [n.strategy.state.theta for n in survivors]
    reforms = [n.strategy.regroup.reformations for n in survivors]
    assert len(set(ends)) == 1, ends
    assert all(r >= 1 for r in reforms), reforms
    assert all(t.tobytes() == thetas[0].tobytes() for t in thetas)
    assert all(p.tobytes() == thetas[0].tobytes() for p in params)


async def test_a_crash_mid_run_is_redone_over_the_survivors_who_end_with_one_model():
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "diloco", options=OPTS) as nodes:
        await _train(nodes, 40, warm=7)
        survivors = await _crash(nodes, 2)
        ends = await _finish(survivors)
        params = await _params(survivors)
        thetas = [n.strategy.state.theta for n in survivors]
        reforms = [n.strategy.regroup.reformations + n.strategy.state.adoptions for n in survivors]
    assert len(set(ends)) == 1 and 40 <= ends[0] <= 40 + 2 + 1, ends  # the stop rides with the next sum: h + tau late
    assert all(r >= 1 for r in reforms), reforms
    assert all(t.tobytes() == thetas[0].tobytes() for t in thetas)
    assert all(p.tobytes() == thetas[0].tobytes() for p in params)


async def test_a_restarted_node_adopts_the_global_copy_and_ends_with_the_same_model():
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "diloco", options=OPTS) as nodes:
        joiner = Node(topo, 3, "diloco", options=OPTS)
        await _train(nodes, 10_000, stop=lambda: joiner.steps >= 12)
        try:
            group, ends, params = await _crash_and_rejoin(nodes, joiner)
            adopted = joiner.strategy.state.adoptions
        finally:
            await joiner.close()
    assert len(set(ends)) == 1, ends
    assert adopted == 1
    assert all(p.tobytes() == params[0].tobytes() for p in params)


async def test_a_crash_during_the_final_sync_is_redone_over_the_survivors_who_end_with_one_model():
    """Node 2 dies right after it sent its part of the final full-model sync: the survivors'
    final operation fails, is redone over the next view with their unchanged pseudo-gradients,
    and they end with one model equal to one θ_g (their digest check passes)."""
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "diloco", options=OPTS) as nodes:
        victim = nodes[2].strategy
        launch = victim.ops.launch
        killed: list[asyncio.Task[None]] = []

        async def launch_then_die(f: int, step: int, **kw: Any) -> None:
            await launch(f, step, **kw)
            if f == FULL and not killed:  # the final sync's own part is on its way: die now
                killed.append(asyncio.ensure_future(nodes[2].crash()))

        victim.ops.launch = launch_then_die
        await _survivors_of_a_crash_end_with_one_model(nodes, 2, killed, "the final sync")


async def test_a_member_that_failed_the_final_sync_alone_adopts_the_leaders_result_and_ends_with_it():
    """Node 3's final sync fails on it alone (its sums arrived, then a failure): the others
    apply the final outer step and go on to the closing checks. Node 3 asks for a redo; at the
    new epoch it is one operation behind, adopts the leader's θ_g (the final step in it) and
    joins the closing checks: every node ends with the same model."""
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "diloco", options=OPTS) as nodes:
        late = nodes[3].strategy
        failed, (ends, params, thetas) = await _fail_once_then_finish(nodes, late, lambda op: op.f == FULL,
                                                                      "the final sync")
        adoptions = late.state.adoptions
    assert failed, "node 3 never reached the final sync"
    assert len(set(ends)) == 1, ends
    assert adoptions == 1
    assert all(t.tobytes() == thetas[0].tobytes() for t in thetas)
    assert all(p.tobytes() == thetas[0].tobytes() for p in params)


EAGER = {"inner_steps": 4, "eager": True, "outer_lr": 0.7}


@pytest.mark.parametrize("which", ["stop", "completion", "final sync"])
async def test_an_eager_stop_that_failed_on_a_member_alone_is_re_formed_and_ends_with_one_model(which):
    """Eager updates' stop: node 3's sum fails on it alone (its sums arrived, then a failure):
    the first round that carries the stop (node 3 misses the agreed stop and learns it from
    the leader's counters), the round the completion step awaits (the one launched where the
    stop was seen, right after it) or the final sync. The others complete it and go on; node 3
    asks for a redo, adopts the leader's θ_g and momentum at the new epoch, takes part in what
    the leader runs, and the closing checks' exact mean leaves every node with one model equal
    to one θ_g."""
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "diloco", options=EAGER) as nodes:
        late = nodes[3].strategy
        stops: list[int] = []

        def target(op: Any) -> bool:
            if which == "final sync":
                return op.f == FULL
            if op.f != FULL and op.stop and op.k not in stops:
                stops.append(op.k)
            return op.f != FULL and bool(stops) and op.k == stops[0] + (which == "completion")

        failed, (ends, params, thetas) = await _fail_once_then_finish(nodes, late, target, f"the {which}")
        adoptions = late.state.adoptions
    assert failed, f"node 3 never reached the {which}"
    assert len(set(ends)) == 1, ends
    assert adoptions == 1
    assert all(t.tobytes() == thetas[0].tobytes() for t in thetas)
    assert all(p.tobytes() == thetas[0].tobytes() for p in params)


async def test_a_crash_during_an_eager_stops_completion_is_redone_over_the_survivors_who_end_with_one_model():
    """Eager updates' stop: node 2 dies right after it launched the round the completion step
    awaits (the operation after the first one that carries the stop). The survivors' round is
    redone over the next view with their unchanged pseudo-gradients, and the completion step,
    the final sync and the closing checks' exact mean leave them with one model equal to one
    θ_g."""
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "diloco", options=EAGER) as nodes:
        victim = nodes[2].strategy
        launch = victim.ops.launch
        stops: list[int] = []
        killed: list[asyncio.Task[None]] = []

        async def launch_then_die(f: int, step: int, **kw: Any) -> None:
            await launch(f, step, **kw)
            op = victim.state.inflight
            if op is None or op.f == FULL or not op.stop:
                return
            stops.append(op.k)
            if op.k == stops[0] + 1 and not killed:  # its part of the completion's round is on its way
                killed.append(asyncio.ensure_future(nodes[2].crash()))

        victim.ops.launch = launch_then_die
        await _survivors_of_a_crash_end_with_one_model(nodes, 2, killed, "the stop's completion")


async def test_an_eager_member_that_adopts_mid_run_counts_every_contribution_once():
    """Eager updates, μ = 0: node 3's round 2 fails on it alone (its sums arrived, then a
    failure); the others complete it and node 3 adopts the leader's θ_g in the next round, with
    the leader's own fresh contribution of that round in it and node 3's own weight 0. Every
    contribution of every round enters every node's θ_g exactly once, with the weight the round's
    mean gives it, so the run ends (completion step, exact mean) at θ_start − η·Σ_r Σw·Δ(r)/Σw(r)
    over the rounds' sums as the members received them."""
    lr = 0.5
    opts = {"inner_steps": 4, "eager": True, "outer_lr": lr, "outer_momentum": 0.0, "final_sync": "outer"}
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "diloco", options=opts) as nodes:
        lead, late = nodes[0].strategy, nodes[3].strategy
        start, sums = _record_rounds(lead)
        failed, (ends, params, thetas) = await _fail_once_then_finish(
            nodes, late, lambda op: op.f != FULL and op.k == 2, "round 2")
        adoptions = late.state.adoptions
        adopters = sum(n.strategy.state.adoptions for n in nodes.values())
    assert failed, "node 3 never reached round 2"
    assert adoptions == 1
    assert len(set(ends)) == 1, ends
    assert all(t.tobytes() == thetas[0].tobytes() for t in thetas)
    assert all(p.tobytes() == thetas[0].tobytes() for p in params)
    # The round node 3 adopted in: every adopter's weight 0. Node 3's failure replaces the view, and
    # a member still waiting on round 2 when the new view arrives fails it too and adopts as well.
    assert 3 in sums and sums[3][1] == 4.0 - adopters, (sums[3][1], adopters)
    want = np.asarray(start[0], np.float64) - lr * sum(s / sw for s, sw in sums.values() if sw > 0)
    np.testing.assert_allclose(thetas[0], want, rtol=0, atol=2e-6)


async def test_an_eager_run_that_loses_a_node_and_takes_it_back_counts_every_contribution_once():
    """Eager updates, μ = 0: node 3 crashes (the round in flight is redone over three members,
    whose own fresh terms entered over four), then restarts and joins, adopting the leader's
    θ_g with the leader's fresh term of the round in flight in it. Every contribution of every
    round enters every node's θ_g exactly once, with the weight its round's mean gives it: the
    run ends at θ_start − η·Σ_r Σw·Δ(r)/Σw(r) over the sums the leader received."""
    lr = 0.5
    opts = {"inner_steps": 4, "eager": True, "outer_lr": lr, "outer_momentum": 0.0, "final_sync": "outer"}
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "diloco", options=opts) as nodes:
        start, sums = _record_rounds(nodes[0].strategy)
        joiner = Node(topo, 3, "diloco", options=opts)
        await _train(nodes, 10_000, stop=lambda: joiner.steps >= 12)
        try:
            group, ends, params = await _crash_and_rejoin(nodes, joiner)
            thetas = [n.strategy.state.theta for n in group]
            adopted = joiner.strategy.state.adoptions
        finally:
            await joiner.close()
    assert len(set(ends)) == 1, ends
    assert adopted == 1
    assert all(t.tobytes() == thetas[0].tobytes() for t in thetas)
    assert all(p.tobytes() == thetas[0].tobytes() for p in params)
    assert any(sw == 3.0 for _, sw in sums.values())  # rounds without node 3 (or with it at weight 0)
    want = np.asarray(start[0], np.float64) - lr * sum(s / sw for s, sw in sums.values() if sw > 0)
    np.testing.assert_allclose(thetas[0], want, rtol=0, atol=2e-6)


ADAMW = {"optimizer": "adamw", "lr": 0.01}



def _adam_state(flat: Any) -> list[dict[str, bytes]]:
    """The inner optimizer's state of every parameter (AdamW: exp_avg, exp_avg_sq, step), as
    bytes, read from torch (on the thread that owns the model)."""
    opt = flat.optimizer
    return [{k: v.detach().cpu().contiguous().numpy().tobytes() for k, v in opt.state[p].items()}
            if p in opt.state else {} for p in flat.params]


async def _read_adam_state(node: Node) -> list[dict[str, bytes]]:
    rep = node.strategy.ctx.replica
    return await rep.gate.run(lambda: _adam_state(rep.flat))


def _keep_given_states(nodes: list[Node]) -> list[dict[str, Any]]:
    """Wrap each node's DiLoCo state snapshot (what Regroup broadcasts to a member behind or a
    joiner): every snapshot given, with what the node held at that moment — θ_g, b, the
    counters of its latest launch, and its AdamW state as the export read it."""
    given: list[dict[str, Any]] = []
    for n in nodes:
        regroup, rep = n.strategy.regroup, n.strategy.ctx.replica
        snapshot, export = regroup.snapshot, rep.flat.export_state
        seen: dict[str, Any] = {}

        def export_and_keep(flat=rep.flat, export=export, seen=seen) -> np.ndarray:
            seen["adam"] = _adam_state(flat)  # (on the model's thread, in the same job as the export)
            return export()

        async def snapshot_and_keep(n=n, snapshot=snapshot, seen=seen) -> np.ndarray:
            st = n.strategy.state
            held = {"node": n.id, "theta": st.theta.copy(), "launched": st.launched,
                    "bufs": [None if b is None else b.copy() for b in st.bufs]}
            seen.clear()
            vec = await snapshot()  # (θ_g, b and the counters are packed before its first await)
            given.append({**held, "adam": seen.get("adam"), "vec": vec.tobytes()})
            return vec

        rep.flat.export_state = export_and_keep
        regroup.snapshot = snapshot_and_keep
    return given


@pytest.mark.parametrize("inner", ["copy", "fresh"])
async def test_a_joiner_ends_its_adoption_with_the_leaders_theta_momentum_counters_and_inner_state(inner):
    """Node 3 crashes and restarts (AdamW inner steps, two streamed fragments with τ = 1). Right
    after it adopted, its θ_g and model equal the leader's θ_g as the leader gave it, its outer
    momentum b equals the leader's for every fragment, its counters (inner steps, operations,
    outer steps applied) the leader's latest launch's, and its AdamW state (exp_avg, exp_avg_sq,
    step) the leader's at that moment with ``join_inner_state=copy``, or its own, untouched,
    with ``fresh`` — all bitwise. Its first operation is the leader's (the same number and
    fragment), with Δ = 0 and weight 0."""
    opts = {**OPTS, "join_inner_state": inner}
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "diloco", options=opts, trainer=ADAMW) as nodes:
        given = _keep_given_states([nodes[i] for i in (0, 1, 2)])
        joiner = Node(topo, 3, "diloco", options=opts, trainer=ADAMW)
        await _train(nodes, 10_000, stop=lambda: joiner.steps >= 12)
        survivors = await _crash(nodes, 3)
        await until(lambda: all(n.strategy.regroup.reformations + n.strategy.state.adoptions >= 1 for n in survivors),
                    30, "re-formed")
        try:
            await joiner.restart()
            assert joiner.strategy.ctx.joining
            js = joiner.strategy
            assert js.adoption._kept is not None  # the leader's state, given at the join
            kept = js.adoption._kept[0].copy()  # (its θ_g: the joiner's θ_g from its adoption on)
            own = await _read_adam_state(joiner)
            take = js.adoption.take
            after: dict[str, Any] = {}

            async def take_and_look() -> Any:
                got = await take()
                st = js.state
                after.update(theta=st.theta.copy(), bufs=[None if b is None else b.copy() for b in st.bufs],
                             counters=(st.t, st.ops, st.applied), params=await js.ctx.replica.get_params(),
                             adam=await _read_adam_state(joiner))
                return got

            js.adoption.take = take_and_look
            launch, first = js.ops.launch, []

            async def launch_and_look(f: int, step: int, **kw: Any) -> None:
                await launch(f, step, **kw)
                op = js.state.inflight
                if not first and op is not None:
                    first.append((op.k, op.f, op.w, bool(op.payload.any())))

            js.ops.launch = launch_and_look
            joiner.go(10_000)
            await until(lambda: bool(after) and bool(first), 30, "the joiner's adoption")
            leader = [g for g in given if g["theta"].tobytes() == kept.tobytes()]
            assert leader, "no member gave the state the joiner kept"
            lead = leader[-1]
            assert after["theta"].tobytes() == lead["theta"].tobytes()
            assert after["params"].tobytes() == lead["theta"].tobytes()  # θ_local ← θ_g
            assert len(after["bufs"]) == len(lead["bufs"]) == 2
            for mine, theirs in zip(after["bufs"], lead["bufs"]):
                assert theirs is not None and mine is not None and mine.tobytes() == theirs.tobytes()
            c = lead["launched"]
            assert after["counters"] == (c.t, c.op, c.applied) and c.applied >= 2
            assert first[0] == (c.op, c.frag, 0.0, False)  # it takes part in the leader's operation: Δ = 0, weight 0
            if inner == "copy":
                assert lead["adam"] is not None and lead["adam"][0], "the leader's export did not read AdamW's state"
                assert after["adam"] == lead["adam"]
            else:
                assert after["adam"] == own and lead["adam"] is None  # (the leader gave no inner state)
            group = [*survivors, joiner]
            ends = await _finish(group)
            params = await _params(group)
        finally:
            await joiner.close()
    assert len(set(ends)) == 1 and all(p.tobytes() == params[0].tobytes() for p in params), ends

async def test_a_member_behind_keeps_its_own_inner_state_when_it_adopts():
    """Node 3's operation fails on it alone (AdamW inner steps; ``join_inner_state=copy``, the
    default): at the next epoch it adopts the leader's θ_g, momentum and counters, and its AdamW
    state (exp_avg, exp_avg_sq, step) stays bitwise its own — only a joiner copies the
    leader's."""
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "diloco", options=OPTS, trainer=ADAMW) as nodes:
        late = nodes[3]
        lead_states: list[Any] = []
        take = late.strategy.adoption.take
        seen: list[tuple[Any, Any]] = []

        async def take_and_look() -> Any:
            before = await _read_adam_state(late)
            lead_states.append(await _read_adam_state(nodes[0]))  # (a leader's, for contrast)
            got = await take()
            seen.append((before, await _read_adam_state(late)))
            return got

        late.strategy.adoption.take = take_and_look
        failed, (ends, params, thetas) = await _fail_once_then_finish(
            nodes, late.strategy, lambda op: op.f != FULL and op.k == 3, "operation 3")
        adoptions = late.strategy.state.adoptions
    assert failed and adoptions == 1 and len(seen) == 1
    assert len(set(ends)) == 1 and all(p.tobytes() == thetas[0].tobytes() for p in params)
    before, after = seen[0]
    assert before[0] and after == before
    assert lead_states[0] != before  # (the leader's differs: copying it would show)


async def test_a_sum_redone_after_a_departure_averages_the_survivors_unchanged_deltas_once():
    """Node 2 dies right after it launched a fragment's sum (τ = 1: the others are on their way
    to that sum's merge). The survivors' attempt over four members fails and is redone over the
    three of them with the Δ each formed at its send (not re-read from the model, which has
    trained on since), Σw = 3: the mean applied is the survivors' mean Δ. Every operation is
    applied once on every survivor, and θ_g moves only by these outer steps: replaying them
    from the start with the sums as they arrived gives each survivor's θ_g bitwise."""
    from p2psync.strategies.diloco.outer import outer_step

    opts = {**OPTS, "final_sync": "outer"}
    topo = ring(4, base_port=free_port())
    async with cluster(topo, "diloco", options=opts) as nodes:
        victim, survivors = nodes[2], [nodes[i] for i in (0, 1, 3)]
        killed: list[asyncio.Task[None]] = []
        at: list[int] = []
        launch = victim.strategy.ops.launch

        async def launch_then_die(f: int, step: int, **kw: Any) -> None:
            await launch(f, step, **kw)
            op = victim.strategy.state.inflight
            if op is not None and op.k == 5 and not killed:  # its part of sum 5 is on its way: die now
                at.append(op.k)
                killed.append(asyncio.ensure_future(victim.crash()))

        victim.strategy.ops.launch = launch_then_die
        # per survivor: Δ formed at each send, every attempt of every sum, every outer step
        sent: dict[int, dict[int, bytes]] = {n.id: {} for n in survivors}
        tries: dict[int, list[tuple[int, tuple[int, ...], bytes, Any]]] = {n.id: [] for n in survivors}
        applied: dict[int, list[tuple[int, int, np.ndarray, Any, np.ndarray, float]]] = {n.id: [] for n in survivors}
        start: dict[int, np.ndarray] = {}
        for n in survivors:
            s = n.strategy

            def wrap(n=n, s=s, launch=s.ops.launch, reduce=s.ops.reduce, outer=s.ops.outer, begin=s._begin) -> None:
                async def begin_and_keep() -> None:
                    await begin()
                    start[n.id] = s.state.theta.copy()

                async def launch_and_keep(f: int, step: int, **kw: Any) -> None:
                    st = s.state
                    delta = np.subtract(st.theta[st.frags[f]], await s.ctx.replica.get_params_range(st.ranges[f]),
                                        dtype=np.float32)
                    await launch(f, step, **kw)
                    sent[n.id][st.inflight.k] = delta.tobytes()

                async def reduce_and_keep(view: Any, op: Any) -> Any:
                    try:
                        got = await reduce(view, op)
                    except BaseException as exc:
                        tries[n.id].append((op.k, view.members, op.payload.tobytes(), exc))
                        raise
                    tries[n.id].append((op.k, view.members, op.payload.tobytes(), None))
                    return got

                async def outer_and_keep(op: Any, total: np.ndarray, side: np.ndarray, extra: Any, *,
                                         merge_local: bool) -> None:
                    st = s.state
                    before = st.theta.copy(), None if st.bufs[op.f] is None else st.bufs[op.f].copy()
                    await outer(op, total, side, extra, merge_local=merge_local)
                    applied[n.id].append((op.k, op.f, *before, np.array(total, np.float32), float(side[0])))

                s._begin, s.ops.launch, s.ops.reduce, s.ops.outer = (begin_and_keep, launch_and_keep,
                                                                     reduce_and_keep, outer_and_keep)

            wrap()
        await _train(nodes, 24, warm=5)
        ends = await _finish(survivors)
        assert killed, "node 2 never reached sum 5"
        await asyncio.gather(*killed)
        thetas = {n.id: n.strategy.state.theta.copy() for n in survivors}
        adoptions = [n.strategy.state.adoptions for n in survivors]
    assert len(set(ends)) == 1, ends
    assert adoptions == [0, 0, 0]  # (the redo, not a member behind adopting a leader's state)
    k = at[0]
    for i in sent:
        redo = [t for t in tries[i] if t[0] == k]
        assert redo[-1][1] == (0, 1, 3) and redo[-1][3] is None, redo  # it succeeded over the survivors
        assert all(t[2] == sent[i][k] for t in redo)  # with the Δ formed at the send, every attempt
    assert any(len([t for t in tries[i] if t[0] == k]) >= 2 for i in sent)  # (an attempt with node 2 failed)
    for i in sent:
        ks = [a[0] for a in applied[i]]
        assert ks == sorted(set(ks)) == list(range(len(ks))), ks  # every operation once, in order
        _, f, _, _, total, sw = applied[i][k]
        mine = [np.frombuffer(sent[j][k], np.float32) for j in sent]
        assert sw == 3.0
        np.testing.assert_allclose(total, np.add(np.add(mine[0], mine[1]), mine[2]), rtol=1e-6, atol=1e-7)
        theta, bufs = start[i].copy(), [None, None]
        for kk, ff, th0, b0, tot, w in applied[i]:  # θ_g moves by these outer steps only, each once
            assert th0.tobytes() == theta.tobytes(), f"node {i}: θ_g moved outside the outer step before sum {kk}"
            assert (b0 is None) == (bufs[ff] is None) and (b0 is None or b0.tobytes() == bufs[ff].tobytes())
            idx = nodes[0].strategy.state.frags[ff]
            part = theta[idx]
            bufs[ff] = outer_step(part, bufs[ff], np.divide(tot, np.float32(w), dtype=np.float32), lr=opts["outer_lr"],
                                  momentum=0.9, nesterov=True)
            theta[idx] = part
        assert theta.tobytes() == thetas[i].tobytes()
    assert all(t.tobytes() == thetas[0].tobytes() for t in thetas.values())

"""``--strategy diloco-async`` over real ZeroMQ with real trainers: every node applies one
numbered stream of pseudo-gradients, so θ_g hashes the same on every node after every completed
buffer and every node ends with one model; DyLU gives a slow node fewer inner steps per phase and
nobody waits a phase; AdamW's state is untouched by the outer applies; a node killed mid-run
leaves survivors with one model; bad options are refused before anything starts.

A joiner (a crashed node's new process): it adopts, at its join, the packed DN state (θ_g, the
momentum, the buffer's sum, the counters) bitwise as a survivor gave it, starts its model from
that θ_g, continues at the giver's loop step (so ``--steps`` is the run's budget, not a fresh
one), trains, and the run ends with one model on every node."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from p2psync.errors import ConfigError
from p2psync.strategies.diloco.dn import DNState, apply_update
from p2psync.topology import mesh, ring
from tests.helpers import close_strategies, free_port, make_trainer, start_strategies, zmq_cluster

pytestmark = pytest.mark.timeout(120)


async def _run(topo, steps, options, *, trainers=None, codec="none", error_feedback=False, setup=None):
    """Every node trains until its strategy stops (want_stop on the last step); returns (the
    strategies' final params, θ_g, hashes after each buffer, reports per node)."""
    async with zmq_cluster(topo) as eps:
        if trainers is None:
            trainers = {i: make_trainer(topo, i) for i in topo.ids}
        strats = await start_strategies(eps, topo, "diloco-async", options=options, trainers=trainers,
                                        max_steps=steps, codec=codec, error_feedback=error_feedback)
        try:
            if setup is not None:
                setup(strats)

            async def loop(s):
                reps, step = [], 0
                while True:
                    rep = await s.run_step(step, step + 1 >= steps)
                    reps.append(rep)
                    step += 1
                    if rep.stop or step > 3 * steps:
                        return reps

            reps = await asyncio.wait_for(asyncio.gather(*(loop(s) for s in strats)), 90)
            params = [await s.ctx.replica.get_params() for s in strats]
            thetas = [s.dn.theta.copy() for s in strats]
            hashes = [dict(s.hashes) for s in strats]
        finally:
            await close_strategies(strats)
    return params, thetas, hashes, reps


@pytest.mark.parametrize("kind,codec,feedback", [("mesh", "none", False), ("ring", "e3m0", True)])
async def test_theta_g_hashes_agree_after_every_buffer_and_every_node_ends_with_one_model(kind, codec, feedback):
    """4 nodes (a mesh, uncompressed; a ring, where pseudo-gradients are relayed, with 4-bit
    outer gradients and error feedback): the same θ_g hash on every node after every completed
    buffer, one final model equal to θ_g everywhere, and the stream the one Delayed Nesterov
    replays: θ_g equals DN applied by a single process to the decoded updates in number order."""
    topo = (mesh if kind == "mesh" else ring)(4, base_port=free_port())
    steps = 24
    streams: list[list[tuple[int, np.ndarray]]] = [[] for _ in topo.ids]

    def setup(strats):
        for s, out in zip(strats, streams):  # record every update each node applies, in order
            drain = s._drain

            def recording(s=s, out=out, drain=drain):
                before = s.dn.count
                box = dict(s.pending.get(s.stream, {})) if s.stream is not None else {}
                drain()
                for c in range(before, s.dn.count):
                    out.append((c, box[c - s.base].g.copy()))
            s._drain = recording

    params, thetas, hashes, reps = await _run(topo, steps, {"inner_steps": 4, "dylu": "false"}, codec=codec,
                                              error_feedback=feedback, setup=setup)
    counts = {r[-1].extra["applied"] for r in reps}
    assert len(counts) == 1, counts
    common = set.intersection(*(set(h) for h in hashes))
    assert len(common) >= 4, hashes  # (4 nodes, N = 4, about 6 phases each: 5-6 buffers)
    for c in common:
        assert len({h[c] for h in hashes}) == 1, (c, [h[c] for h in hashes])
    assert all(t.tobytes() == thetas[0].tobytes() for t in thetas)
    assert all(p.tobytes() == thetas[0].tobytes() for p in params)
    assert all(r[-1].stop for r in reps) and max(len(r) for r in reps) == steps
    # every node applied the same updates (bitwise), and replaying them gives θ_g
    n = counts.pop()
    assert all([c for c, _ in st] == list(range(n)) for st in streams)
    for st in streams[1:]:
        assert all(a.tobytes() == b.tobytes() for (_, a), (_, b) in zip(st, streams[0]))
    init = make_trainer(topo, 0)
    from tests.helpers import trainer_params
    ref = DNState.start(np.asarray(trainer_params(init), np.float32))
    for _, g in streams[0]:
        apply_update(ref, g, lr=0.7, momentum=0.9, buffer=4)
    assert ref.theta.tobytes() == thetas[0].tobytes()


async def test_nodes_that_finish_together_restart_from_one_theta_g_as_synchronous_diloco_does():
    """The grace period (the paper's Alg. 2): equal nodes finish a phase together, and each
    restarts only once the buffer that holds its update is complete, so every node's k-th phase
    starts from the same θ_g, the one after k momentum steps (synchronous DiLoCo's outer step
    k). Waiting only for its own update let the first node of a buffer restart from θ_g with
    that update alone."""
    topo = mesh(3, base_port=free_port())
    starts: list[list[bytes]] = [[] for _ in topo.ids]

    def setup(strats):
        for s, out in zip(strats, starts):
            restart = s._restart_phase

            async def recording(s=s, out=out, restart=restart):
                await restart()
                out.append(s.theta_start.tobytes())
            s._restart_phase = recording

    # a merge window far longer than any phase: how long a loaded machine takes does not matter
    _, thetas, _, reps = await _run(topo, 20, {"inner_steps": 4, "dylu": "false", "merge_s": 30.0}, setup=setup)
    phases = min(len(st) for st in starts)
    assert phases >= 4, [len(st) for st in starts]
    for k in range(phases):
        assert len({st[k] for st in starts}) == 1, k  # one θ_g at every phase start
    assert [r[-1].extra["buffers"] for r in reps] == [reps[0][-1].extra["buffers"]] * 3


async def test_dylu_gives_a_slow_node_fewer_inner_steps_and_nobody_waits_a_phase():
    """Node 2 takes 4x as long per step (emulated): after its first phase it takes about a
    quarter of the fast nodes' inner steps per phase, so it sends about as often; no node's
    grace wait comes near a phase of its own; the run still ends with one model."""
    from tests.helpers import slowed_trainers

    topo = mesh(3, base_port=free_port())
    steps, H, fast_s, slow_s = 80, 8, 0.02, 0.08
    trainers = slowed_trainers(topo, f"0:{fast_s},1:{fast_s},2:{slow_s}")
    params, thetas, _, reps = await _run(topo, steps, {"inner_steps": H, "dylu_min_steps": 1}, trainers=trainers)
    last = [r[-1].extra for r in reps]
    assert all(x["h_m"] >= H - 2 for x in last[:2]) and 1 <= last[2]["h_m"] <= 3, last  # (speeds are measured)
    assert len(reps[2]) < 0.6 * len(reps[0]), [len(r) for r in reps]
    # the slow node contributes about as often (its first phase, before any speed is measured, is H long)
    assert last[2]["sent"] >= 0.5 * last[0]["sent"], last
    for i, x in enumerate(last):  # nobody waits half a phase of its own (the merge window is a quarter of one)
        assert x["max_grace_s"] < 0.5 * H * (slow_s if i == 2 else fast_s), last
    for r, x in zip(reps, last):  # each step reports its own wait (the driver sums them), not the total so far
        assert abs(sum(rep.wait_s for rep in r) - x["grace_wait_s"]) < 1e-4, (x, [rep.wait_s for rep in r])
    assert all(p.tobytes() == thetas[0].tobytes() for p in params)


def _inner_state(rep):
    async def read():
        return (await rep.export_state())[rep.numel:]
    return read()


async def test_outer_applies_and_restarts_leave_adamws_state_bitwise_untouched():
    """AdamW inner steps: restarting from θ_g after each phase (θ_g holding every update
    applied meanwhile) and the final θ_local ← θ_g move the model, not AdamW's exp_avg,
    exp_avg_sq or step."""
    topo = ring(2, base_port=free_port())
    seen: list[list[tuple[bytes, bytes, bool]]] = [[], []]

    def setup(strats):
        for s, out in zip(strats, seen):
            rep, restart, finish = s.ctx.replica, s._restart_phase, s._finish

            def wrap(fn, out=out, rep=rep):
                async def kept(*a, **kw):
                    before, p0 = await _inner_state(rep), await rep.get_params()
                    got = await fn(*a, **kw)
                    after, p1 = await _inner_state(rep), await rep.get_params()
                    out.append((before.tobytes(), after.tobytes(), p0.tobytes() != p1.tobytes()))
                    return got
                return kept
            s._restart_phase, s._finish = wrap(restart), wrap(finish)

    trainers = {i: make_trainer(ring(2), i, optimizer="adamw", lr=0.01) for i in (0, 1)}
    params, thetas, _, _ = await _run(topo, 13, {"inner_steps": 4, "dylu": "false"}, trainers=trainers, setup=setup)
    assert params[0].tobytes() == params[1].tobytes() == thetas[0].tobytes()
    for node, out in enumerate(seen):
        assert len(out) >= 3, out
        assert all(after == before for before, after, _ in out), f"node {node}: AdamW's state changed"
        assert sum(moved for *_, moved in out[1:]) >= 2, f"node {node}: the outer applies never moved the model"
        state = np.frombuffer(out[-1][0], np.float32)
        assert np.any(state != 0)


async def test_bad_options_are_refused_before_anything_starts():
    topo = ring(2, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        for bad, name in (({"dn_c": 0.25}, "dn_c"), ({"outer_codec": "zip"}, "outer_codec"),
                          ({"dn_buffer": -1}, "dn_buffer"), ({"outer_momentum": 1.0}, "outer_momentum"),
                          ({"dylu_min_steps": 0}, "dylu_min_steps"), ({"grace_s": 0}, "grace_s")):
            with pytest.raises(ConfigError, match=name):
                await start_strategies(eps, topo, "diloco-async", options=bad)


async def test_a_node_killed_mid_run_leaves_survivors_with_one_model():
    """Ring-4, node 2 crashes mid-run (``--on-failure continue``): the survivors re-form (the
    stream of the old view is frozen, members behind adopt the leader's state, numbering
    restarts), go on, and end with one θ_g as their model, bitwise."""
    from tests.integration.test_leave_join_zmq import _crash, _finish, _params, _train, cluster

    topo = ring(4, base_port=free_port())
    opts = {"inner_steps": 4, "dylu": "false"}
    async with cluster(topo, "diloco-async", options=opts) as nodes:
        await _train(nodes, 40, warm=10)
        before = nodes[0].strategy.ctx.epoch
        survivors = await _crash(nodes, 2)
        ends = await _finish(survivors)
        params = await _params(survivors)
        thetas = [n.strategy.dn.theta.copy() for n in survivors]
        reforms = [int(n.strategy.regroup.synced > before) for n in survivors]  # re-formed over a newer view
        applied = [n.strategy.dn.count for n in survivors]
        members = [n.strategy.ctx.group for n in survivors]
    assert all(m == (0, 1, 3) for m in members), members
    assert all(r >= 1 for r in reforms), reforms
    assert len(set(applied)) == 1, applied
    assert all(t.tobytes() == thetas[0].tobytes() for t in thetas)
    assert all(p.tobytes() == thetas[0].tobytes() for p in params)
    assert max(ends) >= 40, ends


async def test_a_hole_in_the_stream_is_re_formed_away():
    """A number handed out whose update never goes out (node 1's flooded sends are dropped
    once): the others hold the updates after it for ``hole_s``, ask for a new epoch, re-form
    and go on; every node ends with one model."""
    from tests.integration.test_leave_join_zmq import _finish, _params, _train, cluster

    topo = mesh(3, base_port=free_port())
    opts = {"inner_steps": 3, "dylu": "false", "hole_s": 1.0, "grace_s": 0.5}
    async with cluster(topo, "diloco-async", options=opts) as nodes:
        lost = nodes[1].strategy
        forward, dropped = lost.flood.forward, []

        def drop_once(origin, arrays, **kw):
            if origin == 1 and not dropped and lost.dn.count >= 3:
                dropped.append(kw["step"])
                return
            forward(origin, arrays, **kw)
        lost.flood.forward = drop_once
        before = nodes[0].strategy.ctx.epoch
        await _train(nodes, 30, warm=5)
        ends = await _finish(list(nodes.values()))
        params = await _params(list(nodes.values()))
        epochs = [n.strategy.regroup.synced for n in nodes.values()]
        adoptions = sum(n.strategy.adoptions for n in nodes.values())
    assert dropped, "node 1 never sent an update to drop"
    assert all(p.tobytes() == params[0].tobytes() for p in params)
    assert min(epochs) > before, (before, epochs)  # a new epoch came for the hole, and the members re-formed
    assert adoptions >= 1  # (the members that missed the update took the state of one that applied it)
    assert max(ends) >= 30, ends


async def test_a_restarted_node_adopts_the_leaders_state_continues_at_its_step_and_ends_with_one_model(monkeypatch):
    """Ring-4, node 3 crashes and a new process of it joins the run going on: at the join it
    adopts the state the leader gave (θ_g, the momentum, the buffer's sum and the counters,
    bitwise, as the leader held them when it gave them), its model starts from that θ_g, its
    loop continues at the leader's step (not at 0: its step budget is the run's), it trains
    and sends updates of its own, and every node ends with one model (θ_g, bitwise)."""
    from p2psync.strategies.diloco.async_strategy import DilocoAsync
    from p2psync.strategies.diloco.dn import pack
    from tests.helpers import until
    from tests.integration.test_leave_join_zmq import Node, _crash, _finish, _params, _train, cluster

    restored: list[tuple[int, bool, bytes, bytes]] = []  # (node, joining, its DN state, θ_g) as each adoption left them
    restore = DilocoAsync._restore

    async def keep_restored(self, vec):
        await restore(self, vec)
        restored.append((self.ctx.node_id, self.ctx.joining, pack(self.dn).tobytes(), self.dn.theta.tobytes()))
    monkeypatch.setattr(DilocoAsync, "_restore", keep_restored)  # (a Regroup takes the bound method when built)
    topo = ring(4, base_port=free_port())
    opts = {"inner_steps": 4, "dylu": "false"}
    async with cluster(topo, "diloco-async", options=opts) as nodes:
        given: list[tuple[int, bytes, int]] = []  # (giver, its packed DN state, its step) per snapshot given
        for n in (nodes[i] for i in (0, 1, 2)):
            snapshot = n.strategy._snapshot

            async def keep(n=n, snapshot=snapshot):
                s = n.strategy
                held = (n.id, pack(s.dn).tobytes(), s.step)
                vec = await snapshot()
                given.append(held)
                return vec
            n.strategy.regroup.snapshot = keep
        joiner = Node(topo, 3, "diloco-async", options=opts)
        steps = 200
        await _train(nodes, steps, warm=12)
        survivors = await _crash(nodes, 3)
        await until(lambda: all(n.strategy.regroup.synced is not None and n.strategy.ctx.group == (0, 1, 2)
                                for n in survivors), 30, "the survivors to re-form")
        crashed_at = min(n.step for n in survivors)  # (every survivor's step grows from here)
        try:
            await joiner.restart()
            js = joiner.strategy
            assert js.ctx.joining and js.adoptions == 1
            mine = [r for r in restored if r[0] == 3 and r[1]]
            assert len(mine) == 1, [r[:2] for r in restored]
            _, _, got, theta = mine[0]
            leader = [g for g in given if g[1] == got]
            assert leader, "the joiner's state is not one a member gave"
            _, _, lead_step = leader[-1]
            assert js.start_step == joiner.step == lead_step >= crashed_at > 0
            assert js.theta_start is not None and js.theta_start.tobytes() == theta
            assert (await js.ctx.replica.get_params()).tobytes() == theta  # θ_local ← θ_g
            joiner.go(steps)
            group = [*survivors, joiner]
            ends = await _finish(group)
            params = await _params(group)
            thetas = [n.strategy.dn.theta.copy() for n in group]
            counts = [n.strategy.dn.count for n in group]
            sent, first = js.sent, joiner.reports[0]
        finally:
            await joiner.close()
    assert all(p.tobytes() == thetas[0].tobytes() for p in params) and all(
        t.tobytes() == thetas[0].tobytes() for t in thetas)
    assert len(set(counts)) == 1, counts
    assert sent >= 1 and first["adoptions"] == 1
    assert max(ends) >= steps and ends[-1] <= steps, ends  # the joiner's budget is the run's: it ends by step 200

"""How the members of a run start: the same model, and either all fresh or all resumed at one
step, which every member can restore.

Why: every member compares, in one tiny exact allgather (``attach.numel``), what it is about
to start with: ``[trainable parameter count, how it starts, checkpoint step]``, where "how" is
:data:`FRESH` (no ``--resume``), :data:`RESUMED` (from its own checkpoint, at that step) or
:data:`NO_CHECKPOINT` (asked to resume, but its folder holds no checkpoint). A different
parameter count means a different model; a mix of fresh and resuming nodes would wait in
different places (a fresh node in the broadcast of the coordinator's initial parameters that
resumed nodes skip) until a timeout with no clear error. Each is one :class:`ConfigError`
naming every node's value, raised on every member at once (:func:`start_plan` is pure and
every member computes the same plan from the same rows).

Which step a resumed run continues at (:func:`start_plan`): the latest one every member can
restore.

* Checkpoints of one step: each node restores its own.
* Checkpoints of different steps, or some nodes without one (a node died before the run
  stopped, so its last checkpoint is older than the survivors'; a node's disk was full), under a
  strategy whose replicas are identical after every step (``Strategy.identical_replicas ==
  "every_step"``: SSGD): any node's checkpoint at step S is every node's state at step S. The
  run continues at the highest step S any node has; the lowest-id node at S broadcasts its
  state (parameters and optimizer state as one float32 vector, its training state beyond it:
  hyperparameters, LR schedulers, scaler; and its buffers) over the group, the way the state
  sync of :mod:`p2psync.strategies.regroup` brings a member that fell behind up to date, and
  every node behind adopts it. Its data position and RNG states stay its own checkpoint's (as a
  joiner's are its own).
* Under any other strategy the replicas differ between nodes, so another node's state is no
  substitute, and each node keeps one checkpoint (its latest): the steps must be equal, else
  one ConfigError names every node's step.

The chosen step is logged on every node (``resuming at step S: ...``). Then a fresh start takes
the coordinator's initial parameters (a broadcast), so a script seeded differently on one node
does not silently diverge.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from p2psync.api.replica import HookedReplica
from p2psync.api.runtime import NodeRuntime
from p2psync.errors import ConfigError, ProtocolError
from p2psync.model import MAX_META_BYTES, Buffers

log = logging.getLogger("p2psync.session")

#: how a node starts (the second value of its start row)
FRESH, RESUMED, NO_CHECKPOINT = 0, 1, 2


@dataclass(frozen=True)
class StartPlan:
    """What every member does at the start: ``resume_step`` None for a fresh start, else the
    step the run continues at; ``donor`` the node whose state the nodes in ``adopters`` take
    (None when every node restores its own checkpoint); ``why`` the line each node logs."""

    resume_step: int | None
    donor: int | None = None
    adopters: tuple[int, ...] = ()
    why: str = ""


def start_plan(rows: Sequence[np.ndarray], members: Sequence[int], me: int, *, identical: bool,
               strategy: str = "") -> StartPlan:
    """Check the gathered ``[numel, how, step]`` rows (group order) and decide the start (see
    the module docstring). ``identical``: the strategy's replicas are identical after every
    step. Pure: a malformed row is a :class:`ProtocolError`, a disagreement a
    :class:`ConfigError`."""
    vals: list[tuple[int, int, int]] = []
    for n, r in zip(sorted(members), rows, strict=True):
        if r.shape != (3,) or int(r[1]) not in (FRESH, RESUMED, NO_CHECKPOINT) or int(r[0]) < 0 or int(r[2]) < 0:
            raise ProtocolError("attach", f"node {n} sent a malformed start record {r.tolist()!r}"[:160])
        vals.append((int(r[0]), int(r[1]), int(r[2])))
    named = list(zip(sorted(members), vals))
    if len({v[0] for v in vals}) > 1:
        detail = ", ".join(f"node {n}: {v[0]}" for n, v in named)
        raise ConfigError(f"node {me}: the attached models differ in their number of trainable parameters "
                          f"({detail}); every node must train the same model")

    def how(v: tuple[int, int, int]) -> str:
        return {FRESH: "fresh start", RESUMED: f"checkpoint of step {v[2]}", NO_CHECKPOINT: "no checkpoint"}[v[1]]

    detail = ", ".join(f"node {n}: {how(v)}" for n, v in named)
    kinds = {v[1] for v in vals}
    if kinds == {FRESH}:
        return StartPlan(None)
    if FRESH in kinds:
        raise ConfigError(f"node {me}: the nodes do not agree on how the run starts ({detail}); resume every "
                          "node (--resume RUN_DIR, or Session.load_state_dict before attach), or none")
    if RESUMED not in kinds:
        raise ConfigError(f"node {me}: asked to resume, but no node has a checkpoint ({detail}): was the run "
                          "started with --checkpoint-every N, and is RUN_DIR its folder (<out>/<run-id>)?")
    steps = {n: v[2] for n, v in named if v[1] == RESUMED}
    top = max(steps.values())
    behind = tuple(n for n, v in named if v[1] == NO_CHECKPOINT or v[2] < top)
    if not behind:
        return StartPlan(top, why=f"resuming at step {top}: every node from its own checkpoint")
    if not identical:
        raise ConfigError(f"node {me}: the nodes' checkpoints are not of one step ({detail}); --strategy "
                          f"{strategy or '?'} keeps a different replica on each node, so a node cannot take "
                          "another's state: resume from checkpoints of the same step (each node keeps its "
                          "latest), or start afresh")
    donor = min(n for n, s in steps.items() if s == top)
    return StartPlan(top, donor, behind,
                     f"resuming at step {top}, the latest checkpoint any node has ({detail}): node {donor}'s state; "
                     f"{', '.join(f'node {n}' for n in behind)} adopt{'s' if len(behind) == 1 else ''} it "
                     f"(replicas of --strategy {strategy or '?'} are identical after every step)")


async def identical_start(rt: NodeRuntime, replica: HookedReplica, *, resumed_at: int | None,
                          resuming: bool = False) -> int | None:
    """Agree on the start (see the module docstring) and carry it out: on a fresh start take
    the coordinator's initial parameters; resuming from checkpoints of different steps (a
    strategy with identical replicas), adopt the donor's state if this node is behind.
    ``resumed_at``: the step of this node's own checkpoint (None: it has none); ``resuming``:
    it was asked to resume. Returns the step the run continues at (None: a fresh start)."""
    c = rt.collectives
    view = rt.membership.view
    members = list(view.members) if view is not None else list(rt.topo.ids)
    how = RESUMED if resumed_at is not None else NO_CHECKPOINT if resuming else FRESH
    mine = np.array([replica.numel, how, resumed_at or 0], np.int64)
    rows = await c.allgather(mine, members, tag="attach.numel")
    cls = rt.strategy_cls
    plan = start_plan(rows, members, rt.node_id, identical=cls.identical_replicas == "every_step",
                      strategy=cls.name)
    if plan.resume_step is None:
        params = await replica.get_params()
        params = await c.broadcast(params, min(members), members, tag="attach.params")
        await replica.set_params(params)
        return None
    log.warning("node %d: %s", rt.node_id, plan.why)
    if plan.donor is not None:
        await _adopt(rt, replica, members, plan)
    return plan.resume_step


async def _adopt(rt: NodeRuntime, replica: HookedReplica, members: Sequence[int], plan: StartPlan) -> None:
    """The donor's state, buffers and training state to every member; those behind take them."""
    c, me, donor = rt.collectives, rt.node_id, plan.donor
    if donor is None:
        return
    try:
        size = replica.state_size()  # the same answer on every member: all go on, or all stop here
    except ConfigError as exc:
        raise ConfigError(f"node {me}: {plan.why}, but node {donor}'s state cannot be handed over: {exc}; resume "
                          "from checkpoints of one step") from None
    vec = await replica.export_state() if me == donor else np.zeros(size, np.float32)
    state = await c.broadcast(vec, donor, members, tag="attach.resume.state")
    nbuf = replica.buffer_bytes
    raw = (await replica.get_buffers()).raw if me == donor else np.zeros(nbuf, np.uint8)
    bufs = await c.broadcast(raw, donor, members, tag="attach.resume.buffers") if nbuf else raw
    meta = await replica.export_meta() if me == donor else b""
    n = await c.broadcast(np.array([len(meta)], np.int64), donor, members, tag="attach.resume.metalen")
    if not 0 <= int(n[0]) <= MAX_META_BYTES:
        raise ProtocolError("state", f"node {donor} announced a training state of {int(n[0])} bytes")
    got = await c.broadcast(np.frombuffer(meta, np.uint8) if me == donor else np.zeros(int(n[0]), np.uint8),
                            donor, members, tag="attach.resume.meta")
    if me not in plan.adopters:
        return
    if state.size != size or state.dtype != np.float32 or np.asarray(bufs).size != nbuf:
        raise ProtocolError("state", f"node {donor} sent a state that does not fit this replica")
    await replica.import_state(np.array(state, dtype=np.float32))
    if nbuf:
        await replica.set_buffers(Buffers(raw=np.array(bufs, dtype=np.uint8)))
    await replica.import_meta(np.asarray(got, np.uint8).tobytes())
    log.warning("node %d: adopted node %d's state at step %d; its data position and RNG states are its own "
                "checkpoint's (or fresh, without one)", me, donor, plan.resume_step)


__all__ = ["FRESH", "NO_CHECKPOINT", "RESUMED", "StartPlan", "identical_start", "start_plan"]

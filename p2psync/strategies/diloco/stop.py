"""The stop (IO): the operations in flight applied, the final sync, and the closing checks.

Stop: with a step budget every node stops at the same step (with DyLU the fastest node's budget:
its wish rides with the sums); otherwise a node's wish rides in
the side sum of every operation it launches and every member stops at the apply of the first
one that carries it (up to h + τ steps late). At the stop every operation in flight is applied,
``final_sync=full`` folds the work since each fragment's last send into one last outer step,
θ_local ← θ_g on every node, buffers follow ``--buffers``, and a digest of θ_g is compared
(one model: ``identical_replicas = "end"``). A script whose loop just ends, without an agreed
stop, leaves every node with its own local model.

The stop is re-formed over the survivors like every other operation: the final full-model sync
is an operation (:data:`~.state.FULL`), and the closing checks after it (eager's exact mean,
buffers, the digest of θ_g) run as one more operation (:data:`~.state.CLOSE`), both through
:class:`~p2psync.strategies.regroup.Regroup`. A member that missed an operation the others
completed there (it failed on it alone) adopts the leader's θ_g — with the final sync in it once
the leader is in the closing checks — and takes part in what the leader runs (:mod:`.adoption`,
:meth:`.ops.Operations.adopt`). With ``eager`` the completion step awaits the round in flight
like any operation: a member that failed it alone (or the final sync after it) adopts the
leader's θ_g and momentum, which hold the leader's completion step, and the closing checks'
exact mean ends the run with one θ_g over the members that reached it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from p2psync.collectives import OpId
from p2psync.coordinator import View
from p2psync.errors import ConfigError, PeerFailure, ReplicaMismatch
from p2psync.model import MODEL_BUFFERS
from p2psync.strategies.base import StrategyContext
from p2psync.strategies.buffers import sync_buffers
from p2psync.strategies.diloco.identity import differing, digest
from p2psync.strategies.diloco.node import NodeState
from p2psync.strategies.diloco.ops import Operations
from p2psync.strategies.diloco.options import DilocoOptions
from p2psync.strategies.diloco.outer import outer_step
from p2psync.strategies.diloco.state import CLOSE, FULL, Counters
from p2psync.strategies.regroup import Adopted, Regroup, exact_mean
from p2psync.tasks import gather_or_cancel


class Stop:
    """The stop's protocol over the node's :class:`~.node.NodeState`: :meth:`flush` (through
    ``ops``), then :meth:`close_checks` as one more operation (through ``regroup``)."""

    def __init__(self, ctx: StrategyContext, opts: DilocoOptions, state: NodeState, ops: Operations,
                 regroup: Regroup) -> None:
        self.ctx = ctx
        self.opts = opts
        self.state = state
        self.ops = ops
        self.regroup = regroup

    async def flush(self, extra: dict[str, Any], step: int) -> None:
        """The stop: apply the operation in flight (eager: its completion step), the final full
        sync (``final_sync=full``), then the closing checks (:meth:`close_checks`) as one more
        operation. A member that adopts a leader's state on the way joins what the leader runs
        (the module docstring)."""
        st, ops = self.state, self.ops
        if st.theta is None:
            raise ConfigError("diloco: no global copy yet")
        # the model's progress since the last send is measured from θ_g as it was then (eager's
        # completion step below moves θ_g without any local step behind it)
        since = st.theta.copy()
        # (an adoption on the way may launch the leader's final sync, or take a θ_g that holds it)
        if st.inflight is not None and st.inflight.f != FULL:
            if self.opts.eager:  # the completion step: the others' last contributions, no new own one
                last = await ops.collect(extra, final=True)
                if isinstance(last, tuple):
                    late = ops.late_part(last[0], last[1], last[2], extra)
                    if late is not None:
                        o = self.opts
                        st.bufs[0] = outer_step(st.theta, st.bufs[0], late, lr=o.outer_lr,
                                                momentum=o.outer_momentum, nesterov=o.nesterov)
            else:
                await ops.apply(extra, final=True)
        if self.opts.final_sync == "full" and not st.final_done:
            if st.inflight is None or st.inflight.f != FULL:
                await ops.launch(FULL, step, ref=since if self.opts.eager else None)
            got = await ops.collect(extra, final=True)
            if isinstance(got, tuple):
                full, s, side, _ = got
                await ops.outer(full, s, side, extra, merge_local=False)
            elif got is None or got.frag != CLOSE:
                raise PeerFailure("diloco: the final sync ended without a result")
        if st.theta is None:
            raise ConfigError("diloco: no global copy yet")
        st.launched = Counters(op=st.ops, t=st.t, step=step, applied=st.applied, frag=CLOSE)
        done = await self.regroup.run(st.ops, self.close_checks)
        if isinstance(done, Adopted):  # it missed the final sync: the leader's θ_g holds it
            await ops.adopt(extra)
            if not st.final_done:
                raise PeerFailure("diloco: adopted a state that is not at the stop's closing checks")
            done = await self.regroup.run(st.ops, self.close_checks)
        if isinstance(done, Adopted):
            raise PeerFailure("diloco: the members did not agree on the stop's closing checks")

    async def close_checks(self, view: View) -> None:
        """The stop's last operation over ``view``: eager's exact mean of θ_g and the momentum,
        θ_local ← θ_g, buffers as ``--buffers`` says, and a digest of θ_g compared over the
        members (a mismatch is a :class:`~p2psync.errors.ReplicaMismatch`)."""
        st = self.state
        if st.theta is None:
            raise ConfigError("diloco: no global copy yet")
        coll = self.ctx.collectives
        op = OpId("diloco", st.ops, view.epoch).tag
        theta, mom = st.theta, st.bufs[0]
        if self.opts.eager:  # every node's own θ_g and momentum differ by its in-flight terms: one exact mean
            m = mom.copy() if mom is not None else np.zeros_like(theta)
            theta, mom = await gather_or_cancel([exact_mean(coll, theta.copy(), view.members, tag=f"{op}.mean"),
                                                 exact_mean(coll, m, view.members, tag=f"{op}.mean.b")])
        await self.ctx.replica.set_params(theta.copy())
        await sync_buffers(MODEL_BUFFERS.of(self.ctx.replica), coll, self.ctx.buffers, tag=f"{op}.end",
                           group=view.members)
        differ, _ = await differing(coll, np.array([digest(theta)], np.int64), view.members, tag=f"{op}.hash")
        if differ:
            raise ReplicaMismatch(f"diloco: the global copy differs on node(s) {list(differ)} from node "
                                  f"{view.members[0]}'s at the end", nodes=differ, tensor="theta_g")
        st.theta = theta  # (kept only once every member holds it: a redo starts from the same θ_g)
        if self.opts.eager:
            st.bufs[0] = mom

"""A member behind, or a joiner, adopts a leader's DiLoCo state (IO).

The first operation of a new view compares operation numbers (Regroup's sync, with the
operation number as its step), and a member behind or a joiner adopts the lowest-id leader's
θ_g, outer momentum and counters (:mod:`.state`; not its local model; a joiner also its inner
optimizer state with ``join_inner_state=copy``), resets θ_local ← θ_g and takes part in the
operation the leader runs with Δ = 0 and weight 0 (its first send of every fragment after that
also weighs 0 with ``uniform``). Its loop moves to the leader's step. Taking the state is
:meth:`Adoption.take`; taking part in the leader's operation is the operations'
(:meth:`~.ops.Operations.adopt`).

With ``eager`` the leader's θ_g holds its outer step of the round in flight already, and with
it the leader's own fresh term of that round (:func:`~.outer.own_term`), which the state carries
too. This node takes that term as the one its θ_g holds of the round, in place of its own (it
takes part with Δ = 0): its next late part takes the leader's term out of the round's mean, as
the leader's does, so the leader's contribution enters its θ_g once, and from then on it
computes what the leader computes except for its own fresh terms.

At the stop (:mod:`.stop`) the leader's counters name :data:`~.state.FULL` (it is in the final
sync: this node takes part in it with Δ = 0) or :data:`~.state.CLOSE` (θ_g holds the final sync
already: this node joins the closing checks); a member that missed the agreed stop learns it
there. The same holds with ``eager``: the leader's θ_g and momentum then hold its completion
step, and the closing checks' exact mean makes every member's θ_g and momentum one. An eager
leader may also be in the round its completion step awaits (launched after the stop was
agreed: its counters are ``at_stop``): this node takes part in that round with Δ = 0 and
stops with the leader.
"""

from __future__ import annotations

import numpy as np

from p2psync.errors import PeerFailure
from p2psync.strategies.base import StrategyContext
from p2psync.strategies.diloco.node import NodeState
from p2psync.strategies.diloco.options import DilocoOptions
from p2psync.strategies.diloco.state import FULL, Counters, pack_state, state_size, unpack_state


class Adoption:
    """The state a member behind adopts, over the node's :class:`~.node.NodeState`: what a
    leader gives (:meth:`snapshot`), what a member behind keeps (:meth:`restore`) and takes
    over (:meth:`take`). :meth:`snapshot`, :meth:`restore` and :meth:`size` are the three that
    :class:`~p2psync.strategies.regroup.Regroup` is built with; taking part in the leader's
    operation after :meth:`take` is the operations' (:meth:`.ops.Operations.adopt`)."""

    def __init__(self, ctx: StrategyContext, opts: DilocoOptions, state: NodeState) -> None:
        self.ctx = ctx
        self.opts = opts
        self.state = state
        #: the leader's state kept by :meth:`restore` until :meth:`take`: θ_g, b, its counters,
        #: (eager) the own fresh term its θ_g holds
        self._kept: tuple[np.ndarray, list[np.ndarray | None], Counters, np.ndarray | None] | None = None
        #: the leader's inner optimizer state a joiner takes (``join_inner_state=copy``)
        self._inner: np.ndarray | None = None

    @property
    def pending(self) -> Counters | None:
        """The counters of a leader's state kept by :meth:`restore` and not taken yet (None:
        there is none)."""
        return None if self._kept is None else self._kept[2]

    def size(self) -> int:
        """Length of the state vector a member behind adopts."""
        inner = self.ctx.replica.state_size() if self.opts.join_inner_state == "copy" else 0
        return state_size(self.ctx.replica.numel, len(self.state.frags), eager=self.opts.eager) + inner

    def _held(self) -> np.ndarray | None:
        """Eager: the own fresh term θ_g holds of the round this node launched last (zeros when
        it holds none: the stop's final sync and closing checks); None without ``eager``."""
        st = self.state
        if not self.opts.eager or st.theta is None:
            return None
        op = st.inflight
        if op is not None and op.k == st.launched.op and op.f != FULL and op.held is not None:
            return op.held
        return np.zeros_like(st.theta)

    async def snapshot(self) -> np.ndarray:
        """θ_g, b, (eager) the own fresh term θ_g holds of the round in flight, and the counters
        as of this node's latest launch (Regroup runs the sync of a new view inside that
        operation: θ_g changes only when it is applied, or, eager, when the round is launched);
        with ``join_inner_state=copy`` this node's model and optimizer state after them."""
        st = self.state
        if st.theta is None:
            raise PeerFailure("diloco: asked for a state before it has one")
        vec = pack_state(st.theta, st.bufs, st.frags, st.launched, self._held())
        if self.opts.join_inner_state == "copy":
            vec = np.concatenate([vec, await self.ctx.replica.export_state()])
        return vec

    async def restore(self, vec: np.ndarray) -> None:
        """Keep the leader's state; the step loop takes it over (:meth:`take`)."""
        own = state_size(self.ctx.replica.numel, len(self.state.frags), eager=self.opts.eager)
        self._kept = unpack_state(vec[:own], self.ctx.replica.numel, self.state.frags, eager=self.opts.eager)
        self._inner = np.array(vec[own:], np.float32, copy=True) if vec.size > own else None

    async def take(self) -> tuple[Counters, np.ndarray | None]:
        """Take the leader's state kept by :meth:`restore` (Regroup's sync of a new view): the
        operation in flight is dropped; θ_g, b, counters; a joiner's first adoption also the
        leader's inner state (``join_inner_state=copy``); θ_local ← θ_g; every fragment fresh.
        Returns the leader's counters and (eager) the own fresh term its θ_g holds."""
        st = self.state
        if self._kept is None or st.schedule is None:
            raise PeerFailure("diloco: no state to adopt")
        theta, bufs, c, held = self._kept
        self._kept = None
        await st.drop_inflight()
        st.theta, st.bufs = theta, bufs
        st.t, st.ops, st.applied = c.t, c.op, c.applied
        inner, self._inner = self._inner, None
        if inner is not None and self.ctx.joining and st.adoptions == 0:  # a joiner: the leader's inner state
            await self.ctx.replica.import_state(inner)
        await self.ctx.replica.set_params(st.theta.copy())
        st.fresh = set(range(len(st.frags)))
        st.marks = [self.ctx.replica.samples] * len(st.frags)
        st.adoptions += 1
        st.stopping = st.stopping or c.stopping  # (a member that missed the agreed stop learns it)
        return c, held

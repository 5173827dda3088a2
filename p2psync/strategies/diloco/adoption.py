"""A member behind, or a joiner, adopts a leader's DiLoCo state (IO).

The first operation of a new view compares operation numbers (Regroup's sync, with the
operation number as its step), and a member behind or a joiner adopts the lowest-id leader's
θ_g, outer momentum and counters (:mod:`.state`; not its local model; a joiner also its inner
optimizer state with ``join_inner_state=copy``), resets θ_local ← θ_g and takes part in the
operation the leader runs with Δ = 0 and weight 0 (its first send of every fragment after that
also weighs 0 with ``uniform``). Its loop moves to the leader's step.

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

import logging
from typing import Any

import numpy as np

from p2psync.errors import PeerFailure
from p2psync.strategies.diloco.ops import Operations
from p2psync.strategies.diloco.state import CLOSE, FULL, Counters, pack_state, state_size, unpack_state

log = logging.getLogger("p2psync.diloco")


class Adoption(Operations):
    """The state a member behind adopts: what a leader gives (:meth:`_snapshot`), what a member
    behind keeps (:meth:`_restore`) and takes over in its step loop (:meth:`_take_adopted`)."""

    def _state_size(self) -> int:
        inner = self.ctx.replica.state_size() if self.opts.join_inner_state == "copy" else 0
        return state_size(self.ctx.replica.numel, len(self.frags), eager=self.opts.eager) + inner

    def _held(self) -> np.ndarray | None:
        """Eager: the own fresh term θ_g holds of the round this node launched last (zeros when
        it holds none: the stop's final sync and closing checks); None without ``eager``."""
        if not self.opts.eager or self.theta is None:
            return None
        op = self.inflight
        if op is not None and op.k == self._launched.op and op.f != FULL and op.held is not None:
            return op.held
        return np.zeros_like(self.theta)

    async def _snapshot(self) -> np.ndarray:
        """θ_g, b, (eager) the own fresh term θ_g holds of the round in flight, and the counters
        as of this node's latest launch (Regroup runs the sync of a new view inside that
        operation: θ_g changes only when it is applied, or, eager, when the round is launched);
        with ``join_inner_state=copy`` this node's model and optimizer state after them."""
        if self.theta is None:
            raise PeerFailure("diloco: asked for a state before it has one")
        vec = pack_state(self.theta, self.bufs, self.frags, self._launched, self._held())
        if self.opts.join_inner_state == "copy":
            vec = np.concatenate([vec, await self.ctx.replica.export_state()])
        return vec

    async def _restore(self, vec: np.ndarray) -> None:
        """Keep the leader's state; the step loop takes it over (:meth:`_take_adopted`)."""
        own = state_size(self.ctx.replica.numel, len(self.frags), eager=self.opts.eager)
        self._adopted = unpack_state(vec[:own], self.ctx.replica.numel, self.frags, eager=self.opts.eager)
        self._inner = np.array(vec[own:], np.float32, copy=True) if vec.size > own else None

    async def _take_adopted(self, extra: dict[str, Any]) -> Counters:
        """Take the leader's state (Regroup's sync of a new view): θ_g, b, counters;
        θ_local ← θ_g; then take part in the operation the leader is running with Δ = 0 and
        weight 0 (applied at once when τ = 0)."""
        if self._adopted is None or self.schedule is None:
            raise PeerFailure("diloco: no state to adopt")
        theta, bufs, c, held = self._adopted
        self._adopted = None
        if self.inflight is not None:
            await self.close()
        self.theta, self.bufs = theta, bufs
        self.t, self.ops, self.applied = c.t, c.op, c.applied
        inner, self._inner = self._inner, None
        if inner is not None and self.ctx.joining and self.adoptions == 0:  # a joiner: the leader's inner state
            await self.ctx.replica.import_state(inner)
        await self.ctx.replica.set_params(self.theta.copy())
        self.fresh = set(range(len(self.frags)))
        self.marks = [self.ctx.replica.samples] * len(self.frags)
        self.adoptions += 1
        cur = self.cursor
        self._stopping = self._stopping or c.stopping  # (a member that missed the agreed stop learns it)
        if c.frag in (FULL, CLOSE):
            log.warning("node %d: adopted the leader's DiLoCo state at its stop (operation %d, %s)", self.ctx.node_id,
                        c.op, "final sync" if c.frag == FULL else "closing checks")
            if c.frag == FULL:  # take part in the leader's final sync with Δ = 0
                await self._launch(FULL, c.step, zero=True)
            else:
                self._final_done = True
            return c
        if cur is None or not 0 <= c.frag < len(self.frags):
            raise PeerFailure(f"diloco: the leader's operation {c.op} names fragment {c.frag}")
        cur.since, cur.next_frag, cur.due = 0, c.frag, None
        await self._launch(c.frag, c.step, zero=True, at_stop=c.at_stop)
        if self.opts.eager:  # θ_g holds the leader's step of this round, its own fresh term in it
            cur.applied()  # (awaited at the next send)
            self.applied += 1
            if self.inflight is not None:
                self.inflight.held = held
        elif cur.apply_now():
            got = await self._apply(extra)
            if isinstance(got, Counters):
                return got
        log.warning("node %d: adopted the leader's DiLoCo state at operation %d (step %d%s)", self.ctx.node_id,
                    c.op, c.step, ", at its stop" if c.at_stop else "")
        return c

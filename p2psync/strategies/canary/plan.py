"""Canary's multi-interface exchange schedule and its routing rules (pure).

Paper: Zhou et al., *Canary*, §4.4.2 (Fig. 13, Table 2 on BCube; Fig. 14 and Fig. 10 on a
mesh), read as the schedule consistent with Table 2: α·β pieces per worker (the paper's
"4 pieces / 36 in total" and its AR-1 thread assignment are errors).

**Layout.** ``BCube(α, β)``: node ``x`` has digits ``d_l(x)`` (level ``l`` < β, base α); its
level-``l`` *cube* is the α nodes that differ from it in digit ``l`` only, all on the level-``l``
switch, so every cube exchange uses NIC ``l``. A colayer's flat gradient is split into β parts
(one per *thread* ``τ[t]``), each into α *slots* ``⟨τ[t], j⟩``; slot ``⟨τ[t], j⟩`` is *owned* by
every node with ``d_t = j``. A slot larger than the piece size is cut into several pieces that
all follow the slot's route. A mesh (or any group that is not the whole BCube: a ring, a star,
a BCube with a member gone) is the same schedule with one level whose single cube is the whole
group (α = n, β = 1): the mesh scatter/gather of Fig. 14 (slot ``j`` owned by the ``j``-th
member); pairs that are not adjacent are reached hop by hop.

**Steps of thread t** (spec §6.3): ``k = 0 .. β-1`` are the allgather stage's steps on level
``(t + k) mod β``, ``k = β`` is the allreduce stage's step 1 on level ``t`` (its step 2, the
concatenation, is local):

* ``k = 0``: to each cube peer ``y`` send slot ``⟨τ[t], d_t(y)⟩``; receive slot ``⟨τ[t], d_t(x)⟩``;
* ``1 <= k < β``: all cube peers share ``d_t``: exchange slot ``⟨τ[t], d_t(x)⟩`` (partial sums);
* ``k = β``: send slot ``⟨τ[t], d_t(x)⟩`` (the total) to each level-``t`` cube peer, receive
  theirs.

Per round every NIC carries ``(β + 1)(α − 1)`` slots (BCube(3, 2): 6 per NIC, 54 slots over the
9 workers' 6 each), and at every step the β threads use β distinct levels.

**Routing (additive, exactly once).** The synchronous schedule is written here as a flow of
*contributions*: a node keeps, per slot, a *result* (what it will apply) and, per (step, peer),
an *outbox* of data not yet sent there. Data for a slot that reaches a node at *stage*
``s`` (its own gradient: 0; received at step ``k``: ``k + 1``) goes

* if the node owns the slot: into the result, and into the outboxes of every later allgather
  step ``k' >= max(1, s)`` and of the allreduce step (every peer of those steps);
* if not: its own contribution goes into its result and the step-0 outbox of the slot's owner
  in its level-t cube; what arrives at the allreduce step goes into the result.

A step-0 receipt is the sender's own gradient, which the sender keeps in its own result: the
owner's allreduce-step outbox for that sender leaves it out (the synchronous schedule sends the
total back, the sender replacing its own copy; here nobody gets its own gradient back, which is
the same sum and, asynchronously, fewer messages: an owner has data for a fast peer only when
*other* nodes' gradients came in, not merely the peer's own).

Every contribution then reaches every node's result exactly once, along one path, whatever the
order in which the nodes run their steps; run in lockstep it is exactly the schedule above
(every node ends with the sum over all n). That is what makes Canary's asynchronous mode (a
node pushes its outbox, the peer answers at once with its own outbox or an *empty packet*,
spec §6.5) lose nothing: data a slow peer could not take part in waits in an outbox and leaves
with its next exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from p2psync.errors import ConfigError
from p2psync.topology import Topology, bcube_digits


@dataclass(frozen=True)
class Slot:
    """One piece of a colayer: thread ``t``, owner digit ``j``, element range [lo, hi)."""

    index: int
    thread: int
    owner: int
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Layout:
    """Who exchanges what with whom, for one group of nodes."""

    group: tuple[int, ...]
    alpha: int
    levels: int
    digits: dict[int, tuple[int, ...]]
    #: ``bcube`` (levels = NICs) or ``mesh`` (one cube: the whole group)
    kind: str

    @cached_property
    def _cubes(self) -> dict[tuple[int, int], tuple[int, ...]]:
        out: dict[tuple[int, int], tuple[int, ...]] = {}
        for x in self.group:
            for level in range(self.levels):
                out[(x, level)] = tuple(y for y in self.group if all(
                    (self.digits[x][k] == self.digits[y][k]) != (k == level) for k in range(self.levels))
                    or y == x)
        return out

    def cube(self, x: int, level: int) -> tuple[int, ...]:
        """The members of ``x``'s level-``level`` cube, ``x`` included, in id order."""
        return self._cubes[(x, level)]

    def level(self, thread: int, step: int) -> int:
        """The level (NIC) thread ``thread`` uses at step ``step``."""
        return thread if step >= self.levels else (thread + step) % self.levels

    @property
    def steps(self) -> int:
        """Network steps per thread: β allgather steps and one allreduce step."""
        return self.levels + 1

    def peers(self, x: int, thread: int, step: int) -> tuple[int, ...]:
        return tuple(y for y in self.cube(x, self.level(thread, step)) if y != x)

    def owns(self, x: int, slot: Slot) -> bool:
        return self.digits[x][slot.thread] == slot.owner

    def sent_owner(self, x: int, thread: int, step: int, peer: int) -> int:
        """The owner digit of the slots ``x`` sends to ``peer`` at ``step`` of ``thread``."""
        return self.digits[peer][thread] if step == 0 else self.digits[x][thread]

    def received_owner(self, x: int, thread: int, step: int, peer: int) -> int:
        """The owner digit of the slots ``x`` receives from ``peer`` at ``step``."""
        return self.sent_owner(peer, thread, step, x)

    def slots(self, n: int, piece: int) -> tuple[Slot, ...]:
        """A colayer of ``n`` elements as slots of at most ``piece`` elements (β parts of α
        slots; large slots cut further; empty ones dropped)."""
        if piece < 1:
            raise ConfigError(f"piece size {piece} must be >= 1")
        out: list[Slot] = []
        for t, (a, b) in enumerate(_split(0, n, self.levels)):
            for j, (lo, hi) in enumerate(_split(a, b, self.alpha)):
                for c in range(lo, hi, piece):
                    out.append(Slot(len(out), t, j, c, min(hi, c + piece)))
        return tuple(out)

    def route(self, x: int, slot: Slot, stage: int, source: int | None = None) -> tuple[bool, tuple[tuple[int, int], ...]]:
        """Where data for ``slot`` that reached ``x`` at ``stage`` (from ``source``) goes: (into
        the result?, the (step, peer) outboxes). Stage 0 is x's own gradient, ``k + 1`` a
        receipt at step ``k``. ValueError for data that cannot arrive there (a peer sent the
        wrong slot)."""
        t, beta = slot.thread, self.levels
        if self.owns(x, slot):
            if stage > beta:
                raise ValueError(f"node {x} owns slot {slot.index}: it receives it in the allgather stage only")
            # a step-0 receipt is its sender's own gradient, which the sender keeps: no echo
            out = [(k, y) for k in range(max(1, stage), beta + 1) for y in self.peers(x, t, k)
                   if not (stage == 1 and k == beta and y == source)]
            return True, tuple(out)
        if stage == 0:
            (owner,) = [y for y in self.peers(x, t, 0) if self.digits[y][t] == slot.owner]
            return True, ((0, owner),)
        if stage == beta + 1:
            return True, ()
        raise ValueError(f"node {x} does not own slot {slot.index}: it receives it in the allreduce step only")

    def nic_sends(self, x: int) -> dict[int, int]:
        """Slots ``x`` sends per level (NIC) in one synchronous round (per piece of each slot
        when slots are cut): ``(β + 1)(α − 1)`` on every level."""
        out = {level: 0 for level in range(self.levels)}
        for t in range(self.levels):
            for k in range(self.steps):
                out[self.level(t, k)] += len(self.peers(x, t, k))
        return out


def _split(lo: int, hi: int, k: int) -> list[tuple[int, int]]:
    n = hi - lo
    return [(lo + (n * j) // k, lo + (n * (j + 1)) // k) for j in range(k)]


def layout_for(topo: Topology, group: Sequence[int]) -> Layout:
    """BCube's multi-NIC layout when ``group`` is the whole BCube, else the mesh layout over
    ``group`` (a one-level cube; non-adjacent pairs are reached hop by hop)."""
    g = tuple(sorted(set(group)))
    if not g:
        raise ConfigError("canary: empty group")
    alpha, beta = int(topo.params.get("alpha", 0)), int(topo.params.get("beta", 0))
    if topo.kind == "bcube" and alpha >= 2 and beta >= 1 and list(g) == topo.ids and len(g) == alpha**beta:
        return Layout(g, alpha, beta, {x: bcube_digits(x, alpha, beta) for x in g}, "bcube")
    return Layout(g, max(1, len(g)), 1, {x: (i,) for i, x in enumerate(g)}, "mesh")


__all__ = ["Layout", "Slot", "layout_for"]

"""What a shard owner keeps so that every worker pulls the same shard at a barrier (BSP's
rounds, ElasticBSP's barriers; spec §4.2 "The model weights are synchronized and will be
available to all workers in the next iteration", §10 "every superstep ends with all workers
holding identical parameters"). Pure: no I/O.

The race it closes: the scheduler releases every worker at once, but their pulls reach an owner
at different times; a fast worker may pull, compute and push its next gradient before a slow
worker's pull arrives, which would then see weights nobody else pulled. Nothing is added to the
wire but two integers: a push piece carries its **generation** ``g`` (the number of the last
barrier its worker was released from: 0 before the first) and a pull after a barrier carries
that barrier's number ``b`` (0: an ordinary pull, the current weights). The protocol guarantees
that an owner has applied (or holds) every piece of generations < b before any piece of
generation b arrives (a worker pushes generation b only after the release of barrier b, which
follows every acknowledged push of the generation before), and that every live worker's pull
of barrier b has been served before any piece of generation b + 1 exists (barrier b + 1 needs a
push of generation b from everyone, each made after its worker's pull of b).

Outside rounds every piece is one optimizer step of its own, in arrival order, with the
hyperparameters its worker pushed and the learning rate times the store's ``scale``.

* **Snapshot** (ElasticBSP, and any store not in rounds mode): when the first piece of
  generation b is about to be applied while some member has not pulled barrier b yet, the owner
  copies its shard (weights and version) first; pulls of b are served from that copy, which is
  dropped once every member has pulled b. So at most one copy exists (its barrier's pulls all
  come before the next barrier's first piece), and none at all when every pull of b arrives
  before the first piece of generation b.
* **Rounds** (BSP: SSP(0), DSSP(0, 0); every OK is a barrier): the pieces of the open generation
  are kept, acknowledged on arrival, and applied together once the generation is complete —
  when a piece of a later generation arrives, a pull of a later barrier or an ordinary pull
  comes, or the store re-shards — summed per range in origin-id order and divided by their
  number: one optimizer step on the round's mean gradient, with the hyperparameters the
  lowest origin pushed (BSP's aggregated update, spec §6.1 ``aggregate_rounds``). The result
  does not depend on the order pieces arrived in, so the run is bitwise reproducible and
  SSP(0) equals BSP exactly; a pull of barrier b never sees generation b, which stays held until
  then. It costs one round of the shard's pieces per origin in memory (at most the whole model
  per owner).

A pull of a barrier whose copy is gone (a worker that pulls b again after everyone else did,
pulls across a re-shard, which drops the copy) is served the current shard and counted in
:attr:`BarrierState.misses`: identical pulls are guaranteed between live workers without
failures; a failure loses pushes anyway (:meth:`ParamStore.reshard`).
"""

from __future__ import annotations

import logging
from typing import Iterable, Protocol

import numpy as np

from p2psync.params.optim import Hypers

log = logging.getLogger("p2psync.params")


class Shard(Protocol):
    """The owner's optimizer on its shard (:class:`p2psync.params.store.ShardOptimizer`)."""

    w: np.ndarray
    version: int

    def apply(self, a: int, b: int, g: np.ndarray, hypers: Hypers, lr_scale: float = 1.0) -> None: ...


#: a push piece as the owner takes it: (origin, a, b, gradient, generation, hyperparameters)
Piece = tuple[int, int, int, np.ndarray, int, Hypers]


class BarrierState:
    """One owner's generations, its open round (rounds mode) and its barrier copy. Offsets are
    absolute (``lo`` is the shard's first element)."""

    def __init__(self, *, rounds: bool, lo: int = 0) -> None:
        self.rounds = rounds
        self.lo = lo
        #: the newest generation seen (the open round in rounds mode)
        self.gen = 0
        self._round: dict[tuple[int, int], dict[int, tuple[np.ndarray, Hypers]]] = {}  # range -> origin -> sum
        self._snap: tuple[int, np.ndarray, int] | None = None  # (barrier, weights, version)
        self._pulled: dict[int, set[int]] = {}  # barrier -> members that pulled it
        #: pulls of a barrier served without its copy (see the module docstring)
        self.misses = 0
        #: barrier copies taken (a fast worker's push came before a slow worker's pull)
        self.snapshots = 0
        #: pulls of a barrier b served after a piece of generation b arrived (the race, closed)
        self.late_pulls = 0

    @property
    def pending(self) -> int:
        """Pieces held in the open round."""
        return sum(len(by) for by in self._round.values())

    def take(self, opt: Shard, pieces: Iterable[Piece], members: Iterable[int], scale: float = 1.0) -> int:
        """Pieces that arrived: applied now (one step each, learning rate times ``scale``) or
        held in the open round. Returns how many were applied now."""
        applied = 0
        for g, batch in sorted(self._by_gen(pieces).items()):
            if g > self.gen:
                self._advance(opt, g, members)
            if self.rounds and g == self.gen:
                for o, a, b, arr, hyp in batch:
                    by = self._round.setdefault((a, b), {})
                    by[o] = (by[o][0] + arr, hyp) if o in by else (arr, hyp)
                continue
            for _, a, b, arr, hyp in batch:
                opt.apply(a - self.lo, b - self.lo, arr, hyp, scale)
                applied += 1
        opt.version += applied
        return applied

    @staticmethod
    def _by_gen(pieces: Iterable[Piece]) -> dict[int, list[tuple[int, int, int, np.ndarray, Hypers]]]:
        out: dict[int, list[tuple[int, int, int, np.ndarray, Hypers]]] = {}
        for o, a, b, arr, g, hyp in pieces:
            out.setdefault(g, []).append((o, a, b, arr, hyp))
        return out

    def _advance(self, opt: Shard, g: int, members: Iterable[int]) -> None:
        """The first piece of generation ``g``: every piece of the generations before is here."""
        if self.rounds:
            self.flush(opt)
        elif not set(members) <= self._pulled.get(g, set()):
            self._snap = (g, opt.w.copy(), opt.version)  # replaces an older one (see above)
            self.snapshots += 1
        self.gen = g
        self._forget(g)

    def flush(self, opt: Shard) -> int:
        """Apply the open round: per range, one step on the origins' pieces summed in id order
        and divided by their number, with the lowest origin's hyperparameters."""
        n = 0
        for (a, b), by in sorted(self._round.items()):
            s = np.zeros(b - a, np.float32)
            for o in sorted(by):
                s += by[o][0]
            s /= np.float32(len(by))
            opt.apply(a - self.lo, b - self.lo, s, by[min(by)][1], 1.0)
            n += len(by)
        self._round.clear()
        opt.version += n
        return n

    def serve(self, opt: Shard, barrier: int, caller: int, members: Iterable[int]) -> tuple[np.ndarray, int]:
        """The shard (weights never modified afterwards, version in pieces) a pull of
        ``barrier`` (0: the current weights) by ``caller`` gets."""
        snap = self._snap if barrier and self._snap is not None and self._snap[0] == barrier else None
        if self.rounds and (barrier == 0 or self.gen < barrier):
            self.flush(opt)
        if barrier and self.gen == barrier and (snap is not None or self.rounds):
            self.late_pulls += 1
        if snap is not None:
            out = snap[1], snap[2]
        else:
            if barrier and self.gen >= barrier + (1 if self.rounds else 0):  # generation b was applied
                if not self.misses:
                    log.warning("barrier %d pulled by node %d after its copy was dropped: served the current "
                                "shard", barrier, caller)
                self.misses += 1
            out = opt.w.copy(), opt.version
        if barrier:
            done = self._pulled.setdefault(barrier, set())
            done.add(caller)
            self._forget(barrier)
            if set(members) <= done and self._snap is not None and self._snap[0] == barrier:
                self._snap = None
        return out

    def _forget(self, barrier: int) -> None:
        for b in [b for b in self._pulled if b < barrier]:
            del self._pulled[b]

    def reset(self, lo: int) -> None:
        """A re-shard (after :meth:`flush`): a new shard at ``lo``; copies and pull records of
        the old split are dropped, the generation goes on."""
        self.lo = lo
        self._round.clear()
        self._snap = None
        self._pulled.clear()

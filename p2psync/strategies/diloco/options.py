"""The ``--opt`` options of ``--strategy diloco``.

Options (``--opt NAME=VALUE``; :class:`DilocoOptions`):

* ``inner_steps`` H (100), ``outer_lr`` (0.7), ``outer_momentum`` (0.9), ``nesterov`` (true);
* ``fragments`` P (1), ``fragment_by`` (``blocks``: repeated blocks dealt to P fragments, plus one
  more for every other parameter; ``flat``: P contiguous ranges), ``fragment_pattern``
  (``strided`` | ``sequential``), ``tau`` (0), ``alpha`` (0.5); ``inner_steps`` must be a multiple
  of the number of fragments synchronized in turn, P_total (P, or P + 1 with that extra
  fragment), and ``tau`` < inner_steps / P_total: checked against P and P + 1 here, and against
  the model's P_total once it is known (:meth:`DilocoOptions.check_parts`);
* ``outer_codec`` (the run's ``--codec``; ``e3m0`` for 4-bit, ``e3m0:sr`` with
  stochastic rounding), ``error_feedback`` (the run's
  ``--error-feedback``; ``true`` | ``false``), ``outer_collective`` (the plan of the
  pseudo-gradients' allreduce; empty: ``direct`` for a lossy per-piece outer codec, so that each
  node's Δ is encoded once and summed in float32 at the piece's owner instead of re-encoded at
  every hop of a ring, else the run's ``--collective``);
* ``weighting`` (``uniform`` | ``samples``: each Δ weighted by the samples behind it);
* ``final_sync`` (``full``: one last outer step over the whole model at the stop; ``outer``: the
  outer parameters as they are), ``init_sync`` (true: every member starts from the lowest id's
  parameters), ``join_inner_state`` (``copy``: a joiner takes the leader's inner optimizer state;
  ``fresh``: it keeps its own);
* ``dylu`` (Dynamic Local Updates: after each cycle a node takes
  h_m = max(⌈dylu_min_steps / P⌉, ⌊⌊v_m / max v · H⌋ / P⌋) inner steps per fragment, v its
  measured compute speed, published in every side sum, so slow and fast nodes reach each sum
  together; operations are matched by number, not by step), ``dylu_min_steps`` (5);
* ``eager`` (Eager updates; ``fragments=1``, ``tau=0``, ``weighting=uniform``: a round's sum is
  awaited only at the next round's send, a whole round later, and each node steps its own θ_g
  with its fresh Δ over the members plus the previous round's mean less its own fresh term of
  that round (the others' Δ: each contribution enters once); the nodes' θ_g
  differ until the stop, which applies a completion step and then an exact mean of θ_g and the
  momentum), ``eager_delay`` (1; more is not built).

Bad or unbuilt combinations are a ConfigError naming the option.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from p2psync.collectives.plan import ALGOS
from p2psync.compress import TopK, get_codec
from p2psync.errors import ConfigError
from p2psync.strategies.options import StrategyOptions, check_outer_codec, option, positive, require, tri_state

#: where P_total = fragments + 1 comes from (fragment_by=blocks)
_EXTRA = "with fragment_by=blocks they form one more fragment: embeddings, final norm, output layer"


@dataclass(frozen=True)
class DilocoOptions(StrategyOptions):
    """``--opt`` options of ``--strategy diloco`` (see the module docstring)."""

    inner_steps: int = option(100, "H: inner steps between two syncs of the same parameters")
    outer_lr: float = option(0.7, "outer learning rate (DiLoCo 0.7, Streaming 0.4)")
    outer_momentum: float = option(0.9, "outer momentum, 0 <= mu < 1")
    nesterov: bool = option(True, "Nesterov outer momentum (false: heavy ball)")
    fragments: int = option(1, "P: fragments synchronized in turn (Streaming DiLoCo)")
    fragment_by: Literal["blocks", "flat"] = option("blocks", "fragments of repeated blocks (+1 for the rest) "
                                                              "or contiguous ranges")
    fragment_pattern: Literal["strided", "sequential"] = option("strided", "which blocks go together")
    tau: int = option(0, "overlap: a fragment's average is merged tau inner steps after it was sent")
    alpha: float = option(0.5, "merge weight of the local parameters (tau > 0)")
    eager: bool = option(False, "eager updates: a round's sum is applied a whole round later, each node's own "
                                "contribution at once")
    eager_delay: int = option(1, "rounds of eager overlap (only 1 is built)")
    outer_codec: str = option("", "codec of the pseudo-gradient allreduce (empty: the run's --codec)")
    error_feedback: str = option("", "error feedback of the outer codec: true/false (empty: --error-feedback)")
    outer_collective: str = option("", "plan of the pseudo-gradient allreduce (empty: direct for a lossy outer "
                                       "codec, else the run's --collective)")
    weighting: Literal["uniform", "samples"] = option("uniform", "weights of the nodes' pseudo-gradients")
    dylu: bool = option(False, "per-node inner steps proportional to the node's measured speed")
    dylu_min_steps: int = option(5, "with dylu: the fewest inner steps a node takes per cycle")
    final_sync: Literal["full", "outer"] = option("full", "at the stop: one last full outer step, or the outer "
                                                          "parameters as they are")
    join_inner_state: Literal["copy", "fresh"] = option("copy", "a joiner copies the leader's inner optimizer "
                                                                "state, or keeps its own (fresh)")
    init_sync: bool = option(True, "start every member from the lowest id's parameters")

    def __post_init__(self) -> None:
        require(self.inner_steps >= 1, self, "inner_steps", "must be a whole number >= 1")
        positive(self, "outer_lr")
        require(0.0 <= self.outer_momentum < 1.0, self, "outer_momentum", "must be in [0, 1)")
        require(self.fragments >= 1, self, "fragments", "must be a whole number >= 1")
        # (the model is not known here: P_total is fragments, or fragments + 1 with fragment_by=blocks;
        # check_parts checks the one the model gives)
        counts = self.part_counts()
        fits = [p for p in counts if self.inner_steps % p == 0]
        require(bool(fits), self, "inner_steps", f"must be a multiple of fragments={self.fragments}" + (
            f", or of {counts[-1]} when the model has parameters outside its repeated blocks ({_EXTRA})"
            if len(counts) > 1 else ""))
        p = min(fits) if fits else self.fragments
        require(0 <= self.tau < self.inner_steps // p, self, "tau",
                f"must be 0 <= tau < inner_steps / {'fragments' if p == self.fragments else p} = "
                f"{self.inner_steps // p} (at most one fragment in flight)")
        require(math.isfinite(self.alpha) and 0.0 <= self.alpha <= 1.0, self, "alpha", "must be in [0, 1]")
        require(not self.eager or self.fragments == 1, self, "eager", "only with fragments=1 (eager updates of "
                "streamed fragments are not built)")
        require(not self.eager or self.tau == 0, self, "eager", "only with tau=0 (the overlap is a whole round)")
        require(not self.eager or self.weighting == "uniform", self, "eager", "only with weighting=uniform")
        require(not self.eager or not self.outer_codec.startswith("topk"), self, "eager", "not with a topk outer_codec")
        require(self.eager_delay == 1, self, "eager_delay", "only 1 is built (2-outer-steps eager is not)")
        require(self.dylu_min_steps >= 1, self, "dylu_min_steps", "must be a whole number >= 1")
        require(self.dylu or self.dylu_min_steps == 5, self, "dylu_min_steps", "only with dylu=true")
        require(not (self.dylu and self.eager), self, "dylu", "not with eager")
        require(self.outer_collective in ("", *ALGOS), self, "outer_collective",
                f"one of {', '.join(ALGOS)} (empty: direct for a lossy outer codec, else --collective)")
        check_outer_codec(self, self.outer_codec, self.error_feedback)

    def part_counts(self) -> tuple[int, ...]:
        """The numbers of fragments synchronized in turn (P_total) these options can give before
        the model is known: ``fragments``; with ``fragment_by=blocks`` and ``fragments`` > 1 also
        ``fragments`` + 1, the model's parameters outside its repeated blocks forming one more
        fragment when it has any."""
        if self.fragments > 1 and self.fragment_by == "blocks":
            return self.fragments, self.fragments + 1
        return (self.fragments,)

    def check_parts(self, parts: int) -> None:
        """The schedule's checks once the model's fragments are known (``parts`` = P_total, one
        of :meth:`part_counts`): ``inner_steps`` a multiple of P_total and ``tau`` < inner_steps /
        P_total. ConfigError naming the options as the user set them, and saying where a
        fragment more than ``fragments`` comes from."""
        if parts == self.fragments:
            require(self.inner_steps % parts == 0, self, "inner_steps", f"must be a multiple of fragments={parts}")
            require(0 <= self.tau < self.inner_steps // parts, self, "tau",
                    f"must be 0 <= tau < inner_steps / fragments = {self.inner_steps // parts} "
                    "(at most one fragment in flight)")
            return
        why = (f"with fragments={self.fragments} and fragment_by={self.fragment_by} the model is synchronized as "
               f"{parts} fragments in turn (its repeated blocks in {self.fragments} groups, and one more for the "
               "parameters outside them: embeddings, final norm, output layer)")
        if self.inner_steps % parts:
            near = sorted({max(parts, self.inner_steps // parts * parts), -(-self.inner_steps // parts) * parts})
            raise ConfigError(f"--opt inner_steps={self.inner_steps}: {why}, so inner_steps must be a multiple of "
                              f"{parts} (e.g. {' or '.join(map(str, near))}), or use --opt fragment_by=flat for "
                              f"exactly {self.fragments} fragments")
        h = self.inner_steps // parts
        if not 0 <= self.tau < h:
            raise ConfigError(f"--opt tau={self.tau}: {why}, one every inner_steps / {parts} = {h} steps, so tau must "
                              f"be 0 <= tau < {h} (at most one fragment in flight)")

    def outer_plan(self, codec: str, run_algo: str) -> str:
        """The collective plan of the pseudo-gradients' allreduce under the outer ``codec``:
        ``outer_collective`` when set, else ``direct`` for a lossy per-piece codec (each
        contribution encoded once: a ring would re-encode partial sums at every hop, which
        compounds a 4-bit codec's error with the group's size), else the run's ``run_algo``."""
        if self.outer_collective:
            return self.outer_collective
        c = get_codec(codec)
        return "direct" if c.lossy and not isinstance(c, TopK) else run_algo

    @property
    def feedback(self) -> bool | None:
        """The error_feedback option: True, False, or None (the run's setting)."""
        return tri_state(self.error_feedback)


__all__ = ["DilocoOptions"]

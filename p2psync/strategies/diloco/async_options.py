"""The ``--opt`` options of ``--strategy diloco-async`` (:class:`DilocoAsyncOptions`).

* ``inner_steps`` H (50, the Async Local-SGD paper's default): the fastest node's inner steps
  per phase; with ``dylu`` a node takes H_m = max(dylu_min_steps, ⌊v_m / max v · H⌋);
* ``outer_lr`` ε (0.7): with one update per worker per buffer Delayed Nesterov *is* synchronous
  Nesterov on the buffer's mean, so DiLoCo's outer learning rate is the homogeneous default (the
  paper swept {0.03, 0.1, 0.3, 0.7}; its toy notebook used 0.07 for plain async, not for DN);
* ``outer_momentum`` β (0.9); ``dn_buffer`` N (0: the group's size, re-read at every view);
  ``dn_c`` (0 only: c > 0 makes the intermediate steps depend on when a buffer completes, so
  members that apply one stream would still agree, but the buffer's net effect would depend on
  the arrival order, spec E8);
* ``dylu`` (true), ``dylu_min_steps`` (5; a node never takes more than ``inner_steps``);
* ``grace_s`` (5.0): how long a node that sent its pseudo-gradient waits for every update up to
  its own to be applied before it restarts from θ_g as it stands;
* ``merge_s`` (0: a quarter of the node's phase just ended): how long it then waits for the rest
  of the buffer that holds its update (the paper's grace period: nodes that finish together
  restart from one θ_g);
* ``hole_s`` (0: the peer timeout): how long a missing update may hold up the updates numbered
  after it before the members re-form (a number handed out but never delivered);
* ``send_timeout`` (5.0): seconds before a flooded send to a silent peer is dropped;
* ``outer_codec`` (the run's ``--codec``), ``error_feedback`` (the run's ``--error-feedback``).

Bad values are a ConfigError naming the option.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2psync.strategies.options import (StrategyOptions, check_outer_codec, non_negative, option, positive, require,
                                        tri_state)



@dataclass(frozen=True)
class DilocoAsyncOptions(StrategyOptions):
    """``--opt`` options of ``--strategy diloco-async`` (see the module docstring)."""

    inner_steps: int = option(50, "H: inner steps per phase of the fastest node")
    outer_lr: float = option(0.7, "epsilon: outer learning rate of Delayed Nesterov")
    outer_momentum: float = option(0.9, "beta: outer momentum, 0 <= beta < 1")
    dn_buffer: int = option(0, "N: updates per momentum step (0: the group's size)")
    dn_c: float = option(0.0, "Delayed Nesterov's momentum activation c (only 0)")
    dylu: bool = option(True, "Dynamic Local Updates: inner steps per phase proportional to the node's speed")
    dylu_min_steps: int = option(5, "with dylu: the fewest inner steps a node takes per phase")
    grace_s: float = option(5.0, "seconds a node waits for the updates up to its own before it restarts")
    merge_s: float = option(0.0, "seconds it then waits for the rest of its buffer (0: a quarter of its phase)")
    hole_s: float = option(0.0, "seconds a missing update may hold up the stream before the members re-form "
                                "(0: the peer timeout)")
    send_timeout: float = option(5.0, "seconds before a flooded send to a silent peer is dropped")
    outer_codec: str = option("", "codec of the pseudo-gradients (empty: the run's --codec)")
    error_feedback: str = option("", "error feedback of the outer codec: true/false (empty: --error-feedback)")

    def __post_init__(self) -> None:
        require(self.inner_steps >= 1, self, "inner_steps", "must be a whole number >= 1")
        positive(self, "outer_lr")
        require(0.0 <= self.outer_momentum < 1.0, self, "outer_momentum", "must be in [0, 1)")
        require(self.dn_buffer >= 0, self, "dn_buffer", "must be a whole number >= 0 (0: the group's size)")
        require(self.dn_c == 0.0, self, "dn_c", "only 0 is built: with c > 0 a buffer's effect depends on the order "
                "in which its updates arrive")
        require(self.dylu_min_steps >= 1, self, "dylu_min_steps", "must be a whole number >= 1")
        positive(self, "grace_s", "send_timeout")
        non_negative(self, "hole_s", "merge_s")
        check_outer_codec(self, self.outer_codec, self.error_feedback)

    @property
    def feedback(self) -> bool | None:
        """The error_feedback option: True, False, or None (the run's setting)."""
        return tri_state(self.error_feedback)


__all__ = ["DilocoAsyncOptions"]

"""What a synchronous strategy does when a member fails: the run's failure policy, decided once.

* :class:`Reform` (``--on-failure continue`` with a membership service): every operation runs
  over the current view; a failed one is given up and redone over the next view
  (:class:`~p2psync.strategies.regroup.Regroup`), and a peer's failure alone changes nothing
  until that view comes.
* :class:`Stop` (``--on-failure stop``, or no membership service: unit tests): every operation
  runs over every node of the topology at epoch 0, and a failed peer ends the run with
  :class:`~p2psync.errors.PeerFailure` naming it (the pending receives of the strategy's
  operations fail at once: :class:`~p2psync.strategies.base.FailStop`).

:func:`failure_policy` is the one place that chooses; a strategy asks its policy for the view
an operation runs over (:meth:`FailurePolicy.view`), hands it peer failures
(:meth:`FailurePolicy.on_peer_failure`) and lets it check, at the start of a step, whether the
run can go on (:meth:`FailurePolicy.check`), without testing the setting itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from p2psync.coordinator import View
from p2psync.strategies.base import FailStop, StrategyContext


class FailurePolicy(ABC):
    """One strategy's answer to a member's failure (see the module docstring)."""

    #: a failed operation is redone over the next view (else a failed peer ends the run)
    reforms: ClassVar[bool]

    @abstractmethod
    def view(self) -> View:
        """The view the next operation runs over."""

    @abstractmethod
    def on_peer_failure(self, peer: int) -> None:
        """``peer`` failed (the membership client's report, on the event loop)."""

    @abstractmethod
    def check(self) -> None:
        """Raise PeerFailure when the run cannot go on (a strategy calls it as a step starts)."""


class Reform(FailurePolicy):
    """Operations run over the current view; failures are handled by the next view."""

    reforms = True

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx

    def view(self) -> View:
        return self.ctx.view

    def on_peer_failure(self, peer: int) -> None:
        """Nothing yet: the view that removes ``peer`` re-forms the group."""

    def check(self) -> None:
        """Never stops the run: a failed operation waits for the next view instead."""


class Stop(FailurePolicy):
    """Operations run over every node at epoch 0; a failed peer ends the run."""

    reforms = False

    def __init__(self, ctx: StrategyContext, name: str, prefix: str) -> None:
        #: the failed peers, and the scope of the strategy's operations (tags under ``prefix``)
        self.failstop = FailStop(ctx, name, prefix)
        self._view = View(epoch=0, members=tuple(ctx.topology.ids))

    def view(self) -> View:
        return self._view

    def on_peer_failure(self, peer: int) -> None:
        """Remember ``peer`` and fail the pending receives of the strategy's operations."""
        self.failstop.on_peer_failure(peer)

    def check(self) -> None:
        """PeerFailure naming the failed peers, if any."""
        self.failstop.check()


def failure_policy(ctx: StrategyContext, name: str, prefix: str | None = None) -> FailurePolicy:
    """The policy of strategy ``name`` (its operations' tags start with ``prefix``, default
    ``name.``): :class:`Reform` with ``--on-failure continue`` and a membership service (a
    view), else :class:`Stop`. Call it after the rendezvous (a strategy's constructor)."""
    if ctx.on_failure == "continue" and ctx.membership.view is not None:
        return Reform(ctx)
    return Stop(ctx, name, prefix if prefix is not None else f"{name}.")


__all__ = ["FailurePolicy", "Reform", "Stop", "failure_policy"]

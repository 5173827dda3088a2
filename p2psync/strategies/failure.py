"""What a synchronous strategy does when a member fails: the run's failure policy, decided once.

* :class:`Reform` (``--on-failure continue`` with a membership service): every operation runs
  over the current view; a failed one is given up and redone over the next view
  (:class:`~p2psync.strategies.regroup.Regroup`), and a peer's failure alone changes nothing
  until that view comes.
* :class:`Stop` (``--on-failure stop``, or no membership service: unit tests): every operation
  runs over every node of the topology at epoch 0, and a failed peer ends the run with
  :class:`~p2psync.errors.PeerFailure` naming it (the pending receives of the strategy's
  operations fail at once: :class:`~p2psync.strategies.base.FailStop`).

:func:`failure_policy` is the one place that chooses. A strategy exposes its policy as
:attr:`~p2psync.strategies.base.Strategy.failure`; the step driver checks it before every step
(:meth:`FailurePolicy.check`, through :meth:`~p2psync.strategies.base.Strategy.run_step`). The
strategy asks it for the view an operation runs over (:meth:`FailurePolicy.view`), hands it
peer failures (:meth:`FailurePolicy.on_peer_failure`), runs an operation under it
(:meth:`FailurePolicy.run`: once, or the strategy's re-forming path) and asks it which errors
are recovered from (:meth:`FailurePolicy.recovers`), without testing the setting itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Awaitable, Callable, TypeVar

from p2psync.coordinator import View
from p2psync.errors import PeerFailure, PeerTimeout, ProtocolError
from p2psync.strategies.base import FailStop, StrategyContext

T = TypeVar("T")


class FailurePolicy(ABC):
    """One strategy's answer to a member's failure (see the module docstring)."""

    @abstractmethod
    def view(self) -> View:
        """The view the next operation runs over."""

    @abstractmethod
    def on_peer_failure(self, peer: int) -> None:
        """``peer`` failed (the membership client's report, on the event loop)."""

    @abstractmethod
    def check(self) -> None:
        """Raise PeerFailure when the run cannot go on (the step driver calls it before every
        step: :meth:`~p2psync.strategies.base.Strategy.run_step`)."""

    @abstractmethod
    def recovers(self, exc: BaseException) -> bool:
        """Whether an operation that failed with ``exc`` is given up and redone over the next
        view (True), or ``exc`` ends the run (False)."""

    @abstractmethod
    async def run(self, once: Callable[[View], Awaitable[T]], reform: Callable[[], Awaitable[T]]) -> T:
        """An operation under the policy, given both ways of running it: ``once(view)`` runs it
        over :meth:`view` a single time (a failure ends the run); ``reform()`` runs it over the
        current view and redoes it over the next one when it fails. Returns what the chosen one
        returns, raises what it raises."""


class Reform(FailurePolicy):
    """Operations run over the current view; failures are handled by the next view."""

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx

    def view(self) -> View:
        return self.ctx.view

    def on_peer_failure(self, peer: int) -> None:
        """Nothing yet: the view that removes ``peer`` re-forms the group."""

    def check(self) -> None:
        """Never stops the run: a failed operation waits for the next view instead."""

    def recovers(self, exc: BaseException) -> bool:
        """A member's failure (PeerFailure, which includes a peer's non-finite piece), a wait
        on a peer that timed out (PeerTimeout), or members that ran the operation over
        different groups (ProtocolError ``collective_mismatch``: two views with the same epoch
        around a coordinator takeover, until the newer one arrives). Any other error ends the
        run."""
        return isinstance(exc, (PeerFailure, PeerTimeout)) or (
            isinstance(exc, ProtocolError) and exc.reason == "collective_mismatch")

    async def run(self, once: Callable[[View], Awaitable[T]], reform: Callable[[], Awaitable[T]]) -> T:
        """``reform()``."""
        return await reform()


class Stop(FailurePolicy):
    """Operations run over every node at epoch 0; a failed peer ends the run."""

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

    def recovers(self, exc: BaseException) -> bool:
        """Never: every failure ends the run."""
        return False

    async def run(self, once: Callable[[View], Awaitable[T]], reform: Callable[[], Awaitable[T]]) -> T:
        """``once(view)`` over every node at epoch 0."""
        return await once(self._view)


def failure_policy(ctx: StrategyContext, name: str, prefix: str | None = None) -> FailurePolicy:
    """The policy of strategy ``name`` (its operations' tags start with ``prefix``, default
    ``name.``): :class:`Reform` with ``--on-failure continue`` and a membership service (a
    view), else :class:`Stop`. Call it after the rendezvous (a strategy's constructor)."""
    if ctx.on_failure == "continue" and ctx.membership.view is not None:
        return Reform(ctx)
    return Stop(ctx, name, prefix if prefix is not None else f"{name}.")


__all__ = ["FailurePolicy", "Reform", "Stop", "failure_policy"]

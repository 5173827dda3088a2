"""The strategy interface, its context and the name registry.

A strategy owns one training step end to end — local compute through the
:class:`~p2psync.training.trainer.Trainer`-like replica, and whatever it exchanges through
collectives and coordinator clients — so each algorithm can overlap communication with compute
its own way. It never touches sockets directly.

Only :meth:`Strategy.train_step` is abstract. ``want_stop`` tells the strategy this node would
like to stop after this step; the strategy returns ``stop=True`` when the run ends (synchronous
strategies agree on it collectively, so all nodes stop at the same step).

Membership changes (issue 10 item 5, DESIGN "Membership is a sequence of views") reach every
strategy through one hook, :meth:`Strategy.on_view`, called on the event loop with every newer
:class:`~p2psync.coordinator.views.View` (``on_peer_failure`` is still called once per failed
peer, before the view that removes it). :attr:`StrategyContext.group` and
:attr:`StrategyContext.epoch` give the current training group. ``on_failure`` (``--on-failure``)
says whether synchronous strategies re-form over the survivors (``continue``, see
:mod:`~p2psync.strategies.regroup`) or stop with :class:`PeerFailure` (``stop``). A node that
joins a running run (``joining``) fetches its state from live peers in :meth:`Strategy.start`
and the training loop starts at :attr:`Strategy.start_step`; a step may move the loop to
another step (``StepReport.next_step``) when it adopted a peer's state instead of training.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Protocol, Sequence

import numpy as np

from p2psync.collectives import Collectives, OpStats
from p2psync.coordinator import MembershipClient, RpcClient, RpcServer, View
from p2psync.errors import ConfigError, PeerFailure
from p2psync.strategies.canary_colayers import Layer
from p2psync.strategies.options import StrategyOptions, build_options
from p2psync.tasks import gather_or_cancel
from p2psync.topology import Topology
from p2psync.transport import Transport
from p2psync.vocab import ON_FAILURE, OnFailure


#: a learning rate or weight decay: one number, or one value per parameter element when the
#: optimizer's parameter groups differ
PerElement = float | np.ndarray


@dataclass(frozen=True)
class SgdHyper:
    """The plain-SGD hyper-parameters in effect for the next step (DTS's compensation needs
    them, ../shared/specs/dts.md §1.7)."""

    lr: PerElement
    momentum: float
    weight_decay: PerElement


@dataclass(frozen=True)
class SgdStep:
    """One local SGD step: ``grad`` is what SGD fed to its momentum buffer (the gradient plus
    weight_decay times the parameters before the step), ``hyper`` the numbers it used."""

    grad: np.ndarray
    hyper: SgdHyper


class Replica(Protocol):
    """What a strategy needs of the local model (implemented by training.Trainer)."""

    numel: int

    @property
    def samples(self) -> int: ...

    async def compute_gradients(self, abort: threading.Event | None = None) -> tuple[float, np.ndarray]: ...
    async def apply_gradients(self, vec: np.ndarray) -> None: ...
    async def apply_each(self, vecs: Sequence[np.ndarray]) -> None: ...
    #: one local step with plain SGD, reporting the tensor SGD fed to its buffer (DTS)
    async def sgd_step(self, vec: np.ndarray) -> SgdStep: ...
    #: the optimizer's plain-SGD numbers (ConfigError for any other optimizer)
    async def sgd_hyper(self) -> SgdHyper: ...
    #: parameters += dw, SGD momentum buffers += du (DTS's compensation)
    async def correct(self, dw: np.ndarray, du: np.ndarray | None) -> None: ...
    async def get_params(self) -> np.ndarray: ...
    async def set_params(self, vec: np.ndarray) -> None: ...
    #: parameters + optimizer state as one float32 vector (same length on every node of a run)
    async def export_state(self) -> np.ndarray: ...
    async def import_state(self, vec: np.ndarray) -> None: ...
    def state_size(self) -> int: ...
    #: the modules with trainable parameters, in the flat vector's order (Canary's colayers)
    def layers(self) -> list[Layer]: ...




@dataclass
class StrategyContext:
    node_id: int
    topology: Topology
    transport: Transport
    rpc: RpcClient
    rpc_server: RpcServer
    membership: MembershipClient
    replica: Replica
    collectives: Collectives
    #: seconds any single peer-dependent wait may take
    peer_timeout: float = 30.0
    options: Mapping[str, Any] = field(default_factory=dict)
    #: ``continue``: synchronous strategies re-form over the survivors; ``stop``: PeerFailure
    on_failure: OnFailure = "continue"
    #: this node registered after the run started: fetch the state from live peers first
    joining: bool = False
    #: the run's step budget when it has one (``--steps``): every node stops after step
    #: ``max_steps - 1``, known in advance (strategies that agree on stopping only every few
    #: steps use it to stop exactly there)
    max_steps: int | None = None

    def __post_init__(self) -> None:
        if self.on_failure not in ON_FAILURE:
            raise ConfigError(f"--on-failure {self.on_failure!r}: choose continue or stop")

    @property
    def alive(self) -> list[int]:
        return [n for n in self.topology.ids if n not in self.membership.failed]

    @property
    def coordinator(self) -> int:
        """The node coordinating now (it moves to the lowest live id when the coordinator dies);
        call its services with ``membership.call_coordinator``, which retries when it moves."""
        return self.membership.coordinator

    @property
    def view(self) -> View:
        """The current view; without a membership service (tests): every node, epoch 0."""
        v = self.membership.view
        return v if v is not None else View(epoch=0, members=tuple(self.topology.ids))

    @property
    def group(self) -> tuple[int, ...]:
        """The current training group: the members of the current view."""
        return self.view.members

    @property
    def epoch(self) -> int:
        return self.view.epoch


@dataclass
class StepReport:
    loss: float
    stop: bool = False
    #: seconds this step spent moving data / blocked waiting for peers
    comm_s: float = 0.0
    wait_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    #: the step the loop runs next (default: this one + 1); set when the strategy adopted a
    #: peer's state at another step instead of training (a lagging survivor after a re-form)
    next_step: int | None = None


class Strategy(ABC):
    name: ClassVar[str] = ""
    #: the options accepted via --opt NAME=VALUE (a frozen dataclass; see strategies/options.py)
    Options: ClassVar[type[StrategyOptions]] = StrategyOptions

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self.opts: StrategyOptions = parse_options(type(self), ctx.options, topology=ctx.topology)
        #: the first step the training loop runs (a joiner sets it to the step it joined at)
        self.start_step = 0

    @classmethod
    def check_options(cls, opts: Any, topology: Topology) -> None:
        """Checks of ``opts`` (this strategy's :attr:`Options`) that need the topology (a
        group size against N); ConfigError naming the option."""

    @classmethod
    def coordinator_services(cls, server: RpcServer, topology: Topology, options: Mapping[str, Any]) -> None:
        """Register this strategy's coordinator services (called on the coordinator node before
        rendezvous, so they exist before any node can call them, and on the node that takes over
        when the coordinator dies: the services start empty and rebuild their state from the
        members' next calls)."""

    async def start(self) -> None:
        """Called once after rendezvous, before the first step."""

    @abstractmethod
    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        """Run one step (compute + exchange) and report it."""

    def on_peer_failure(self, peer: int) -> None:
        """A peer was declared failed by the membership service (called on the event loop)."""

    #: the strategy wants :meth:`on_grad_ready` during backward (user scripts and the built-in
    #: job both go through ``attach``, which installs the per-parameter hooks)
    grad_ready: ClassVar[bool] = False

    def on_grad_ready(self, index: int, offset: int, grad: np.ndarray) -> None:
        """Parameter ``index`` (flat ``offset``) got its gradient during backward (event loop;
        only when :attr:`grad_ready`). Strategies that pipeline layer groups start sending
        here; the flat gradient at the step is still what ``compute_gradients`` returns."""

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own state for a user's checkpoint (JSON-friendly values); the model
        and optimizer state are in their own state dicts."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (called after :meth:`start`, before the first step)."""

    def on_view(self, view: View) -> None:
        """A newer membership view (a node left or joined; called on the event loop, after
        ``on_peer_failure`` for the peers it removes). Strategies take their group from it."""

    async def close(self) -> None:
        """Called once at the end (also after errors)."""


REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"strategy name {cls.name!r} is empty or taken")
    REGISTRY[cls.name] = cls
    return cls


def get_strategy(name: str) -> type[Strategy]:
    from p2psync import strategies  # noqa: F401  (registers the built-ins)

    if name not in REGISTRY:
        raise ConfigError(f"unknown strategy {name!r} (choose from {', '.join(sorted(REGISTRY))})")
    return REGISTRY[name]


def parse_options(cls: type[Strategy], raw: Mapping[str, Any], *,
                  topology: Topology | None = None) -> Any:
    """``cls.Options`` built from the user's ``raw`` options and checked (against ``topology``
    too when given): the one place a strategy's options are validated, called at the CLI edge
    (``p2psync run``: exit 2), by ``Session``/``NodeRuntime`` before the rendezvous, and by the
    strategy itself. Typed ``Any`` so each strategy reads its own dataclass's fields."""
    opts = build_options(cls.Options, raw, strategy=cls.name)
    if topology is not None:
        cls.check_options(opts, topology)
    return opts


class FailStop:
    """For synchronous strategies: a failed peer ends the run with PeerFailure naming it, and
    the receives of the strategy's pending collective (tags starting with ``prefix``) are
    aborted at once instead of waiting for their timeout."""

    def __init__(self, ctx: StrategyContext, name: str, prefix: str) -> None:
        self.ctx = ctx
        self.name = name
        self.prefix = prefix
        self.failed: set[int] = set()

    def on_peer_failure(self, peer: int) -> None:
        self.failed.add(peer)
        self.ctx.transport.mailbox.abort(self._error((peer,)), match=lambda tag: tag.startswith(self.prefix))

    def _error(self, peers: tuple[int, ...]) -> PeerFailure:
        departed = [p for p in peers if p in self.ctx.membership.departed]
        if departed and len(departed) == len(peers):  # a loop that ended, not a crash
            return PeerFailure(f"{self.name}: peer(s) {departed} ended their training loop and left the run; "
                               "with --on-failure stop the others cannot go on (end every node's loop at "
                               "the same step: --steps/--time and p2psync.should_stop())", peers=peers)
        return PeerFailure(f"{self.name}: peer(s) {list(peers)} failed; synchronous training cannot "
                           "continue", peers=peers)

    def check(self) -> None:
        if self.failed:
            raise self._error(tuple(sorted(self.failed)))


async def mean_and_agree(coll: Collectives, vec: np.ndarray, flag: bool, *, tag: str,
                         group: Sequence[int] | None = None,
                         more: Sequence[np.ndarray] = ()) -> tuple[np.ndarray, bool, OpStats]:
    """The mean of ``vec`` over ``group`` (default every node; through the run's codec, which may be lossy) and
    whether any node raised ``flag``, plus the stats of the vector's allreduce.

    ``more``: further tensors averaged by their own allreduces (``<tag>.m<k>``: a lossy codec
    with error feedback then selects within each tensor); their means are appended to the
    result, in order.

    Control values (stop flags, counts) never pass through a lossy codec: int8 and sketch8 do
    not map 0 to exactly 0, so a flag riding in the quantized vector reads as "stop" about half
    the time. The flag gets its own exact allreduce (codec ``none``), run concurrently with the
    vector's, so it adds no round trip. If either fails, the other is cancelled.
    """
    one = np.array([1.0 if flag else 0.0], dtype=np.float32)
    (mean, stats), flags, *others = await gather_or_cancel([
        coll.allreduce_with_stats(vec, group, op="mean", tag=tag),
        coll.allreduce(one, group, op="sum", tag=f"{tag}.flag", codec="none"),
        *(coll.allreduce(x, group, op="mean", tag=f"{tag}.m{k}") for k, x in enumerate(more))])
    if others:
        mean = np.concatenate([mean, *others])
    return mean, bool(flags[0] > 0), stats

"""The strategy interface, its context and the name registry.

A strategy owns one training step end to end — local compute through the replica
(:class:`~p2psync.model.replica.Replica`: a small core, plus the capabilities the strategy
declares in :attr:`Strategy.requires`, checked when it is built), and whatever it exchanges
through collectives and coordinator clients — so each algorithm can overlap communication with
compute its own way. It never touches sockets directly.

Only :meth:`Strategy.train_step` is abstract. ``want_stop`` tells the strategy this node would
like to stop after this step; the strategy returns ``stop=True`` when the run ends (synchronous
strategies agree on it collectively, so all nodes stop at the same step).

Membership changes (docs/architecture.md, "Membership is a sequence of views") reach every
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

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Hashable, Literal, Mapping, Sequence, final

import numpy as np

from p2psync.collectives import Collectives, OpStats
from p2psync.compress import Codec, get_codec
from p2psync.coordinator import MembershipClient, RpcClient, RpcServer, View
from p2psync.errors import ConfigError, PeerFailure
from p2psync.model import Capability, Replica, check_replica
from p2psync.strategies.needs import Needs
from p2psync.strategies.options import StrategyOptions, build_options
from p2psync.tasks import gather_or_cancel
from p2psync.topology import Topology
from p2psync.transport import Transport
from p2psync.vocab import ON_FAILURE, BufferMode, OnFailure

if TYPE_CHECKING:
    from p2psync.strategies.failure import FailurePolicy


@dataclass
class StrategyContext:
    """Everything a strategy may use, handed to its constructor: this node's id, the topology,
    the transport, RPC client and server, the membership client, the local :class:`Replica`
    and the collectives, plus the run's settings (options, timeouts, failure policy).

    Built once per node by ``NodeRuntime.start_strategy`` (api/runtime.py) and kept by
    :class:`Strategy` as ``self.ctx``; e.g. ssgd.py: ``coll = self.ctx.collectives``.
    """

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
    #: module buffers at a synchronizing step (``--buffers``; strategies/buffers.py)
    buffers: BufferMode = "broadcast"
    #: audit the replicas every N steps where the strategy promises them equal (``--audit-every``)
    audit_every: int | None = None
    #: seconds a node that hears no majority of the run waits before it gives up (NoQuorum)
    quorum_timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.on_failure not in ON_FAILURE:
            raise ConfigError(f"--on-failure {self.on_failure!r}: choose continue or stop")

    @property
    def alive(self) -> list[int]:
        """The topology's nodes not declared failed by the membership client, in id order."""
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
        """The current view's epoch (0 without a membership service); e.g. dts.py compares
        ``self.ctx.epoch`` with the epoch it trained in to notice a re-form."""
        return self.view.epoch


@dataclass
class StepReport:
    """What :meth:`Strategy.train_step` returns for one step: its loss, whether the run stops
    after it, the seconds spent communicating and waiting, strategy fields for the metrics
    (``extra``) and, when the strategy moved elsewhere, the next step to run.

    Read by the session's step loop (api/driver.py ``StepDriver._drive``): ``self.step = self.step + 1
    if rep.next_step is None else rep.next_step``; one metrics record per report.
    """

    loss: float
    #: the run ends after this step (synchronous strategies agree on it: every node stops here)
    stop: bool = False
    #: seconds this step spent moving data / blocked waiting for peers
    comm_s: float = 0.0
    wait_s: float = 0.0
    #: strategy-specific values added to this step's metrics record (JSON-friendly)
    extra: dict[str, Any] = field(default_factory=dict)
    #: the step the loop runs next (default: this one + 1); set when the strategy adopted a
    #: peer's state at another step instead of training (a lagging survivor after a re-form)
    next_step: int | None = None


class Strategy(ABC):
    """One synchronization algorithm, seen by the runtime through these hooks.

    Subclass it, set :attr:`name`, decorate it with :func:`register` and implement
    :meth:`train_step`; every other hook has a do-nothing default. ``NodeRuntime`` builds it
    with the node's :class:`StrategyContext`, calls :meth:`start`, then the session's step
    loop calls ``rep = await strategy.run_step(self.step, want_stop)`` (the failure policy's
    check, then :meth:`train_step`) until a report says ``stop``; :meth:`close` runs at the
    end. Everything runs on the node's event loop; the model is reached only through
    ``self.ctx.replica``. See ssgd.py for the smallest complete one.
    """

    #: the name ``--strategy`` selects (the :data:`REGISTRY` key)
    name: ClassVar[str] = ""
    #: the options accepted via --opt NAME=VALUE (a frozen dataclass; see strategies/options.py)
    Options: ClassVar[type[StrategyOptions]] = StrategyOptions
    #: what it needs of the user's script (optimizer, schedules, clipping), checked once per run
    #: before anything starts (strategies/needs.py) and shown in the README's table
    needs: ClassVar[Needs] = Needs()
    #: what it needs of the replica beyond the core :class:`~p2psync.model.replica.Replica`
    #: (p2psync/model/replica.py), checked when the strategy is built (ConfigError naming
    #: what is missing); e.g. dts.py: ``requires = (SGD_COMPENSATION, MODEL_BUFFERS)``
    requires: ClassVar[tuple[Capability[Any], ...]] = ()
    #: what one :meth:`train_step` is, as tables name it: ``"step"`` (one local iteration) or
    #: ``"round"`` (several local iterations, then one exchange)
    step_unit: ClassVar[Literal["step", "round"]] = "step"

    #: the failure policy of a synchronous strategy (strategies/failure.py, set in its
    #: constructor), applied around its steps by :meth:`run_step`; None: a failed peer is the
    #: strategy's own business (asynchronous strategies)
    failure: FailurePolicy | None = None

    def __init__(self, ctx: StrategyContext) -> None:
        check_replica(ctx.replica, type(self).requires, f"--strategy {type(self).name}")
        self.ctx = ctx
        self.opts: StrategyOptions = parse_options(type(self), ctx.options, topology=ctx.topology)
        #: the first step the training loop runs (a joiner sets it to the step it joined at)
        self.start_step = 0

    @classmethod
    def check_options(cls, opts: Any, topology: Topology) -> None:
        """Checks of ``opts`` (this strategy's :attr:`Options`) that need the topology (a
        group size against N); ConfigError naming the option."""

    @classmethod
    def check_blocks(cls, opts: Any, *, blocks: int, rest: bool) -> None:
        """Checks of ``opts`` that need the model's shape, when it is known before any node
        starts (``p2psync run``'s built-in language models): ``blocks`` repeated blocks
        (modules named ``<prefix>.<index>``) and, ``rest``, parameters outside them;
        ConfigError naming the option. Otherwise a strategy checks the model it is given at
        :meth:`start`."""

    @classmethod
    def coordinator_services(cls, server: RpcServer, topology: Topology, options: Mapping[str, Any]) -> None:
        """Register this strategy's coordinator services (called on the coordinator node before
        rendezvous, so they exist before any node can call them, and on the node that takes over
        when the coordinator dies: the services start empty and rebuild their state from the
        members' next calls)."""

    def codecs(self) -> list[Codec]:
        """The codecs this strategy encodes with; ``NodeRuntime.start_strategy`` warms them
        (:meth:`Codec.warm`) before :meth:`start`. Default: the collectives' (``--codec``)."""
        return [get_codec(self.ctx.collectives.codec)]

    async def start(self) -> None:
        """Called once after rendezvous, before the first step (``NodeRuntime.start_strategy``:
        ``await strategy.start()``). A joiner fetches its state here and sets
        :attr:`start_step`, e.g. ssgd.py: ``self.start_step = await self.regroup.join()``."""

    @abstractmethod
    async def train_step(self, step: int, want_stop: bool) -> StepReport:
        """Run one step (compute + exchange) and report it. ``want_stop``: this node would like
        to stop after this step (``--steps``/``--time`` reached, or ``Session.request_stop()``).
        Called through :meth:`run_step` only, which has checked :attr:`failure` first."""

    @final
    async def run_step(self, step: int, want_stop: bool) -> StepReport:
        """One step under the failure policy: PeerFailure when :attr:`failure` stops the run
        (:meth:`~p2psync.strategies.failure.FailurePolicy.check`), else :meth:`train_step`.
        The one way a step is run: the session's step loop (api/driver.py
        ``StepDriver._drive``: ``rep = await strategy.run_step(self.step, want_stop)``) and
        test harnesses."""
        if self.failure is not None:
            self.failure.check()
        return await self.train_step(step, want_stop)

    def on_peer_failure(self, peer: int) -> None:
        """A peer was declared failed by the membership service, or finished and left (called
        on the event loop, once per peer, before the view that removes it). Registered by
        ``NodeRuntime.start_strategy``: ``self.membership.listeners.append(strategy.on_peer_failure)``."""

    #: where the strategy promises every member the same model (parameters and buffers),
    #: checked by the replica audit (strategies/audit.py): ``every_step`` (after every step:
    #: ``--audit-every`` applies), ``end`` (after the run's last step), ``never``
    identical_replicas: ClassVar[Literal["every_step", "end", "never"]] = "never"

    #: the strategy wants :meth:`on_grad_ready` during backward (user scripts and the built-in
    #: job both go through ``attach``, which installs the per-parameter hooks)
    grad_ready: ClassVar[bool] = False

    def on_grad_ready(self, index: int, offset: int, grad: np.ndarray) -> None:
        """Parameter ``index`` (flat ``offset``) got its gradient during backward (event loop;
        only when :attr:`grad_ready`). Strategies that pipeline layer groups start sending
        here; the flat gradient at the step is still what ``compute_gradients`` returns."""

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own state for a user's checkpoint (JSON values or torch tensors: the
        checkpoint is a ``torch.save`` dict loaded with ``weights_only=True``); the model and
        optimizer state are in their own state dicts. Called on the event loop (api/driver.py)
        when a checkpoint is taken: ``copy.deepcopy(self.strategy.state_dict())``."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (called after :meth:`start`, before the first step, by
        the session's step loop, with the state of the checkpoint the node resumes from)."""

    def on_view(self, view: View) -> None:
        """A newer membership view (a node left or joined; called on the event loop, after
        ``on_peer_failure`` for the peers it removes). Strategies take their group from it.
        Registered by ``NodeRuntime.start_strategy``: ``self.membership.view_listeners.append(strategy.on_view)``."""

    async def close(self) -> None:
        """Called once at the end (also after errors), when the node runtime closes; stop the
        strategy's own tasks and services here. A :class:`P2PSyncError` raised here is ignored
        (the run is over)."""


REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: add a strategy to :data:`REGISTRY` under its :attr:`Strategy.name`
    (ValueError when the name is empty or taken). Example, ssgd.py: ``@register`` above
    ``class SSGD(Strategy)``."""
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"strategy name {cls.name!r} is empty or taken")
    REGISTRY[cls.name] = cls
    return cls


def get_strategy(name: str) -> type[Strategy]:
    """The strategy class registered as ``name`` (importing the built-ins first); ConfigError
    listing the choices otherwise. Called from e.g. api/runtime.py:
    ``self.strategy_cls = get_strategy(cfg.strategy)``."""
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
    the receives of the strategy's pending collectives (its operations' scope: the tags
    starting with ``prefix``, opened with this object) fail at once instead of waiting for
    their timeout."""

    def __init__(self, ctx: StrategyContext, name: str, prefix: str) -> None:
        self.ctx = ctx
        self.name = name
        #: the strategy's operations: every receive under ``prefix``
        self.scope = ctx.transport.scope(prefix)
        self.failed: set[int] = set()

    def on_peer_failure(self, peer: int) -> None:
        """Remember ``peer`` and fail the pending receives of the strategy's scope with
        PeerFailure. Called by the strategy's failure policy (strategies/failure.py ``Stop``)."""
        self.failed.add(peer)
        self.scope.abort(self._error((peer,)))

    def _error(self, peers: tuple[int, ...]) -> PeerFailure:
        departed = [p for p in peers if p in self.ctx.membership.departed]
        if departed and len(departed) == len(peers):  # a loop that ended, not a crash
            return PeerFailure(f"{self.name}: peer(s) {departed} ended their training loop and left the run; "
                               "with --on-failure stop the others cannot go on (end every node's loop at "
                               "the same step: --steps/--time and p2psync.should_stop())", peers=peers)
        return PeerFailure(f"{self.name}: peer(s) {list(peers)} failed; synchronous training cannot "
                           "continue", peers=peers)

    def check(self) -> None:
        """Raise PeerFailure naming the failed peers, if any; called through the failure
        policy (strategies/failure.py ``Stop.check``) before every step and within one."""
        if self.failed:
            raise self._error(tuple(sorted(self.failed)))


async def mean_and_agree(coll: Collectives, vec: np.ndarray, flag: bool, *, tag: str, feedback: Hashable,
                         group: Sequence[int] | None = None,
                         more: Sequence[np.ndarray] = ()) -> tuple[np.ndarray, bool, OpStats]:
    """The mean of ``vec`` over ``group`` (default every node; through the run's codec, which may be lossy) and
    whether any node raised ``flag``, plus the stats of the vector's allreduce.

    ``feedback``: the error-feedback key of ``vec`` (the same at every step of the strategy);
    ``more[k]`` is keyed ``(feedback, "m", k)``.

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
        coll.allreduce_with_stats(vec, group, op="mean", tag=tag, feedback=feedback),
        coll.allreduce(one, group, op="sum", tag=f"{tag}.flag", codec="none"),
        *(coll.allreduce(x, group, op="mean", tag=f"{tag}.m{k}", feedback=(feedback, "m", k))
          for k, x in enumerate(more))])
    if others:
        mean = np.concatenate([mean, *others])
    return mean, bool(flags[0] > 0), stats

"""The strategy interface, its context and the name registry.

A strategy owns one training step end to end — local compute through the
:class:`~p2psync.training.trainer.Trainer`-like replica, and whatever it exchanges through
collectives and coordinator clients — so each algorithm can overlap communication with compute
its own way. It never touches sockets directly.

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

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Hashable, Literal, Mapping, Protocol, Sequence

import numpy as np

from p2psync.collectives import Collectives, OpStats
from p2psync.compress import Codec, get_codec
from p2psync.coordinator import MembershipClient, RpcClient, RpcServer, View
from p2psync.errors import ConfigError, PeerFailure
from p2psync.params.optim import HyperValues, OptimSpec
from p2psync.strategies.buffers import Buffers
from p2psync.strategies.canary_colayers import Layer
from p2psync.strategies.needs import Needs
from p2psync.strategies.options import StrategyOptions, build_options
from p2psync.tasks import gather_or_cancel
from p2psync.topology import Topology
from p2psync.transport import Transport
from p2psync.vocab import ON_FAILURE, BufferMode, OnFailure


#: bytes of an encoded training state (``Replica.export_meta``) a peer may send
MAX_META_BYTES = 16 << 20

#: a learning rate or weight decay: one number, or one value per parameter element when the
#: optimizer's parameter groups differ
PerElement = float | np.ndarray


@dataclass(frozen=True)
class SgdHyper:
    """The plain-SGD hyper-parameters in effect for the next step (DTS's compensation needs
    them)."""

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
    """What a strategy needs of the local model: the strategy's only way to compute, step and
    read or replace the model.

    Implemented by :class:`~p2psync.api.replica.HookedReplica` (the user's model behind the
    step gate; what ``p2psync run`` and ``attach`` use) and by
    :class:`~p2psync.training.trainer.Trainer` (a one-thread compute executor; tests). The
    coroutines are awaited on the node's event loop; the model itself is only touched on the
    thread that owns it (the training thread, or the Trainer's compute thread), one job at a
    time, so communication goes on while they run.

    Example: ``ctx.replica`` of the :class:`StrategyContext` a strategy is built with; in
    ssgd.py: ``loss, grad = await self.ctx.replica.compute_gradients()``.
    """

    #: elements of the flat parameter vector (the length of gradients and parameters)
    numel: int

    @property
    def samples(self) -> int:
        """Training samples in the local iterations the strategy has taken so far."""

    async def compute_gradients(self, abort: threading.Event | None = None) -> tuple[float, np.ndarray]:
        """The next local iteration's (loss, flat float32 gradient copy); the model is not
        stepped. Raises Aborted when ``abort`` is set first, TrainingEnded when the user's
        loop ended. Called from every strategy's ``train_step``, e.g. ssgd.py:
        ``loss, grad = await self.ctx.replica.compute_gradients()``."""

    async def apply_gradients(self, vec: np.ndarray) -> None:
        """Set the gradients to the flat ``vec`` and run one optimizer step (the user's own
        optimizer: LR schedule, momentum, weight decay apply). Called from e.g. ssgd.py:
        ``await self.ctx.replica.apply_gradients(mean)``."""

    async def apply_each(self, vecs: Sequence[np.ndarray]) -> None:
        """One optimizer step per gradient in ``vecs``, in order, in one job. Called from
        asgd.py's receiver: ``await self.ctx.replica.apply_each([g * self.scale for g in grads])``."""

    async def sgd_step(self, vec: np.ndarray) -> SgdStep:
        """One local step with plain SGD, reporting the tensor SGD fed to its buffer (DTS).
        Called from dts.py: ``stepped = await self.ctx.replica.sgd_step(grad)``."""

    async def sgd_hyper(self) -> SgdHyper:
        """The optimizer's plain-SGD numbers (ConfigError for any other optimizer). Called
        from dts.py's ``start``: ``hyper = await self.ctx.replica.sgd_hyper()``."""

    async def optim_spec(self) -> OptimSpec:
        """The optimizer's class, options and parameter-group layout as the parameter store's
        owners run it (ConfigError for an optimizer that cannot be sharded). Called from
        ps.py's ``start``: ``spec = await self.ctx.replica.optim_spec()``."""

    async def optim_hypers(self, spec: OptimSpec) -> dict[int, HyperValues]:
        """Every parameter group's numeric hyperparameters as they are now (the user's LR
        scheduler changes them). Called from ps.py before each push:
        ``hypers = await self.ctx.replica.optim_hypers(spec)``."""

    async def correct(self, dw: np.ndarray, du: np.ndarray | None) -> None:
        """Parameters += ``dw``, SGD momentum buffers += ``du`` (DTS's compensation). Called
        from dts.py: ``await self.ctx.replica.correct(dw, du)``."""

    async def get_params(self) -> np.ndarray:
        """A copy of the parameters as one flat float32 vector. Called from e.g. esync.py:
        ``w = await self.ctx.replica.get_params()``."""

    async def set_params(self, vec: np.ndarray) -> None:
        """Replace the parameters with the flat ``vec`` (optimizer state unchanged). Called
        from e.g. esync.py: ``await self.ctx.replica.set_params(w_t + ... * mean)``."""

    async def get_params_range(self, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
        """The parameters in ``ranges`` ((lo, hi) of the flat vector), concatenated, as float32:
        a part of :meth:`get_params` without a copy of the whole model. Called from diloco.py
        for one fragment: ``local = await self.ctx.replica.get_params_range(self.ranges[f])``."""

    async def set_params_range(self, ranges: Sequence[tuple[int, int]], vec: np.ndarray) -> None:
        """Replace the parameters in ``ranges`` with ``vec`` (their values, concatenated); the
        rest of the model and the optimizer state unchanged. Called from diloco.py after a
        fragment's outer step: ``await self.ctx.replica.set_params_range(self.ranges[f], merged)``."""

    async def export_state(self) -> np.ndarray:
        """Parameters + optimizer state as one float32 vector (same length on every node of a
        run). Called from regroup.py when serving a joiner: ``vec = await ctx.replica.export_state()``."""

    async def import_state(self, vec: np.ndarray) -> None:
        """Replace parameters and optimizer state with an :meth:`export_state` vector. Called
        from regroup.py's ``fetch_state``: ``await ctx.replica.import_state(np.array(vec, copy=True))``."""

    async def export_meta(self) -> bytes:
        """The rest of the training state a joiner takes with :meth:`export_state`: the
        optimizer's hyperparameters, its LR schedulers and a scaler, encoded
        (training/user_state.py). Called from regroup.py next to ``export_state``."""

    async def import_meta(self, raw: bytes) -> None:
        """Take an :meth:`export_meta` state (ProtocolError when malformed)."""

    def state_size(self) -> int:
        """The length of :meth:`export_state`'s vector (regroup.py checks a fetched state
        against it)."""

    def layers(self) -> list[Layer]:
        """The modules with trainable parameters, in the flat vector's order (Canary's
        colayers). Called from canary.py's ``start``: ``layers = self.ctx.replica.layers()``."""

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the model's buffers (0: it has none; nothing to synchronize)."""

    async def get_buffers(self, floats: bool = False) -> Buffers:
        """A copy of the model's buffers (BatchNorm statistics): their raw bytes and, with
        ``floats``, the floating-point ones as float32. Called from ssgd.py:
        ``mine = await self.ctx.replica.get_buffers(floats=...)``."""

    async def set_buffers(self, buffers: Buffers) -> None:
        """Write :class:`Buffers` back (raw bytes first, then the float values if given)."""

    async def digests(self, buffers: bool = True) -> list[tuple[str, bytes]]:
        """(name, 8-byte digest) of every parameter and (``buffers``) buffer: what the replica
        audit compares (strategies/audit.py)."""


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
    loop calls ``rep = await strategy.train_step(self.step, want_stop)`` until a report says
    ``stop``; :meth:`close` runs at the end. Everything runs on the node's event loop; the model
    is reached only through ``self.ctx.replica``. See ssgd.py for the smallest complete one.
    """

    #: the name ``--strategy`` selects (the :data:`REGISTRY` key)
    name: ClassVar[str] = ""
    #: the options accepted via --opt NAME=VALUE (a frozen dataclass; see strategies/options.py)
    Options: ClassVar[type[StrategyOptions]] = StrategyOptions
    #: what it needs of the user's script (optimizer, schedules, clipping), checked once per run
    #: before anything starts (strategies/needs.py) and shown in the README's table
    needs: ClassVar[Needs] = Needs()
    #: what one :meth:`train_step` is, as tables name it: ``"step"`` (one local iteration) or
    #: ``"round"`` (several local iterations, then one exchange)
    step_unit: ClassVar[Literal["step", "round"]] = "step"

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
        Called by the session's step loop (api/driver.py ``StepDriver._drive``):
        ``rep = await strategy.train_step(self.step, want_stop)``."""

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
        """Raise PeerFailure naming the failed peers, if any; strategies call it at the start
        of a step through their failure policy (strategies/failure.py ``Stop.check``)."""
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

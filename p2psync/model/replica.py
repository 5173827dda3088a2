"""What a strategy may ask of the local model: a small core (:class:`Replica`) every replica
implements, and capabilities (:class:`Capability`) that only some strategies need and declare.

The core computes and steps (``compute_gradients``, ``apply_gradients``), reads and replaces
the parameters, and moves the whole training state (``export_state``/``import_state`` and the
encoded user state ``export_meta``/``import_meta``: joins, re-forms). A capability is a
runtime-checkable protocol plus a name for errors; a strategy lists the ones it uses in
``Strategy.requires`` and they are checked once, when the strategy is built, so a replica that
lacks one fails with a :class:`~p2psync.errors.ConfigError` naming it before any training.
Typed access goes through the capability: ``SGD_COMPENSATION.of(ctx.replica).correct(dw, du)``.

The one implementation is :class:`~p2psync.api.replica.HookedReplica` (the user's model behind
the step gate), which has every capability. The coroutines are awaited on the node's event
loop; the model itself is only touched on the thread that owns it, one job at a time, so
communication goes on while they run.
"""

from __future__ import annotations

import threading
from typing import Any, Generic, Protocol, Sequence, TypeVar, cast, runtime_checkable

import numpy as np

from p2psync.errors import ConfigError
from p2psync.model.values import Buffers, Layer, SgdHyper, SgdStep
from p2psync.params.optim import HyperValues, OptimSpec

C = TypeVar("C")


@runtime_checkable
class Replica(Protocol):
    """The core every replica implements: the strategy's only way to compute, step and read or
    replace the model. E.g. ssgd.py: ``loss, grad = await self.ctx.replica.compute_gradients()``."""

    #: elements of the flat parameter vector (the length of gradients and parameters)
    numel: int

    @property
    def samples(self) -> int:
        """Training samples in the local iterations the strategy has taken so far."""

    async def compute_gradients(self, abort: threading.Event | None = None) -> tuple[float, np.ndarray]:
        """The next local iteration's (loss, flat float32 gradient copy); the model is not
        stepped. Raises Aborted when ``abort`` is set first, TrainingEnded when the training
        loop ended."""

    async def apply_gradients(self, vec: np.ndarray) -> None:
        """Set the gradients to the flat ``vec`` and run one optimizer step (the user's own
        optimizer: LR schedule, momentum, weight decay apply)."""

    async def get_params(self) -> np.ndarray:
        """A copy of the parameters as one flat float32 vector."""

    async def set_params(self, vec: np.ndarray) -> None:
        """Replace the parameters with the flat ``vec`` (optimizer state unchanged)."""

    async def export_state(self) -> np.ndarray:
        """Parameters + optimizer state as one float32 vector (same length on every node of a
        run); what a joiner or a member behind takes (strategies/regroup.py)."""

    async def import_state(self, vec: np.ndarray) -> None:
        """Replace parameters and optimizer state with an :meth:`export_state` vector."""

    async def export_meta(self) -> bytes:
        """The rest of the training state a joiner takes with :meth:`export_state`: the
        optimizer's hyperparameters, its LR schedulers and a scaler, encoded
        (training/user_state.py)."""

    async def import_meta(self, raw: bytes) -> None:
        """Take an :meth:`export_meta` state (ProtocolError when malformed)."""

    def state_size(self) -> int:
        """The length of :meth:`export_state`'s vector (a fetched state is checked against it)."""


@runtime_checkable
class StepEach(Protocol):
    """Several optimizer steps in one job (ASGD applies the gradients that arrived)."""

    async def apply_each(self, vecs: Sequence[np.ndarray], scale: float = 1.0) -> None:
        """One optimizer step per gradient in ``vecs``, in order, in one job, each gradient
        multiplied by ``scale`` first (``vec * scale``, one at a time: no scaled copies of all
        of them at once)."""


@runtime_checkable
class StepAsIs(Protocol):
    """An optimizer step on ``.grad`` as the iteration left it, without a vector of it."""

    async def step_as_is(self) -> None:
        """``optimizer.step()`` with ``.grad`` as it stands (a missing gradient as zeros): what
        :meth:`Replica.apply_gradients` of the gradient the parked iteration arrived with does
        while nothing changed ``.grad`` since, so a strategy can drop that copy first."""


@runtime_checkable
class SgdCompensation(Protocol):
    """Plain SGD's arithmetic, exposed so a strategy can replay it (DTS's compensation)."""

    async def sgd_step(self, vec: np.ndarray) -> SgdStep:
        """One local step with plain SGD, reporting the tensor SGD fed to its buffer."""

    async def sgd_hyper(self) -> SgdHyper:
        """The optimizer's plain-SGD numbers (ConfigError for any other optimizer)."""

    async def correct(self, dw: np.ndarray, du: np.ndarray | None) -> None:
        """Parameters += ``dw``, SGD momentum buffers += ``du``."""


@runtime_checkable
class ParamRanges(Protocol):
    """Parts of the parameter vector without a copy of the whole model (DiLoCo's fragments)."""

    async def get_params_range(self, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
        """The parameters in ``ranges`` ((lo, hi) of the flat vector), concatenated, as float32."""

    async def set_params_range(self, ranges: Sequence[tuple[int, int]], vec: np.ndarray) -> None:
        """Replace the parameters in ``ranges`` with ``vec`` (their values, concatenated); the
        rest of the model and the optimizer state unchanged."""


@runtime_checkable
class OptimizerShards(Protocol):
    """The user's optimizer as the parameter store's owners run it, per slice."""

    async def optim_spec(self) -> OptimSpec:
        """The optimizer's class, options and parameter-group layout (ConfigError for an
        optimizer that cannot be sharded)."""

    async def optim_hypers(self, spec: OptimSpec) -> dict[int, HyperValues]:
        """Every parameter group's numeric hyperparameters as they are now (the user's LR
        scheduler changes them)."""


@runtime_checkable
class ModelBuffers(Protocol):
    """The model's buffers (BatchNorm statistics), synchronized at a strategy's "one model"
    points (strategies/buffers.py)."""

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the model's buffers (0: it has none; nothing to synchronize)."""

    async def get_buffers(self, floats: bool = False) -> Buffers:
        """A copy of the model's buffers: their raw bytes and, with ``floats``, the
        floating-point ones as float32."""

    async def set_buffers(self, buffers: Buffers) -> None:
        """Write :class:`Buffers` back (raw bytes first, then the float values if given)."""


@runtime_checkable
class Layered(Protocol):
    """The model's layers in the flat vector's order (Canary's colayers)."""

    def layers(self) -> list[Layer]:
        """The modules with trainable parameters, in the flat vector's order."""


class Capability(Generic[C]):
    """A protocol beyond the core :class:`Replica` that a strategy declares it needs
    (``Strategy.requires``), with the name errors give it."""

    def __init__(self, name: str, protocol: type[Any]) -> None:
        self.name = name
        self.protocol = protocol

    def held_by(self, replica: object) -> bool:
        """Whether ``replica`` implements the protocol (every member present)."""
        return isinstance(replica, self.protocol)

    def of(self, replica: object, who: str = "this strategy") -> C:
        """``replica`` seen through the capability; ConfigError naming ``who`` and the
        capability when it lacks one."""
        if not self.held_by(replica):
            raise ConfigError(f"{who} needs {self.name} of the replica, which "
                              f"{type(replica).__name__} does not provide")
        return cast(C, replica)

    def __repr__(self) -> str:
        return f"Capability({self.name!r})"


STEP_EACH: Capability[StepEach] = Capability("several optimizer steps in one job (apply_each)", StepEach)
STEP_AS_IS: Capability[StepAsIs] = Capability("an optimizer step on .grad as it stands (step_as_is)", StepAsIs)
SGD_COMPENSATION: Capability[SgdCompensation] = Capability(
    "plain SGD's compensation (sgd_step, sgd_hyper, correct)", SgdCompensation)
PARAM_RANGES: Capability[ParamRanges] = Capability(
    "parameter ranges (get_params_range, set_params_range)", ParamRanges)
OPTIMIZER_SHARDS: Capability[OptimizerShards] = Capability(
    "the optimizer's spec and hyperparameters (optim_spec, optim_hypers)", OptimizerShards)
MODEL_BUFFERS: Capability[ModelBuffers] = Capability(
    "the model's buffers (buffer_bytes, get_buffers, set_buffers)", ModelBuffers)
LAYERED: Capability[Layered] = Capability("the model's layers (layers)", Layered)


def check_replica(replica: object, requires: Sequence[Capability[Any]], who: str) -> None:
    """ConfigError unless ``replica`` implements the core :class:`Replica` and every
    capability of ``requires``, naming ``who`` and everything missing at once."""
    missing = [] if isinstance(replica, Replica) else ["the core replica protocol"]
    missing += [c.name for c in requires if not c.held_by(replica)]
    if missing:
        raise ConfigError(f"{who} cannot run on a {type(replica).__name__} replica: it needs "
                          + "; ".join(missing))


__all__ = ["LAYERED", "MODEL_BUFFERS", "OPTIMIZER_SHARDS", "PARAM_RANGES", "SGD_COMPENSATION", "STEP_AS_IS",
           "STEP_EACH", "Capability", "Layered", "ModelBuffers", "OptimizerShards", "ParamRanges", "Replica",
           "SgdCompensation", "StepAsIs", "StepEach", "check_replica"]

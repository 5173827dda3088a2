"""One rooted exception hierarchy for p2psync.

Foreign errors (zmq, msgpack, OS) are translated into these at the edges only, so callers
catch ``P2PSyncError`` (or one of its branches) and never a library's own exception type. The
edges say so declaratively with :class:`translate`: a table from foreign exception types to the
p2psync error each becomes, applied to a block or a function.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Callable, Literal, Mapping


class P2PSyncError(Exception):
    """Root of every error p2psync raises on purpose."""


class ConfigError(P2PSyncError, ValueError):
    """Bad configuration: topology file, CLI option, run config.

    ``field`` names the offending field (``nodes[3].nics[1].port``) when there is one.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class ProtocolError(P2PSyncError):
    """A message on the wire violates the schema or limits. ``reason`` is a short stable key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class TransportError(P2PSyncError):
    """A socket-level failure: bind, connect, send."""


class PeerTimeout(P2PSyncError, TimeoutError):
    """A wait that depends on a peer ran past its timeout."""


class PeerFailure(P2PSyncError):
    """A peer is dead or unreachable. ``peers`` names the node ids concerned."""

    def __init__(self, message: str, *, peers: tuple[int, ...] = ()) -> None:
        self.peers = tuple(peers)
        super().__init__(message)


class PeerUnreachable(PeerFailure, TransportError):
    """A send could not reach its peer within the timeout."""


class GroupCutOff(PeerFailure):
    """The live nodes do not join every member of a group: some members cannot reach the
    others, directly or through any node that is not marked dead, so no collective can run
    over the group until the membership changes. ``parts``: the members grouped by what the
    live nodes still join; ``peers``: the dead nodes that would have joined them."""

    def __init__(self, message: str, *, parts: tuple[tuple[int, ...], ...], peers: tuple[int, ...] = ()) -> None:
        self.parts = tuple(parts)
        super().__init__(message, peers=peers)


class NonFinitePiece(PeerFailure, ProtocolError):
    """A peer sent a tensor piece with NaN or infinity: remote bad input (a ProtocolError,
    reason ``non_finite``) attributed to that peer (a PeerFailure naming it: synchronous
    strategies wait for the view that excludes it and redo the step without it)."""

    def __init__(self, message: str, *, peer: int) -> None:
        self.peers = (peer,)
        self.reason = "non_finite"
        self.detail = message
        Exception.__init__(self, message)


class BadRequest(ProtocolError):
    """A peer's request carries arguments that are out of range or of the wrong type (remote
    bad input: the handler refuses it, its caller gets a :class:`RemoteError` of this kind)."""

    def __init__(self, detail: str) -> None:
        super().__init__("bad_request", detail)


class RemoteError(P2PSyncError):
    """An RPC handler on another node raised: ``kind`` is its error type name
    (``"ConfigError"``, ``"NotCoordinator"``, ...), ``message`` its message as the remote node
    wrote it."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        self.message = message
        super().__init__(f"{kind}: {message}")


class TrainingError(P2PSyncError):
    """The training loop or a strategy failed in a way that ends the run."""


class Diverged(TrainingError):
    """Training produced NaN or infinity: this node's own gradient or a tensor it was about to
    send holds one, or the coordinator ended the run because most members were reported for
    sending them. The run cannot go on; no peer is blamed for it."""


class SumDiverged(Diverged):
    """A sum of finite values that this node computed in a collective overflowed (NaN or
    infinity): the group's values diverged, not this node's own. Unlike a node's own
    divergence (which ends that node only; the others go on without it), the node reports it
    and the coordinator ends the run on every member: a member that owns no overflowing piece
    would otherwise wait for pieces that are never sent."""


class ReplicaMismatch(TrainingError):
    """Members whose replicas a strategy promises bitwise equal hold different models (the
    replica audit). ``nodes``: those that differ from the group's lowest id; ``tensor``: the
    first parameter or buffer that differs."""

    def __init__(self, message: str, *, nodes: tuple[int, ...] = (), tensor: str = "") -> None:
        self.nodes = tuple(nodes)
        self.tensor = tensor
        super().__init__(message)


class Aborted(P2PSyncError):
    """A local computation was abandoned on request (e.g. ESync's READY arrived mid-iteration)."""


class DuplicateNode(ConfigError):
    """A second process registered under a node id whose registered process is still alive.

    Retried by a registering node until its start timeout (a restarted node's previous process
    may not be declared failed yet); final if the other process really is alive."""


class Fenced(P2PSyncError):
    """This node was removed from the run (declared failed while it paused, or cut off on the
    minority side of a partition): its progress since is void. The process ends with
    ``EXIT_FENCED``; a launcher restarts it, and the new process rejoins with the majority's
    state. ``rejoin`` is False when it was excluded for what it sent (non-finite values): then
    it ends as failed and is not started again."""

    def __init__(self, message: str, *, rejoin: bool = True) -> None:
        self.rejoin = rejoin
        super().__init__(message)


class RunEnded(Fenced):
    """The run this process asked to rejoin is ending: its members agreed to stop and wait in
    the finish barrier (its registration came after that, or its strategy had not joined the
    training when every member had finished). There is nothing left to join: the process ends
    without an error and is not started again."""

    def __init__(self, message: str) -> None:
        super().__init__(message, rejoin=False)


class NoQuorum(P2PSyncError):
    """This node heard no coordinator holding a majority of the run for longer than its
    ``--quorum-timeout``: it stopped stepping meanwhile and gives up now."""


class TrainingEnded(P2PSyncError):
    """The user's training loop ended (the script closed its session): no more local steps."""


class SimulationError(P2PSyncError):
    """A virtual-time simulation cannot go on: nothing is ready or scheduled while the awaited
    result is not done (a deadlock, in virtual time), or a foreign thread tried to schedule work
    on the simulated loop (its arrival time would not be reproducible)."""


#: foreign exception type(s) -> the p2psync error built from the caught exception
Rules = Mapping["type[BaseException] | tuple[type[BaseException], ...]", Callable[[Any], P2PSyncError]]


class translate:
    """Translate foreign errors at an edge, declaratively: the first rule whose type matches
    builds the p2psync error that is raised instead (``from None``: the library's traceback is
    not the user's business; its message goes into the new one where the rule puts it). Errors
    that are already p2psync's, and exceptions no rule names, pass through unchanged.

    A block::

        with translate({OSError: lambda e: ConfigError(f"cannot read topology {p}: {e.strerror}")}):
            text = p.read_text()

    or a whole function (a module-level table reads like the edge's contract)::

        SEND_ERRORS = {zmq.Again: lambda e: PeerUnreachable("..."), zmq.ZMQError: lambda e: TransportError(str(e))}

        @translate(SEND_ERRORS)
        def _send(...): ...
    """

    def __init__(self, rules: Rules) -> None:
        for kinds in rules:
            for kind in kinds if isinstance(kinds, tuple) else (kinds,):
                if not (isinstance(kind, type) and issubclass(kind, BaseException)):
                    raise TypeError(f"translate: {kind!r} is not an exception type")
        self.rules = dict(rules)

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        if exc is None or isinstance(exc, P2PSyncError):
            return False
        for kinds, make in self.rules.items():
            if isinstance(exc, kinds):
                raise make(exc) from None
        return False

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        import functools

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)
        return wrapped

"""What one node does with one piece of a collective, step by step, as a state machine without
IO (:class:`PieceMachine`): it decides, the executor's piece loop
(:meth:`~p2psync.collectives.piece_run.Run._piece`) acts. Pure: no asyncio, no transport, no
array.

The loop asks :meth:`PieceMachine.next` for the next action until it returns None:

* :class:`Seal`: the owner of a fully reduced piece quantizes it once (lossy codecs), before the
  first allgather step or, without one, at the end;
* :class:`Exchange`: one step of the plan: the :class:`Send` of every transfer of the piece from
  this node and the :class:`~p2psync.collectives.schedule.Expect` of every transfer to it (made
  once per schedule), performed together (awaited alone when there is only one:
  :attr:`Exchange.single`). Each send says where its frames come from
  (:class:`Payload`) and whether its values are known finite (:class:`Check`).

and reports what happened:

* :meth:`PieceMachine.scanned`: the loop scanned a ``Check.SCAN`` send's values (once per step);
* :meth:`PieceMachine.exchanged`: the step's sends and receives completed; returns
  :class:`Release` when the partial sum held from the step before is no longer read;
* :meth:`PieceMachine.arrived`: one expected piece arrived, decoded and checked: returns
  :class:`Hold` (a partial sum sent straight on by the next step,
  :attr:`~p2psync.collectives.schedule.Step.defer`) or :class:`Apply` (add it into, or copy it
  over, the working buffer's piece);
* :meth:`PieceMachine.applied`: the result of an ``Apply`` whose ``verdict`` is ``SCAN``.

State (per piece): ``fresh`` (its values are still only in the caller's tensor, not in the
working buffer), ``clean`` (its working-buffer values are known finite), ``cached`` (the codec's
frames of its current values are kept, lossy codecs), ``held`` (a received partial sum waits for
the next send) and ``seal`` (the seal is still to do).

Actions are values the loop reads and never changes; they are plain slotted dataclasses, not
frozen ones, as one is made per piece and step (a frozen one costs about twice as much to make).
The actions without a per-piece part (:class:`Seal`, :class:`Release`, :class:`Hold`, every
:class:`Apply`) are made once and shared.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from p2psync.collectives.plan import Transfer
from p2psync.collectives.schedule import Expect, Step


class Payload(enum.Enum):
    """Where a send's frames come from: ``OWN_FILL``, this node's own values copied where
    they are sent from; ``SUM_FILL``, the held partial sum added to this node's values there;
    ``CACHED``, the codec's frames kept for the piece (what was received or sealed);
    ``ENCODE``, the working buffer's piece, encoded now (a view of it, lossless codecs)."""

    OWN_FILL = "own_fill"
    SUM_FILL = "sum_fill"
    CACHED = "cached"
    ENCODE = "encode"


class Check(enum.Enum):
    """Whether a send's values are known finite: ``YES`` (a fill checks what it computes, or the
    piece is known clean: the transport skips its scan), ``SCAN`` (lossless values sent as
    they are: scan them here, once per step, and report it with :meth:`PieceMachine.scanned`;
    if not finite the transport's scan raises), ``NO`` (encoded frames: the transport scans)."""

    YES = "yes"
    SCAN = "scan"
    NO = "no"


class Verdict(enum.Enum):
    """What applying a received piece makes of the piece's finiteness: ``CLEAN`` (a copy of a
    piece the transport checked on arrival), ``DIRTY`` (a sum nobody checked), ``SCAN`` (the
    fused check: scan the result now, report it with :meth:`PieceMachine.applied`, and when not
    finite blame the sender if the received values hold the NaN / infinity)."""

    CLEAN = "clean"
    DIRTY = "dirty"
    SCAN = "scan"


@dataclass(slots=True)
class Send:
    """Send the piece to ``transfer.dst`` (over ``transfer.nic``, or relayed when
    ``transfer.via``), its frames from ``payload``, finiteness as ``check`` says."""

    transfer: Transfer
    payload: Payload
    check: Check


@dataclass(slots=True)
class Exchange:
    """One step: ``sends`` under the operation's tag plus ``send_suffix``, and ``expects``, in
    sender order (the order their values are applied in). ``fill``: ``OWN_FILL`` or
    ``SUM_FILL`` when every send of the step sends one fill computed where it is sent from
    (the payload of each of ``sends``), else None. ``base_mine``: a ``SUM_FILL`` adds to the
    caller's tensor's values (the piece is fresh), else to the working buffer's. ``single``:
    ``len(sends) + len(expects) == 1``."""

    phase: str
    send_suffix: str
    sends: tuple[Send, ...]
    expects: tuple[Expect, ...]
    fill: Payload | None
    base_mine: bool
    #: one send or one receive alone: awaited directly, without tasks (every ring step)
    single: bool


@dataclass(slots=True)
class Seal:
    """Quantize the fully reduced piece once (lossy codecs): those frames are what everyone gets."""


@dataclass(slots=True)
class Release:
    """Give back the held partial sum (a borrowed piece views the sender's ring)."""


@dataclass(slots=True)
class Hold:
    """Keep the arrived partial sum (do not release it): the next send adds it in."""


@dataclass(slots=True)
class Apply:
    """Add the arrived values into the working buffer's piece (``reduce``) or copy them over
    it; ``base_mine``: add them to the caller's tensor's values instead (the piece's first
    value); ``cache``: keep the arrived frames as the piece's (a lossy copy); ``verdict``: the
    piece's finiteness after."""

    reduce: bool
    base_mine: bool
    cache: bool
    verdict: Verdict


SEAL = Seal()
RELEASE = Release()
HOLD = Hold()

# the members the decisions use, read once: an attribute of an Enum class goes through the
# metaclass's __getattr__ hook on every read (Python 3.11)
_OWN_FILL, _SUM_FILL, _CACHED, _ENCODE = Payload.OWN_FILL, Payload.SUM_FILL, Payload.CACHED, Payload.ENCODE
_YES, _SCAN, _NO = Check.YES, Check.SCAN, Check.NO


def _applies(verdict: Verdict) -> tuple[tuple[tuple[Apply, ...], ...], ...]:
    """Every Apply with ``verdict``, indexed ``[reduce][base_mine][cache]``."""
    return tuple(tuple(tuple(Apply(r, b, c, verdict) for c in (False, True)) for b in (False, True))
                 for r in (False, True))


#: the Apply actions, made once and shared (values), by verdict, then [reduce][base_mine][cache]
_APPLY_SCAN, _APPLY_DIRTY, _APPLY_CLEAN = _applies(Verdict.SCAN), _applies(Verdict.DIRTY), _applies(Verdict.CLEAN)


class PieceMachine:
    """One piece's walk through its ``steps`` on this node (see the module docstring).
    ``lossy``: the codec is lossy; ``fused``: received pieces are checked here, fused with
    their use (lossless codec, no extra check); ``fresh``: the piece's values are only in the
    caller's tensor so far; ``seal``: this node owns the fully reduced piece and seals it."""

    __slots__ = ("steps", "lossy", "fused", "fresh", "clean", "cached", "held", "seal", "_i", "_fill", "_defer")

    def __init__(self, steps: tuple[Step, ...], *, lossy: bool, fused: bool, fresh: bool, seal: bool) -> None:
        self.steps = steps
        self.lossy = lossy
        self.fused = fused
        self.fresh = fresh
        self.clean = False
        self.cached = False
        self.held = False
        self.seal = seal
        self._i = 0
        self._fill = False  # the current step sends a fill
        self._defer = False  # the current step holds what arrives

    def next(self) -> Seal | Exchange | None:
        """The next action: a seal, the next step's exchange, or None when the piece is done."""
        if self.seal and (self._i >= len(self.steps) or self.steps[self._i].phase.startswith("ag")):
            self.seal = False
            self.cached = True
            return SEAL
        if self._i >= len(self.steps):
            return None
        step = self.steps[self._i]
        self._i += 1
        self._defer = step.defer
        fill: Payload | None = None
        sends: tuple[Send, ...] = ()
        if not step.sends:
            self._fill = False
        elif self.held or self.fresh:
            self._fill = True
            fill = _SUM_FILL if self.held else _OWN_FILL
            for t in step.sends:
                sends += (Send(t, fill, _YES),)
        else:
            self._fill = False
            check = _NO if self.lossy else _YES if self.clean else _SCAN
            for t in step.sends:
                sends += (Send(t, _CACHED if not t.reduce and self.cached else _ENCODE, check),)
        return Exchange(step.phase, step.send_suffix, sends, step.expects, fill, self.fresh,
                        len(sends) + len(step.expects) == 1)

    def scanned(self, finite: bool) -> None:
        """A ``Check.SCAN`` send's values were scanned: finite or not."""
        if finite:
            self.clean = True

    def exchanged(self, fill_owned: bool) -> Release | None:
        """The step's sends and receives completed. ``fill_owned``: its fill (if it sent one)
        computed its values into the working buffer (not only into a shared-memory ring)."""
        if not self._fill:
            return None
        if fill_owned:  # checked by the fill, and now in the working buffer
            self.clean = True
            self.fresh = False
        if self.held:  # a partial sum that nothing reads any more
            self.held = False
            self.fresh = False
            return RELEASE
        return None

    def arrived(self, e: Expect) -> Hold | Apply:
        """``e``'s piece arrived (decoded and checked): hold it or apply it."""
        if self._defer:
            self.held = True
            return HOLD
        base_mine, self.fresh = self.fresh, False
        cache = not e.reduce and self.lossy
        if cache:
            self.cached = True
        if self.fused:
            applies = _APPLY_SCAN
            self.clean = False
        elif e.reduce:
            applies = _APPLY_DIRTY
            self.clean = False
        else:
            applies = _APPLY_CLEAN
            self.clean = True
        return applies[e.reduce][base_mine][cache]

    def applied(self, finite: bool) -> None:
        """An ``Apply`` with ``Verdict.SCAN`` was scanned: the piece is finite or not."""
        self.clean = finite


__all__ = ["Apply", "Check", "Exchange", "Expect", "Hold", "Payload", "PieceMachine", "Release", "Seal",
           "Send", "Verdict"]

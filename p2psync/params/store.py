"""A parameter server sharded over the peers.

The flat parameter vector is split into one contiguous shard per member
(:func:`~p2psync.params.shards.shard_bounds`); the owner of a shard holds its weights **and its
optimizer state** and runs the update, as the thesis' parameter server does:

* :meth:`ParamStore.push` sends each shard's part of a gradient to its owner as pieces of at most
  ``piece_bytes``; the owner applies every piece on arrival, summing the pieces of the same range
  that queued up meanwhile into one update (Alg. 1 server line 2), and acknowledges each piece.
  ``push`` returns once every piece is acknowledged, so a scheduler told about the push after it
  returns (the thesis' ``clock_p^push``) only releases workers whose pulls will see it. A piece
  an owner cannot take (a dead owner, a malformed piece) makes ``push`` raise, naming the owner:
  a lost push is reported, never silently dropped.
* Pushes are gradients, so the run's codec applies to their pieces (with error feedback per
  piece when asked, always for ``topk``); a piece that does not decode, or is not finite, is
  refused and counted. :meth:`ParamStore.pull` fetches every shard exactly (its owner sends the current weights as pieces).
* The update is the user's optimizer (:mod:`p2psync.params.optim`: its class and options, one
  instance per segment of the owner's shard, torch's own arithmetic) with the hyperparameters
  the pushing worker's optimizer had at the time of the push (its LR schedule included): every
  piece carries its groups' values. Each push is one optimizer step with the learning rate
  scaled by ``scale`` (default 1/N: N pushes move the weights about as far as one step on their
  mean; with plain SGD exactly as far); in ``rounds`` mode a round is one step, unscaled, on the
  round's mean gradient, so with one worker, or BSP, the store does exactly what the user's
  optimizer does locally on the averaged gradient.
* Barriers (:mod:`p2psync.params.barriers`): a push carries its generation (the barriers its
  worker passed) and a pull after a barrier the barrier's number; an owner serves every pull of
  a barrier the shard as it was at that barrier, from a copy taken when the next generation's
  first piece arrived before some member's pull (no extra round trip). With ``rounds`` (BSP)
  an owner instead keeps each generation's pieces (acknowledged on arrival) and applies them in
  origin order once the generation is complete, so results do not depend on arrival order.

A piece for an owner that is not adjacent is forwarded by the store itself, hop by hop along the transport's shortest live paths (``<name>.fwd``), each hop a flow-controlled
bulk send counted on the NIC it leaves by. Acknowledgements and pull requests are small control
messages (relayed by the transport). Every wait on a peer has the store's ``timeout``.

**Moving shards on a view change** (:meth:`ParamStore.reshard`): when members leave or join,
the members of the new view re-split the vector among themselves (:func:`shard_bounds` of the
new member list) in exact allreduces (step 0 below, then two; the store epoch is the view epoch, and every tag
carries it). *Owners* are the members that held a shard of the current split; *fresh* members
bring no state: joiners, and a member whose process restarted (a new incarnation: its old shard
is lost, as a departed owner's is):

1. *which copy of a lost shard is freshest* (over the owners; only when a shard was lost):
   every worker keeps the vector it pulled last and, per owner, the version (pushes applied)
   the owner's shard had when it was served; the versions of the lost shards are gathered, and
   for each lost shard the holder of the highest version (the lowest id among equals) supplies
   it;
2. *the whole state* (over every member of the new view): each owner contributes its own
   shard's weights and optimizer state (per element: :meth:`ShardOptimizer.export_state`), the
   chosen holders the lost shards' weights, fresh members and everyone elsewhere zeros; the sum
   is the exact state (x + 0 = x), every member takes its new shard (weights and optimizer
   state: the state of a moved slice moves with it) and continues from those weights. The
   same vector carries, per member, a few integers (its store generation and the caller's
   ``clock``) so that a joiner learns where the others are: its store goes on at their
   barrier generation, and :attr:`ParamStore.clocks` gives the strategy the members' clocks.

A joiner builds its store with ``joining=True`` (no shard, at the store epoch below the view
that admitted it) and calls :meth:`ParamStore.reshard` with the members of that view, as they
do; leaves and joins in one view are one re-shard. Until then it answers pieces and pulls of
older store epochs "moved" (they were meant for its previous process) and keeps newer ones.

What is lost with a dead owner: the pushes its shard applied after the freshest copy was pulled
(at most the pushes one pull interval holds), and its shard's optimizer state (momentum, Adam's
moments and step: that slice's optimizer starts fresh); both are logged. A push that did not complete (a piece for the dead owner, or one that arrived at an
owner after it moved on) is *lost*, counted in :attr:`ParamStore.lost_pushes` and reported by
the push raising :class:`~p2psync.errors.PeerFailure`; its other pieces stay applied (a partial
gradient). Pieces and pulls carry the store epoch: an owner refuses older epochs' pieces, and
its current epoch's once its own re-shard has begun (the snapshot it contributes is taken then;
the sender's push fails, is counted, and the sender re-shards), and keeps newer ones until it
has re-sharded itself; a pull of a newer epoch waits the same way. A second failure during a re-shard makes it raise
PeerFailure; the caller re-shards again over the newer view (a joiner too: with the members of
the newer view). A re-shard given up (a failure, or :meth:`ParamStore.abort_reshard` when a
newer view supersedes it) leaves the current split in place, taking pieces again. Since one can
end on some members and be given up on others (its last pieces arrive as a newer view does),
every re-shard begins with a tiny allreduce of each member's store epoch (step 0): members at an
older epoch than the newest bring no state, as fresh members do, and the ranges they would
have supplied are restored like a lost shard's, from the newest owners' pulled copies (their
optimizer state starts fresh; pushes they applied after giving up are lost).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence

import numpy as np

from p2psync.coordinator.rpc import RpcClient, RpcServer
from p2psync.compress import ErrorFeedback, get_codec
from p2psync.errors import (ConfigError, Diverged, P2PSyncError, PeerFailure, PeerTimeout, PeerUnreachable,
                             ProtocolError, RemoteError, TransportError)
from p2psync.params.barriers import BarrierState, Piece
from p2psync.params.optim import (Hypers, OptimSpec, ShardOptimizer, decode_hypers, encode_hypers)
from p2psync.params.shards import piece_ranges, shard_bounds
from p2psync.tasks import TaskSet, cancel_all
from p2psync.transport import Transport
from p2psync.transport.forward import Forwarder
from p2psync.wire import Message

log = logging.getLogger("p2psync.params")

#: errors of an owner's pull handler that mean a peer failed or timed out, not a bad request:
#: the pull failed (PeerFailure), as if the owner had; and ``UnknownMethod``: every node runs the
#: same store (the rendezvous checked the run's options), so an owner without the pull method
#: is a new process of a restarted node that has not joined the store yet (the process that
#: owned the shard is gone)
_PEER_ERRORS = frozenset([*(c.__name__ for c in (PeerFailure, PeerUnreachable, PeerTimeout)), "UnknownMethod"])


@dataclass
class PushStats:
    pieces: int = 0
    forwarded: int = 0
    seconds: float = 0.0


class ParamStore:
    """One peer's part of the store: the owner of its shard, a client of the others."""

    def __init__(self, *, transport: Transport, rpc_server: RpcServer, rpc: RpcClient, members: Sequence[int],
                 params: np.ndarray, optim: OptimSpec, scale: float | None = None, piece_bytes: int = 1 << 20, timeout: float = 30.0,
                 name: str = "ps", codec: str = "none", error_feedback: bool = False, rounds: bool = False,
                 joining: bool = False, epoch: int = 0) -> None:
        """``members`` share the vector ``params`` (every member passes the same) at store epoch
        ``epoch``. ``joining``: this node joins a running store: it holds no shard (``members``
        and ``params`` are not used but for the vector's size) until its first :meth:`reshard`,
        which every current member runs with it; meanwhile it answers pieces and pulls of store
        epochs up to ``epoch`` "moved" (they were meant for a previous process of this node)
        and keeps newer ones until it has re-sharded."""
        self.transport, self.rpc, self.name, self.timeout = transport, rpc, name, timeout
        self.me = transport.node_id
        self.numel = int(params.size)
        if type(epoch) is not int or epoch < 0:
            raise ConfigError(f"{name}: store epoch {epoch!r} must be an integer >= 0")
        self.bounds = {} if joining else shard_bounds(self.numel, members)
        if not joining and self.me not in self.bounds:
            raise ConfigError(f"node {self.me} is not a member of the store {sorted(self.bounds)}")
        self.lo, self.hi = self.bounds.get(self.me, (0, 0))
        self.piece = max(1, piece_bytes // 4)
        if optim.numel != self.numel:
            raise ConfigError(f"{name}: the optimizer covers {optim.numel} values, the store {self.numel}")
        if scale is not None and not (math.isfinite(scale) and scale > 0):
            raise ConfigError(f"{name}: scale={scale} must be a finite number > 0")
        self.optim = optim
        self._scale = scale  # None: 1/N, N the members of the current split
        self.opt = self._shard(params[self.lo:self.hi])
        #: generations, the open round (``rounds``: BSP) and the barrier copy of this shard
        self.barriers = BarrierState(rounds=rounds, lo=self.lo)
        self.codec = get_codec(codec)
        # what a lossy codec dropped from a piece is added to the same piece of the next push
        self.feedback = (ErrorFeedback() if self.codec.lossy and (error_feedback or self.codec.always_feedback)
                         else None)
        self._seq = itertools.count(1)
        self._tasks = TaskSet(f"{name}-{self.me}")
        self.malformed = 0
        prefix = f"{name}."
        # a joiner relays for anyone: the members' split does not name it yet
        self.fwd = Forwarder(transport=transport, name=name, timeout=timeout,
                             accept=lambda to, tag: (to in self.bounds or not self.holds) and tag.startswith(prefix),
                             on_reject=self._reject)
        #: pushes that did not reach every owner (a dead owner, an owner that had moved on)
        self.lost_pushes = 0
        #: the view epoch of the current shard split, and an event set whenever it changes
        self.epoch = epoch
        self._moved = asyncio.Event()
        self._later: list[Message] = []  # pieces of a newer epoch, applied once this node re-sharded
        self._moving: int | None = None  # the epoch a re-shard under way moves to
        #: the vector this worker pulled last and each owner's version in it (a lost shard's replica)
        self.pulled = np.array(params, dtype=np.float32, copy=True)
        self.pulled_versions = {o: 0 for o in self.bounds}
        #: every member's ``clock`` at the last re-shard (members that held state only)
        self.clocks: dict[int, tuple[int, ...]] = {}
        #: a re-shard's allreduces, and every client wait (acknowledgements, a pull's shard
        #: pieces, a re-shard's allreduces)
        self._reshard = transport.scope(f"{name}.rs")
        self._waits = transport.scope(*(f"{name}.{k}" for k in ("ack.", "shard.", "rs")))
        rpc_server.register(f"{name}.pull", self._serve_pull)

    def _shard(self, w: np.ndarray, state: np.ndarray | None = None) -> ShardOptimizer:
        """This node's :class:`ShardOptimizer` for the current split (``own_pieces`` set too)."""
        pieces = piece_ranges(self.lo, self.hi, self.piece)
        self.own_pieces = len(pieces)
        self._piece_set = {(a - self.lo, b - self.lo) for a, b in pieces}
        return ShardOptimizer(self.optim, w, lo=self.lo, pieces=pieces, state=state)

    @property
    def scale(self) -> float:
        """The learning-rate factor of one push outside rounds."""
        return 1.0 / max(1, len(self.bounds)) if self._scale is None else self._scale

    @property
    def members(self) -> list[int]:
        return sorted(self.bounds)

    @property
    def holds(self) -> bool:
        """This node owns a shard (False for a joiner until its first :meth:`reshard`)."""
        return self.me in self.bounds

    def _check_member(self) -> None:
        if not self.holds:
            raise ConfigError(f"{self.name}: node {self.me} joins the store and holds no shard yet (re-shard first)")

    @property
    def version(self) -> int:
        """Pushes applied to this node's shard (whole pushes: their pieces all arrived)."""
        return self.opt.version // self.own_pieces

    def start(self) -> None:
        self.fwd.start()
        self._tasks.spawn(self._serve_pushes())

    async def close(self) -> None:
        await self._tasks.close()
        await self.fwd.close()

    @property
    def moving(self) -> int | None:
        """The store epoch a re-shard under (or left by a failed) :meth:`reshard` moves to."""
        return self._moving

    def abort_reshard(self, exc: P2PSyncError) -> int:
        """Fail the allreduces of a re-shard under way with ``exc`` now (a newer view supersedes
        its member list); :meth:`reshard` raises it and may be called again over the newer view."""
        return self._reshard.abort(exc)

    def abort_waits(self, exc: P2PSyncError) -> int:
        """Fail this store's pending client waits (acknowledgements, shard pieces of a pull,
        a re-shard's allreduces) with ``exc`` now; its serving loops keep running."""
        return self._waits.abort(exc)

    # -- sending tensors over direct links ------------------------------------------------

    @property
    def forwarded(self) -> int:
        """Pieces this node passed on for others."""
        return self.fwd.forwarded

    def _reject(self, msg: Message, why: str) -> None:
        if not self.malformed:
            log.warning("node %d: malformed %s message from node %d ignored (%s)", self.me, self.name, msg.src, why)
        self.malformed += 1

    # -- push -----------------------------------------------------------------------------

    async def push(self, grad: np.ndarray, *, gen: int = 0, hypers: Hypers | None = None) -> PushStats:
        """Send ``grad`` to the shard owners; returns once every piece is applied (or held in
        its round) and acked. ``gen``: the last barrier this worker was released from;
        ``hypers``: every parameter group's hyperparameters for this push
        (:func:`~p2psync.params.optim.read_hypers` of the worker's optimizer; default: the
        values the spec was read with)."""
        self._check_member()
        if grad.shape != (self.numel,):
            raise ConfigError(f"{self.name}: gradient has shape {grad.shape}, the store holds {self.numel} values")
        if type(gen) is not int or gen < 0:
            raise ConfigError(f"{self.name}: push generation {gen!r} must be an integer >= 0")
        hyp: Hypers = dict(enumerate(self.optim.initial)) if hypers is None else hypers
        if any(g not in hyp or len(hyp[g]) != self.optim.width for g in range(self.optim.groups)):
            raise ConfigError(f"{self.name}: hyperparameters {dict(hyp)!r} do not match the optimizer's "
                              f"{self.optim.groups} group(s) of {self.optim.width} value(s)"[:300])
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        seq = next(self._seq)
        ack = f"{self.name}.ack.{self.me}.{self.transport.incarnation}.{seq}"
        st = PushStats()
        sends = []
        for owner, (lo, hi) in self.bounds.items():
            if owner == self.me:
                self.barriers.take(self.opt, [(self.me, a, b, np.array(grad[a:b], np.float32), gen, hyp)
                                              for a, b in piece_ranges(lo, hi, self.piece)], self.bounds, self.scale)
                continue
            for a, b in piece_ranges(lo, hi, self.piece):
                meta = {"o": self.me, "ack": ack, "lo": a, "hi": b, "c": self.codec.spec, "e": self.epoch, "g": gen,
                        "h": encode_hypers(hyp, self.optim.groups_in(a, b))}
                sends.append((owner, asyncio.ensure_future(self.fwd.send(owner, f"{self.name}.push",
                                                                      self._encode(grad[a:b], a), meta))))
        st.pieces = len(sends)
        try:
            for owner, s in sends:
                try:
                    st.forwarded += await s
                except Diverged:  # this node's own values: nobody else to blame
                    raise
                except P2PSyncError as exc:
                    self.lost_pushes += 1
                    raise PeerFailure(f"{self.name}: push to the owner of shard {self.bounds[owner]}, node {owner}, "
                                      f"failed: {exc}", peers=(owner,)) from exc
            try:
                await self._acks(ack, [o for o, _ in sends])
            except (PeerFailure, PeerTimeout):
                self.lost_pushes += 1
                raise
        finally:
            await cancel_all(s for _, s in sends)  # done ones are left as they are
            self.transport.retire(ack)
        st.seconds = loop.time() - t0
        return st

    def _encode(self, x: np.ndarray, at: int) -> list[np.ndarray]:
        if self.feedback is None:
            return self.codec.encode(np.array(x, dtype=np.float32, copy=True))
        x = self.feedback.compensate(at, x)
        enc = self.codec.encode(x)
        self.feedback.record(at, x, self.codec.decode(enc, x.size))
        return enc

    async def _acks(self, tag: str, owners: list[int]) -> None:
        missing = {o: owners.count(o) for o in set(owners)}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while any(missing.values()):
            try:
                msg = await self.transport.recv(tag, timeout=max(0.001, deadline - loop.time()))
            except PeerTimeout:
                late = sorted(o for o, n in missing.items() if n)
                raise PeerTimeout(f"{self.name}: no acknowledgement from shard owner(s) {late} within "
                                  f"{self.timeout:g}s: that part of the push may be lost") from None
            err = msg.meta.get("err")
            if msg.meta.get("moved") is not None:  # the owner re-sharded already: this push is lost
                raise PeerFailure(f"{self.name}: node {msg.src} moved to store epoch {msg.meta.get('moved')!r} "
                                  f"(this node is at {self.epoch}): the push is lost", peers=(msg.src,))
            if err is not None:
                raise ProtocolError("store", f"node {msg.src} refused a piece: {err}"[:200])
            if missing.get(msg.src, 0) > 0:
                missing[msg.src] -= 1

    def _decode(self, m: Message, a: Any, b: Any) -> np.ndarray | None:
        """The gradient piece ``[a, b)`` a push message carries, or None if it is not one of
        this shard's pieces, not in this store's codec, or not finite."""
        if type(a) is not int or type(b) is not int or (a - self.lo, b - self.lo) not in self._piece_set \
                or m.meta.get("c") != self.codec.spec:
            return None
        try:
            arr = self.codec.decode(m.arrays, b - a)
        except ProtocolError:
            return None
        if arr.dtype != np.float32 or arr.shape != (b - a,) or not np.isfinite(arr).all():
            return None
        return arr

    async def _serve_pushes(self) -> None:
        tag = f"{self.name}.push"
        while True:
            try:
                batch = [await self.transport.listen(tag)]
            except TransportError:
                return
            while (m := self.transport.recv_nowait(tag)) is not None and len(batch) < 256:
                batch.append(m)
            await self._apply(batch)

    async def _apply(self, batch: Sequence[Message]) -> None:
        """Apply a batch of push pieces (summing those of the same range; :class:`BarrierState`
        holds a BSP round's) and acknowledge them."""
        pieces: list[Piece] = []
        acks: list[tuple[int, str, dict[str, Any]]] = []
        for m in batch:
            meta = m.meta
            o, ack, a, b, e = meta.get("o"), meta.get("ack"), meta.get("lo"), meta.get("hi"), meta.get("e")
            gen = meta.get("g")
            if type(o) is not int or not isinstance(ack, str) or not ack.startswith(f"{self.name}.ack.") \
                    or type(e) is not int or type(gen) is not int or gen < 0:
                self._reject(m, "bad origin, ack tag, epoch or generation")
                continue
            if e > self.epoch:  # the sender re-sharded first: apply once this node has too
                self._later.append(m)
                continue
            # an older split, or this one being left, or (a joiner's) a split of this node's
            # previous process: the sender's push is lost
            if e < self.epoch or self._moving is not None or not self.holds:
                acks.append((o, ack, {"moved": self._moving or self.epoch}))
                continue
            if o not in self.bounds:
                self._reject(m, "origin is not a member")
                continue
            arr = self._decode(m, a, b)
            hyp = None if arr is None or type(a) is not int or type(b) is not int else \
                decode_hypers(meta.get("h"), self.optim, self.optim.groups_in(a, b))
            if arr is None or hyp is None or type(a) is not int or type(b) is not int:
                self._reject(m, "piece not of the shard, of the wrong size or codec, not finite, or without valid "
                                "hyperparameters")
                acks.append((o, ack, {"err": f"bad piece [{a}, {b}) for shard [{self.lo}, {self.hi}) (codec "
                                             f"{meta.get('c')!r}, this store {self.codec.spec!r})"}))
                continue
            pieces.append((o, a, b, arr, gen, hyp))
            acks.append((o, ack, {}))
        self.barriers.take(self.opt, pieces, self.bounds, self.scale)
        for o, ack, meta in acks:
            try:
                await self.transport.send(o, ack, kind="event", meta=meta, timeout=self.timeout)
            except P2PSyncError as exc:
                log.info("node %d: %s ack to node %d lost: %s", self.me, self.name, o, exc)

    # -- pull -----------------------------------------------------------------------------

    async def pull(self, *, barrier: int = 0) -> np.ndarray:
        """Every shard's current weights, as one vector (kept as the replica of lost shards);
        ``barrier``: the weights as they were at that barrier (the number in the OK that
        released this worker; :mod:`p2psync.params.barriers`). PeerFailure when an owner
        is dead, has moved to another store epoch, or could not send its shard (a relay on the
        way died with the pieces in flight): the caller follows the view and re-shards."""
        self._check_member()
        if type(barrier) is not int or barrier < 0:
            raise ConfigError(f"{self.name}: barrier {barrier!r} must be an integer >= 0")
        out = np.empty(self.numel, np.float32)
        out[self.lo:self.hi], own = self.barriers.serve(self.opt, barrier, self.me, self.bounds)
        others = [o for o in self.bounds if o != self.me]
        versions = await asyncio.gather(*(self._pull_one(o, out, barrier) for o in others))
        self.pulled[:] = out
        self.pulled_versions = {self.me: own // self.own_pieces, **dict(zip(others, versions))}
        return out

    async def _pull_one(self, owner: int, out: np.ndarray, barrier: int) -> int:
        """Fetch ``owner``'s shard into ``out``; returns its version."""
        lo, hi = self.bounds[owner]
        tag = f"{self.name}.shard.{self.me}.{self.transport.incarnation}.{next(self._seq)}"
        try:
            try:
                rep = await self.rpc.call(owner, f"{self.name}.pull", {"tag": tag, "e": self.epoch, "b": barrier},
                                          timeout=self.timeout)
            except RemoteError as exc:  # the owner could not serve it: a relay on the way here died
                if exc.kind not in _PEER_ERRORS:  # with its pieces in flight, or its wait for this
                    raise                         # node's store epoch timed out
                raise PeerFailure(f"{self.name}: node {owner} could not serve the pull: {exc.message}",
                                  peers=(owner,)) from exc
            pieces = rep.get("pieces") if isinstance(rep, dict) else None
            version = rep.get("version") if isinstance(rep, dict) else None
            if isinstance(rep, dict) and rep.get("moved") is not None:
                raise PeerFailure(f"{self.name}: node {owner} moved to store epoch {rep['moved']!r} (this node is at "
                                  f"{self.epoch})", peers=(owner,))
            if type(pieces) is not int or pieces != len(piece_ranges(lo, hi, self.piece)) or type(version) is not int:
                raise ProtocolError("store", f"node {owner} answered a pull with {rep!r}"[:200])
            for _ in range(pieces):
                m = await self.transport.recv(tag, timeout=self.timeout)
                a, b = m.meta.get("lo"), m.meta.get("hi")
                arr = m.arrays[0] if len(m.arrays) == 1 else None
                if (type(a) is not int or type(b) is not int or not lo <= a <= b <= hi or arr is None
                        or arr.dtype != np.float32 or arr.shape != (b - a,)):
                    raise ProtocolError("store", f"node {owner} sent a malformed shard piece")
                out[a:b] = arr
            return version
        except (PeerFailure, PeerTimeout) as exc:
            raise PeerFailure(f"{self.name}: pull of shard [{lo}, {hi}) from node {owner} failed: {exc}",
                              peers=(owner,)) from exc
        finally:
            self.transport.retire(tag)

    async def _serve_pull(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        tag, e, barrier = args.get("tag"), args.get("e"), args.get("b")
        if not isinstance(tag, str) or not tag.startswith(f"{self.name}.shard.") or type(e) is not int \
                or type(barrier) is not int or barrier < 0:
            raise ProtocolError("store", f"bad pull from node {caller}")
        if e > self.epoch:  # the caller re-sharded first: serve the new split once this node has too
            await self._until_epoch(e)
        if e < self.epoch or self._moving is not None or not self.holds:
            return {"moved": self._moving or self.epoch}
        if caller not in self.bounds:
            raise ProtocolError("store", f"pull from node {caller}, not a member")
        # a consistent copy (or the barrier's); the bytes in flight are never modified
        w, version = self.barriers.serve(self.opt, barrier, caller, self.bounds)
        ranges = piece_ranges(self.lo, self.hi, self.piece)
        for a, b in ranges:
            await self.fwd.send(caller, tag, [w[a - self.lo:b - self.lo]], {"lo": a, "hi": b})
        return {"pieces": len(ranges), "version": version // self.own_pieces}

    # -- moving shards ---------------------------------------------------------------------

    async def _until_epoch(self, e: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while self.epoch < e:
            self._moved.clear()
            try:
                await asyncio.wait_for(self._moved.wait(), max(0.001, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise PeerTimeout(f"{self.name}: node {self.me} did not reach store epoch {e} within "
                                  f"{self.timeout:g}s") from None

    async def reshard(self, members: Sequence[int], epoch: int, allreduce: Allreduce, *,
                      fresh: Sequence[int] = (), clock: Sequence[int] = ()) -> np.ndarray:
        """Re-split the store over ``members`` (the view of ``epoch``); every member calls it
        with the same ``members`` and ``epoch``. Returns the weights to continue from (the whole
        restored vector). ``allreduce(vec, group, tag)`` sums exactly over the group.

        ``fresh``: members that bring no state (joiners, and members whose process restarted:
        their old shard is lost like a departed owner's); a joining store (``joining=True``)
        is fresh itself and need not know the others. ``clock``: small integers (< 2**24, the
        same number of them on every member) each member contributes; afterwards
        :attr:`clocks` holds every state-holding member's (a joiner reads the members' clocks
        there). ConfigError when the arguments cannot describe a re-split (an owner listed as
        fresh, a member neither holding a shard nor fresh, no member holding state); PeerFailure
        when the allreduces fail, or a joiner finds that no member held state (nothing is
        installed then: it may re-shard again over a newer view). Members left at an older
        split by a re-shard that ended on others only bring no state (module docstring)."""
        new = sorted(set(members))
        fresh_set = set(fresh)
        if epoch <= self.epoch:
            raise ConfigError(f"{self.name}: re-shard to epoch {epoch}, the store is at epoch {self.epoch}")
        if self.me not in new:
            raise ConfigError(f"{self.name}: node {self.me} re-shards over {new}, which do not include it")
        ticks = list(clock)
        if any(type(c) is not int or not 0 <= c < 1 << 24 for c in ticks):
            raise ConfigError(f"{self.name}: clock {ticks!r} must hold integers in [0, 2**24)"[:200])
        joining = not self.holds
        if joining:
            fresh_set.add(self.me)
        elif self.me in fresh_set:
            raise ConfigError(f"{self.name}: node {self.me} holds a shard and cannot re-shard as fresh")
        else:
            stray = [m for m in new if m not in self.bounds and m not in fresh_set]
            if stray:
                raise ConfigError(f"{self.name}: members {stray} hold no shard and are not listed as fresh")
        owners = [m for m in new if m not in fresh_set]  # a joiner may not know them all: not used there
        if not joining and not owners:
            raise ConfigError(f"{self.name}: no member of {new} holds the store's state")
        self._moving = epoch  # from now on pieces and pulls of the current split are refused (moved)
        try:
            return await self._resplit(new, owners, joining, epoch, ticks, allreduce)
        except BaseException:  # given up (a newer view, a failure): the current split goes on
            self._moving = None
            raise

    async def _resplit(self, new: list[int], owners: list[int], joining: bool, epoch: int, ticks: list[int],
                       allreduce: Allreduce) -> np.ndarray:
        """:meth:`reshard`'s two allreduces and the installation of the new split."""
        self.barriers.flush(self.opt)  # a BSP round's pieces are acknowledged: part of the state
        n = self.numel
        ch = self.opt.channels
        # 0. who holds the newest split: a re-shard that ended on some members only (a newer view
        # superseded it as its last pieces arrived) left the others at their older split; those
        # bring no state, as fresh members do, and their ranges come from the newest owners
        mine = np.zeros(len(new), np.float32)
        if not joining:
            mine[new.index(self.me)] = self.epoch + 1
        at = await allreduce(mine, new, f"{self.name}.rs{epoch}.s")
        held = {m: int(at[r]) - 1 for r, m in enumerate(new) if at[r] > 0}
        top = max(held.values(), default=-1)
        behind = sorted(m for m, e in held.items() if e < top)
        if behind:
            log.warning("node %d: %s members %s are at older store epochs than %d (%s): their shards are dropped "
                        "and their ranges taken from the members at %d", self.me, self.name, behind, top,
                        {m: held[m] for m in behind}, top)
        owners = [m for m in owners if m in held and m not in behind]  # a member holding nothing is fresh
        bring = not joining and self.me not in behind  # this node contributes its state
        width = 2 + len(ticks)  # per member: holds state, store generation, its clock
        lost: list[int] = []
        holders: dict[int, int] = {}
        v = np.zeros(0, np.float32)
        if bring:
            # 1. the freshest copy of every lost shard, among the owners (version + 1: 0 means
            # "no copy"); a fresh member's old shard is lost: it is a new process
            lost = [o for o in self.members if o not in owners]
            rank = owners.index(self.me)
            v = np.zeros(len(owners) * max(1, len(lost)), np.float32)
            for j, o in enumerate(lost):
                v[rank * len(lost) + j] = self.pulled_versions.get(o, -1) + 1
            if lost:
                v = await allreduce(v, owners, f"{self.name}.rs{epoch}.v")
            holders = {o: int(np.argmax(v[j::len(lost)])) for j, o in enumerate(lost)}  # first max: lowest id
        # 2. the whole state over every member: own shard (weights, optimizer state), the chosen
        # replicas of lost shards, zeros from fresh members; then each member's clock
        x = np.zeros((1 + ch) * n + len(new) * width, np.float32)
        if bring:
            x[self.lo:self.hi] = self.opt.w
            st = self.opt.export_state()
            for k in range(ch):
                x[(1 + k) * n + self.lo:(1 + k) * n + self.hi] = st[k]
            for o, h in holders.items():
                if owners[h] == self.me:
                    a, b = self.bounds[o]
                    x[a:b] = self.pulled[a:b]
            row = (1 + ch) * n + new.index(self.me) * width
            x[row:row + width] = [1, self.barriers.gen, *ticks]
        full = await allreduce(x, new, f"{self.name}.rs{epoch}.w")
        for o, h in holders.items():
            log.warning("node %d: %s shard %s of node %d (gone or restarted) restored from node %d's copy at version "
                        "%d; its optimizer state starts fresh", self.me, self.name, self.bounds[o], o, owners[h],
                        int(v[h * len(lost) + lost.index(o)]) - 1)
        tail = full[(1 + ch) * n:].reshape(len(new), width)
        if not (tail[:, 0] == 1).any():  # only joiners: there is no state to take (nothing installed)
            raise PeerFailure(f"{self.name}: no member of {new} held the store's state at epoch {epoch}",
                              peers=tuple(m for m in new if m != self.me))
        self.clocks = {m: tuple(int(c) for c in tail[r, 2:]) for r, m in enumerate(new) if tail[r, 0] == 1}
        self.bounds = shard_bounds(n, new)
        self.lo, self.hi = self.bounds[self.me]
        state = full[n:(1 + ch) * n].reshape(ch, n)[:, self.lo:self.hi]
        self.opt = self._shard(full[self.lo:self.hi], np.ascontiguousarray(state))
        if self.feedback is not None:
            self.feedback = ErrorFeedback()  # residues were kept per piece of the old split
        self.barriers.reset(self.lo)
        if not bring:  # the generation goes on where the members' stores are
            self.barriers.gen = max((int(g) for g, held in zip(tail[:, 1], tail[:, 0]) if held == 1), default=0)
        self.pulled[:] = full[:n]
        self.pulled_versions = {o: 0 for o in new}
        self.epoch = epoch
        self._moving = None
        self._moved.set()
        later, self._later = self._later, []
        if later:
            await self._apply(later)
        return full[:n].copy()


#: ``allreduce(vec, group, tag)``: the exact sum of ``vec`` over ``group`` (every member calls it)
Allreduce = Callable[[np.ndarray, list[int], str], Awaitable[np.ndarray]]

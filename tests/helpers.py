"""Shared test helpers: free ports, endpoint groups, membership nodes, trainers, strategies (the
fixtures that track and close what these create are in conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import shutil
import socket
from typing import (TYPE_CHECKING, Any, AsyncIterator, Callable, Coroutine, Iterable, Mapping, Protocol,
                    TypeVar)

from p2psync.coordinator import MembershipClient, RpcClient, RpcServer
from p2psync.coordinator.votes import VoteStore
from p2psync.sim.loop import ACTOR, VirtualLoop
from p2psync.sim.medium import SimHub
from p2psync.topology import Topology
from p2psync.transport import Transport, ZmqEndpoint

if TYPE_CHECKING:
    from p2psync.transport.shaping import Shaper


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


#: free_port's range: just below the kernel's ephemeral ports, which it hands to sockets bound to
#: port 0 and to outgoing connections (the ZeroMQ connects of every test in this run included)
_PORTS_HIGH = _ephemeral_low()
_PORTS_LOW = max(1024, _PORTS_HIGH - 12000)
#: ports the shipped topologies (topologies/*.json) bind, which tests also run: never handed out
_SHIPPED_PORTS = range(29500, 29600)


def _own_range() -> tuple[int, int, int]:
    """This process's part of the range and where it starts: pytest-xdist workers (``gwN`` of
    ``PYTEST_XDIST_WORKER_COUNT``) each take their own slice (they run side by side, so their
    ports never meet); otherwise the whole range, from a pid-dependent start (runs side by side
    differ)."""
    span = _PORTS_HIGH - _PORTS_LOW
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > int(worker[2:]):
        size = span // int(count)
        lo = _PORTS_LOW + int(worker[2:]) * size
        return lo, lo + size, lo
    return _PORTS_LOW, _PORTS_HIGH, _PORTS_LOW + (os.getpid() * 211) % span


_RANGE_LOW, _RANGE_HIGH, _next_port = _own_range()


def free_port() -> int:
    """A TCP port free on every local address now (each NIC of a loopback topology binds it on
    its own 127.x address), for ``ring(4, base_port=free_port())``.

    Not one the kernel chose (bind to port 0, then released, as this used to be): the kernel
    may hand that very port to the next outgoing connection before the test binds it. These
    come from below the ephemeral range, which the kernel never assigns by itself, and
    successive calls in this process never repeat one until its part of the range wraps."""
    global _next_port
    span = _RANGE_HIGH - _RANGE_LOW
    for _ in range(span):
        port = _next_port
        _next_port = _RANGE_LOW + (port - _RANGE_LOW + 1) % span
        if port in _SHIPPED_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:  # taken (or in TIME_WAIT): the next one
                continue
            return port
    raise RuntimeError(f"no free TCP port in {_RANGE_LOW}..{_RANGE_HIGH - 1}")


def keyed(topo: Topology) -> tuple[Topology, dict[int, Any]]:
    """``topo`` with fresh public keys on every node, and every node's keys (a keyed cluster)."""
    from p2psync.transport.keys import generate, with_public_keys

    keys = generate(topo)
    return with_public_keys(topo, keys), keys


def zmq_endpoints_for(topo: Topology, ids: Iterable[int] | None = None, *, timeout: float = 10.0,
                      keys: dict[int, Any] | None = None, **options: Any) -> dict[int, ZmqEndpoint]:
    """An endpoint (not started) for each node of ``ids`` (default: every node of ``topo``);
    ``options``: ZmqEndpoint/Transport keywords, ``keys``: every node's keys (:func:`keyed`).
    What :func:`zmq_cluster` and the ``zmq_endpoints`` fixture start and close."""
    return {i: ZmqEndpoint(topology=topo, node_id=i, default_timeout=timeout,
                           keys=keys[i] if keys is not None else None, **options)
            for i in (topo.ids if ids is None else ids)}


@contextlib.asynccontextmanager
async def zmq_cluster(topo: Topology, *, timeout: float = 10.0, keys: dict[int, Any] | None = None,
                      **options: Any) -> AsyncIterator[dict[int, ZmqEndpoint]]:
    """Started endpoints for every node (``options``: ZmqEndpoint/Transport keywords; ``keys``:
    every node's keys, from :func:`keyed`)."""
    eps = zmq_endpoints_for(topo, timeout=timeout, keys=keys, **options)
    try:
        for e in eps.values():
            await e.start()
        yield eps
    finally:
        for e in eps.values():
            await e.close()


_T = TypeVar("_T")


class Medium(Protocol):
    """Where the nodes' endpoints meet: ``endpoint(node_id, **options)`` builds node
    ``node_id``'s endpoint (not started; ``options``: Transport keywords)."""

    def endpoint(self, node_id: int, **options: Any) -> Transport: ...


class VirtualMedium:
    """The simulator's in-memory medium (:class:`~p2psync.sim.medium.SimHub`) for
    :class:`MemberNode`, on the loop of :func:`virtual`: messages go through the wire encoder and
    the strict decoder, each is delivered to its receiver one loop iteration after the send (a
    node's shaper, if it brings one, delays it as on ZeroMQ), as a callback of the receiver's
    actor, and a closed endpoint leaves the medium (sends to it are retried, then fail, as to a
    node whose connection dropped)."""

    def __init__(self, topo: Topology) -> None:
        self.hub = SimHub(topo)

    def endpoint(self, node_id: int, **options: Any) -> Transport:
        return self.hub.endpoint(node_id, **options)


def virtual(main: Coroutine[Any, Any, _T]) -> _T:
    """Run ``main`` to its end in virtual time (:func:`p2psync.sim.loop.run` on a fresh
    :class:`~p2psync.sim.loop.VirtualLoop`): every wait ends as soon as what it waits for
    happens or its time comes, without waiting in real time; a wait for nothing at all (no
    timer left) is a deadlock, raised as :class:`~p2psync.errors.SimulationError`."""
    from p2psync.sim.loop import run

    return run(main, loop=VirtualLoop(trace=False))


#: the media a scenario of membership runs over (``pytest.mark.parametrize("medium", MEDIA)``):
#: the simulator's in virtual time, and real ZeroMQ on loopback in real time
MEDIA = ("virtual", "zmq")


def medium_for(medium: str, topo: Topology) -> Medium | None:
    """A fresh :class:`VirtualMedium` of ``topo`` for ``"virtual"`` (the scenario runs on
    :func:`virtual`'s loop), None (ZeroMQ on loopback) for ``"zmq"``."""
    if medium not in MEDIA:
        raise ValueError(f"unknown medium {medium!r} (choose from {', '.join(MEDIA)})")
    return VirtualMedium(topo) if medium == "virtual" else None


def run_on(medium: str, main: Coroutine[Any, Any, _T]) -> _T:
    """Run ``main`` to its end: in virtual time for ``"virtual"`` (:func:`virtual`), on a fresh
    asyncio loop in real time for ``"zmq"``."""
    if medium not in MEDIA:
        main.close()
        raise ValueError(f"unknown medium {medium!r} (choose from {', '.join(MEDIA)})")
    return virtual(main) if medium == "virtual" else asyncio.run(main)


def as_actor(actor: int, call: Callable[[], _T]) -> _T:
    """``call()`` as ``actor`` (:data:`p2psync.sim.loop.ACTOR`): the tasks and callbacks it
    schedules carry it, so that a :class:`~p2psync.sim.loop.VirtualLoop` can hold them (a
    paused process); on any other loop, nothing changes."""
    ctx = contextvars.copy_context()
    ctx.run(ACTOR.set, actor)
    return ctx.run(call)


class MemberNode:
    """One node's membership, as a node process builds it: endpoint, RPC server and client,
    membership client; the endpoint is ZeroMQ's on loopback, or ``medium``'s (a
    :class:`VirtualMedium`: the same node in virtual time). What the node hosts for the cluster
    (the membership service, a CoordinatorHost) is a subclass's: :meth:`start_hosted`,
    :meth:`close_hosted`. ``close()`` is idempotent: a test closes a node to kill it,
    :func:`member_cluster` closes every node::

        class Node(MemberNode):
            def start_hosted(self) -> None: ...
        async with member_cluster(topo, lambda i: Node(topo, i)) as nodes:
            await nodes[1].close()  # node 1 dies
    """

    def __init__(self, topo: Topology, i: int, *, shaper: Shaper | None = None, votes: VoteStore | None = None,
                 medium: Medium | None = None) -> None:
        #: where its endpoint lives (None: ZeroMQ on loopback); another process of the node joins the same
        self.medium = medium
        self.ep: Transport = (ZmqEndpoint(topology=topo, node_id=i, default_timeout=10.0, shaper=shaper)
                              if medium is None else medium.endpoint(i, default_timeout=10.0, shaper=shaper))
        self.server = RpcServer(self.ep)
        self.rpc = RpcClient(self.ep, local=self.server)
        self.client = MembershipClient(transport=self.ep, rpc=self.rpc, coordinator=topo.coordinator, votes=votes)
        self.closed = False

    def start_hosted(self) -> None:
        """Start what this node hosts (after its endpoint, before its RPC server serves)."""

    async def close_hosted(self) -> None:
        """Close what :meth:`start_hosted` started (after the membership client)."""

    async def start(self) -> None:
        await self.ep.start()
        self.start_hosted()
        self.server.start()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self.client.close()
        await self.close_hosted()
        await self.server.close(grace=0.1)
        await self.ep.close()


class HostNode(MemberNode):
    """A member running a CoordinatorHost, as a node process does: it hosts membership while it
    coordinates (node ``topo.coordinator`` from the start)."""

    def __init__(self, topo: Topology, i: int, *, votes: VoteStore | None = None, medium: Medium | None = None) -> None:
        from p2psync.coordinator.failover import CoordinatorHost

        super().__init__(topo, i, votes=votes, medium=medium)
        self.host = CoordinatorHost(server=self.server, membership=self.client, expected=topo.ids,
                                    start_timeout=20, run_info={"run_id": "t"})

    def start_hosted(self) -> None:
        if self.ep.node_id == self.ep.topology.coordinator:
            self.host.host()

    async def close_hosted(self) -> None:
        await self.host.close()


_Member = TypeVar("_Member", bound=MemberNode)


@contextlib.asynccontextmanager
async def member_cluster(topo: Topology, make: Callable[[int], _Member]) -> AsyncIterator[dict[int, _Member]]:
    """``make(i)`` for every node of ``topo``: all started, registered and running their membership
    clients, each node as its actor (:func:`as_actor`); every one closed on the way out."""
    nodes = {i: make(i) for i in topo.ids}
    try:
        for i, n in nodes.items():
            await as_actor(i, lambda n=n: asyncio.ensure_future(n.start()))
        await asyncio.gather(*(as_actor(i, lambda n=n: asyncio.ensure_future(n.client.register("fp", timeout=20)))
                               for i, n in nodes.items()))
        for i, n in nodes.items():
            as_actor(i, n.client.start)
        yield nodes
    finally:
        for n in nodes.values():
            await n.close()


def full_views(nodes: Mapping[int, MemberNode]) -> bool:
    """Every node's view holds every node, and every node but the coordinator (node 0) has three
    RTT samples of it or more: ``await until(lambda: full_views(nodes), 10, "full views")``."""
    return all(n.client.view is not None and len(n.client.view.members) == len(nodes)
               and (i == 0 or n.rpc.estimator(0).samples >= 3) for i, n in nodes.items())


#: the device of :func:`make_trainer`'s models: ``cpu`` unless ``P2PSYNC_TEST_DEVICE`` says
#: otherwise (``P2PSYNC_TEST_DEVICE=cuda pytest tests/integration`` runs the in-process strategy
#: matrix and the other trainer-driven tests on a GPU)
TEST_DEVICE = os.environ.get("P2PSYNC_TEST_DEVICE", "cpu")


def make_trainer(topo: Topology, node_id: int, *, model: str = "mlp", batch_size: int = 16,
                 lr: float = 0.1, momentum: float = 0.9, seed: int = 0, partition_scheme: str = "iid",
                 optimizer: str = "sgd", weight_decay: float = 0.0):
    """A real Trainer for ``node_id`` on the digits data (a language model's: pysource),
    exactly as a node process builds it."""
    from p2psync.training.config import LM_SPECS, RunConfig
    from p2psync.training.node import build_trainer

    cfg = RunConfig(topology="-", model=model, data="pysource" if model in LM_SPECS else "digits",
                    batch_size=batch_size, lr=lr, momentum=momentum,
                    optimizer=optimizer, weight_decay=weight_decay,
                    seed=seed, partition=partition_scheme, device=TEST_DEVICE, threads=1)
    return build_trainer(cfg, topo, node_id)


def slowed_trainers(topo: Topology, step_time: str, *, mode: str = "wait", **trainer: Any) -> dict[int, Any]:
    """A real Trainer per node (``trainer``: :func:`make_trainer` keywords), each node that
    ``step_time`` names (``NODE:SECONDS,...``, as ``--step-time``; ``mode`` as ``--slowdown-mode``)
    with that emulated step time: ``start_strategies(eps, topo, name, trainers=slowed_trainers(...))``."""
    from p2psync.training.hetero import parse_profiles

    prof = parse_profiles(step_time=step_time, mode=mode)
    trainers = {i: make_trainer(topo, i, **trainer) for i in topo.ids}
    for i, tr in trainers.items():
        tr.slowdown = prof.get(i, tr.slowdown)
    return trainers


class GatePath:
    """A :func:`make_trainer` Trainer's model on the gate path, as ``Session.attach`` builds it
    without the node runtime: a :class:`~p2psync.api.gate.StepGate` on the running event loop, a
    :class:`~p2psync.api.replica.HookedReplica` over the model and its optimizer, whose ``step``
    is hooked (it arrives at the gate), and a training thread running the built-in job's plain
    loop (``forward_backward(gate.abandon)``, then ``optimizer.step()``) until :meth:`close`.

    The thread serves the gate's jobs from the start (hooks are installed before the first
    iteration) and begins the loop at :meth:`go`. Build it on the event loop thread;
    :meth:`release` (what the session's ``StepDriver._drive`` does after each step) lets the
    thread compute the next iteration while the strategy's background exchange goes on.
    """

    def __init__(self, trainer: Any) -> None:
        import threading
        import types

        from p2psync.api.gate import StepGate
        from p2psync.api.replica import HookedReplica
        from p2psync.model.flat import FlatModel
        from p2psync.training.user_state import UserState

        self.trainer = trainer
        self.gate = StepGate(asyncio.get_running_loop())
        opt = trainer.optimizer
        self._own_step = opt.step
        self.replica = HookedReplica(flat=FlatModel(model=trainer.model, optimizer=opt), gate=self.gate,
                                     step=self._own_step, user_state=UserState(opt))
        self._go = threading.Event()
        self._closing = threading.Event()
        self._pending = (float("nan"), 0)
        #: what ended the training thread other than :meth:`close` (a divergence), if anything
        self.error: BaseException | None = None
        opt.step = types.MethodType(lambda _opt, closure=None: self._on_step(), opt)
        _PATHS[id(self.replica)] = self
        self._thread = threading.Thread(target=self._run, daemon=True, name="p2psync-test-training")

    def start(self) -> None:
        """Start the training thread: it serves the gate's jobs until :meth:`go`."""
        self._thread.start()

    def go(self) -> None:
        """Start the training loop (the thread too, if :meth:`start` was not called)."""
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()
        self._go.set()
        self.gate.nudge()

    def release(self) -> None:
        """Let the parked training thread compute its next iteration (event loop thread)."""
        self.gate.release()

    def drive(self, strategy: Any) -> Any:
        """``strategy`` with its ``train_step`` followed, as ``StepDriver._drive`` does, by
        :meth:`release` unless the step stopped the run: the next iteration's forward and
        backward overlap the strategy's background exchange (and Canary's colayers leave during
        that backward)."""
        step = strategy.train_step

        async def train_step(*args: Any, **kw: Any) -> Any:
            rep = await step(*args, **kw)
            if not rep.stop:
                self.release()
            return rep
        strategy.train_step = train_step
        return strategy

    def _run(self) -> None:
        from p2psync.errors import Aborted

        tr = self.trainer
        try:
            self.gate.serve(until=lambda: self._go.is_set() or self._closing.is_set())
            while not self._closing.is_set():
                try:
                    self._pending = tr.forward_backward(self.gate.abandon)
                except Aborted:  # abandoned by the strategy: the step below is skipped
                    self._pending = (float("nan"), 0)
                tr.optimizer.step()
        except BaseException as exc:  # close() ends a parked thread with an exception
            if not self._closing.is_set():
                self.error = exc
                self.gate.end()  # a strategy waiting for an iteration learns the loop ended

    def _on_step(self) -> None:
        """The hooked ``optimizer.step()``: Session._on_step's arrival (``HookedReplica.arrive``)
        without the session's closure, checkpoint and lifecycle."""
        from p2psync.errors import Diverged

        rep = self.replica
        loss, samples = self._pending
        self._pending = (float("nan"), 0)
        rep.user_state.on_step()
        if not rep.arrive(loss=loss, samples=samples):
            raise Diverged(f"training diverged after {self.trainer.batches_done} batches: the gradient holds NaN "
                           "or infinity (nothing was sent; no peer is blamed)")

    async def evaluate(self) -> tuple[float, float]:
        """(test loss, test accuracy), computed on the training thread while it is parked."""
        return await self.gate.run(self.trainer.evaluate_now)

    async def close(self) -> None:
        """End the loop: the thread leaves the gate (or its backward's wait) and stops; the
        optimizer's own ``step`` is put back."""
        from p2psync.errors import P2PSyncError

        self._closing.set()
        self.gate.end()
        self.gate.finish()
        self.gate.fail(P2PSyncError("test training loop closed"))
        if self._thread.ident is not None:
            await asyncio.to_thread(self._thread.join, 30)
            assert not self._thread.is_alive(), "the test training thread did not end"
        self.replica.remove_hooks()
        self.trainer.optimizer.step = self._own_step
        _PATHS.pop(id(self.replica), None)


#: every open GatePath by ``id`` of its replica (:func:`gate_path`)
_PATHS: dict[int, GatePath] = {}


def gate_path(s: Any) -> GatePath:
    """The :class:`GatePath` behind strategy ``s`` (or its replica)."""
    replica = s.ctx.replica if hasattr(s, "ctx") else s
    return _PATHS[id(replica)]


async def evaluate(s: Any) -> tuple[float, float]:
    """(test loss, test accuracy) of strategy ``s``'s model (on its training thread)."""
    return await gate_path(s).evaluate()


def gate_replicas(trainers: Any) -> Any:
    """Every trainer's model on a running :class:`GatePath`: their HookedReplicas, by the same
    keys (a dict) or in order (an iterable), for hand-built :func:`make_context` calls; close
    each with :func:`close_replica`."""
    if isinstance(trainers, Mapping):
        paths = {k: GatePath(tr) for k, tr in trainers.items()}
        for p in paths.values():
            p.go()
        return {k: p.replica for k, p in paths.items()}
    built = [GatePath(tr) for tr in trainers]
    for p in built:
        p.go()
    return [p.replica for p in built]


async def close_replica(replica: Any) -> None:
    """Close the :class:`GatePath` behind ``replica`` (a strategy's ``ctx.replica``)."""
    await gate_path(replica).close()


@contextlib.asynccontextmanager
async def gated(trainers: Iterable[Any]) -> AsyncIterator[list[Any]]:
    """Every trainer's model on a started :class:`GatePath`: their HookedReplicas, in order
    (a single-process reference run: ``compute_gradients``, ``apply_gradients``, ...); closed
    on the way out."""
    replicas = gate_replicas(trainers)
    try:
        yield replicas
    finally:
        for r in replicas:
            await close_replica(r)


def trainer_params(trainer: Any) -> Any:
    """A Trainer's parameters as one flat float32 vector, read directly (before its gate path
    starts, or after it closed: no other thread touches the model then)."""
    import numpy as np
    import torch

    with torch.no_grad():
        return np.concatenate([p.detach().reshape(-1).to("cpu", torch.float32).numpy()
                               for p in trainer.model.parameters() if p.requires_grad])


def make_context(topo: Topology, transport, replica, *, peer_timeout: float = 10.0, options=None,
                 codec: str = "none", error_feedback: bool = False, max_steps: int | None = None):
    from p2psync.collectives import Collectives
    from p2psync.coordinator import MembershipClient, RpcClient, RpcServer
    from p2psync.strategies import StrategyContext

    server = RpcServer(transport)
    rpc = RpcClient(transport, local=server)
    membership = MembershipClient(transport=transport, rpc=rpc, coordinator=topo.coordinator)
    return StrategyContext(node_id=transport.node_id, topology=topo, transport=transport, rpc=rpc,
                           rpc_server=server, membership=membership, replica=replica,
                           collectives=Collectives(transport, timeout=peer_timeout, codec=codec,
                                                       error_feedback=error_feedback),
                           peer_timeout=peer_timeout, options=options or {}, max_steps=max_steps)


async def start_strategies(transports, topo: Topology, name: str, *, options=None, codec: str = "none",
                           error_feedback: bool = False, trainers=None, max_steps: int | None = None,
                           release: bool = True):
    """One started strategy per node (coordinator services and RPC servers included), as node
    processes build them, each on the gate path of its Trainer (``trainers``, else
    :func:`make_trainer`'s): a :class:`GatePath` whose training loop starts, as under
    ``Session``, after the gradient-ready hooks (Canary's) and before the strategy's ``start``,
    and which is released after every step that did not stop the run (:meth:`GatePath.drive`;
    ``release=False``: a step's iteration is computed only when the step asks for it, so what
    one step sends is all sent within it)."""
    from p2psync.strategies import get_strategy

    cls = get_strategy(name)
    strats: list[Any] = []
    servers, paths = [], []
    try:
        for i in topo.ids:
            tr = trainers[i] if trainers is not None else make_trainer(topo, i)
            path = GatePath(tr)
            paths.append(path)
            ctx = make_context(topo, transports[i], path.replica, options=options, codec=codec,
                               error_feedback=error_feedback, max_steps=max_steps)
            servers.append(ctx.rpc_server)
            if i == topo.coordinator:
                cls.coordinator_services(ctx.rpc_server, topo, dict(options or {}))
            ctx.rpc_server.start()
            strats.append(path.drive(cls(ctx)) if release else cls(ctx))
        for path in paths:
            path.start()
        for s, path in zip(strats, paths):  # as Session: hooks first, then the loop and the strategy's start
            if cls.grad_ready:
                await path.replica.enable_grad_ready(s.on_grad_ready)
            path.go()
        await asyncio.gather(*(s.start() for s in strats))
    except BaseException:  # a bad option or a failed start: nothing created here outlives the call
        for s in strats:
            await s.close()
        for srv in servers:
            await srv.close()
        for path in paths:
            await path.close()
        raise
    return strats


async def close_strategies(strats) -> None:
    for s in strats:
        await s.close()
        await s.ctx.rpc_server.close()
        await gate_path(s).close()


def in_threads(fn: Any, ids: Any, timeout: float) -> dict[int, Any]:
    """``fn(i)`` for every id on a thread of its own (nodes of one run in one process); each
    node's result, or the exception it raised, by id (joined within ``timeout`` in all)."""
    import threading
    import time

    out: dict[int, Any] = {}

    def node(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as exc:  # the test decides
            out[i] = exc

    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in ids]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return out


def forge_nan_sends(transport: Any) -> None:
    """Make ``transport``'s node a modified one: every array it sends gets a NaN, after its own
    checks (a Fill computed first), and goes out marked as checked."""
    import numpy as np

    from p2psync.wire import Fill

    orig = transport.send

    async def send(peer: int, tag: str, arrays: Any = (), **kw: Any) -> None:
        kw["checked"] = True
        out = [np.array(a.own() if isinstance(a, Fill) else a) for a in arrays]
        for a in out:
            a[0] = np.nan
        await orig(peer, tag, out, **kw)
    transport.send = send


async def until(pred, timeout: float, what: str) -> None:
    """Wait (bounded) until ``pred()`` holds; polls the condition, fails naming ``what``."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.002)


#: tests that build network namespaces: root and iproute2's ``ip`` and ``tc`` (a GPU image had
#: root but no iproute2)
NETNS = __import__("pytest").mark.skipif(
    os.geteuid() != 0 or any(shutil.which(t) is None for t in ("ip", "tc")),
    reason="network namespaces need root and iproute2 (ip, tc)")


def netns_mesh2(tmp_path: Any) -> Any:
    """A 2-node mesh in the benchmarking range with a 50 Mb/s link, for --shaper netem runs."""
    import json

    from p2psync.topology import mesh, topology_to_dict

    d = topology_to_dict(mesh(2, base_port=free_port(), subnet="198.18.0.0/16"))
    d["links"] = [{"a": 0, "b": 1, "bandwidth_mbps": 50}]
    topo = tmp_path / "ns.json"
    topo.write_text(json.dumps(d))
    return topo


@contextlib.asynccontextmanager
async def memory_collectives(topo: Topology, **kw: Any) -> AsyncIterator[dict[int, Any]]:
    """Collectives for every node over the in-memory transport (unit tests of logic)."""
    from p2psync.collectives import Collectives
    from p2psync.transport.memory import MemoryHub

    hub = MemoryHub(topo)
    eps = {i: hub.endpoint(i, default_timeout=5) for i in topo.ids}
    for e in eps.values():
        await e.start()
    try:
        yield {i: Collectives(e, **kw) for i, e in eps.items()}
    finally:
        for e in eps.values():
            await e.close()


@contextlib.asynccontextmanager
async def memory_strategies(topo: Topology, name: str, options: dict[str, Any], *, codec: str = "none",
                            step_times: str = "", release: bool = True, **trainer: Any) -> AsyncIterator[list[Any]]:
    """Started strategies for every node over the in-memory transport, with real trainers
    (``trainer``: make_trainer keywords; ``step_times``: emulated ``NODE:SECONDS,...``;
    ``release``: as :func:`start_strategies`)."""
    from p2psync.transport.memory import MemoryHub

    hub = MemoryHub(topo)
    eps = {i: hub.endpoint(i, default_timeout=10) for i in topo.ids}
    for e in eps.values():
        await e.start()
    trainers = slowed_trainers(topo, step_times, **trainer)
    try:
        strats = await start_strategies(eps, topo, name, options=options, trainers=trainers, codec=codec,
                                        release=release)
        try:
            yield strats
        finally:
            await close_strategies(strats)
    finally:
        for e in eps.values():
            await e.close()


async def drive_until_stop(strats: Any, steps: int) -> list[list[Any]]:
    """Every node's loop (``want_stop`` from the last requested step on) until its strategy
    reports ``stop`` (bounded: 3x the steps); each node's step reports."""

    async def loop(s: Any) -> list[Any]:
        step, reps = 0, []
        while True:
            rep = await s.run_step(step, step + 1 >= steps)
            reps.append(rep)
            step += 1
            if rep.stop or step >= 3 * steps:
                return reps
    return list(await asyncio.gather(*(loop(s) for s in strats)))


async def run_until_stop(strats: Any, steps: int) -> list[list[dict[str, Any]]]:
    """:func:`drive_until_stop`, each node's step reports' ``extra``."""
    return [[rep.extra for rep in reps] for reps in await drive_until_stop(strats, steps)]


def record_barrier_pulls(strats: list[Any], slow: tuple[int, int] = (2, 1),
                        latency_s: float = 0.03) -> dict[int, dict[int, bytes]]:
    """Every worker's pulled vector at every barrier (``{barrier: {node: bytes}}``). The link
    ``slow`` (from, to) delays by ``latency_s``: the pull of a barrier by ``from`` reaches
    owner ``to`` after the other workers pulled, computed and pushed again (the race the
    barrier copies close)."""
    import numpy as np

    from p2psync.transport.shaping import InprocShaper, LinkSpec

    seen: dict[int, dict[int, bytes]] = {}
    for s in strats:
        me = s.ctx.transport.node_id
        if me == slow[0]:
            s.ctx.transport.shaper = InprocShaper({slow[1]: LinkSpec(latency_s=latency_s)})

        async def pull(*, barrier: int = 0, pull: Any = s.store.pull, me: int = me) -> np.ndarray:
            w = await pull(barrier=barrier)
            if barrier:
                seen.setdefault(barrier, {})[me] = w.tobytes()
            return w
        s.store.pull = pull
    return seen


@contextlib.contextmanager
def tiny_filesystem(folder: Any, size_kib: int, *, read_only: bool = False) -> Any:
    """``folder`` (created) as a filesystem of its own of ``size_kib`` KiB, read-only with
    ``read_only``: a tmpfs mounted there (root only), unmounted afterwards. A full disk and a
    read-only folder as real as they get, including for root, whom file modes do not stop.
    Skips the test where mounting is not possible."""
    import subprocess
    from pathlib import Path

    import pytest

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a filesystem of its own needs root (mount -t tmpfs)")
    opts = f"size={size_kib}k" + (",ro" if read_only else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()[:200]}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def read_only_folder(folder: Any) -> Any:
    """``folder`` (created) where nothing can be created or written: mode 0555 for a user whom
    that stops, else (root) a read-only tmpfs mounted there (:func:`tiny_filesystem`); skips
    the test where neither works."""
    from pathlib import Path

    import pytest

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        try:
            probe = path / ".probe"
            try:
                probe.write_text("")
            except PermissionError:
                yield path
                return
            probe.unlink()
            pytest.skip("mode 0555 does not stop this user's writes, and mounting needs root")
        finally:
            os.chmod(path, 0o755)
    with tiny_filesystem(path, 16, read_only=True) as p:
        yield p


def direct_reference(xs: list[Any], pieces: int, codec: str) -> Any:
    """What the direct plan must give: per piece k (owned by member k of the sorted group),
    the owner's own values plus every other member's decode(encode(values)) in sender order,
    in float32, then decode(encode(that sum))."""
    import numpy as np

    from p2psync.compress import get_codec

    c = get_codec(codec)
    n = xs[0].size
    per = -(-n // pieces)
    out = np.empty(n, np.float32)
    for k in range(pieces):
        lo, hi = k * per, min(n, (k + 1) * per)
        acc = xs[k][lo:hi].copy()
        for i, x in enumerate(xs):
            if i != k:
                acc = acc + c.roundtrip(x[lo:hi])
        out[lo:hi] = c.roundtrip(acc)
    return out

"""The user-facing functions behind :mod:`p2psync.api` (imported on first use: they need torch,
the launcher and the CLI do not). ``p2psync.attach(model, optimizer)`` in a user's script lands
here; the process's one :class:`~p2psync.api.session.Session` lives in this module."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from p2psync.api.env import from_env
from p2psync.api.session import Session
from p2psync.errors import ConfigError

log = logging.getLogger("p2psync")

_lock = threading.Lock()
_current: Session | None = None
_warned_single = False
_crashed = False
_hooks_installed = False


def session() -> Session | None:
    """This process's :class:`Session`. In a process started by ``p2psync run`` (``P2PSYNC_NODE``
    set) it always exists: before :func:`attach` it is created here, not yet attached (so that
    ``register_state`` and ``load_state_dict`` can be called before ``attach``, which then joins
    the run with this same session). As a single node (no ``P2PSYNC_NODE``) there is none: None.
    Raises :class:`ConfigError` when the launcher's variables are malformed."""
    with _lock:
        return _session_locked()


def _session_locked() -> Session | None:
    """:func:`session`, with ``_lock`` held."""
    global _current
    if _current is None:
        env = from_env(os.environ)
        if env is None:
            return None
        _current = Session(config=env.config, node=env.node_id)
        _install_exit_hooks()
    return _current


def _single_node_warning() -> None:
    global _warned_single
    if not _warned_single:
        _warned_single = True
        log.warning("p2psync: P2PSYNC_NODE is not set: running as a single node "
                    "(start the script with 'p2psync run TOPOLOGY -- python SCRIPT' to train on several)")


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
           scaler: Any = None) -> torch.optim.Optimizer:
    """Join the run this process was started for with this process's :func:`session` (the one
    created before, if any); returns ``optimizer`` with its step hooked. As a single node:
    ``optimizer`` untouched. The optimizer's LR schedulers are found without naming them
    (also those created after this call); ``scheduler`` (one or a list) and ``scaler`` (a
    ``GradScaler``) name them explicitly: checkpoints, resume and joiners carry their state."""
    global _current
    with _lock:
        s = _session_locked()
        if s is None:
            _single_node_warning()
            return optimizer
        if s.replica is not None:
            raise ConfigError(f"node {s.node_id}: p2psync.attach() was called twice; a node trains one "
                              "model (attach it once)")
        try:
            s.attach(model, optimizer, scheduler=scheduler, scaler=scaler)
        except BaseException:
            _current = None  # a later call starts afresh
            s.close(graceful=False)
            raise
        return optimizer


def shard(dataset: Any, *, labels: Sequence[int] | np.ndarray | None = None) -> Any:
    """This node's part of ``dataset`` (a ``torch.utils.data.Subset``), split as the run's
    ``--partition`` says (iid, shards, dirichlet; the non-iid schemes need the labels: taken
    from ``dataset.targets`` when present, else pass ``labels=``). As a single node: the whole
    dataset."""
    from p2psync.training.partition import partition

    env = from_env(os.environ)
    if env is None:
        _single_node_warning()
        return dataset
    cfg = env.config
    n = len(dataset)
    if labels is None:
        labels = getattr(dataset, "targets", None)
    if labels is None:
        if cfg.partition != "iid":
            raise ConfigError(f"--partition {cfg.partition} needs the labels: pass "
                              "p2psync.shard(dataset, labels=...)")
        labels = np.zeros(n, np.int64)
    y = np.asarray(labels if not isinstance(labels, torch.Tensor) else labels.cpu().numpy())
    if y.shape[0] != n:
        raise ConfigError(f"p2psync.shard: {y.shape[0]} labels for {n} samples")
    parts = partition(y.astype(np.int64), env.world_size, cfg.partition, seed=cfg.seed,
                      alpha=cfg.dirichlet_alpha, shards_per_part=cfg.shards_per_node)
    return torch.utils.data.Subset(dataset, parts[env.rank].tolist())


def log_values(**values: Any) -> None:
    """Add values (``loss``, ``samples``, ``accuracy``, ...) to this node's metrics."""
    if _current is not None:
        _current.log(**values)


def should_stop() -> bool:
    """True once the run agreed to stop: end the training loop."""
    return _current is not None and _current.should_stop


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Backward passes inside the block are not averaged (gradient accumulation, as DDP's
    ``no_sync``): their gradients accumulate locally, and the next backward pass outside it
    averages the sum. Only where backward averages (``ssgd``'s default); elsewhere, and as a
    single node, it does nothing."""
    if _current is None:
        yield
        return
    with _current.no_sync():
        yield


def _install_exit_hooks() -> None:
    """Close this process's session at exit (once, however many sessions it starts)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    # atexit runs handlers last-registered first: pyzmq's garbage collector (zero-copy sends)
    # registers its own shutdown when first imported, which may be after attach; import it now
    # so that the session closes (and still sends) before pyzmq's handler runs
    import zmq.utils.garbage  # noqa: F401

    previous = sys.excepthook

    def hook(exc_type: Any, exc: Any, tb: Any) -> None:
        global _crashed
        _crashed = True
        previous(exc_type, exc, tb)

    sys.excepthook = hook
    atexit.register(_close_at_exit)


def _close_at_exit() -> None:
    s = _current
    if s is not None:
        try:
            s.close(graceful=not _crashed)
        except Exception as exc:  # the process is exiting: report, do not raise
            print(f"p2psync: node {s.node_id}: {type(exc).__name__}: {exc}", file=sys.stderr)


__all__ = ["Session", "attach", "log_values", "no_sync", "session", "shard", "should_stop"]

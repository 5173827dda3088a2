"""The user-facing API (issue 11; DESIGN "What the user does"): three lines in a PyTorch script.

    import p2psync
    train_set = p2psync.shard(train_set)                  # this node's part of the data
    optimizer = p2psync.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # the loop stays: zero_grad(); loss.backward(); optimizer.step()

``attach`` reads the node's identity, topology and options from the environment that
``p2psync run TOPOLOGY [options] -- CMD`` sets (:mod:`p2psync.api.env`), starts a
:class:`~p2psync.api.session.Session` for this process and returns the user's own optimizer
with its ``step`` hooked. Without those variables the script runs as a single node: ``attach``
returns the optimizer untouched and ``shard`` the whole dataset (one warning). The session
ends when the script does (the finish barrier runs at exit; if the script dies of an exception
the node leaves at once, so its peers detect it in seconds instead of waiting for it), or
explicitly with ``p2psync.session().close()``. ``p2psync.log(loss=..., samples=...)`` adds the
loss and batch size to the node's metrics; ``p2psync.should_stop()`` turns true when the run
agreed to stop (its ``--time`` / ``--steps`` budget).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import Any, Sequence

from typing import TYPE_CHECKING

import numpy as np

from p2psync.api.env import from_env
from p2psync.errors import ConfigError

if TYPE_CHECKING:  # imported on first use: the launcher imports p2psync.api.* and needs neither
    import torch

    from p2psync.api.session import Session


def __getattr__(name: str) -> Any:
    if name == "Session":
        from p2psync.api.session import Session

        return Session
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

log = logging.getLogger("p2psync")

_lock = threading.Lock()
_current: Session | None = None
_warned_single = False
_crashed = False


def session() -> Session | None:
    """The session ``attach`` started in this process (None before, or as a single node)."""
    return _current


def _single_node_warning() -> None:
    global _warned_single
    if not _warned_single:
        _warned_single = True
        log.warning("p2psync: P2PSYNC_NODE is not set: running as a single node "
                    "(start the script with 'p2psync run TOPOLOGY -- python SCRIPT' to train on several)")


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Join the run this process was started for; returns ``optimizer`` with its step hooked."""
    global _current
    with _lock:
        env = from_env(os.environ)
        if env is None:
            _single_node_warning()
            return optimizer
        if _current is not None:
            raise ConfigError(f"node {env.node_id}: p2psync.attach() was called twice; a node trains one "
                              "model (attach it once)")
        from p2psync.api.session import Session

        s = Session(config=env.config, node=env.node_id)
        s.attach(model, optimizer)
        _current = s
        _install_exit_hooks()
        return optimizer


def shard(dataset: Any, *, labels: Sequence[int] | np.ndarray | None = None) -> Any:
    """This node's part of ``dataset`` (a ``torch.utils.data.Subset``), split as the run's
    ``--partition`` says (iid, shards, dirichlet; the non-iid schemes need the labels: taken
    from ``dataset.targets`` when present, else pass ``labels=``). As a single node: the whole
    dataset."""
    import torch

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


def _install_exit_hooks() -> None:
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


__all__ = ["Session", "attach", "log_values", "session", "shard", "should_stop"]

"""The user-facing API : three lines in a PyTorch script.

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

``p2psync.session()`` is this process's session: under ``p2psync run`` it exists before
``attach`` too (created unattached, so ``p2psync.session().register_state(name, get, set)``
can come first; ``attach`` then joins the run with it); as a single node it is None. Call it as
``p2psync.session()`` (or ``p2psync.api.facade.session()``): in this package ``session`` names
the module :mod:`p2psync.api.session`.
"""

from __future__ import annotations

from typing import Any

_FACADE = ("Session", "attach", "log_values", "no_sync", "shard", "should_stop")


def __getattr__(name: str) -> Any:
    """The facade (and torch) is imported on first use: ``p2psync.api.runtime`` and
    ``p2psync.api.env`` serve the launcher, which never trains."""
    if name in _FACADE:
        from p2psync.api import facade

        return getattr(facade, name)
    raise AttributeError(f"module 'p2psync.api' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = ["Session", "attach", "log_values", "no_sync", "shard", "should_stop"]

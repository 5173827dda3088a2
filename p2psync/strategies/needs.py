"""What each strategy needs of the user's training script, declared in one place and checked once.

Every strategy class carries a :class:`Needs` (``Strategy.needs``): which optimizers it can
train with, what becomes of an LR schedule and of gradient clipping, and why where it restricts
anything. :func:`check` compares one strategy's needs with an :class:`OptimizerInfo` and raises
one :class:`~p2psync.errors.ConfigError` listing everything that does not fit. It runs once per
run, before anything is started: ``p2psync run`` checks the built-in job's ``--optimizer``
before any node is spawned (:meth:`OptimizerInfo.builtin`), ``attach`` checks the user's
optimizer before the node joins the run (:meth:`OptimizerInfo.of`). :func:`needs_table` renders
the declarations as the README's "What each strategy needs" table (a test keeps them equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping

from p2psync.errors import ConfigError
from p2psync.params.optim import ELEMENTWISE_NAMES as ELEMENTWISE

#: ``any``: the user's optimizer steps (any ``torch.optim`` optimizer or its own);
#: ``elementwise``: the parameter store's owners run its class on shards (:data:`ELEMENTWISE`);
#: ``plain_sgd``: ``torch.optim.SGD`` without Nesterov, dampening or maximize, one momentum
OptimizerRule = Literal["any", "elementwise", "plain_sgd"]

_RULE_TEXT: dict[str, str] = {
    "any": "any",
    "elementwise": "elementwise torch.optim: " + ", ".join(ELEMENTWISE),
    "plain_sgd": "torch.optim.SGD (momentum allowed; no Nesterov, dampening or maximize)",
}


@dataclass(frozen=True)
class Needs:
    """One strategy's requirements (see the module docstring); the text fields are what the
    README table shows."""

    optimizer: OptimizerRule = "any"
    schedules: str = "honoured: the user's optimizer steps"
    clipping: str = "clips each node's own gradient, before anything is exchanged"
    #: what happens to module buffers (BatchNorm statistics; ``--buffers``)
    buffers: str = "each node's own"
    why: str = ""


@dataclass(frozen=True)
class OptimizerInfo:
    """What the checks read of the user's optimizer: its class (``module.Name``; torch.optim
    classes as ``torch.optim.Name``) and each parameter group's options (no parameters)."""

    cls: str
    groups: tuple[Mapping[str, Any], ...] = field(default=({},))

    @property
    def name(self) -> str:
        return self.cls.rsplit(".", 1)[-1]

    @property
    def torch_optim(self) -> bool:
        return self.cls == f"torch.optim.{self.name}"

    @classmethod
    def of(cls, optimizer: Any) -> "OptimizerInfo":
        """The info of a torch optimizer object."""
        import torch

        t = type(optimizer)
        name = f"{t.__module__}.{t.__qualname__}"
        if t.__module__.startswith("torch.optim"):
            if getattr(torch.optim, t.__qualname__, None) is t:
                name = f"torch.optim.{t.__qualname__}"
        groups = tuple({k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups)
        return cls(cls=name, groups=groups)

    @classmethod
    def builtin(cls, optimizer: str, *, momentum: float) -> "OptimizerInfo":
        """The info of the built-in job's ``--optimizer`` (training/trainer.py ``make_optimizer``)."""
        name = {"sgd": "SGD", "nesterov": "SGD", "adam": "Adam", "adamw": "AdamW"}.get(optimizer)
        if name is None:
            raise ConfigError(f"--optimizer {optimizer!r}: choose sgd, nesterov, adam or adamw")
        group: dict[str, Any] = {"momentum": momentum, "nesterov": True} if optimizer == "nesterov" else \
            {"momentum": momentum} if optimizer == "sgd" else {}
        return cls(cls=f"torch.optim.{name}", groups=(group,))


def problems(needs: Needs, info: OptimizerInfo) -> list[str]:
    """Everything about ``info`` that ``needs`` does not allow (empty: it fits). Pure."""
    rule = needs.optimizer
    out: list[str] = []
    if rule == "elementwise":
        if not (info.torch_optim and info.name in ELEMENTWISE):
            out.append(f"optimizer {info.cls} is not supported: needs {_RULE_TEXT[rule]}")
    elif rule == "plain_sgd":
        if info.cls != "torch.optim.SGD":
            out.append(f"optimizer {info.cls} is not supported: needs {_RULE_TEXT[rule]}")
        else:
            for i, g in enumerate(info.groups):
                for key, bad in (("nesterov", bool(g.get("nesterov", False))),
                                 ("dampening", float(g.get("dampening", 0) or 0) != 0),
                                 ("maximize", bool(g.get("maximize", False)))):
                    if bad:
                        out.append(f"parameter group {i}: SGD with {key}={g.get(key)!r} is not supported "
                                   f"(needs {_RULE_TEXT[rule]})")
            moms = sorted({float(g.get("momentum", 0) or 0) for g in info.groups})
            if len(moms) > 1:
                out.append(f"every parameter group must use the same momentum (got {moms})")
    return out


def check(strategy: str, needs: Needs, info: OptimizerInfo) -> None:
    """ConfigError listing every problem :func:`problems` finds, with the strategy's reason."""
    found = problems(needs, info)
    if found:
        why = f" ({needs.why})" if needs.why else ""
        raise ConfigError(f"--strategy {strategy} cannot train with this optimizer{why}:\n  - "
                          + "\n  - ".join(found))


def needs_table(rows: Iterable[tuple[str, Needs]]) -> str:
    """The markdown table of ``(strategy name, needs)`` rows (the README's)."""
    out = ["| strategy | optimizer | LR schedule | gradient clipping | buffers | why |", "|---|---|---|---|---|---|"]
    for name, n in rows:
        out.append(f"| `{name}` | {_RULE_TEXT[n.optimizer]} | {n.schedules} | {n.clipping} | {n.buffers} | "
                   f"{n.why or '—'} |")
    return "\n".join(out)

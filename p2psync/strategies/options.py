"""Strategy options: one frozen dataclass per strategy, built from the user's ``--opt NAME=VALUE``
pairs (or ``Session(strategy_options=...)``) at the edge, before anything starts.

A strategy declares its options as fields with a default and a help line::

    @dataclass(frozen=True)
    class ESyncOptions(StrategyOptions):
        mode: Literal["blocking", "nonblocking"] = option("nonblocking", "blocking or nonblocking")
        query_timeout: float = option(10.0, "seconds before a State Server query fails")

        def __post_init__(self) -> None:
            positive(self, "query_timeout")

and names the class in ``Strategy.Options``. :func:`build_options` converts each value to its
field's type (``int``, ``float``, ``bool``, ``str``, or a ``Literal`` of strings, whose values
are the only ones accepted); ``__post_init__`` checks what needs no topology, and
``Strategy.check_options`` what does (a group size against N). Every error is a
:class:`~p2psync.errors.ConfigError` naming the option (``--opt NAME=VALUE: ...``), so
``p2psync run`` exits 2 with it before any process starts.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Mapping, TypeVar, get_args, get_origin

from p2psync.compress import get_codec
from p2psync.errors import ConfigError

O = TypeVar("O", bound="StrategyOptions")


@dataclass(frozen=True)
class StrategyOptions:
    """A strategy's options (this base: a strategy without any)."""

    def as_dict(self) -> dict[str, Any]:
        """Every option by name, with its value."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def option(default: Any, help: str) -> Any:
    """A field of a :class:`StrategyOptions` dataclass: its default and one line of help."""
    return field(default=default, metadata={"help": help})


def build_options(cls: type[O], raw: Mapping[str, Any], *, strategy: str) -> O:
    """``cls`` from ``raw`` (name -> value, values as typed or as text)."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in known:
            listing = ", ".join(sorted(known)) or "none"
            raise ConfigError(f"--opt {name}: unknown option for strategy {strategy} (known: {listing})")
        values[name] = _convert(name, value, hints[name])
    return cls(**values)


def _convert(name: str, value: Any, typ: Any) -> Any:
    if get_origin(typ) is Literal:
        choices = get_args(typ)
        if str(value) not in choices:
            raise ConfigError(f"--opt {name}={value!r}: choose from {', '.join(map(str, choices))}")
        return str(value)
    try:
        if typ is bool:
            return _parse_bool(value)
        if typ is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return typ(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--opt {name}={value}: expected {typ.__name__}") from None


#: the words a boolean option reads as true, and as false
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def _parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    raise ValueError(text)


def tri_state(text: str) -> bool | None:
    """A text option that is true, false, or empty for the run's own setting (None)."""
    v = text.strip().lower()
    return None if not v else v in TRUE_WORDS


def check_outer_codec(opts: StrategyOptions, outer_codec: str, error_feedback: str) -> None:
    """The checks of a strategy's ``outer_codec`` option (a codec spec, empty: the run's
    ``--codec``) and its ``error_feedback`` option (true, false, or empty: the run's
    ``--error-feedback``), the values of those two options of ``opts``: ConfigError naming
    the option."""
    require(error_feedback.strip().lower() in ("", *TRUE_WORDS, *FALSE_WORDS), opts, "error_feedback",
            "true or false (empty: the run's --error-feedback)")
    if outer_codec:
        try:
            get_codec(outer_codec)
        except ConfigError as exc:
            raise ConfigError(f"--opt outer_codec={outer_codec}: {exc}") from None


def require(ok: bool, opts: StrategyOptions, name: str, rule: str) -> None:
    """ConfigError ``--opt NAME=VALUE: RULE`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"--opt {name}={getattr(opts, name)}: {rule}")


def positive(opts: StrategyOptions, *names: str) -> None:
    """Each option in ``names`` is a finite number > 0."""
    for n in names:
        v = getattr(opts, n)
        require(math.isfinite(v) and v > 0, opts, n, "must be a finite number > 0")


def non_negative(opts: StrategyOptions, *names: str) -> None:
    """Each option in ``names`` is a number >= 0 (float options may be inf)."""
    for n in names:
        v = getattr(opts, n)
        require(v >= 0, opts, n, "must be >= 0")


__all__ = ["FALSE_WORDS", "TRUE_WORDS", "StrategyOptions", "build_options", "check_outer_codec", "non_negative",
           "option", "positive", "require", "tri_state"]

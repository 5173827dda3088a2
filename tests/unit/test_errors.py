"""p2psync.errors.translate: the declarative table that turns foreign errors into p2psync's at
an edge (a block or a function), first matching rule wins, p2psync's own errors pass through."""

from __future__ import annotations

import json

import pytest

from p2psync.errors import ConfigError, P2PSyncError, ProtocolError, TransportError, translate


def test_a_block_turns_a_foreign_error_into_the_rules_error_without_its_chain():
    with pytest.raises(ConfigError, match="cannot read x: No such file") as info:
        with translate({OSError: lambda e: ConfigError(f"cannot read x: {e.strerror}")}):
            open("/nonexistent/p2psync/x")
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_first_matching_rule_wins_and_tuples_match_any_of_their_types():
    rules = {json.JSONDecodeError: lambda e: ConfigError(f"line {e.lineno}"),
             (ValueError, TypeError): lambda e: ProtocolError("bad", type(e).__name__)}
    with pytest.raises(ConfigError, match="line 1"):
        with translate(rules):
            json.loads("{")
    with pytest.raises(ProtocolError, match="bad: TypeError"):
        with translate(rules):
            len(3)  # type: ignore[arg-type]


def test_own_errors_and_unnamed_exceptions_pass_through_unchanged():
    rules = {ValueError: lambda e: TransportError("translated")}
    with pytest.raises(ConfigError, match="^mine$"):  # a ConfigError is a ValueError, yet ours
        with translate(rules):
            raise ConfigError("mine")
    with pytest.raises(KeyError):
        with translate(rules):
            raise KeyError("k")
    with translate(rules):
        pass  # no error: nothing happens


def test_as_a_decorator():
    @translate({ZeroDivisionError: lambda e: P2PSyncError("division")})
    def f(x: int) -> float:
        return 1 / x

    assert f(2) == 0.5
    with pytest.raises(P2PSyncError, match="division"):
        f(0)


def test_a_rule_must_name_exception_types():
    with pytest.raises(TypeError, match="not an exception type"):
        translate({int: lambda e: P2PSyncError("x")})  # type: ignore[dict-item]

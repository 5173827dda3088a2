"""Strategy options: frozen dataclasses built from the user's NAME=VALUE pairs."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from p2psync import Session
from p2psync.errors import ConfigError
from p2psync.strategies import REGISTRY, get_strategy
from p2psync.strategies.base import parse_options
from p2psync.topology import ring

ROOT = Path(__file__).resolve().parents[2]


def test_options_are_frozen_typed_and_default_when_absent():
    o = parse_options(get_strategy("esync"), {"query_timeout": "2.5"})
    assert (o.mode, o.query_timeout) == ("nonblocking", 2.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.mode = "blocking"
    assert parse_options(get_strategy("canary"), {"pipeline": "off", "p": 3}).pipeline is False
    with pytest.raises(ConfigError, match="--opt p=2.5: expected int"):
        parse_options(get_strategy("canary"), {"p": 2.5})
    assert parse_options(get_strategy("canary"), {"replies": "round"}).replies == "round"
    # the sketch's width: 5 bits by default, or chosen per piece within sketch_tol (0)
    from p2psync.compress import Sketch8
    from p2psync.strategies.canary import sketch_codec
    assert sketch_codec(parse_options(get_strategy("canary"), {})).spec == "sketch8:5"
    auto = sketch_codec(parse_options(get_strategy("canary"), {"sketch_bits": "0"}))
    assert isinstance(auto, Sketch8) and auto.spec == "sketch8:auto" and auto.tol == Sketch8.AUTO_TOL
    assert sketch_codec(parse_options(get_strategy("canary"), {"sketch_bits": "0", "sketch_tol": "0.25"})
                        ).spec == "sketch8:auto=0.25"
    assert sketch_codec(parse_options(get_strategy("canary"), {"sketch_bits": "6"})).spec == "sketch8:6"
    assert sketch_codec(parse_options(get_strategy("canary"), {"sketch_bits": "8"})).spec == "sketch8"
    for bad in ({"sketch_bits": "9"}, {"sketch_bits": "-1"}, {"sketch_tol": "0"}, {"sketch_tol": "1.5"},
                {"sketch_tol": "0.2"}):  # a tolerance with the fixed width: it would be ignored
        with pytest.raises(ConfigError, match=next(iter(bad))):
            parse_options(get_strategy("canary"), bad)
    with pytest.raises(ConfigError, match="replies"):
        parse_options(get_strategy("canary"), {"replies": "sometimes"})
    with pytest.raises(ConfigError, match="replies.*mode=native only"):  # bsp sends no replies
        parse_options(get_strategy("canary"), {"replies": "round", "mode": "bsp"})


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_strategy_accepts_its_defaults(name):
    cls = get_strategy(name)
    opts = parse_options(cls, {}, topology=ring(4))
    assert parse_options(cls, opts.as_dict(), topology=ring(4)) == opts


def test_checks_that_need_the_topology_run_when_it_is_given():
    cls = get_strategy("preduce")
    assert parse_options(cls, {"P": 6}).P == 6  # N unknown yet
    with pytest.raises(ConfigError, match="P=6"):
        parse_options(cls, {"P": 6}, topology=ring(4))


def test_session_refuses_a_bad_option_before_it_starts_anything():
    before = threading.active_count()
    with pytest.raises(ConfigError, match="mode='fast'"):
        Session(ROOT / "topologies" / "ring-4.json", 0, "esync", strategy_options=(("mode", "fast"),))
    assert threading.active_count() == before  # no event-loop thread

"""RunConfig: built from the CLI and back, its checks, the step budget."""

from __future__ import annotations

import pytest

from p2psync.cli.main import build_parser
from p2psync.cli.run_cmd import config_from_args
from p2psync.errors import ConfigError
from p2psync.training.config import RunConfig


def _args(*argv):
    ns = build_parser().parse_args(["run", "topologies/ring-4.json", *argv])
    return ns


def test_config_from_cli_and_back():
    cfg = config_from_args(_args("--strategy", "asgd", "--steps", "7", "--lr", "0.2", "--opt",
                                 "max_inflight=4", "--time", "3", "--eval-seconds", "2.5",
                                 "--codec", "sketch8", "--error-feedback", "--slowdown", "0:2"))
    assert cfg.strategy == "asgd" and cfg.steps == 7 and cfg.time_limit == 3 and cfg.eval_seconds == 2.5
    assert cfg.error_feedback and cfg.codec == "sketch8" and cfg.slowdown == "0:2"
    again = config_from_args(_args(*cfg.to_argv()))
    assert again == cfg
    default = config_from_args(_args())
    assert default.epochs == 20.0  # default budget
    assert default.fingerprint() != cfg.fingerprint()
    from dataclasses import replace
    assert replace(default, device="cpu", out="x", run_id="r").fingerprint() == default.fingerprint()


@pytest.mark.parametrize("argv,match", [
    (("--lr", "0"), "--lr"),
    (("--steps", "-3"), "--steps"),
    (("--momentum", "1.5"), "--momentum"),
    (("--opt", "nonsense"), "NAME=VALUE"),
    (("--opt", "zzz=1"), "unknown option"),
    (("--failure-timeout", "0.1"), "--failure-timeout"),
])
def test_config_errors(argv, match):
    with pytest.raises(ConfigError, match=match):
        config_from_args(_args(*argv))


def test_max_steps():
    c = RunConfig(topology="t", epochs=2.0, batch_size=10)
    assert c.max_steps(n_train=1000, n_nodes=4) == 50
    assert RunConfig(topology="t", steps=9).max_steps(1000, 4) == 9
    assert RunConfig(topology="t", time_limit=1.0).max_steps(1000, 4) > 10**12


def test_a_script_run_records_its_command_not_the_built_in_jobs_options():
    from p2psync.cli.main import parse_args
    from p2psync.training.config import BUILTIN_JOB_FIELDS

    script = config_from_args(parse_args(build_parser(), ["run", "t.json", "--lr", "0.3", "--seed", "4", "--",
                                                          "python", "train.py", "--lr", "0.1"]))
    assert script.command == ("python", "train.py", "--lr", "0.1")
    assert RunConfig.from_json(script.to_json()) == script  # what the launcher hands each copy
    rec = script.record()
    assert rec["command"] == ["python", "train.py", "--lr", "0.1"] and rec["seed"] == 4
    assert not BUILTIN_JOB_FIELDS & set(rec) and "lr" not in rec and "model" not in rec
    builtin = config_from_args(_args("--lr", "0.3"))
    assert builtin.command is None and "command" not in builtin.record() and builtin.record()["lr"] == 0.3
    assert "--command" not in " ".join(script.to_argv())
    assert script.fingerprint() == config_from_args(
        parse_args(build_parser(), ["run", "t.json", "--lr", "0.3", "--seed", "4", "--", "other"])).fingerprint()
    with pytest.raises(ConfigError, match="command"):
        RunConfig.from_json('{"topology": "t", "command": ["python", 3]}')

"""What each strategy needs (strategies/needs.py): declared once per class, checked once per run
with one error listing every problem, and shown in the README's table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from p2psync.api import Session
from p2psync.cli.main import main
from p2psync.errors import ConfigError
from p2psync.strategies.base import REGISTRY, get_strategy
from p2psync.strategies.needs import Needs, OptimizerInfo, check, needs_table, problems

ROOT = Path(__file__).resolve().parents[2]
get_strategy("ssgd")  # fills the registry
STORE = ("asp", "bsp", "dssp", "elastic_bsp", "ssp")


def test_the_readme_table_is_the_declarations():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- needs-table: generated from Strategy.needs -->\n(.*?)\n<!-- /needs-table -->", text, re.S)
    assert m, "README.md lost its 'What each strategy needs' table"
    builtin = sorted(n for n, cls in REGISTRY.items() if cls.__module__.startswith("p2psync.strategies."))
    assert m.group(1) == needs_table((n, REGISTRY[n].needs) for n in builtin)  # not tests' own strategies


def _info(opt_cls: type[torch.optim.Optimizer], *groups: dict) -> OptimizerInfo:
    ps = [torch.nn.Parameter(torch.zeros(2)) for _ in groups]
    return OptimizerInfo.of(opt_cls([{"params": [p], **g} for p, g in zip(ps, groups)], lr=0.1))


@pytest.mark.parametrize("name", STORE)
@pytest.mark.parametrize("opt", ["sgd", "nesterov", "adam", "adamw"])
def test_store_strategies_take_every_builtin_optimizer(name, opt):
    assert problems(REGISTRY[name].needs, OptimizerInfo.builtin(opt, momentum=0.9)) == []


def test_dts_lists_every_problem_in_one_error_and_says_why():
    info = _info(torch.optim.SGD, {"momentum": 0.9, "nesterov": True}, {"momentum": 0.5, "dampening": 0.1})
    with pytest.raises(ConfigError) as e:
        check("dts", REGISTRY["dts"].needs, info)
    msg = str(e.value)
    assert "nesterov=True" in msg and "dampening=0.1" in msg and "same momentum" in msg
    assert "compensation" in msg and msg.count("\n  - ") == 3
    with pytest.raises(ConfigError, match="torch.optim.AdamW is not supported"):
        check("dts", REGISTRY["dts"].needs, _info(torch.optim.AdamW, {}))
    assert problems(REGISTRY["dts"].needs, _info(torch.optim.SGD, {"momentum": 0.9}, {"momentum": 0.9})) == []


def test_the_store_refuses_an_optimizer_it_cannot_shard_and_any_takes_everything():
    class Mine(torch.optim.SGD):
        pass

    lbfgs = OptimizerInfo.of(torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(2))]))
    for info in (lbfgs, _info(Mine, {})):
        assert problems(REGISTRY["bsp"].needs, info) and not problems(Needs(), info)
    assert problems(REGISTRY["bsp"].needs, _info(torch.optim.RMSprop, {"momentum": 0.5})) == []


def test_the_cli_refuses_the_builtin_job_before_spawning_a_node(tmp_path, capsys):
    code = main(["run", str(ROOT / "topologies" / "ring-4.json"), "--strategy", "dts", "--optimizer", "adamw",
                 "--out", str(tmp_path), "--no-progress"])
    assert code == 2
    assert "--strategy dts cannot train with this optimizer" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # no run folder: nothing started


def test_attach_refuses_an_optimizer_before_joining_the_run():
    with Session(ROOT / "topologies" / "ring-4.json", 0, "dts") as s:
        model = torch.nn.Linear(3, 2)
        with pytest.raises(ConfigError, match="--strategy dts cannot train with this optimizer"):
            s.attach(model, torch.optim.Adam(model.parameters()))
        assert s.runtime is None

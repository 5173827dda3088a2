"""Which step a resumed run continues at, and whose checkpoint a node may resume from: the
pure start plan every member computes from the same gathered rows, and the refusal of a
checkpoint copied from another node's folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from p2psync.api import checkpoint
from p2psync.api.session import Session
from p2psync.api.start import FRESH, NO_CHECKPOINT, RESUMED, StartPlan, start_plan
from p2psync.errors import ConfigError, ProtocolError
from p2psync.topology import mesh, save

N = 1234  # trainable parameters


def _plan(rows: dict[int, tuple[int, int]], *, identical: bool) -> StartPlan:
    members = sorted(rows)
    got = [np.array([N, how, step], np.int64) for how, step in (rows[n] for n in members)]
    return start_plan(got, members, members[0], identical=identical, strategy="ssgd" if identical else "asgd")


def test_checkpoints_of_one_step_each_node_restores_its_own() -> None:
    for identical in (True, False):
        plan = _plan({0: (RESUMED, 40), 1: (RESUMED, 40), 2: (RESUMED, 40)}, identical=identical)
        assert plan == StartPlan(40, why="resuming at step 40: every node from its own checkpoint")
    assert _plan({0: (FRESH, 0), 1: (FRESH, 0)}, identical=True).resume_step is None


def test_identical_replicas_resume_at_the_latest_step_any_node_has() -> None:
    """A node killed at step 30 (its checkpoint: 30), survivors that went on to 50, a node
    whose disk was full (no checkpoint): the run resumes at 50 from the lowest node at 50."""
    plan = _plan({0: (RESUMED, 50), 1: (NO_CHECKPOINT, 0), 2: (RESUMED, 30), 3: (RESUMED, 50)}, identical=True)
    assert (plan.resume_step, plan.donor, plan.adopters) == (50, 0, (1, 2))
    assert plan.why.startswith("resuming at step 50, the latest checkpoint any node has (node 0: checkpoint of "
                               "step 50, node 1: no checkpoint, node 2: checkpoint of step 30, node 3: checkpoint "
                               "of step 50): node 0's state; node 1, node 2 adopt it")


def test_replicas_that_differ_need_checkpoints_of_one_step() -> None:
    with pytest.raises(ConfigError, match=r"not of one step \(node 0: checkpoint of step 50, node 1: checkpoint "
                                          r"of step 30\); --strategy asgd keeps a different replica"):
        _plan({0: (RESUMED, 50), 1: (RESUMED, 30)}, identical=False)
    with pytest.raises(ConfigError, match="node 1: no checkpoint"):
        _plan({0: (RESUMED, 50), 1: (NO_CHECKPOINT, 0)}, identical=False)


def test_no_checkpoint_anywhere_or_a_fresh_node_among_resumed_ones_is_refused() -> None:
    with pytest.raises(ConfigError, match="no node has a checkpoint"):
        _plan({0: (NO_CHECKPOINT, 0), 1: (NO_CHECKPOINT, 0)}, identical=True)
    with pytest.raises(ConfigError, match="do not agree on how the run starts .*node 1: fresh start"):
        _plan({0: (RESUMED, 5), 1: (FRESH, 0)}, identical=True)
    with pytest.raises(ConfigError, match="differ in their number of trainable parameters"):
        start_plan([np.array([N, FRESH, 0]), np.array([N + 1, FRESH, 0])], [0, 1], 0, identical=True)
    with pytest.raises(ProtocolError):
        start_plan([np.array([N, 7, 0]), np.array([N, FRESH, 0])], [0, 1], 0, identical=True)


def _checkpoint_of(node: int, step: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return checkpoint.snapshot(p2psync={"step": step, "samples": 0, "strategy": "ssgd", "run_id": "r", "node": node,
                                        "strategy_state": {}}, model=model,
                               optimizer=torch.optim.SGD(model.parameters(), lr=0.1), extra={})


@pytest.mark.parametrize("strategy,hint", [("ssgd", "remove it: a node without a checkpoint takes the state"),
                                           ("asgd", "keeps a different replica on each node")])
def test_a_checkpoint_copied_from_another_nodes_folder_is_refused(tmp_path: Path, strategy: str, hint: str) -> None:
    """A survivor's checkpoint copied into the folder of the node that died is not that
    node's: refused at attach (before anything starts), naming both nodes."""
    topo = tmp_path / "mesh2.json"
    save(mesh(2), topo)
    run = tmp_path / "r"
    checkpoint.save_atomic(checkpoint.node_checkpoint(run, 0), _checkpoint_of(0, 8))
    checkpoint.node_checkpoint(run, 1).parent.mkdir(parents=True)
    checkpoint.node_checkpoint(run, 0).rename(checkpoint.node_checkpoint(run, 1))  # "copied" over
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with pytest.raises(ConfigError) as ei:
        with Session(str(topo), 1, strategy, out=str(tmp_path), run_id="r", resume=str(run), steps=20) as s:
            s.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    msg = str(ei.value)
    assert f"{checkpoint.node_checkpoint(run, 1)}: this is node 0's checkpoint, not node 1's" in msg and hint in msg


def test_a_missing_checkpoint_is_refused_where_no_peer_can_stand_in(tmp_path: Path) -> None:
    topo = tmp_path / "mesh2.json"
    save(mesh(2), topo)
    (tmp_path / "r").mkdir()
    model = torch.nn.Linear(4, 3)
    with pytest.raises(ConfigError, match="no checkpoint at"):
        with Session(str(topo), 1, "asgd", out=str(tmp_path), run_id="r", resume=str(tmp_path / "r"), steps=20) as s:
            s.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))

"""Untrusted values from the network (issue 16) over real ZeroMQ: a run id that would make
every node write anywhere, and a node that sends NaN gradients."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from p2psync.api.runtime import NodeRuntime
from p2psync.api.session import Session
from p2psync.errors import PeerFailure, ProtocolError
from p2psync.topology import mesh, save
from p2psync.training.config import RunConfig
from tests.helpers import free_port, in_threads

pytestmark = pytest.mark.timeout(90)

STEPS = 8
POISON_FROM = 2


async def test_a_run_id_that_is_a_path_is_refused(tmp_path: Path) -> None:
    """The coordinator's registration reply names the run; a node uses it as a folder name,
    so an absolute path (or '..', or a separator) is refused as remote bad input."""
    path = tmp_path / "mesh2.json"
    save(mesh(2, base_port=free_port()), path)
    cfg = RunConfig(topology=str(path), out=str(tmp_path / "runs"), start_timeout=10, peer_timeout=5)
    from p2psync.topology import load

    topo = load(path)
    rts = [NodeRuntime(cfg=cfg, topo=topo, node_id=i) for i in (0, 1)]
    evil = str(tmp_path / "elsewhere")
    rts[0].host.run_info["run_id"] = evil  # a coordinator that names the run with a path
    try:
        got = await asyncio.gather(*(rt.rendezvous() for rt in rts), return_exceptions=True)
    finally:
        for rt in rts:
            await rt.close()
    for g in got:
        assert isinstance(g, ProtocolError) and g.reason == "run_id", g
    assert not (tmp_path / "elsewhere").exists()


def test_a_node_sending_nan_gradients_is_excluded_and_the_others_stay_finite(tmp_path: Path) -> None:
    """Node 2 poisons its gradients from step 2 on. Its pieces are rejected by the nodes that
    receive them, counted against it and reported; the coordinator excludes it (first offence)
    and the others redo the step without it: their parameters stay finite and bitwise equal,
    and node 2 is named in their metrics and in the run's summary."""
    topo = tmp_path / "mesh3.json"
    save(mesh(3, base_port=free_port()), topo)
    models = {}
    for i in range(3):  # built here: torch's global generator is shared by threads
        torch.manual_seed(0)
        models[i] = nn.Linear(4, 3)
    g = torch.Generator().manual_seed(1)
    batches = {i: [(torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g))
                   for _ in range(STEPS)] for i in range(3)}
    def node(i: int) -> np.ndarray:
        model = models[i]
        with Session(str(topo), i, "ssgd", out=str(tmp_path), run_id="nan", steps=STEPS, start_timeout=30,
                     peer_timeout=15) as s:
            opt = s.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
            k = 0
            while not s.should_stop:
                opt.zero_grad()
                x, y = batches[i][k % STEPS]
                nn.functional.cross_entropy(model(x), y).backward()
                if i == 2 and k >= POISON_FROM:
                    for p in model.parameters():
                        assert p.grad is not None
                        p.grad.fill_(float("nan"))
                opt.step()  # node 2: raises once it is excluded
                k += 1
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()

    out = in_threads(node, range(3), 80)
    assert isinstance(out.get(2), PeerFailure), out.get(2)
    for i in (0, 1):
        assert isinstance(out.get(i), np.ndarray), out.get(i)
        assert np.isfinite(out[i]).all()
    np.testing.assert_array_equal(out[0], out[1])
    summary = json.loads((tmp_path / "nan" / "summary.json").read_text())
    assert 2 in summary["failed"] and "non-finite" in summary["excluded"]["2"]
    assert summary["nodes"]["0"]["steps"] == STEPS
    named = [json.loads(line).get("offences") for i in (0, 1)
             for line in (tmp_path / "nan" / f"node-{i}.jsonl").read_text().splitlines()]
    assert any(o and o.get("2", 0) >= 1 for o in named), named

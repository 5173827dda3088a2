"""Untrusted values from the network (issue 16) over real ZeroMQ: a run id that would make
every node write anywhere, and a node that sends NaN gradients."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn

from p2psync.api.runtime import NodeRuntime
from p2psync.api.session import Session
from p2psync.errors import Diverged, Fenced, PeerFailure, ProtocolError
from p2psync.topology import mesh, save
from p2psync.training.config import RunConfig
from p2psync.wire import parse_header
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


def _run(tmp_path: Path, run_id: str, bad: Callable[[int, int, Session], bool]) -> tuple[dict[int, Any], Path]:
    """SSGD on mesh(3), three nodes (sessions in threads) for STEPS steps; ``bad(i, k, s)`` is
    called before node i's step k and says whether its gradient is NaN. Each node's final
    parameters or error, and the run folder."""
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
        with Session(str(topo), i, "ssgd", out=str(tmp_path), run_id=run_id, steps=STEPS, start_timeout=30,
                     peer_timeout=15) as s:
            opt = s.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
            k = 0
            while not s.should_stop:
                opt.zero_grad()
                x, y = batches[i][k % STEPS]
                nn.functional.cross_entropy(model(x), y).backward()
                if bad(i, k, s):
                    for p in model.parameters():
                        assert p.grad is not None
                        p.grad.fill_(float("nan"))
                opt.step()
                k += 1
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()

    return in_threads(node, range(3), 80), tmp_path / run_id


def _offences(run: Path) -> list[Any]:
    return [json.loads(line).get("offences") for i in (0, 1)
            for line in (run / f"node-{i}.jsonl").read_text().splitlines()]


def test_a_node_whose_gradient_diverges_stops_itself_and_blames_nobody(tmp_path: Path) -> None:
    """Node 2's gradient turns NaN at step 2: node 2 stops with "training diverged at step 2
    on node 2" before sending anything, nobody reports or excludes anyone, and the others go on
    without it (its departure is a failure) and stay finite and bitwise equal."""
    out, run = _run(tmp_path, "div1", lambda i, k, s: i == 2 and k >= POISON_FROM)
    assert isinstance(out.get(2), Diverged) and "training diverged at step 2 on node 2" in str(out[2]), out.get(2)
    for i in (0, 1):
        assert isinstance(out.get(i), np.ndarray), out.get(i)
        assert np.isfinite(out[i]).all()
    np.testing.assert_array_equal(out[0], out[1])
    summary = json.loads((run / "summary.json").read_text())
    assert 2 in summary["failed"] and not summary["excluded"] and summary["nodes"]["0"]["steps"] == STEPS
    assert not any(_offences(run))


def test_a_run_that_diverges_everywhere_ends_on_every_node_as_diverged(tmp_path: Path) -> None:
    """Every node's gradient turns NaN at step 2 (an honest run diverging): every node ends
    with its own "training diverged" error; no node is excluded, no coordinator deposed."""
    out, run = _run(tmp_path, "div3", lambda i, k, s: k >= POISON_FROM)
    for i in range(3):
        assert isinstance(out.get(i), Diverged) and f"at step 2 on node {i}" in str(out[i]), out.get(i)
    assert not any(_offences(run))


def _poison_after_checks(s: Session, on: threading.Event) -> None:
    """Make node ``s`` malicious: once ``on`` is set, every float32 tensor piece it sends holds
    NaN, written into the frames after its own checks (as a modified node would)."""
    assert s.runtime is not None
    t = s.runtime.transport
    real = t._transmit

    def transmit(peer: int, route: Any, frames: list[Any], *, bulk: bool = False, unordered: bool = False) -> None:
        h = parse_header(bytes(frames[0]))
        if on.is_set() and h.kind == "data":
            frames = [frames[0], *(np.full(f.nbytes // 4, np.nan, "<f4").tobytes() if f.dtype == "float32"
                                   else frame for f, frame in zip(h.frames, frames[1:]))]
        real(peer, route, frames, bulk=bulk, unordered=unordered)

    t._transmit = transmit  # type: ignore[method-assign]


def test_a_node_sending_nan_pieces_is_excluded_on_two_reports(tmp_path: Path) -> None:
    """Node 2 sends NaN pieces from step 2 on (a modified node: its own checks bypassed). Both
    nodes that receive them reject them and report node 2; two reports exclude it; the others
    redo the step without it, stay finite and bitwise equal, and name node 2 in their metrics
    and the run's summary."""
    on = threading.Event()

    def bad(i: int, k: int, s: Session) -> bool:
        if i == 2 and k == 0:
            _poison_after_checks(s, on)
        if i == 2 and k >= POISON_FROM:
            on.set()
        return False

    out, run = _run(tmp_path, "nan", bad)
    # told it was excluded for what it sent: it stops for good (no rejoin)
    fenced = out.get(2)
    assert isinstance(fenced, Fenced) and not fenced.rejoin and "non-finite" in str(fenced), fenced
    for i in (0, 1):
        assert isinstance(out.get(i), np.ndarray), out.get(i)
        assert np.isfinite(out[i]).all()
    np.testing.assert_array_equal(out[0], out[1])
    summary = json.loads((run / "summary.json").read_text())
    assert 2 in summary["failed"] and "reported by nodes [0, 1]" in summary["excluded"]["2"], summary["excluded"]
    assert summary["nodes"]["0"]["steps"] == STEPS
    assert any(o and o.get("2", 0) >= 1 for o in _offences(run))

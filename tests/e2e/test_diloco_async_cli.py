"""``--strategy diloco-async`` checkpointed (``--checkpoint-every``) and resumed (``--resume``)
through the CLI, one process per node.

What holds, and is tested: every node's checkpoint restores its DN state (θ_g, the momentum, the
buffer's sum and the counters, one packed vector) and its θ_start bitwise; the resumed run
continues at the checkpoint's step and at its update count (not from 0); it ends with one model
on every node (the same parameter hash, the end-of-run audit passed).

What does not hold, and why it is not tested: the resumed run is not bitwise equal to the
uninterrupted one, and cannot be, because no two runs of diloco-async are bitwise equal to
each other, interrupted or not. The order in which updates are applied is the sequencer's
numbering, which is the order in which the nodes' requests reach the coordinator: a race between
the nodes' clocks. θ_g's float32 additions do not associate (θ − u₁ − u₂ is not θ − u₂ − u₁ in
the last bits), so another order gives other bits, and a node's next phase starts from that
θ_g. How long a node waits for its buffer (``grace_s``, ``merge_s``) and how many inner steps it
takes (DyLU) depend on wall-clock times as well. ``dylu=false``, an uncompressed codec and
deterministic data remove the data and step-count sources, not the order of arrival. Updates
the checkpoint did not hold applied (a node's own update still in flight when it was taken)
are dropped at the resume, as at a re-form.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from p2psync.strategies.diloco.async_strategy import digest
from p2psync.strategies.diloco.dn import unpack
from p2psync.topology import mesh, save
from tests.e2e.test_cli_run import cli, lines, node_logs
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(120)


def test_a_checkpointed_run_resumes_its_state_bitwise_and_ends_with_one_model(tmp_path: Path) -> None:
    """Mesh-2, 24 steps, a checkpoint every 10: the run resumed from its step-20 checkpoints
    restores each node's DN state and θ_start bitwise (the restore line's digests are the
    checkpoint's), continues at step 21 and update count ≥ the checkpoint's, and ends with one
    model. (A merge window longer than the run keeps the two nodes within a phase of each
    other, so the slower one reaches step 20 before the stop: a resume needs every node's
    checkpoint of the same step.)"""
    topo = tmp_path / "mesh2.json"
    save(mesh(2, base_port=free_port()), topo)
    opts = ["--opt", "inner_steps=4", "--opt", "dylu=false", "--opt", "merge_s=30"]
    run = tmp_path / "a"

    def go(*more: object) -> None:
        r = cli("run", topo, "--strategy", "diloco-async", *opts, "--out", tmp_path, "--no-progress", "--steps", "24",
                *more, timeout=100)
        assert r.returncode == 0, r.stderr[-3000:] + node_logs(run)

    go("--run-id", "a", "--checkpoint-every", "10")
    saved = {}
    for i in (0, 1):
        ck = torch.load(run / f"node-{i}" / "checkpoint.pt", weights_only=False)
        st = ck["strategy_state"]
        vec = np.asarray(st["dn"].numpy(), np.float32)
        saved[i] = (ck["step"], unpack(vec, (vec.size - 6) // 3).count, digest(vec),
                    digest(np.asarray(st["theta_start"].numpy(), np.float32)))
        assert saved[i][0] == 20 and saved[i][1] > 0, saved
    before = {i: len(lines(run / f"node-{i}.jsonl")) for i in (0, 1)}

    go("--resume", run)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failed"] == [] and set(summary["nodes"]) == {"0", "1"}
    nodes = summary["nodes"].values()
    assert len({v["params_sha1"] for v in nodes}) == 1, summary["nodes"]  # one model
    assert all(v["audits"]["passed"] >= 1 and v["audits"]["incomplete"] == 0 for v in nodes), summary["nodes"]
    for i in (0, 1):
        step, count, state, start = saved[i]
        log = (run / f"node-{i}.log").read_text()
        got = re.findall(r"diloco-async state restored at update (\d+) \(state ([0-9a-f]+), theta_start ([0-9a-f]+)\)",
                         log)
        assert got == [(str(count), f"{state:016x}", f"{start:016x}")], (i, got, saved[i])
        recs = lines(run / f"node-{i}.jsonl")[before[i]:]
        assert recs and recs[0]["step"] == step + 1, recs[:1]  # the loop continues at the checkpoint's step
        assert recs[0]["applied"] >= count and recs[-1]["applied"] > count, (recs[0], recs[-1])
    assert max(v["steps"] for v in nodes) == 24

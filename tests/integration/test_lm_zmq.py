"""The language model over real ZeroMQ: the built-in job's ``lm-tiny`` under SSGD (four nodes
in one process, each with its own training thread and node runtime) is one process training on
the union of the nodes' batches: AdamW, warm-up + cosine decay and clipping at 1.0 of the
group's mean gradient included."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from p2psync.cli.builtin_job import run_builtin
from p2psync.topology import load as load_topology
from p2psync.topology import ring, save
from p2psync.training.config import RunConfig, lm_defaults
from p2psync.training.node import build_trainer
from p2psync.training.trainer import warmup_cosine
from tests.helpers import free_port, in_threads

pytestmark = pytest.mark.timeout(180)

STEPS = 50


def test_ssgd_on_lm_tiny_is_one_process_on_the_union_of_the_batches(tmp_path: Path) -> None:
    topo_path = tmp_path / "ring4.json"
    save(ring(4, base_port=free_port()), topo_path)
    # one sequence per node: the test's time budget (the arithmetic does not depend on it). A
    # lower peak learning rate than lm-tiny's default: at 2e-3 AdamW amplifies float32 rounding
    # (the union's sums run in another order than the ring's) by about 1.2x per step, past 1e-5
    # after ~35 steps; at 5e-4 it stays below 1e-6 over the 50 steps
    cfg = RunConfig(topology=str(topo_path), strategy="ssgd", steps=STEPS, out=str(tmp_path), run_id="lm",
                    device="cpu", threads=1, start_timeout=30, peer_timeout=30, eval_every=10_000,
                    model="lm-tiny", data="pysource", **{**lm_defaults("lm-tiny"), "batch_size": 1, "lr": 5e-4})
    topo = load_topology(topo_path)
    trainers = {i: build_trainer(cfg, topo, i) for i in topo.ids}  # in turn: torch's generator is global
    samplers = [trainers[i].sampler for i in topo.ids]
    batches = [np.concatenate([s.batch(k) for s in samplers]) for k in range(STEPS)]
    out = in_threads(lambda i: run_builtin(cfg, i, trainers[i]), topo.ids, 160)
    for i in topo.ids:
        if not isinstance(out.get(i), dict):
            raise AssertionError(f"node {i}: {out.get(i)!r}")
    assert {out[i]["params_sha1"] for i in topo.ids} == {out[0]["params_sha1"]}  # one model
    assert all(out[i]["steps"] == STEPS for i in topo.ids)
    losses = np.zeros((len(topo.ids), STEPS))
    for i in topo.ids:
        recs = [json.loads(line) for line in (tmp_path / "lm" / f"node-{i}.jsonl").read_text().splitlines()]
        by_step = {r["step"]: r["loss"] for r in recs if "loss" in r and r.get("step", 0) >= 1}
        losses[i] = [by_step[k + 1] for k in range(STEPS)]
    group = losses.mean(axis=0)  # equal batches: the union's mean loss

    # one process on the union of the batches, from the same initial weights and optimizer
    ref = build_trainer(cfg, topo, 0)
    sched = torch.optim.lr_scheduler.LambdaLR(ref.optimizer, lambda k: warmup_cosine(k, STEPS))
    expect = []
    for k in range(STEPS):
        x, y = ref.batch_tensors(batches[k])
        ref.optimizer.zero_grad()
        loss, _ = ref.loss_of(x, y)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(ref.model.parameters(), 1.0)
        ref.optimizer.step()
        sched.step()
        expect.append(float(loss.detach()))
    np.testing.assert_allclose(group, expect, rtol=1e-5, atol=1e-5)
    assert np.mean(expect[-10:]) < np.mean(expect[:5]) - 0.5  # it learnt
    final_bpb = out[0]["final_val_bpb"]
    assert final_bpb == out[3]["final_val_bpb"] and final_bpb < 8.0

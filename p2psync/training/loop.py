"""The training loop: calls the strategy step by step, evaluates, writes metrics.

The loop starts at the strategy's ``start_step`` (a node that joined a running run starts at
the step it joined at) and moves to ``StepReport.next_step`` when a strategy adopted a peer's
state at another step instead of training (issue 10 item 5)."""

from __future__ import annotations

import hashlib
import time
from typing import Any, Callable

from p2psync.strategies.base import Strategy
from p2psync.training.metrics import MetricsWriter, bytes_sent
from p2psync.training.trainer import Trainer


async def train_loop(*, node_id: int, strategy: Strategy, trainer: Trainer, metrics: MetricsWriter,
                     max_steps: int, time_limit: float | None, eval_every: int,
                     eval_seconds: float | None = None,
                     nic_bytes: Callable[[], dict[str, dict[str, int]]]) -> dict[str, Any]:
    t0 = time.monotonic()
    trainer.t0 = t0  # slowdown schedules count from the start of training
    comm = wait = 0.0
    step = strategy.start_step
    acc = test_loss = None
    last_eval = t0
    while True:
        elapsed = time.monotonic() - t0
        want_stop = step + 1 >= max_steps or (time_limit is not None and elapsed >= time_limit)
        rep = await strategy.train_step(step, want_stop)
        step = step + 1 if rep.next_step is None else rep.next_step
        comm += rep.comm_s
        wait += rep.wait_s
        now = time.monotonic() - t0
        rec: dict[str, Any] = {
            "node": node_id, "step": step, "time": round(now, 4), "loss": rep.loss,
            "compute_s": round(trainer.compute_s, 4), "comm_s": round(comm, 4), "wait_s": round(wait, 4),
            "samples": trainer.samples, "samples_per_s": trainer.samples / now if now > 0 else 0.0,
            "nics": nic_bytes(), "factor": trainer.factor, **rep.extra,
        }
        evaluate = (rep.stop or step % eval_every == 0
                    or (eval_seconds is not None and time.monotonic() - last_eval >= eval_seconds))
        if evaluate:
            last_eval = time.monotonic()
            test_loss, acc = await trainer.evaluate()
            rec["test_loss"], rec["accuracy"] = test_loss, acc
        metrics.write(rec, flush=evaluate)
        if rep.stop:
            break
    wall = time.monotonic() - t0
    nics = nic_bytes()
    params = await trainer.get_params()
    return {
        "node": node_id, "steps": step, "wall_s": round(wall, 3), "final_accuracy": acc,
        "final_test_loss": test_loss, "samples": trainer.samples,
        "samples_per_s": trainer.samples / wall if wall > 0 else 0.0,
        "compute_s": round(trainer.compute_s, 3), "comm_s": round(comm, 3), "wait_s": round(wait, 3),
        "bytes_sent": bytes_sent({"nics": nics}),
        "bytes_recv": sum(v["recv"] for v in nics.values()), "nics": nics,
        # equal on every member of a synchronous run (SSGD: bitwise), joiners included
        "params_sha1": hashlib.sha1(params.tobytes()).hexdigest()[:16],
    }

"""The built-in job of ``p2psync run``: an ordinary training script on :class:`p2psync.Session`.

Why: there is one training path (docs/architecture.md). The job builds its model, optimizer and data shard
(:func:`~p2psync.training.node.build_trainer`), attaches the optimizer, and runs the plain loop
``forward / backward / optimizer.step()`` until the run agrees to stop (``--time``, ``--steps``,
``--epochs``; ``--lr-schedule cosine`` / ``warmup-cosine``: an LR scheduler created after
``attach``, as scripts do), evaluating every ``--eval-every`` strategy steps (and every
``--eval-seconds``). A language model (``--model lm-*``) also logs its validation loss in bits
per byte (``val_bpb``; ``final_val_bpb`` in the stats) and records its corpus (``data``) and
tokens per sample (``tokens_per_s`` in the stats).
The emulated device time (``--slowdown``, ``--step-time``) runs after backward (``--slowdown-mode
quota``: no pad, the whole iteration computes at the device's rate) and ends early
when the strategy abandons the iteration (ESync's READY, §4.2): the job then still calls
``optimizer.step()``, which the strategy skips. Checkpoints (``--checkpoint-every``) also carry
the job's data position and step-time generator, so ``--resume`` continues exactly.
``--init-from`` loads the model's initial weights from a file (before the session attaches it).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from p2psync.api.checkpoint import load_weights
from p2psync.api.session import Session
from p2psync.errors import Aborted
from p2psync.topology import Topology, load
from p2psync.training.config import RunConfig
from p2psync.training.node import build_trainer
from p2psync.training.corpus import TokenData, bits_per_byte
from p2psync.training.trainer import Trainer, warmup_cosine


def run_builtin(cfg: RunConfig, node_id: int, trainer: Trainer | None = None) -> dict[str, Any]:
    """Train node ``node_id`` to the end of the run; returns its final stats. ``trainer``: one
    built already (:func:`~p2psync.training.node.build_trainer`; tests build them in turn)."""
    topo = load(cfg.topology)
    trainer = trainer if trainer is not None else build_trainer(cfg, topo, node_id)
    with contextlib.closing(trainer):  # its CPU cap (--slowdown-mode quota) ends with the job
        return _train(cfg, topo, node_id, trainer)


def _train(cfg: RunConfig, topo: Topology, node_id: int, trainer: Trainer) -> dict[str, Any]:
    if cfg.init_from is not None:
        load_weights(cfg.init_from, trainer.model)
    session = Session(config=cfg, node=node_id, topo=topo,
                      max_steps=cfg.max_steps(trainer.n_train, topo.size))
    register_trainer_state(session, trainer)
    if trainer.throttle is not None:  # --slowdown-mode quota: the cores a node of factor 1 gets
        session.info["cpu_share"] = round(trainer.throttle.share, 4)
    lm = isinstance(trainer.data, TokenData)
    if isinstance(trainer.data, TokenData):
        session.info.update(data=trainer.data.corpus.meta, tokens_per_sample=trainer.tokens_per_sample)
    with session:
        opt = session.attach(trainer.model, trainer.optimizer)
        total = max(1, session.max_steps)
        sched: torch.optim.lr_scheduler.LRScheduler | None = None
        if cfg.lr_schedule == "cosine":
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)
        elif cfg.lr_schedule == "warmup-cosine":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: warmup_cosine(k, total))
        trainer.t0 = time.monotonic()  # slowdown schedules count from the start of training
        last_eval, last_eval_step = time.monotonic(), 0
        while not session.should_stop:
            try:
                loss, n = trainer.forward_backward(session.gate.abandon)
                session.log(loss=loss, samples=n, factor=trainer.factor)
            except Aborted:  # abandoned by the strategy: the step below is skipped
                pass
            opt.step()
            if sched is not None:
                sched.step()
            due = (session.step - last_eval_step >= cfg.eval_every
                   or (cfg.eval_seconds is not None and time.monotonic() - last_eval >= cfg.eval_seconds))
            if due or session.should_stop:
                last_eval, last_eval_step = time.monotonic(), session.step
                test_loss, acc = trainer.evaluate_now()
                session.log(test_loss=test_loss, accuracy=acc,
                            **({"val_bpb": bits_per_byte(test_loss)} if lm else {}))
    return session.stats


def register_trainer_state(session: Session, trainer: Trainer) -> None:
    """Checkpoints of the built-in job carry its data position (completed iterations: the
    sampler's batches are a function of it) and the emulated device's step-time generator."""

    def set_sampler(v: Any) -> None:
        if isinstance(v, dict) and type(v.get("batches_done")) is int and v["batches_done"] >= 0:
            trainer.batches_done = v["batches_done"]

    def set_jitter(v: Any) -> None:
        if isinstance(v, dict) and isinstance(v.get("internal"), list):
            trainer._jitter.setstate((v["version"], tuple(v["internal"]), v["gauss_next"]))

    def get_jitter() -> dict[str, Any]:
        version, internal, gauss_next = trainer._jitter.getstate()
        return {"version": version, "internal": list(internal), "gauss_next": gauss_next}

    session.register_state("sampler", lambda: {"batches_done": trainer.batches_done}, set_sampler)
    session.register_state("jitter", get_jitter, set_jitter)


__all__ = ["register_trainer_state", "run_builtin"]

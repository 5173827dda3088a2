"""Building one node's local replica for the built-in job: data, partition, model, optimizer,
emulated device (the runtime that joins the run is :mod:`p2psync.api.runtime`)."""

from __future__ import annotations

import torch

from p2psync.topology import Topology
from p2psync.training.config import RunConfig
from p2psync.training.data import load_dataset
from p2psync.training.hetero import default_profile, parse_profiles
from p2psync.training.models import build_model
from p2psync.training.partition import partition
from p2psync.training.trainer import Trainer, make_optimizer, resolve_device


def build_trainer(cfg: RunConfig, topo: Topology, node_id: int) -> Trainer:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    data = load_dataset(cfg.data, data_dir=cfg.data_dir, synthetic_size=cfg.synthetic_size)
    parts = partition(data.y_train, topo.size, cfg.partition, seed=cfg.seed,
                      alpha=cfg.dirichlet_alpha, shards_per_part=cfg.shards_per_node)
    rank = topo.ids.index(node_id)
    torch.manual_seed(cfg.seed)  # identical initial weights on every node
    model = build_model(cfg.model, data.input_shape, data.num_classes, hidden=cfg.hidden)
    device = resolve_device(cfg.device)
    model.to(device)  # before the optimizer takes the parameters (Trainer keeps it there)
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.momentum, cfg.weight_decay)
    profile = parse_profiles(cfg.slowdown, cfg.slowdown_schedule, cfg.step_time, cfg.slowdown_mode,
                             cfg.step_jitter).get(node_id) or default_profile(cfg.slowdown_mode, cfg.step_jitter)
    return Trainer(model=model, optimizer=opt, data=data, indices=parts[rank],
                   batch_size=cfg.batch_size, seed=cfg.seed * 1000 + node_id, device=device,
                   slowdown=profile)


__all__ = ["build_trainer"]

"""Building one node's :class:`~p2psync.training.trainer.Trainer` for the built-in job: data,
partition, model, optimizer, emulated device (the job attaches its model and optimizer to a
session, whose replica strategies use: :mod:`p2psync.api.replica`)."""

from __future__ import annotations

import torch

from p2psync.topology import Topology
from p2psync.training.config import RunConfig
from p2psync.training.corpus import TokenData, pysource
from p2psync.training.cpu_quota import CpuQuota, Throttle, controller, host_share
from p2psync.training.data import Dataset, load_dataset
from p2psync.training.hetero import default_profile, parse_profiles
from p2psync.training.models import build_model
from p2psync.training.partition import partition
from p2psync.training.trainer import Trainer, make_optimizer, resolve_device


#: the language models' gradient clipping (global norm), after backward, before the step
LM_CLIP_NORM = 1.0


def build_trainer(cfg: RunConfig, topo: Topology, node_id: int) -> Trainer:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    data = load_data(cfg)
    labels = data.labels if isinstance(data, TokenData) else data.y_train
    parts = partition(labels, topo.size, cfg.partition, seed=cfg.seed,
                      alpha=cfg.dirichlet_alpha, shards_per_part=cfg.shards_per_node)
    rank = topo.ids.index(node_id)
    torch.manual_seed(cfg.seed)  # identical initial weights on every node
    if isinstance(data, TokenData):
        model = build_model(cfg.model, (data.context,), 256)
    else:
        model = build_model(cfg.model, data.input_shape, data.num_classes, hidden=cfg.hidden)
    device = resolve_device(cfg.device)
    model.to(device)  # before the optimizer takes the parameters (Trainer keeps it there)
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.momentum, cfg.weight_decay)
    profiles = parse_profiles(cfg.slowdown, cfg.slowdown_schedule, cfg.step_time, cfg.slowdown_mode,
                              cfg.step_jitter)
    profile = profiles.get(node_id) or default_profile(cfg.slowdown_mode, cfg.step_jitter)
    throttle = None
    if profile.mode == "quota":
        ctl = controller()
        throttle = Throttle(CpuQuota.create(ctl=ctl), host_share(profiles, topo, node_id, ctl))
    return Trainer(model=model, optimizer=opt, data=data, indices=parts[rank],
                   batch_size=cfg.batch_size, seed=cfg.seed * 1000 + node_id, device=device,
                   slowdown=profile, clip_norm=LM_CLIP_NORM if cfg.lm is not None else None, throttle=throttle)


def load_data(cfg: RunConfig) -> Dataset | TokenData:
    """The built-in job's data set: ``--data`` (a language model's: windows of its context)."""
    if cfg.lm is not None:
        return TokenData(pysource(), cfg.lm.context)
    return load_dataset(cfg.data, data_dir=cfg.data_dir, synthetic_size=cfg.synthetic_size)


__all__ = ["LM_CLIP_NORM", "build_trainer", "load_data"]

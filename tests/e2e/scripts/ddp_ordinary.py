"""The reference for examples/ordinary.py: the same model, data shards, optimizer, schedule and
clipping under torch's own DistributedDataParallel (gloo, one process per rank on this host).
``python ddp_ordinary.py WORLD PORT OUT EPOCHS``: writes ``OUT/rank-<r>.json`` with the
accuracy and the clipped gradient norms, as the example writes its result.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))

from ordinary import Net, digits, evaluate  # noqa: E402

from p2psync.training.config import RunConfig  # noqa: E402
from p2psync.training.partition import partition  # noqa: E402


def rank_main(rank: int, world: int, port: int, out: str, epochs: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(1)  # the example's --seed
    d = RunConfig(topology="-")  # p2psync.shard's defaults: the same shards
    train_set, test_set = digits()
    parts = partition(train_set.targets.numpy(), world, d.partition, seed=d.seed,  # type: ignore[attr-defined]
                      alpha=d.dirichlet_alpha, shards_per_part=d.shards_per_node)
    shard = Subset(train_set, parts[rank].tolist())
    loader = DataLoader(shard, batch_size=32, shuffle=True, drop_last=True)
    net = Net()
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, epochs * len(loader)))
    norms: list[float] = []
    for _ in range(epochs):
        for data, target in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
    _, acc = evaluate(model, DataLoader(test_set, batch_size=500))
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"accuracy": acc, "grad_norms": norms}))
    dist.destroy_process_group()


if __name__ == "__main__":
    world, port, out, epochs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    # forked ranks inherit the imports (spawned ones import torch and scikit-learn again)
    torch.multiprocessing.start_processes(rank_main, args=(world, port, out, epochs), nprocs=world,
                                          start_method="fork")

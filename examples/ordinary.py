"""An ordinary PyTorch training script, as people write them: a CNN with BatchNorm, AdamW, a
cosine learning-rate schedule stepped per batch, gradient clipping, a DataLoader with worker
processes, gradient accumulation, and the model saved at the end. Data: scikit-learn's 8x8
handwritten digits (no download).

It runs alone (``python examples/ordinary.py``) and, with the lines marked ``# p2psync``, as a
node of a run:

    p2psync run topologies/ring-4.json --strategy ssgd -- python examples/ordinary.py

Under ``ssgd`` it trains the model torch's DDP would: ``loss.backward()`` returns with the
group's mean gradient in ``.grad`` (so ``clip_grad_norm_`` clips the mean, and the logged norm
is the mean's), BatchNorm's running statistics are the lowest node's on every node after every
step, and every node saves the same ``state_dict``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import p2psync  # p2psync


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(torch.flatten(x, 1))


def digits() -> tuple[TensorDataset, TensorDataset]:
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = perm[:360], perm[360:]
    train_set = TensorDataset(x[train], y[train])
    train_set.targets = y[train]  # type: ignore[attr-defined]  # labels, for non-iid shards
    return train_set, TensorDataset(x[test], y[test])


def evaluate(model: nn.Module, loader: DataLoader) -> tuple[float, float]:
    model.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for data, target in loader:
            out = model(data)
            loss += F.cross_entropy(out, target, reduction="sum").item()
            correct += int((out.argmax(1) == target).sum())
            n += len(target)
    model.train()
    return loss / n, correct / n


def main() -> None:
    parser = argparse.ArgumentParser(description="an ordinary PyTorch script (BatchNorm, AdamW, cosine, clipping)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--accumulate", type=int, default=1, help="backward passes per optimizer step")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=os.environ.get("P2PSYNC_RUN_DIR", "."),
                        help="folder for model.pt and result.json (under p2psync run: the node's own)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    train_set, test_set = digits()
    train_set = p2psync.shard(train_set)  # p2psync
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        drop_last=True, persistent_workers=args.workers > 0)
    test_loader = DataLoader(test_set, batch_size=500)

    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    optimizer = p2psync.attach(model, optimizer)  # p2psync
    steps = args.epochs * (len(loader) // args.accumulate)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, steps))

    norms: list[float] = []
    for epoch in range(args.epochs):
        optimizer.zero_grad()
        for i, (data, target) in enumerate(loader):
            loss = F.cross_entropy(model(data), target) / args.accumulate
            loss.backward()
            if (i + 1) % args.accumulate:
                continue
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), args.clip)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        test_loss, acc = evaluate(model, test_loader)
        print(f"epoch {epoch}: test loss {test_loss:.4f}, accuracy {acc:.4f}, lr {scheduler.get_last_lr()[0]:.2e}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    torch.save(state, out / "model.pt")
    digest = hashlib.sha1(b"".join(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                                   for t in state.values())).hexdigest()[:16]
    (out / "result.json").write_text(json.dumps({"accuracy": acc, "test_loss": test_loss, "state_sha1": digest,
                                                 "grad_norms": norms}))
    print(f"final accuracy {acc:.4f}, state_dict sha1 {digest}")


if __name__ == "__main__":
    main()

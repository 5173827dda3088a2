"""An ordinary PyTorch training script (in the style of PyTorch's classic MNIST example) on the
handwritten digits that ship with scikit-learn (8x8 images, no download).

It runs with plain ``python examples/digits.py`` and no p2psync at all. Three lines, marked
``# p2psync``, make it a node of a p2psync run:

    p2psync run topologies/ring-4.json --strategy ssgd -- python examples/digits.py --epochs 5

starts it once per node of the topology; each copy trains on its own shard of the data and the
chosen strategy synchronizes the replicas around ``optimizer.step()``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

import p2psync  # p2psync


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def digits() -> tuple[TensorDataset, TensorDataset]:
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=g)
    test, train = perm[:360], perm[360:]
    train_set = TensorDataset(x[train], y[train])
    train_set.targets = y[train]  # type: ignore[attr-defined]  # labels, for non-iid shards
    return train_set, TensorDataset(x[test], y[test])


def train(args: argparse.Namespace, model: nn.Module, device: torch.device, loader: DataLoader,
          optimizer: torch.optim.Optimizer, epoch: int) -> None:
    model.train()
    for batch_idx, (data, target) in enumerate(loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(loader.dataset)}]\tLoss: {loss.item():.6f}")


def test(model: nn.Module, device: torch.device, loader: DataLoader) -> float:
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            loss += F.cross_entropy(output, target, reduction="sum").item()
            correct += int((output.argmax(dim=1) == target).sum())
    n = len(loader.dataset)
    print(f"Test set: Average loss: {loss / n:.4f}, Accuracy: {correct}/{n} ({100.0 * correct / n:.1f}%)")
    return correct / n


def main() -> None:
    parser = argparse.ArgumentParser(description="PyTorch digits example")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--gamma", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    train_set, test_set = digits()
    train_set = p2psync.shard(train_set)  # p2psync
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=1000)

    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    optimizer = p2psync.attach(model, optimizer)  # p2psync
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()


if __name__ == "__main__":
    main()

"""An ordinary PyTorch script that trains a small byte-level language model (a decoder-only
transformer, the shape of ``p2psync run --model lm-tiny``) on the Python standard library's own
source code: no download, the text ships with Python.

It runs with plain ``python examples/lm.py`` as one process. The lines marked ``# p2psync``
make it a node of a p2psync run:

    p2psync run topologies/ring-4.json --strategy ssgd -- python examples/lm.py --steps 300

starts it once per node of the topology; each copy trains on its own part of the text windows
and the chosen strategy synchronizes the replicas around ``optimizer.step()``. Alone with
``--batch-size 32`` (four nodes' batches of 8 together) it is the single-process reference: the
loss one process reaches on the union of the data at equal tokens.

AdamW with a linear warm-up and a cosine decay, gradient clipping at 1.0, bf16 autocast on CUDA.
Losses are reported in bits per byte (bpb); ``--steps`` counts optimizer steps.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler

import p2psync  # p2psync
from p2psync.data import pysource


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ByteLM(nn.Module):
    def __init__(self, width: int = 128, layers: int = 5, heads: int = 4, context: int = 128) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, 256)
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight"))
                                else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Windows(Dataset):
    """Windows of ``context + 1`` bytes starting every ``context`` bytes: (inputs, next bytes)."""

    def __init__(self, data: np.ndarray, context: int) -> None:
        self.data, self.context = torch.from_numpy(data), context  # the bytes, as loaded

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.data[i * self.context: i * self.context + self.context + 1].long()
        return w[:-1], w[1:]


def lr_factor(step: int, total: int, warmup: float = 0.05, floor: float = 0.1) -> float:
    warm = max(1, round(warmup * total))
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Validation loss in bits per byte."""
    model.eval()
    nats, count = 0.0, 0
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            nats += F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    model.train()
    return nats / count / math.log(2)


def main() -> None:
    parser = argparse.ArgumentParser(description="byte-level transformer LM on the Python standard library")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--eval-windows", type=int, default=64, help="validation windows per evaluation")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    corpus = pysource()
    print(f"corpus: Python {corpus.meta['python']} stdlib, {corpus.meta['bytes']} bytes, "
          f"sha256 {corpus.meta['sha256'][:16]}")
    train_set = Windows(corpus.train, args.context)
    val_set = Windows(corpus.val, args.context)
    picks = np.linspace(0, len(val_set) - 1, min(args.eval_windows, len(val_set))).round().astype(int)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, picks.tolist()), batch_size=16)
    train_set = p2psync.shard(train_set)  # p2psync
    sampler = RandomSampler(train_set, replacement=True, num_samples=args.steps * args.batch_size,
                            generator=torch.Generator().manual_seed(args.seed))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = ByteLM(args.width, args.layers, args.heads, args.context).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    optimizer = p2psync.attach(model, optimizer)  # p2psync
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lr_factor(k, args.steps))
    t0, tokens = time.perf_counter(), 0
    for step, (x, y) in enumerate(train_loader, start=1):
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        tokens += y.numel()
        if step % args.log_interval == 0:
            print(f"step {step} loss {loss.item() / math.log(2):.4f} bpb, "
                  f"{tokens / (time.perf_counter() - t0):.0f} tokens/s")
        if step % args.eval_every == 0 or step == args.steps:
            bpb = evaluate(model, val_loader, device)
            print(f"step {step} validation {bpb:.4f} bpb")
            p2psync.log(val_bpb=bpb)  # p2psync
        if p2psync.should_stop():  # p2psync
            break


if __name__ == "__main__":
    main()

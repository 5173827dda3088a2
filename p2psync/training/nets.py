"""The torch modules behind :mod:`p2psync.training.models` (imported on first build, so that
importing the model names, as the launcher does, does not import torch)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def mlp(input_shape: tuple[int, ...], classes: int, hidden: int = 128) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


def cnn(input_shape: tuple[int, ...], classes: int) -> nn.Module:
    c = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4, classes))


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(y)) + self.short(x))


def resnet18(input_shape: tuple[int, ...], classes: int) -> nn.Module:
    """ResNet-18 layout (2-2-2-2 basic blocks, 64-512 channels) with a 3x3 stem for small images."""
    layers: list[nn.Module] = [nn.Conv2d(input_shape[0], 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


class _LmBlock(nn.Module):
    """One pre-norm decoder block: causal self-attention (``F.scaled_dot_product_attention``)
    and a GELU MLP of 4 x width, each around a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class ByteLM(nn.Module):
    """A decoder-only transformer over byte tokens: token and learned position embeddings,
    ``layers`` pre-norm blocks, a final LayerNorm and an untied linear head to 256 logits.
    ``forward(tokens)`` maps int64 (batch, time <= context) to logits (batch, time, 256)."""

    def __init__(self, *, width: int, layers: int, heads: int, context: int, vocab: int = 256) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.context = context
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_LmBlock(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        for name, p in self.named_parameters():  # GPT-2's initialization
            if p.dim() > 1:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"{t} tokens exceed the context of {self.context}")
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.ln(x))
        return out


def lm_params(width: int, layers: int, context: int, vocab: int = 256) -> int:
    """:class:`ByteLM`'s parameter count: per block 12 w^2 + 13 w, embeddings (vocab + context) w,
    final norm 2 w, head w vocab + vocab."""
    return layers * (12 * width * width + 13 * width) + (vocab + context) * width + 2 * width + width * vocab + vocab

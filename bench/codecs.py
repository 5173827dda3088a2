"""Codec encode/decode throughput (GB/s of float32 input, one core) and relative L2 error.

    python -m bench.codecs [--elements 4194304]

Inputs: a Student-t(2) tensor (heavy-tailed, like gradients) and real gradients of the MLP,
CNN and ResNet-18 models on the digits data.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench._common import markdown_table, save_png
from p2psync.compress import Fp16, Int8Uniform, NoCodec, Sketch8
from p2psync.model.flat import FlatModel
from p2psync.topology import mesh
from p2psync.training.config import RunConfig
from p2psync.training.node import build_trainer


def real_gradient(model: str, steps: int = 5) -> np.ndarray:
    """The flat gradient of the built-in job's ``model`` after ``steps - 1`` plain SGD steps."""
    tr = build_trainer(RunConfig(topology="-", model=model, device="cpu", threads=1), mesh(1), 0)
    flat = FlatModel(model=tr.model, optimizer=tr.optimizer)
    g = np.zeros(0, np.float32)
    for _ in range(steps):
        tr.forward_backward()
        g = flat.grads()
        tr.optimizer.step()
    return g


def best_time(fn, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--elements", type=int, default=1 << 22)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)  # one core: torch's casts (fp16) would otherwise use every core
    rng = np.random.default_rng(0)
    t2 = (rng.standard_t(2, args.elements) * 1e-3).astype(np.float32)
    inputs = {"student-t(2)": t2, "mlp grad": real_gradient("mlp"), "cnn grad": real_gradient("cnn"),
              "resnet18 grad": real_gradient("resnet18", 2)}
    codecs = [NoCodec(), Fp16(), Int8Uniform(), Sketch8(),
              Sketch8(boundaries="quantile", representative="mid")]
    names = ["none", "fp16", "int8", "sketch8", "sketch8 (paper: quantile+mid)"]
    rows, speed = [], {}
    for name, c in zip(names, codecs):
        c.roundtrip(t2[:4096])  # compile numba kernels outside the timing
        enc = c.encode(t2)
        te = best_time(lambda: c.encode(t2))
        td = best_time(lambda: c.decode(enc, t2.size))
        wire = sum(a.nbytes for a in enc)
        errs = [float(np.linalg.norm(c.roundtrip(x) - x) / np.linalg.norm(x)) for x in inputs.values()]
        speed[name] = (t2.nbytes / te / 1e9, t2.nbytes / td / 1e9)
        rows.append([name, *speed[name], t2.nbytes / wire, *errs])
    print(f"## Codecs on {args.elements:,} float32 elements (one core)\n")
    print(markdown_table(["codec", "encode GB/s", "decode GB/s", "ratio",
                          *[f"rel. L2 {k}" for k in inputs]], rows))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(names))
    ax.bar(x - 0.2, [speed[n][0] for n in names], 0.4, label="encode")
    ax.bar(x + 0.2, [speed[n][1] for n in names], 0.4, label="decode")
    ax.set_xticks(x, names, rotation=15, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (float32 input, one core)")
    ax.legend()
    print("\nplot:", save_png(fig, "codecs.png"))


if __name__ == "__main__":
    main()

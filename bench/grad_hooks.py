"""Gradient-ready hooks during backward (Canary's colayers): what they cost the backward pass.

    python -m bench.grad_hooks [--device cuda] [--batches 32 128] [--size 224] [--iters 20] [--rounds 4]

Forward + backward of ResNet-18 (torchvision's when it is installed, else p2psync's own) with a
``register_post_accumulate_grad_hook`` on every parameter, three ways, in alternating rounds:

* **none**: no hooks (the baseline);
* **blocking**: each hook copies its gradient to the host with a blocking ``.to("cpu")`` (what
  p2psync did before: on a GPU it waits for every kernel queued so far, so the autograd thread
  cannot queue the rest of backward meanwhile);
* **async**: :class:`p2psync.training.grad_copies.GradCopies` (pinned copy + CUDA event, posted
  by a delivery thread as it lands; ``flush()`` at the end as ``optimizer.step()`` does).

Per batch size: the median time of an iteration (ms), the ratio blocking / async, and how many
gradients the async hooks had posted before ``backward()`` returned. On the CPU the copies are
plain host copies in every mode. Prints a markdown table and saves bench/out/grad_hooks.png.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np

from bench._common import markdown_table, save_png

MODES = ("none", "blocking", "async")


def _model(size: int) -> Any:
    try:
        import torchvision

        return torchvision.models.resnet18(), "torchvision resnet18"
    except ImportError:
        from p2psync.training.nets import resnet18

        return resnet18((3, size, size), 1000), "p2psync resnet18"


def measure(device: str, batch: int, size: int, iters: int, rounds: int) -> dict[str, Any]:
    import torch

    from p2psync.training.grad_copies import GradCopies

    loop = asyncio.new_event_loop()
    posts: list[float] = []

    class Timed(GradCopies):
        def _post(self, index: int, offset: int, arr: np.ndarray) -> None:
            posts.append(time.perf_counter())
            super()._post(index, offset, arr)

    copies = Timed(loop, lambda *a: None)
    model, name = _model(size)
    model = model.to(device)
    params = list(model.parameters())
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def blocking(p: torch.Tensor) -> None:
        arr = p.grad.detach().reshape(-1).to("cpu", torch.float32).numpy().copy()  # type: ignore[union-attr]
        loop.call_soon_threadsafe(len, arr)

    times: dict[str, list[float]] = {m: [] for m in MODES}
    early: list[int] = []
    try:
        for _ in range(rounds):
            for mode in MODES:
                hooks = [] if mode == "none" else [p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    blocking if mode == "blocking" else copies.hook(i, 0))
                    for i, p in enumerate(params)]
                for it in range(iters + 3):
                    sync()
                    posts.clear()
                    t0 = time.perf_counter()
                    model.zero_grad(set_to_none=False)
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    t_bwd = time.perf_counter()
                    copies.flush()
                    sync()
                    if it >= 3:  # warm-up
                        times[mode].append(time.perf_counter() - t0)
                        if mode == "async":
                            early.append(sum(1 for q in posts if q <= t_bwd))
                    loop.run_until_complete(asyncio.sleep(0))
                for h in hooks:
                    h.remove()
    finally:
        copies.close()
        loop.close()
    med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
    return {"model": name, "params": len(params), "ms": med, "early": statistics.median(early)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    p.add_argument("--size", type=int, default=224, help="image side in pixels")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per mode and round")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds of the three modes")
    args = p.parse_args()
    rows, res = [], []
    for b in args.batches:
        r = measure(args.device, b, args.size, args.iters, args.rounds)
        res.append(r)
        ms = r["ms"]
        rows.append([b, *(ms[m] for m in MODES), ms["blocking"] / ms["async"], f"{r['early']:g} of {r['params']}"])
    print(f"## Gradient-ready hooks: {res[0]['model']}, {args.size} px, {args.device} "
          f"(medians of {args.iters * args.rounds} iterations)\n")
    print(markdown_table(["batch", "none ms", "blocking ms", "async ms", "blocking / async",
                          "async: posted before backward returned"], rows))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = np.arange(len(args.batches))
    for k, m in enumerate(MODES):
        ax.bar(xs + (k - 1) * 0.27, [r["ms"][m] for r in res], 0.27, label=m)
    ax.set_xticks(xs, [f"batch {b}" for b in args.batches])
    ax.set_ylabel("forward + backward, ms")
    ax.set_title(f"gradient-ready hooks on {args.device}")
    ax.legend()
    print("\nplot:", save_png(fig, "grad_hooks.png"))


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


if __name__ == "__main__":
    main()

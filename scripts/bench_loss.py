#!/usr/bin/env python
"""LM-head + cross-entropy, forward and backward: normlab's chunked loss against the alternatives, one run.

Variants (each: loss and gradients of the hidden states and the head weight, timed as forward + backward):
- `materialized`: `F.cross_entropy(h @ W.T)` — the [N, vocab] logits exist (the baseline most code uses);
- `normlab`: `model.loss.fused_linear_cross_entropy`, chunk by chunk in plain PyTorch (what training uses);
- `liger`: Liger-Kernel's fused linear cross-entropy (Triton), when `liger_kernel` is importable (GPU only).
Every variant's loss and gradients are compared with the materialized one in the same run (max abs difference)
before timing, so a fast but wrong kernel shows. Prints median ms, the ratio to `materialized` and peak memory.

    python scripts/bench_loss.py --device cpu --tokens 512 --dim 64 --vocab 1024           # CPU smoke, seconds
    python scripts/bench_loss.py --device cuda --dtype bfloat16 --tokens 16384 --dim 1024 --vocab 32768
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from model.loss import fused_linear_cross_entropy  # noqa: E402

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def variants(device: str, chunk: int) -> dict[str, LossFn]:
    out: dict[str, LossFn] = {
        "materialized": lambda h, w, y: F.cross_entropy((h @ w.t()).float(), y),
        "normlab": lambda h, w, y: fused_linear_cross_entropy(h, w, y, chunk_size=chunk),
    }
    if device == "cuda":
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        except ImportError as error:
            print(f"liger: not importable ({error}); skipped")
        else:
            out["liger"] = lambda h, w, y: liger_fused_linear_cross_entropy(h, w, y)
    return out


def run(fn: LossFn, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fn(h, w, y)
    loss.backward()
    return loss.detach().float(), h.grad.float(), w.grad.float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=16384, help="N = batch x seq")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=1024, help="normlab's chunk_size")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dev, dtype = args.device, getattr(torch, args.dtype)

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()

    torch.manual_seed(0)
    h = torch.randn(args.tokens, args.dim, device=dev, dtype=dtype)
    w = (torch.randn(args.vocab, args.dim, device=dev) / args.dim**0.5).to(dtype)
    y = torch.randint(0, args.vocab, (args.tokens,), device=dev)
    fns = variants(dev, args.chunk)
    reference = run(fns["materialized"], h, w, y)
    print(f"N={args.tokens} dim={args.dim} vocab={args.vocab} device={dev} dtype={args.dtype} chunk={args.chunk}")
    print(f"{'variant':<14}{'ms':>9}{'vs materialized':>17}{'peak MiB':>10}{'|dloss|':>10}{'|dgrad_h|':>11}"
          f"{'|dgrad_W|':>11}")
    base = None
    for name, fn in fns.items():
        got = run(fn, h, w, y)
        diffs = [(a - b).abs().max().item() for a, b in zip(got, reference, strict=False)]
        if dev == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.reps + 2):
            sync()
            t = time.perf_counter()
            run(fn, h, w, y)
            sync()
            times.append(time.perf_counter() - t)
        ms = statistics.median(times[2:]) * 1e3
        base = base or ms
        peak = torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda" else float("nan")
        print(f"{name:<14}{ms:>9.2f}{base / ms:>16.2f}x{peak:>10.0f}{diffs[0]:>10.1e}{diffs[1]:>11.1e}"
              f"{diffs[2]:>11.1e}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Where a training step's time goes: a `torch.profiler` trace of a few steps, broken down by kind of kernel.

Trains normlab's model (random tokens, AdamW) for a few warm-up steps, then profiles `--steps` steps and sorts
every device kernel (CPU ops on a CPU run) into matmul, attention, norm, loss (LM head cross-entropy),
optimizer and other elementwise work by its name; idle is wall time minus busy kernel time (one stream). The
table and the 25 most expensive kernels are printed and, with --out, written to a text file.

    python scripts/profile_train.py --device cpu --dim 64 --layers 2 --seq 64 --batch 2 --vocab 256   # smoke
    python scripts/profile_train.py --device cuda --dtype bfloat16 --dim 1024 --layers 24 --heads 16 \
        --seq 2048 --batch 8 --vocab 32768 --compile --out docs/gpu/profile_350m.txt          # the 371M step

Kernel names differ between libraries and versions, so the buckets are a best effort: the top-kernel list under
the table shows what landed where. On CPU only aten ops are counted: the fused C++ RMSNorm (its own
`normlab_cpu::*` operators) shows up as idle/host time, so read CPU runs for the other buckets.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from bench_train import add_model_args, training_step  # noqa: E402  (scripts/ is on sys.path when run)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

# First match wins; names are lower-cased. Order matters: "softmax" in an attention kernel is attention.
BUCKETS = (
    ("attention", r"flash|fmha|attention|sdpa|_efficient_attention|cudnn_.*mha"),
    ("norm", r"rms|layer_norm|layernorm|_norm_fwd|_norm_bwd|native_layer_norm"),
    ("loss", r"cross_entropy|logsumexp|nll_loss|log_softmax|_fused_linear_cross|scatter|gather"),
    ("optimizer", r"adam|multi_tensor|foreach|_fused_adam"),
    ("matmul", r"gemm|matmul|addmm|\bmm\b|aten::mm|aten::bmm|cutlass|xmma|nvjet|sm90_|sm80_|ampere_|linear"),
)


def bucket(name: str) -> str:
    low = name.lower()
    for label, pattern in BUCKETS:
        if re.search(pattern, low):
            return label
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--steps", type=int, default=5, help="profiled steps")
    ap.add_argument("--compile", action="store_true", help="regional torch.compile of each block")
    ap.add_argument("--out", default=None, help="also write the report to this file")
    args = ap.parse_args()

    dev = args.device
    cfg, step = training_step(args)

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):  # warm-up (and compile)
        step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        wall = (time.perf_counter() - t0) / args.steps
    report = breakdown(prof, dev, wall, args.steps)
    tokens = args.batch * args.seq
    head = (f"config: dim={args.dim} layers={args.layers} heads={args.heads} seq={args.seq} batch={args.batch} "
            f"vocab={args.vocab} params={cfg.num_params() / 1e6:.0f}M device={dev} dtype={args.dtype} "
            f"compile={args.compile}\nstep {wall * 1e3:.1f} ms (profiled, so slower than unprofiled), "
            f"{tokens / wall:,.0f} tokens/s, {tokens * cfg.flops_per_token(args.seq) / wall / 1e12:.1f} TFLOP/s "
            f"model FLOPs\n")
    text = head + report
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


def breakdown(prof: profile, dev: str, wall: float, steps: int) -> str:
    """The per-bucket table and the top kernels, as text. On CUDA: device kernels (self device time); on CPU:
    leaf CPU ops (self CPU time), so nothing is counted twice."""
    per_bucket: dict[str, float] = {}
    kernels: list[tuple[float, str]] = []
    for evt in prof.key_averages():
        if dev == "cuda":
            us = evt.self_device_time_total if hasattr(evt, "self_device_time_total") else evt.self_cuda_time_total
        else:
            us = evt.self_cpu_time_total
        if us <= 0 or (dev != "cuda" and not evt.key.startswith(("aten::", "normlab::"))):
            continue
        seconds = us / 1e6 / steps
        per_bucket[bucket(evt.key)] = per_bucket.get(bucket(evt.key), 0.0) + seconds
        kernels.append((seconds, evt.key))
    busy = sum(per_bucket.values())
    lines = [f"{'kind':<12}{'ms/step':>10}{'share of step':>15}"]
    for label in [b for b, _ in BUCKETS] + ["other"]:
        t = per_bucket.get(label, 0.0)
        lines.append(f"{label:<12}{t * 1e3:>10.2f}{t / wall:>15.1%}")
    idle = max(wall - busy, 0.0)
    lines.append(f"{'idle/host':<12}{idle * 1e3:>10.2f}{idle / wall:>15.1%}   (wall minus busy kernel time)")
    lines.append("\ntop kernels (ms/step, kind, name):")
    for seconds, name in sorted(kernels, reverse=True)[:25]:
        lines.append(f"{seconds * 1e3:>9.3f}  {bucket(name):<10} {name[:110]}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

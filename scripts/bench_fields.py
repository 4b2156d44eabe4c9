#!/usr/bin/env python
"""What each model field costs: forward+backward time of the default model with one field turned on, as a ratio to
the default model measured in the same run.

    python scripts/bench_fields.py                          # CPU fp32: dim 256, 4 layers, seq 256, batch 8
    python scripts/bench_fields.py --threads 1 --clock cpu  # a shared machine: process CPU time, one thread
    python scripts/bench_fields.py --rounds 20 --only norm  # the cases whose name contains "norm"
    python scripts/bench_fields.py --device cuda            # any device (fp32)

All models are built first; then every round times each of them once (`--steps` forward+backward passes of the
training loss on the same random batch) in a freshly shuffled order, so load drift on a shared machine hits them
alike, and each round gives one ratio per case (its time / the default's in that round). The table shows the
median time, the median ratio and the range of the ratio over rounds (after one warm-up round). A field joins by
one entry in CASES: a name and the ModelConfig overrides that turn it on.
"""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from model import ModelConfig, Transformer  # noqa: E402

DEFAULT = "default (llama preset)"
CASES: dict[str, dict] = {  # name → the overrides that turn the field on (each alone, on the default model)
    DEFAULT: {},
    "residual_scale: 1.5": dict(residual_scale=1.5),
    "residual_scale: deepnorm": dict(residual_scale="deepnorm"),
    "branch_scale: scalar": dict(branch_scale="scalar"),
    "branch_scale: vector": dict(branch_scale="vector", branch_scale_init=0.1),
    "norm_depth_scale: true": dict(norm_depth_scale=True),
    "placement_mlp: post": dict(placement_mlp="post"),
    "mix_ln: 0.25": dict(mix_ln=0.25),
    "HybridNorm residual (placement post, placement_mlp none)": dict(placement="post", placement_mlp="none"),
    "embed_norm: true": dict(embed_norm=True),
    "embed_scale: sqrt_dim": dict(embed_scale="sqrt_dim"),
    "norm_affine: false": dict(norm_affine=False),
    "norm: rmsnorm_scalar": dict(norm="rmsnorm_scalar"),
    "norm: dyt (for reference)": dict(norm="dyt"),
    "norm: derf": dict(norm="derf"),
}


def training_pass(cfg: ModelConfig, tokens: torch.Tensor, steps: int) -> Callable[[], None]:
    """`steps` forward+backward passes of the training loss of a model of `cfg` on `tokens` [B, T+1]."""
    torch.manual_seed(0)
    model = Transformer(cfg).to(tokens.device)

    def run() -> None:
        for _ in range(steps):
            model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
            model.zero_grad(set_to_none=True)
        if tokens.device.type == "cuda":
            torch.cuda.synchronize()

    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=1, help="forward+backward passes per timing")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--only", default="", help="only the cases whose name contains this (the default always runs)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: process CPU time, robust to other jobs on a shared machine (with --threads 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = dict(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    cases = {name: over for name, over in CASES.items() if name == DEFAULT or args.only in name}
    runs = {name: training_pass(ModelConfig.preset("llama", **base, **over), tokens.to(args.device), args.steps)
            for name, over in cases.items()}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for r in range(args.rounds + 1):
        random.Random(r).shuffle(order)
        for name in order:
            start = clock()
            runs[name]()
            if r:  # round 0 warms up
                times[name].append((clock() - start) / args.steps)
    cpu = platform.processor() or platform.machine()
    print(f"# forward+backward, fp32, {args.device} ({cpu}), {args.threads} thread(s), {args.clock} clock, "
          f"torch {torch.__version__}, "
          f"dim {args.dim}, {args.layers} layers, seq {args.seq}, batch {args.batch}, vocab {args.vocab}, "
          f"{args.rounds} rounds")
    print("\n| case | median ms | ratio to default (median) | range over rounds |\n|---|---|---|---|")
    for name in runs:
        ratios = [t / d for t, d in zip(times[name], times[DEFAULT], strict=True)]
        print(f"| {name} | {statistics.median(times[name]) * 1e3:.1f} | {statistics.median(ratios):.3f} | "
              f"{min(ratios):.2f}–{max(ratios):.2f} |", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""What z-loss, final-logit soft-capping and attention soft-capping do to the max attention logit and the final
loss at a high learning rate, against QK-norm and the plain model: one short run each, numbers only.

Each run is the default job's model (`configs/default.yaml`: Llama preset, dim 256, 4 layers, 8 heads, seq 256,
batch 8, the default corpus) with the default job's optimizer settings except the learning rate (`--lr`,
default 1e-2, ten times the default; min_lr = lr / 10, 30 warm-up steps, cosine, clip 1.0), trained in a plain
single-process loop with the same pieces `normlab fit` uses (`model.Transformer`, `training.optim`,
`data.TokenDataModule`). Every `--probe-every` steps and at the end the attention probes (`model.probes.record`)
read `attn/max_logit` — the largest scaled pre-softmax attention logit, uncapped even under `attn_softcap` — and
the table gives its maximum over layers at step 0, at the end and over the run. The final loss is the
cross-entropy alone (z-loss's added term excluded; with `logit_softcap`, of the capped logits the model
predicts with): the mean over the last 10% of training steps, and on `--val-batches` fixed validation batches.

    python scripts/compare_logit_stability.py                       # 5 runs × 100 steps, seed 0
    python scripts/compare_logit_stability.py --steps 300 --seeds 0 1 --output runs/logit_stability.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from data.datamodule import TokenDataModule  # noqa: E402
from data.prepare import ensure_default_corpus  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from model.probes import record  # noqa: E402
from training.optim import OptimConfig, build_optimizer, plain_update  # noqa: E402

# name → (ModelConfig overrides, z-loss weight): the plain model, QK-norm, and its three competitors at the
# settings their papers use (PaLM's z-loss weight, Gemma 2's caps).
RUNS: dict[str, tuple[dict, float]] = {
    "plain": ({}, 0.0),
    "qk_norm head": ({"qk_norm": "head"}, 0.0),
    "z_loss 1e-4": ({}, 1e-4),
    "logit_softcap 30": ({"logit_softcap": 30.0}, 0.0),
    "attn_softcap 50": ({"attn_softcap": 50.0}, 0.0),
}


def max_logit(model: Transformer, tokens: torch.Tensor) -> float:
    """Largest attention logit over layers (uncapped) on `tokens` [B, T+1], from the probes; no gradient."""
    with torch.no_grad(), record(model) as rec:
        model(tokens[:, :-1])
    values = rec.scalars()
    return max(v for k, v in values.items() if k.startswith("attn/max_logit_worst/"))


def train_one(name: str, args: argparse.Namespace, data: TokenDataModule, seed: int) -> dict:
    overrides, z_loss = RUNS[name]
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=data.vocab_size, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      max_seq_len=args.seq, **overrides)
    model = Transformer(cfg)
    optim = replace(OptimConfig(), lr=args.lr, min_lr=args.lr / 10, z_loss=z_loss)
    opt, schedule = build_optimizer(model, optim, args.steps)
    batches = iter(data.train_dataloader())
    val = [b for _, b in zip(range(args.val_batches), data.val_dataloader(), strict=False)]
    probe_batch = val[0] if val else next(batches)
    logits = {0: max_logit(model, probe_batch)}
    losses, diverged, t0 = [], None, time.perf_counter()
    for step in range(args.steps):
        batch = next(batches)
        loss, z = model(batch[:, :-1], targets=batch[:, 1:], z_loss=z_loss, return_z_loss=True)
        if not torch.isfinite(loss):
            diverged = step
            break
        plain_update(model, opt, schedule, loss)
        losses.append((loss - z).item())
        if (step + 1) % args.probe_every == 0 or step + 1 == args.steps:
            logits[step + 1] = max_logit(model, probe_batch)
            print(f"    {name} step {step + 1}: loss {losses[-1]:.3f}, max attention logit {logits[step + 1]:.2f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        val_loss = statistics.mean(model(b[:, :-1], targets=b[:, 1:]).item() for b in val) if val else math.nan
    tail = losses[-max(1, len(losses) // 10):]
    return {"run": name, "seed": seed, "diverged_at": diverged, "train_loss_end": statistics.mean(tail),
            "val_loss": val_loss if diverged is None else math.inf, "max_logit_step0": logits[0],
            "max_logit_end": logits[max(logits)], "max_logit_peak": max(logits.values()),
            "max_logit_by_step": logits, "seconds": seconds}


def table(results: list[dict]) -> str:
    lines = ["| run | seeds | max attn logit, step 0 | at end | peak | train loss (last 10%) | val loss | s/run |",
             "|---|---|---|---|---|---|---|---|"]
    for name in RUNS:
        rs = [r for r in results if r["run"] == name]
        if not rs:
            continue

        def col(key: str, fmt: str, rs: list[dict] = rs) -> str:
            return " / ".join(format(r[key], fmt) for r in rs)

        lines.append(f"| {name} | {len(rs)} | {col('max_logit_step0', '.2f')} | {col('max_logit_end', '.2f')} | "
                     f"{col('max_logit_peak', '.2f')} | {col('train_loss_end', '.3f')} | {col('val_loss', '.3f')} | "
                     f"{col('seconds', '.0f')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("data_cache/default"), help="default corpus (built if missing)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--probe-every", type=int, default=25)
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="RUN")
    ap.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")
    args = ap.parse_args()

    ensure_default_corpus(args.data)
    data = TokenDataModule(str(args.data), seq_len=args.seq, batch_size=args.batch, val_batches=args.val_batches)
    data.setup("fit")
    print(f"model dim {args.dim}, {args.layers} layers, {args.heads} heads, seq {args.seq}, batch {args.batch}, "
          f"vocab {data.vocab_size}; lr {args.lr}, {args.steps} steps; {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    results, start = [], time.perf_counter()
    for seed in args.seeds:
        for name in args.runs:
            r = train_one(name, args, data, seed)
            results.append(r)
            print(f"  {name:<18} seed {seed}: max logit {r['max_logit_step0']:.2f} → {r['max_logit_end']:.2f} "
                  f"(peak {r['max_logit_peak']:.2f}), train loss {r['train_loss_end']:.3f}, val {r['val_loss']:.3f}"
                  f"{'' if r['diverged_at'] is None else ', diverged at step ' + str(r['diverged_at'])} "
                  f"({r['seconds']:.0f} s; load {os.getloadavg()[0]:.1f})", flush=True)
            if args.output:
                tmp = args.output.with_suffix(".tmp")
                tmp.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                          indent=1))
                tmp.replace(args.output)
    print(f"\n{table(results)}\n\ntotal {(time.perf_counter() - start) / 60:.1f} min; "
          f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

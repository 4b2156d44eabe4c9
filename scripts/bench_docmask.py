#!/usr/bin/env python
"""Step time with vs without document masking (`data.document_mask`), one model, alternating in one run.

Variants, each a forward + backward + AdamW step of the same model on the same random tokens:
- `causal`: the default path (SDPA with `is_causal`, no mask);
- `docmask`: `position_ids` cutting each row into documents of random lengths (mean `--doc-len` tokens) —
  SDPA with a dense boolean mask [B, 1, T, T] (on CUDA: compiled flex attention with a block mask);
- `docmask-sdpa` (CUDA only): the same with `NORMLAB_DOCMASK=sdpa`, the dense-mask fallback.
Prints the median seconds per step and each variant's ratio to `causal`, measured in the same run (variants
interleaved step by step, so a shared machine's load hits them alike); then the same for one attention call
alone (forward + backward of SDPA at the model's shape, mask construction included), the only part that differs.

    python scripts/bench_docmask.py                     # CPU fp32, the default job's model (dim 256, 4 layers)
    python scripts/bench_docmask.py --device cuda --dtype bfloat16 --dim 1024 --layers 24 --heads 16 \
        --seq 2048 --batch 8 --vocab 32768
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from model import ModelConfig, Transformer  # noqa: E402
from scripts.bench_train import add_model_args, sync  # noqa: E402


def document_positions(batch: int, seq: int, mean_len: int, seed: int = 0) -> torch.Tensor:
    """position_ids [batch, seq]: each row cut into documents of geometric lengths with mean `mean_len`."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq, generator=g) < 1.0 / mean_len
    starts[:, 0] = True
    index = torch.arange(seq).expand(batch, seq)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values  # each token's document start
    return index - first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--doc-len", type=int, default=64, help="mean document length in tokens")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=1, help="timed steps per variant per round")
    ap.add_argument("--attn-reps", type=int, default=50, help="timed attention calls per variant")
    args = ap.parse_args()
    dev = args.device
    torch.manual_seed(0)
    cfg = ModelConfig.preset("llama", vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                             n_heads=args.heads, n_kv_heads=args.kv_heads, max_seq_len=args.seq)
    model = Transformer(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    amp = torch.autocast(dev, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=dev)
    positions = document_positions(args.batch, args.seq, args.doc_len).to(dev)

    def step(position_ids: torch.Tensor | None) -> None:
        with amp:
            loss = model(x[:, :-1], targets=x[:, 1:], position_ids=position_ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    variants = {"causal": (None, "auto"), "docmask": (positions, "auto")}
    if dev == "cuda":
        variants["docmask-sdpa"] = (positions, "sdpa")
    times: dict[str, list[float]] = {k: [] for k in variants}
    for rnd in range(args.rounds + 1):  # round 0 warms up (and compiles flex attention on CUDA)
        for name, (pos, mode) in variants.items():
            os.environ["NORMLAB_DOCMASK"] = mode
            sync(dev)
            t = time.perf_counter()
            for _ in range(args.steps):
                step(pos)
            sync(dev)
            if rnd:
                times[name].append((time.perf_counter() - t) / args.steps)
    docs = int((positions == 0).sum())
    print(f"config: dim={args.dim} layers={args.layers} heads={args.heads} seq={args.seq} batch={args.batch} "
          f"vocab={args.vocab} device={dev} dtype={args.dtype} threads={torch.get_num_threads()}; "
          f"{docs} documents in the batch (mean {args.batch * args.seq / docs:.0f} tokens)")
    report("training step (forward + backward + AdamW)", times)
    report(f"one attention call alone, [{args.batch}, {args.heads}, {args.seq}, {cfg.head_dim}]",
           attention_times(cfg, args, positions))


def attention_times(cfg: ModelConfig, args: argparse.Namespace, positions: torch.Tensor) -> dict[str, list[float]]:
    """Seconds of SDPA forward + backward, causal vs the dense document mask (built from positions each call)."""
    from model.attention import DocumentMask

    dev = args.device
    q, k, v = (torch.randn(args.batch, args.heads, args.seq, cfg.head_dim, device=dev, requires_grad=True)
               for _ in range(3))

    def causal() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def masked() -> None:
        mask = DocumentMask.from_positions(positions).dense
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()

    os.environ["NORMLAB_DOCMASK"] = "sdpa"
    times: dict[str, list[float]] = {"causal": [], "docmask": []}
    for rep in range(args.attn_reps + 3):  # 3 warm-up calls each
        for name, fn in (("causal", causal), ("docmask", masked)):
            sync(dev)
            t = time.perf_counter()
            fn()
            sync(dev)
            if rep >= 3:
                times[name].append(time.perf_counter() - t)
    return times


def report(title: str, times: dict[str, list[float]]) -> None:
    base = statistics.median(times["causal"])
    print(f"{title}:")
    print(f"  {'variant':<14}{'ms':>10}{'vs causal':>11}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<14}{med * 1e3:>10.2f}{med / base:>10.2f}x")


if __name__ == "__main__":
    main()

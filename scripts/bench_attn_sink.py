#!/usr/bin/env python
"""Cost of an attention sink and of exact max-logit tracking against plain SDPA, per attention call.

Variants, each one attention call (forward, then forward + backward) on the same q, k, v:
- `sdpa`: `F.scaled_dot_product_attention`, causal (`is_causal`), or with a dense document mask when `--doc-len`
  is given — the default path, and the baseline of every ratio;
- `sink`: `model.softmax.sdpa_with_sink`, the exact form the model runs (one extra key and feature on SDPA);
- `sink-floatmask`: the other exact SDPA form, an extra zero key/value whose logit σ comes in through an
  additive float mask [1, H, T, S+1] (σ's gradient flows through the mask);
- `sink-math`: `model.softmax.math_attention` with the sink column (what `attn_softcap` runs anyway);
- `sdpa+maxlogit`: `sdpa` plus `model.softmax.max_logit_per_head`, i.e. with `Attention.track_max_logit` on.

All variants are interleaved call by call for `--rounds` rounds, so a shared machine's load hits them alike.
Prints the median milliseconds per call and each variant's ratio to `sdpa` measured in the same run.

`--fields` instead times whole training steps (forward + backward + AdamW, the default job's model: dim 256,
4 layers, 8 heads, seq 256, batch 8) with each attention-side field on, against the default model, interleaved
step by step in one run: the cost of each field where it is paid.

    python scripts/bench_attn_sink.py                                    # CPU fp32, a few shapes
    python scripts/bench_attn_sink.py --shapes 8x8x8x256x32 --doc-len 64  # with document masking
    python scripts/bench_attn_sink.py --device cuda --dtype bfloat16 --shapes 8x16x4x2048x64
    python scripts/bench_attn_sink.py --fields                           # step time per field, CPU
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

from model import ModelConfig, Transformer  # noqa: E402
from model.attention import visible_keys  # noqa: E402
from model.softmax import math_attention, max_logit_per_head, sdpa_with_sink  # noqa: E402
from scripts.bench_docmask import document_positions  # noqa: E402
from scripts.bench_train import sync  # noqa: E402

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def sink_floatmask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor, scale: float,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """The sink as an extra zero key/value with the logit σ in an additive float mask (the alternative form)."""
    B, H, T, D = q.shape
    visible = torch.ones(T, T, dtype=torch.bool, device=q.device).tril() if mask is None else mask
    additive = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
    additive = additive.expand(visible.shape[0] if visible.dim() == 4 else 1, H, T, T)  # [B or 1, H, T, T]
    column = sink.to(q.dtype).view(1, H, 1, 1).expand(additive.shape[0], H, T, 1)
    zero = k.new_zeros(B, k.shape[1], 1, D)
    return F.scaled_dot_product_attention(q, torch.cat([k, zero], 2), torch.cat([v, zero], 2),
                                          attn_mask=torch.cat([additive, column], -1), scale=scale,
                                          enable_gqa=k.shape[1] != H)


def variants(scale: float) -> dict[str, Callable[[Inputs], torch.Tensor]]:
    def sdpa(a: Inputs) -> torch.Tensor:
        q, k, v, _, mask = a
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])

    def tracked(a: Inputs) -> torch.Tensor:
        max_logit_per_head(a[0], a[1], scale, a[4])
        return sdpa(a)

    return {
        "sdpa": sdpa,
        "sink": lambda a: sdpa_with_sink(a[0], a[1], a[2], a[3], scale, a[4], a[1].shape[1] != a[0].shape[1]),
        "sink-floatmask": lambda a: sink_floatmask(a[0], a[1], a[2], a[3], scale, a[4]),
        "sink-math": lambda a: math_attention(a[0], a[1], a[2], a[4], scale, sink=a[3]),
        "sdpa+maxlogit": tracked,
    }


def bench_shape(shape: tuple[int, ...], args: argparse.Namespace) -> None:
    B, H, K, T, D = shape
    dev, dtype = args.device, getattr(torch, args.dtype)
    torch.manual_seed(0)
    q = torch.randn(B, H, T, D, device=dev, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, K, T, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    sink = torch.randn(H, device=dev, requires_grad=True)
    mask = None
    if args.doc_len:
        doc_ids = (document_positions(B, T, args.doc_len).to(dev) == 0).cumsum(-1)
        mask = visible_keys(doc_ids)[:, None]
    inputs = (q, k, v, sink, mask)
    fns = variants(D ** -0.5)
    for backward in (False, True):
        times: dict[str, list[float]] = {name: [] for name in fns}
        for rnd in range(args.rounds + 1):  # round 0 warms up
            for name, fn in fns.items():
                sync(dev)
                t = time.perf_counter()
                out = fn(inputs)
                if backward:
                    out.sum().backward()
                sync(dev)
                if rnd:
                    times[name].append(time.perf_counter() - t)
            for x in (q, k, v, sink):
                x.grad = None
        base = statistics.median(times["sdpa"])
        row = "  ".join(f"{name} {statistics.median(t) * 1e3:.1f} ms (×{statistics.median(t) / base:.2f})"
                        for name, t in times.items())
        kind = "fwd+bwd" if backward else "fwd"
        print(f"B{B} H{H} K{K} T{T} D{D}{' docs' if mask is not None else ''} {kind}: {row}", flush=True)


FIELDS = {  # variant → ModelConfig overrides (and whether max-logit tracking is on)
    "default": {}, "qk_norm head": dict(qk_norm="head"), "qk_norm qkv": dict(qk_norm="qkv"),
    "qk_norm head, kind l2": dict(qk_norm="head", qk_norm_kind="l2"), "sub_norm": dict(sub_norm=True),
    "attn_gate head": dict(attn_gate="head"), "attn_gate elementwise": dict(attn_gate="elementwise"),
    "attn_sink learnable": dict(attn_sink="learnable"), "attn_sink off_by_one": dict(attn_sink="off_by_one"),
    "track_max_logit": dict(track_max_logit=True),
}


def bench_fields(args: argparse.Namespace) -> None:
    """Median training-step seconds of the default job's model with each of FIELDS, and the ratio to default."""
    dev, vocab, batch, seq = args.device, 8192, 8, 256
    steps = {}
    for name, overrides in FIELDS.items():
        overrides = dict(overrides)
        track = overrides.pop("track_max_logit", False)
        torch.manual_seed(0)
        model = Transformer(ModelConfig.preset("llama", vocab_size=vocab, dim=256, n_layers=4, n_heads=8,
                                               max_seq_len=seq, **overrides)).to(dev)
        for layer in model.layers:
            layer.attn.track_max_logit = track
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        amp = torch.autocast(dev, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

        def step(model=model, opt=opt, amp=amp) -> None:
            x = torch.randint(0, vocab, (batch, seq + 1), device=dev)
            with amp:
                loss = model(x[:, :-1], targets=x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps[name] = step
    times: dict[str, list[float]] = {name: [] for name in steps}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for name, step in steps.items():
            sync(dev)
            t = time.perf_counter()
            step()
            sync(dev)
            if rnd:
                times[name].append(time.perf_counter() - t)
    base = statistics.median(times["default"])
    for name, t in times.items():
        print(f"{name:24s} {statistics.median(t):.3f} s/step  ×{statistics.median(t) / base:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--shapes", nargs="+", default=["8x8x8x256x32", "4x8x2x512x64", "1x16x4x1024x64"],
                    help="BxHxKxTxD: batch, query heads, KV heads, sequence, head dim")
    ap.add_argument("--doc-len", type=int, default=0, help="mean document length: a dense document mask")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--fields", action="store_true", help="time training steps with each field instead")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {args.device}, {args.dtype}, {torch.get_num_threads()} threads", flush=True)
    if args.fields:
        return bench_fields(args)
    for shape in args.shapes:
        bench_shape(tuple(int(n) for n in shape.split("x")), args)


if __name__ == "__main__":
    main()

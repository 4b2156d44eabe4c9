"""What one job of the grid measures: a training run, or one at-init measurement, at one seed.

Runs use the pieces `normlab fit` uses — `model.Transformer`, `training.optim` (AdamW groups, warm-up and
cosine schedule, clip 1.0), `model.probes` — in a plain single-process loop: the grid is many tiny models, where
Lightning's per-run start-up would cost more than the training. Results are plain dicts (they cross processes
under `--jobs`).
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from model import Transformer
from model.norms import Norm
from model.probes import record
from training.optim import OptimConfig, build_optimizer, plain_update
from training.stats import training_outcome
from training.study.grid import AtInit, Scale, Train

PROBE_TAGS = ("resid/", "attn/max_logit/", "attn/saturated_frac/")


def _probe(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss on `tokens` [B, T+1] with the stream and attention probes recorded (all batch rows)."""
    with record(model, attn_batch=tokens.shape[0]) as rec:
        loss = model(tokens[:, :-1], targets=tokens[:, 1:])
    return loss, {k: v for k, v in rec.scalars().items() if k.startswith(PROBE_TAGS)}


def norm_inputs(model: Transformer, tokens: torch.Tensor) -> dict[str, dict[str, float]]:
    """For every stream norm (block and final; not the QK-norms): the input it normalizes on `tokens`, as
    `mean_over_rms` (token mean of |mean(x)| / RMS(x)) and `ln_vs_rms` (token mean of ‖LN(x) − RMSNorm(x)‖ /
    ‖RMSNorm(x)‖, both without gains, eps 1e-5) — how far from zero-mean the real activations are, and what
    centring changes on them."""
    seen: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def pre(module, args, kwargs):
            x = args[0]
            residual = kwargs.get("residual", args[1] if len(args) > 1 else None)
            seen[name] = (x if residual is None else x + residual).detach().double()
        return pre

    handles = [m.register_forward_pre_hook(hook(n), with_kwargs=True) for n, m in model.named_modules()
               if isinstance(m, Norm) and not n.endswith(("q_norm", "k_norm"))]
    try:
        with torch.no_grad():
            model(tokens[:, :-1])
    finally:
        for h in handles:
            h.remove()
    out = {}
    for name, x in seen.items():
        mean, ms = x.mean(-1), x.pow(2).mean(-1)
        rms_n = x / (ms[..., None] + 1e-5).sqrt()
        ln = (x - mean[..., None]) / (x.var(-1, unbiased=False)[..., None] + 1e-5).sqrt()
        out[name] = {"mean_over_rms": (mean.abs() / ms.sqrt().clamp_min(1e-30)).mean().item(),
                     "ln_vs_rms": ((ln - rms_n).norm(dim=-1) / rms_n.norm(dim=-1)).mean().item()}
    return out


def qk_gains(model: Transformer) -> dict[str, float]:
    """Per layer, RMS of the q and k norm gains (`qk/gain_q/L{l}`, `qk/gain_k/L{l}`): QK-norm bounds a logit by
    √D·|g_q|·|g_k|, and the gains are not weight-decayed, so the bound can drift."""
    out = {}
    for l, block in enumerate(model.layers):
        for which in ("q", "k"):
            norm = getattr(block.attn, f"{which}_norm", None)
            if norm is not None and getattr(norm, "weight", None) is not None:
                out[f"qk/gain_{which}/L{l}"] = norm.weight.detach().pow(2).mean().sqrt().item()
    return out


def train_run(spec: Train, seed: int, scale: Scale, batches: Iterator[torch.Tensor], vocab_size: int) -> dict:
    """Train `spec` at `seed`; probes at step 0 (the init audit), half-way, and after the last step."""
    torch.manual_seed(seed)
    model = Transformer(spec.arch.config(scale, vocab_size))
    optim = OptimConfig(lr=spec.lr, min_lr=spec.lr / 10, warmup_steps=spec.steps // 10 if spec.warmup else 0,
                        weight_decay=0.1)
    opt, schedule = build_optimizer(model, optim, spec.steps)
    out: dict[str, Any] = {"losses": [], "probes": {}, "diverged_at": None}
    start = time.perf_counter()
    for step in range(spec.steps + 1):
        tokens = next(batches)
        if step == spec.steps:  # a measurement only: the trained model's probes
            loss, out["probes"][step] = _probe(model, tokens)
            out["norm_inputs"] = norm_inputs(model, tokens)
            break
        if step in (0, spec.steps // 2):
            loss, out["probes"][step] = _probe(model, tokens)
        else:
            loss = model(tokens[:, :-1], targets=tokens[:, 1:])
        if not torch.isfinite(loss):
            out["diverged_at"] = step
            break
        plain_update(model, opt, schedule, loss)
        out["losses"].append(loss.item())
    out["gains"] = qk_gains(model)
    out["seconds"] = time.perf_counter() - start
    return out


def final_loss(result: dict) -> float:
    """Mean training loss over the last 10% of steps; +inf for a run whose loss became non-finite."""
    if result["diverged_at"] is not None:
        return math.inf
    losses = result["losses"]
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def outcome(result: dict) -> str:
    """trains / stalled / diverged (`training.stats.training_outcome`, shared with the sweeps' report)."""
    return training_outcome(result["losses"], result["diverged_at"] is not None)


def at_init(spec: AtInit, seed: int, scale: Scale, tokens: torch.Tensor, vocab_size: int) -> dict:
    """One at-init measurement of `spec` at `seed` on the real batch `tokens` [B, T+1]."""
    torch.manual_seed(seed)
    model = Transformer(spec.arch.config(scale, vocab_size))
    if spec.what == "profile":
        _, probes = _probe(model, tokens)
        return {"probes": probes}
    if spec.what == "xiong":
        model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
        return {"w2_grad": [b.mlp.down_proj.weight.grad.norm().item() for b in model.layers]}
    raise ValueError(f"unknown at-init measurement {spec.what!r}")


def toy_no_norm(d: int = 512, depth: int = 24, report: tuple[int, ...] = (1, 6, 12, 24)) -> dict[int, list[float]]:
    """The 24-random-layer toy of the no-normalization baseline, step for step: layers W ~ N(0, 1/d), a
    residual x + W·x' where x' is the raw stream (no norm) or the stream divided by its RMS (a bare RMSNorm),
    from torch.manual_seed(0). Returns {layer: [RMS seen without a norm, RMS seen with one]}."""
    torch.manual_seed(0)
    layers = [torch.randn(d, d) / d ** 0.5 for _ in range(depth)]
    x_plain = torch.randn(d)
    x_norm = x_plain.clone()
    out = {}
    for i, w in enumerate(layers, start=1):
        seen_plain, seen_norm = x_plain, x_norm / x_norm.pow(2).mean().sqrt()
        x_plain, x_norm = x_plain + w @ seen_plain, x_norm + w @ seen_norm
        if i in report:
            out[i] = [seen_plain.pow(2).mean().sqrt().item(), seen_norm.pow(2).mean().sqrt().item()]
    return out

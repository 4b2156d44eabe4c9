"""What one job of the grid measures: a training run, or one at-init measurement, at one seed.

Runs use the pieces `normlab fit` uses — `model.Transformer`, `training.optim` (AdamW groups, warm-up and
cosine schedule, clip 1.0), `model.probes` — in a plain single-process loop: the grid is many tiny models, where
Lightning's per-run start-up would cost more than the training. Results are plain dicts (they cross processes
under `--jobs`).

A seed sets both the initialization and the order of the training batches (`batches` comes from the data module
with that seed); every trained run is scored on the same held-out batches (`val`).
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from model import Transformer
from model.norms import Norm
from model.probes import record
from model.residual import Stream
from training import health_tags as T
from training.errors import UserError
from training.optim import OptimConfig, build_optimizer, plain_update
from training.stats import training_outcome
from training.study.grid import AtInit, Scale, Train

PROBE_TAGS = (T.RESIDUAL, f"{T.ATTN_MAX_LOGIT}/", f"{T.ATTN_SATURATED}/", T.OUTLIER)
UNIGRAM_ENTROPY = "unigram_entropy"  # a trained run's result: the entropy its plateau is judged against
INPUT_SCALES = (0.3, 3.0, 10.0)  # claim 18: the stream entering the middle block, multiplied by k


def build(arch, scale: Scale, vocab_size: int, seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(arch.config(scale, vocab_size))
    if arch.unit_embedding:  # rescale, not redraw: the random weights stay those of the seed
        with torch.no_grad():
            emb = model.tok_embeddings.weight
            emb.mul_(emb.pow(2).mean().rsqrt())
    return model


def _probe(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss on `tokens` [B, T+1] with the stream and attention probes recorded (all batch rows)."""
    with record(model, attn_batch=tokens.shape[0]) as rec:
        loss = model(tokens[:, :-1], targets=tokens[:, 1:])
    return loss, {k: v for k, v in rec.scalars().items() if k.startswith(PROBE_TAGS)}


def _norm_input_hooks(model: Transformer, seen: dict[str, torch.Tensor]) -> list:
    def hook(name: str):
        def pre(module, args, kwargs):
            x = args[0]
            residual = kwargs.get("residual", args[1] if len(args) > 1 else None)
            seen[name] = (x if residual is None else x + residual).detach().double()
        return pre

    return [m.register_forward_pre_hook(hook(n), with_kwargs=True) for n, m in model.named_modules()
            if isinstance(m, Norm) and not n.endswith(("q_norm", "k_norm"))]


def _stream_norm_inputs(model: Transformer, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every stream norm's input (float64) in one forward pass on `tokens` [B, T+1], by module name."""
    seen: dict[str, torch.Tensor] = {}
    handles = _norm_input_hooks(model, seen)
    try:
        with torch.no_grad():
            model(tokens[:, :-1])
    finally:
        for h in handles:
            h.remove()
    return seen


def norm_inputs(model: Transformer, tokens: torch.Tensor) -> dict[str, dict[str, float]]:
    """For every stream norm (block and final; not the QK-norms): the input it normalizes on `tokens`, as
    - `mean_over_rms`: token mean of |mean(x)| / RMS(x) (√(2/(πd)) ≈ 0.1 at d = 64 for isotropic noise);
    - `isotropy`: d·E[mean(x)²] / E[RMS(x)²] over tokens — 1 when the features are isotropic zero-mean noise,
      whatever the width; large when the tokens share a mean offset;
    - `ln_vs_rms`: token mean of ‖LN(x) − RMSNorm(x)‖ / ‖RMSNorm(x)‖, both without gains, eps 1e-5 —
    how far from zero-mean the real activations are, and what centring changes on them."""
    return _input_stats(_stream_norm_inputs(model, tokens))


def _input_stats(seen: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    out = {}
    for name, x in seen.items():
        d = x.shape[-1]
        mean, ms = x.mean(-1), x.pow(2).mean(-1)
        rms_n = x / (ms[..., None] + 1e-5).sqrt()
        ln = (x - mean[..., None]) / (x.var(-1, unbiased=False)[..., None] + 1e-5).sqrt()
        out[name] = {"mean_over_rms": (mean.abs() / ms.sqrt().clamp_min(1e-30)).mean().item(),
                     "isotropy": (d * mean.pow(2).mean() / ms.mean().clamp_min(1e-300)).item(),
                     "ln_vs_rms": ((ln - rms_n).norm(dim=-1) / rms_n.norm(dim=-1)).mean().item()}
    return out


def dim_spread(model: Transformer, tokens: torch.Tensor) -> float:
    """log(largest / median per-dimension RMS) of the final norm's input over the tokens of `tokens` (claim 19:
    "some dimensions grow large, others stay small"); NaN for a model without a final norm."""
    return _spread(_stream_norm_inputs(model, tokens))


def _spread(seen: dict[str, torch.Tensor]) -> float:
    if "norm" not in seen:  # no final norm
        return math.nan
    x = seen["norm"].reshape(-1, seen["norm"].shape[-1])
    per_dim = x.pow(2).mean(0).sqrt()
    return math.log(per_dim.max().item() / per_dim.median().clamp_min(1e-300).item())


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


def _writers(model: Transformer) -> list[torch.Tensor]:
    """Per block, the two matrices that write to the stream (attention's o_proj, the MLP's down_proj)."""
    return [w for b in model.layers for w in (b.attn.o_proj.weight, b.mlp.down_proj.weight)]


def val_loss(model: Transformer, val: Sequence[torch.Tensor]) -> float:
    """Mean loss over the held-out batches (+inf when non-finite)."""
    with torch.no_grad():
        loss = statistics.fmean(model(t[:, :-1], targets=t[:, 1:]).item() for t in val)
    return loss if math.isfinite(loss) else math.inf


def block_ablation(model: Transformer, val: Sequence[torch.Tensor]) -> list[float]:
    """Per block l, the held-out loss with block l skipped (its output replaced by its input): against the
    intact model's, how much the trained model needs that block (Sun et al. 2025's layer-pruning measure of
    "barely felt")."""
    out = []
    for block in model.layers:
        handle = block.register_forward_hook(lambda module, args, output: args[0])
        try:
            out.append(val_loss(model, val))
        finally:
            handle.remove()
    return out


def input_scaling(model: Transformer, val: Sequence[torch.Tensor]) -> dict[float, float]:
    """Per k in INPUT_SCALES, the held-out loss with the stream entering the middle block multiplied by k
    (claim 18: a block "handed an input ten times larger")."""
    block = model.layers[len(model.layers) // 2]
    out = {}
    for k in INPUT_SCALES:
        def scale(module, args, k=k):
            return (Stream(args[0].value() * k), *args[1:])
        handle = block.register_forward_pre_hook(scale)
        try:
            out[k] = val_loss(model, val)
        finally:
            handle.remove()
    return out


def train_run(spec: Train, seed: int, scale: Scale, batches: Iterator[torch.Tensor], val: Sequence[torch.Tensor],
              vocab_size: int) -> dict:
    """Train `spec` at `seed` on `batches`; probes at step 0 (the init audit), half-way, and after the last step,
    then the held-out measurements of the trained model."""
    model = build(spec.arch, scale, vocab_size, seed)
    optim = OptimConfig(lr=spec.lr, min_lr=spec.lr / 10, warmup_steps=round(spec.steps * spec.warmup),
                        weight_decay=0.1)
    opt, schedule = build_optimizer(model, optim, spec.steps)
    w0 = [w.detach().clone() for w in _writers(model)]
    out: dict[str, Any] = {"losses": [], "probes": {}, "diverged_at": None}
    start = time.perf_counter()
    for step in range(spec.steps + 1):
        tokens = next(batches)
        if step == spec.steps:  # a measurement only: the trained model's probes
            loss, out["probes"][step] = _probe(model, tokens)
            seen = _stream_norm_inputs(model, tokens)  # one forward pass for both
            out["norm_inputs"], out["dim_spread"] = _input_stats(seen), _spread(seen)
            break
        if step in (0, spec.steps // 2):
            loss, out["probes"][step] = _probe(model, tokens)
            if step == 0:
                out["dim_spread_init"] = dim_spread(model, tokens)
        else:
            loss = model(tokens[:, :-1], targets=tokens[:, 1:])
        if not torch.isfinite(loss):
            out["diverged_at"] = step
            break
        plain_update(model, opt, schedule, loss, clip=1.0 if spec.clip else math.inf)
        out["losses"].append(loss.item())
    out["seconds"] = time.perf_counter() - start
    out["gains"] = qk_gains(model)
    head = model.output.weight if model.output is not None else model.tok_embeddings.weight
    out["head_rms"] = head.detach().pow(2).mean().sqrt().item()
    out["drift"] = [((w.detach() - w_0).norm() / w_0.norm()).item() for w, w_0 in zip(_writers(model), w0,
                                                                                       strict=True)]
    out["val_loss"] = math.inf if out["diverged_at"] is not None else val_loss(model, val)
    if math.isfinite(out["val_loss"]):
        out["input_scaling"] = input_scaling(model, val)
        if spec.ablate:
            out["ablation"] = block_ablation(model, val)
    return out


def final_loss(result: dict) -> float:
    """The trained model's held-out loss; +inf for a run that diverged (`diverged`) — a finite loss of 10⁶ is a
    divergence, not a number to average."""
    return math.inf if diverged(result) else result["val_loss"]


def initial_loss(result: dict) -> float:
    """The loss at the first step (the untrained model's)."""
    return result["losses"][0] if result["losses"] else math.inf


def diverged(result: dict) -> bool:
    """`outcome` is "diverged" — decided from the losses alone (the unigram entropy plays no part in it)."""
    return training_outcome(result["losses"], result["diverged_at"] is not None, _held_out(result),
                            entropy=math.inf) == "diverged"


def _held_out(result: dict) -> float | None:
    loss = result.get("val_loss")
    return None if loss is None or math.isnan(loss) else loss


def outcome(result: dict) -> str:
    """trains / plateau / diverged (`training.stats.training_outcome`, shared with the sweeps' report): the
    held-out loss against the unigram entropy of the study's training data, which every trained run's result
    carries (`UNIGRAM_ENTROPY`, set by the runner); a run whose held-out loss ends above the untrained model's
    first loss diverged."""
    if diverged(result):
        return "diverged"
    if UNIGRAM_ENTROPY not in result:
        raise UserError("these study measurements do not record the unigram entropy of their training data (they "
                        "were written before the plateau rule): run `normlab study` again to measure them")
    return training_outcome(result["losses"], False, _held_out(result), entropy=result[UNIGRAM_ENTROPY])


def at_init(spec: AtInit, seed: int, scale: Scale, tokens: torch.Tensor, vocab_size: int) -> dict:
    """One at-init measurement of `spec` at `seed` on the real batch `tokens` [B, T+1]."""
    model = build(spec.arch, scale, vocab_size, seed)
    if spec.what == "profile":
        _, probes = _probe(model, tokens)
        return {"probes": probes}
    model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    if spec.what == "xiong":
        return {"w2_grad": [b.mlp.down_proj.weight.grad.norm().item() for b in model.layers]}
    if spec.what == "grads":
        return {"block_grad": [torch.stack([p.grad.norm() for p in b.parameters() if p.grad is not None]).norm().item()
                               for b in model.layers]}
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

"""μP (maximal-update parametrization; Yang & Hu 2021, Yang et al. 2022 "Tensor Programs V") in one place.

Under `ModelConfig.parametrization="mup"` a model of width `dim` behaves like its base model (`mup_base_width`)
scaled up so that every activation coordinate, and its change per step, stays Θ(1) as the width grows — so the
best learning rate found at the base width transfers. With m = dim / mup_base_width (Adam, the "μP with
multipliers" form the `mup` package ships):

| what                                  | standard     | mup                                     | where           |
|---------------------------------------|--------------|-----------------------------------------|-----------------|
| hidden matrices (q/k/v/o, MLP) init σ | σ            | σ / √m  (∝ 1/√fan_in)                   | init.py         |
| hidden matrices' Adam LR              | lr           | lr / m                                  | training/optim  |
| embedding, gains, α/s, g, biases      | σ, lr        | σ, lr  (vector-like: unchanged)         |                 |
| LM head (readout)                     | logits = W h | logits = W h / m  (init σ, lr: as is)   | transformer.py  |
| attention scores                      | q·k / √D     | q·k · √D₀ / D  (1/D; equal at the base) | attention.py    |

D is the head dim and D₀ the base model's (`base_head_dim`). By default the head dim grows with the width at a
fixed number of heads (as in the coordinate check): D = dim / n_heads and D₀ = mup_base_width / n_heads — where
1/D rather than 1/√D matters (q and k become correlated during training, so q·k grows like D, not √D). A model
with an explicit `head_dim` (≠ dim / n_heads) must say how its head dim scales, through `mup_base_head_dim`:
its own head_dim when the head dim stays fixed as the width grows (more heads, as in the Qwen3 family — then
√D₀/D = 1/√D at every width, nothing grows inside a head), or the base model's head dim when it grows with the
width. A default either way would be wrong for the other family, so the config refuses to guess.
`xavier` init is already fan-based and is left as is. "gains, α/s, g": norm gains (also `rmsnorm_scalar`'s one),
DyT's/Derf's α and s, the branch scales g (model/residual.py). The residual-stream fields are width-independent
constants (α, DeepNet's β, LayerNorm Scaling's 1/√l, Mix-LN's and `placement_mlp`'s placements, a numeric
`embed_scale`), so μP covers them as they are; `embed_scale: sqrt_dim` grows with the width and is refused.
Muon-driven matrices keep Muon's own shape scaling (its update has a fixed spectral norm; Bernstein's spectral
condition), so μP's 1/m LR factor applies to AdamW-driven hidden matrices only.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model.config import ModelConfig
    from model.transformer import Transformer

PARAMETRIZATIONS = ("standard", "mup")


def width_mult(cfg: ModelConfig) -> float:
    """m = dim / mup_base_width under μP; 1 under the standard parametrization."""
    return cfg.dim / cfg.mup_base_width if cfg.parametrization == "mup" else 1.0


def hidden_init_mult(cfg: ModelConfig) -> float:
    """The factor on a hidden matrix's init σ: 1/√m (fan-in scaling)."""
    return 1.0 / math.sqrt(width_mult(cfg))


def hidden_lr_mult(cfg: ModelConfig) -> float:
    """The factor on a hidden matrix's Adam learning rate: 1/m."""
    return 1.0 / width_mult(cfg)


def output_mult(cfg: ModelConfig) -> float:
    """The factor on the logits: 1/m (the readout layer's multiplier)."""
    return 1.0 / width_mult(cfg)


def base_head_dim(cfg: ModelConfig) -> float:
    """D₀, the base model's head dim: `mup_base_head_dim` when given, else mup_base_width / n_heads."""
    return cfg.mup_base_head_dim or cfg.mup_base_width / cfg.n_heads


def attn_scale(cfg: ModelConfig) -> float:
    """The attention-score scale s of softmax(q·k·s): 1/√D under standard, √D₀/D under μP. The one source:
    `Attention.scale` holds it for the attention kernels and the probes (model/probes.py) read it there."""
    if cfg.parametrization != "mup":
        return 1.0 / math.sqrt(cfg.head_dim)
    return math.sqrt(base_head_dim(cfg)) / cfg.head_dim


def to_standard(model: Transformer) -> Transformer:
    """A standard-parametrization copy of a μP `model` with the same logits: the output multiplier folded into
    the LM head, and the attention scale folded into the queries (q·k·s = (c·q)·k/√D with c = s·√D; RoPE is
    linear, so scaling q before it is the same). With QK-norm the query's norm gain carries c (the norm would undo
    a scaled projection); an l2 QK-norm's temperature already holds the whole scale, so there c = 1. The model
    itself is not changed; a standard model is returned as it is.

    Raises ValueError for tied embeddings (the head is the embedding there: scaling it would change the input)
    and for an offset or absent (`norm_affine=False`) query-norm gain.
    """
    cfg = model.cfg
    if cfg.parametrization != "mup":
        return model
    fixed_gain = cfg.norm_offset or not cfg.norm_affine  # an offset (1 + w) gain, or none at all
    if cfg.tie_embeddings or (fixed_gain and cfg.qk_norm != "none"):
        why = "its logit multiplier would have to scale the shared embedding" if cfg.tie_embeddings else \
            "the attention scale cannot be folded into an offset (1 + w) or weightless query norm"
        raise ValueError(f"this μP model cannot be written as a standard one ({why}); export with --format "
                         "safetensors to keep normlab's own format")
    with torch.device("meta"):  # type(model): the Transformer class, without importing model.transformer here
        out = type(model)(cfg.replace(parametrization="standard"))
    out.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)
    out = out.to(model.head_weight.device)
    c = model.layers[0].attn.scale / out.layers[0].attn.scale  # 1 when an l2 QK-norm's temperature holds the scale
    with torch.no_grad():
        out.output.weight.copy_(model.output.weight * output_mult(cfg))
        for layer_out, layer in zip(out.layers, model.layers, strict=True):
            q_owner = layer.attn.q_norm if cfg.qk_norm != "none" else layer.attn.q_proj
            target = layer_out.attn.q_norm if cfg.qk_norm != "none" else layer_out.attn.q_proj
            for name, p in q_owner.named_parameters(recurse=False):
                getattr(target, name).copy_(p * c)
    return out

"""The checks behind `ModelConfig`'s errors: each is one line naming the field and its value, and the valid values."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from model.norms import NORM_SITES, NORMS
from model.residual import BRANCH_SCALES, PLACEMENTS

if TYPE_CHECKING:
    from model.config import ModelConfig


def check_choice(name: str, value: Any, valid: tuple) -> None:
    if value not in valid:
        raise ValueError(f"ModelConfig.{name}={value!r} is not valid; choose one of {list(valid)}")


def is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_positive(value: Any) -> bool:
    return is_real(value) and value > 0


def check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"ModelConfig.{name}={value!r} must be a positive integer")


def check_dyt_alpha(cfg: ModelConfig) -> None:
    alpha = cfg.dyt_alpha
    values = alpha.values() if isinstance(alpha, dict) else [alpha]
    if (isinstance(alpha, dict) and set(alpha) != set(NORM_SITES)) or not all(is_positive(v) for v in values):
        raise ValueError(f"ModelConfig.dyt_alpha={alpha!r} must be a positive number or a mapping of each of "
                         f"{list(NORM_SITES)} to one (a per-location α₀)")


def check_stream(cfg: ModelConfig) -> None:
    """The residual-stream and embedding fields (model/residual.py, model/transformer.py)."""
    if cfg.placement_mlp is not None:
        check_choice("placement_mlp", cfg.placement_mlp, tuple(PLACEMENTS))
    check_choice("branch_scale", cfg.branch_scale, BRANCH_SCALES)
    for name, word in (("residual_scale", "deepnorm"), ("embed_scale", "sqrt_dim")):
        value = getattr(cfg, name)
        if value != word and not is_positive(value):
            raise ValueError(f"ModelConfig.{name}={value!r} is not valid; give a positive number or {word!r}")
    if not is_real(cfg.branch_scale_init) or not math.isfinite(cfg.branch_scale_init):
        raise ValueError(f"ModelConfig.branch_scale_init={cfg.branch_scale_init!r} must be a finite number")
    if not is_real(cfg.mix_ln) or not 0 <= cfg.mix_ln < 1:
        raise ValueError(f"ModelConfig.mix_ln={cfg.mix_ln!r} must be a fraction in [0, 1) (0: off; Mix-LN: 0.25)")
    if cfg.mix_ln and not cfg.n_post_layers:
        raise ValueError(f"ModelConfig.mix_ln={cfg.mix_ln} puts ⌊{cfg.mix_ln}·{cfg.n_layers}⌋ = 0 layers in "
                         f"post-norm; use 0 (off) or at least 1/n_layers = {1 / cfg.n_layers:.4g}")
    pre_normed = [name for name, placement in PLACEMENTS.items() if "norm_in" in placement.norms]
    used = {name for layer in range(cfg.n_layers) for name in cfg.sublayer_placements(layer)}
    if cfg.norm_depth_scale and not used & set(pre_normed):
        raise ValueError("ModelConfig.norm_depth_scale=True scales the pre-norm output (norm_in), and no sublayer "
                         f"of this model has one; use a placement with a pre-norm: {pre_normed}")
    if cfg.parametrization == "mup" and cfg.embed_scale == "sqrt_dim":
        raise ValueError("ModelConfig.embed_scale='sqrt_dim' grows the embeddings with the width, which "
                         "parametrization='mup' keeps Θ(1); give a number (a width-independent multiplier)")


def check_attention(cfg: ModelConfig, qk_norms: tuple, qk_norm_kinds: tuple, gates: tuple, sinks: tuple) -> None:
    """The attention fields (model/attention.py, model/qk_norm.py, model/softmax.py)."""
    check_choice("qk_norm", cfg.qk_norm, qk_norms)
    check_choice("qk_norm_kind", cfg.qk_norm_kind, qk_norm_kinds)
    check_choice("sub_norm", cfg.sub_norm, (False, True))
    check_choice("attn_gate", cfg.attn_gate, gates)
    check_choice("attn_sink", cfg.attn_sink, sinks)
    if cfg.qk_norm_kind != "auto" and cfg.qk_norm == "none":
        raise ValueError(f"ModelConfig.qk_norm_kind={cfg.qk_norm_kind!r} needs a QK-norm: set qk_norm to one "
                         f"of {list(qk_norms[1:])}")
    if cfg.qk_norm_kind == "l2" and cfg.qk_norm != "head":
        raise ValueError(f"ModelConfig.qk_norm_kind='l2' normalizes each head's q and k to unit length, so it "
                         f"needs qk_norm='head' (got qk_norm={cfg.qk_norm!r}; a unit-length value would "
                         "shrink by √head_dim)")
    if cfg.sub_norm and cfg.norm == "none":
        raise ValueError("ModelConfig.sub_norm=True uses the block norm's kind, and norm='none' is the "
                         f"identity: choose norm from {[n for n in NORMS if n != 'none']}")

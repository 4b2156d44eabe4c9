"""QK-norm: which of q, k (and v) are normalized, over which width, by which norm — applied before RoPE.

Scope (`ModelConfig.qk_norm`, `QK_NORMS`):

- `head`: per head over head_dim, as in Qwen3 and Gemma 3. The q and k gains are shared by all heads, so GQA
  needs nothing special.
- `full`: over the whole projection (H·D for q, K·D for k), as in OLMo 2.
- `qkv`: `head` plus the same per-head norm on the values. This is HybridNorm's QKV-norm (Zhuo et al. 2025,
  arXiv 2503.04598). The scope is per head: the authors' code (BryceZhuo/HybridNorm, `dense_model/olmo/model.py`,
  `use_query_norm` / `use_key_norm` / `use_value_norm`) builds each of the three norms over d_model / n_heads
  and applies them after the head split, before RoPE.

Kind (`ModelConfig.qk_norm_kind`, `QK_NORM_KINDS`):

- `auto`: the block norm (`ModelConfig.norm`), which was the only choice before this field existed. With
  `norm: dyt` the QK-norm is DyT, and `norm: none` makes it the identity.
- `rmsnorm` / `layernorm`: that norm whatever the block norm is, so a DyT or norm-free model can still have an
  RMSNorm QK-norm.
- `l2`: QKNorm (Henry et al. 2020, "Query-Key Normalization for Transformers", Findings of EMNLP). Per head, q
  and k are scaled to unit length, and the logit g·q̂·k̂ uses a learned scalar g per layer in place of the score
  scale. `L2Norm` computes q̂ as x/rms(x)/√D with RMSNorm's eps. g starts at √D, so at step 0 the logit is
  √D·cos(q, k). That is exactly Llama 4's QK-norm: transformers' `Llama4TextL2Norm` is a weightless RMSNorm
  x/rms(x) on q and k followed by the usual 1/√D, so (√D q̂)·(√D k̂)/√D. It is also a unit-gain RMSNorm
  QK-norm, so `rmsnorm` and `l2` start from the same model and differ only in what is learned: per-channel
  gains, or one temperature. Henry et al. start g at log₂(L² − L), L being the 97.5th-percentile training
  length; normlab does not use that start, so that step 0 matches Llama 4.

  A unit-length q·k is a cosine, which is bounded whatever the width. So under μP the temperature replaces μP's
  √D₀/D score scale as well: the score scale is 1 and g is a width-independent scalar with no μP multiplier.
  An L2 norm on the values would shrink them by √D, so `l2` is for q and k only (`head`).

Parameter kinds: a module whose parameter is neither a matrix nor a norm gain declares it in a class attribute
`param_kinds: dict[str, str]`, mapping the parameter's attribute name to an optimizer-group kind. An instance
whose attribute is None (the key side of `L2Norm`) has no such parameter. The temperature's kind is
`qk_temperature`: it must never reach Muon, and a researcher can give it its own LR and no weight decay.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from model.mup import attn_scale
from model.norms import NORMS, build_norm

if TYPE_CHECKING:
    from model.config import ModelConfig

QK_NORMS = ("none", "head", "full", "qkv")
QK_NORM_KINDS = ("auto", "rmsnorm", "layernorm", "l2")


class L2Norm(nn.Module):
    """x/‖x‖ over the last dim [..., dim], computed in fp32 as x/rms(x)/√dim with RMSNorm's eps (Llama 4). With
    `temperature` (the query side of QKNorm) the result is also multiplied by a learnable scalar g, which
    starts at √dim."""

    param_kinds = {"temperature": "qk_temperature"}

    def __init__(self, dim: int, eps: float, temperature: bool = False) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.temperature = nn.Parameter(torch.empty(())) if temperature else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.temperature is not None:
            nn.init.constant_(self.temperature, math.sqrt(self.dim))  # √D·cos: Llama 4's logit at step 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unit = F.rms_norm(x.float(), (self.dim,), eps=self.eps) / math.sqrt(self.dim)
        return (unit if self.temperature is None else unit * self.temperature).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, temperature={self.temperature is not None}"


def _layer(cfg: ModelConfig, dim: int, query: bool = False) -> nn.Module:
    if cfg.qk_norm_kind == "auto":
        return build_norm(cfg, dim)
    if cfg.qk_norm_kind == "l2":
        return L2Norm(dim, cfg.norm_eps, temperature=query)
    return NORMS[cfg.qk_norm_kind].from_config(cfg, dim)


def build_qk_norms(cfg: ModelConfig) -> dict[str, nn.Module]:
    """The norms `cfg.qk_norm` asks for, by attribute name: `q_norm`, `k_norm`, and for `qkv` also `v_norm`.
    Returns {} when there is no QK-norm."""
    if cfg.qk_norm == "none":
        return {}
    if cfg.qk_norm == "full":
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        return {"q_norm": _layer(cfg, q_dim, query=True), "k_norm": _layer(cfg, kv_dim)}
    norms = {"q_norm": _layer(cfg, cfg.head_dim, query=True), "k_norm": _layer(cfg, cfg.head_dim)}
    if cfg.qk_norm == "qkv":
        norms["v_norm"] = _layer(cfg, cfg.head_dim)
    return norms


def qk_norm_params(cfg: ModelConfig) -> int:
    """Parameters of one attention layer's QK-norms (for `ModelConfig.num_params`)."""
    if cfg.qk_norm == "none":
        return 0
    if cfg.qk_norm_kind == "l2":
        return 1  # the temperature
    count = NORMS[cfg.norm if cfg.qk_norm_kind == "auto" else cfg.qk_norm_kind].num_params
    if cfg.qk_norm == "full":
        return count(cfg, cfg.n_heads * cfg.head_dim) + count(cfg, cfg.kv_heads * cfg.head_dim)
    return (3 if cfg.qk_norm == "qkv" else 2) * count(cfg, cfg.head_dim)


def score_scale(cfg: ModelConfig) -> float:
    """The factor on q·k before the softmax: 1/√D, or μP's √D₀/D (`model.mup.attn_scale`). With an `l2`
    QK-norm it is 1, because the query's temperature carries the scale."""
    return 1.0 if cfg.qk_norm != "none" and cfg.qk_norm_kind == "l2" else attn_scale(cfg)

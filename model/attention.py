"""Causal self-attention with grouped-query heads, rotary positions and optional QK-norm.

Shapes: B batch, T sequence, H query heads, K key/value heads (H % K == 0), D head_dim, C = H·D.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from model.init import init_std
from model.layers import Linear
from model.norms import build_norm
from model.rope import RoPE

if TYPE_CHECKING:
    from model.config import ModelConfig


class LayerCache:
    """One layer's key/value cache for generation: preallocated [B, K, max_len, D], filled left to right."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def append(self, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values and return everything cached so far."""
        end = self.length + k_BKTD.shape[2]
        self.k[:, :, self.length:end], self.v[:, :, self.length:end] = k_BKTD, v_BKTD
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.q_proj = Linear(cfg.dim, q_dim, cfg.bias, init_std(cfg, "in", layer_id, (cfg.dim, q_dim)))
        self.k_proj = Linear(cfg.dim, kv_dim, cfg.bias, init_std(cfg, "in", layer_id, (cfg.dim, kv_dim)))
        self.v_proj = Linear(cfg.dim, kv_dim, cfg.bias, init_std(cfg, "in", layer_id, (cfg.dim, kv_dim)))
        # o_proj writes to the residual stream
        self.o_proj = Linear(q_dim, cfg.dim, cfg.bias, init_std(cfg, "out", layer_id, (q_dim, cfg.dim)))
        # QK-norm bounds the attention logits (Dehghani et al. 2023): per head over D as in Qwen3, with separate
        # Q and K gains shared by all heads (so GQA needs nothing special); or over the whole projection as in OLMo 2.
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = build_norm(cfg, cfg.head_dim), build_norm(cfg, cfg.head_dim)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = build_norm(cfg, q_dim), build_norm(cfg, kv_dim)
        self.rope = RoPE()
        self.softcap = cfg.attn_softcap

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None) -> torch.Tensor:
        """x [B, T, dim] → [B, T, dim]. cos/sin cover positions start … start+T−1 (start = cached length)."""
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":  # before the head split and before RoPE, as in OLMo 2
            q, k = self.q_norm(q), self.k_norm(k)
        q_BTHD = q.view(B, T, self.n_heads, self.head_dim)
        k_BTKD = k.view(B, T, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":  # per head, before RoPE, as in Qwen3
            q_BTHD, k_BTKD = self.q_norm(q_BTHD), self.k_norm(k_BTKD)
        q_BHTD, k_BKTD = self.rope(q_BTHD.transpose(1, 2), k_BTKD.transpose(1, 2), cos, sin)
        v_BKTD = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        mask, causal = None, True
        if cache is not None:
            start = cache.length
            k_BKTD, v_BKTD = cache.append(k_BKTD, v_BKTD)
            if start > 0:  # new queries see every cached key and the new keys up to themselves
                causal = False
                keys = torch.arange(start + T, device=x.device)
                mask = keys[None, :] <= torch.arange(start, start + T, device=x.device)[:, None]
        if self.softcap is None:
            y_BHTD = F.scaled_dot_product_attention(q_BHTD, k_BKTD, v_BKTD, attn_mask=mask, is_causal=causal,
                                                    enable_gqa=self.n_kv_heads != self.n_heads)
        else:
            y_BHTD = softcapped_attention(q_BHTD, k_BKTD, v_BKTD, mask, self.softcap)
        return self.o_proj(y_BHTD.transpose(1, 2).reshape(B, T, -1))


def softcapped_attention(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor,
                         mask_TS: torch.Tensor | None, cap: float) -> torch.Tensor:
    """Causal attention with the scores soft-capped to c · tanh(s / c) before the softmax (Gemma 2).

    SDPA has no hook between the scores and the softmax, so this is plain math attention: it materializes the
    [B, H, T, S] scores (O(T²) memory, no flash kernel) — the price of `attn_softcap`. `mask_TS`: True where a
    query may see a key; None means causal with T == S.
    """
    H, K, D = q_BHTD.shape[1], k_BKTD.shape[1], q_BHTD.shape[-1]
    k_BHSD = k_BKTD.repeat_interleave(H // K, dim=1)  # GQA: query head h reads kv head h // (H/K)
    v_BHSD = v_BKTD.repeat_interleave(H // K, dim=1)
    scores = (q_BHTD @ k_BHSD.transpose(-1, -2)).float() / math.sqrt(D)  # [B, H, T, S], SDPA's scale
    scores = cap * torch.tanh(scores / cap)
    if mask_TS is None:
        T, S = scores.shape[-2:]
        mask_TS = torch.ones(T, S, dtype=torch.bool, device=scores.device).tril()
    probs = scores.masked_fill(~mask_TS, float("-inf")).softmax(-1)
    return probs.to(v_BHSD.dtype) @ v_BHSD

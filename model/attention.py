"""Causal self-attention with grouped-query heads, rotary positions and optional QK-norm.

Shapes: B batch, T sequence, H query heads, K key/value heads (H % K == 0), D head_dim, C = H·D.

Document masking (`DocumentMask`): in a packed window each query sees only earlier keys of its own document
(block-causal). On CUDA this runs `torch.nn.attention.flex_attention` (compiled) with a block mask, which skips
the blocks of other documents; elsewhere, with `attn_softcap`, or with `NORMLAB_DOCMASK=sdpa`, it runs SDPA with a
dense boolean mask [B, 1, T, T] (on CPU: no causal fast path, measured in scripts/bench_docmask.py).
"""
from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model.init import init_std
from model.layers import Linear
from model.mup import attn_scale
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


class DocumentMask(NamedTuple):
    """Which keys each query sees in a packed window: `doc_ids` [B, T] (equal within a document), and the mask in
    the form attention runs: `dense` bool [B, 1, T, T] (True = visible) or a flex-attention `block` mask."""

    doc_ids: torch.Tensor
    dense: torch.Tensor | None
    block: Any = None

    @classmethod
    def from_positions(cls, position_ids: torch.Tensor, softcap: float | None = None) -> DocumentMask:
        """From positions [B, T] that restart at 0 where each document starts (see data.dataset)."""
        doc_ids = (position_ids == 0).cumsum(-1)
        if _use_flex(position_ids.device) and softcap is None:
            return cls(doc_ids, None, _block_mask(doc_ids))
        return cls(doc_ids, visible_keys(doc_ids)[:, None])


def visible_keys(doc_ids: torch.Tensor) -> torch.Tensor:
    """Bool [B, T, T]: query t sees key s when s ≤ t and both lie in the same document."""
    T = doc_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal


def _use_flex(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("NORMLAB_DOCMASK", "auto") != "sdpa" and _flex() is not None


@functools.cache
def _flex() -> tuple[Any, Any] | None:
    """(compiled flex_attention, create_block_mask), or None where this torch has no flex attention."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=False), create_block_mask


def _block_mask(doc_ids: torch.Tensor) -> Any:
    def block_causal(b, h, q, kv):  # flex's mask_mod: index tensors in, bool out
        return (doc_ids[b, q] == doc_ids[b, kv]) & (q >= kv)

    B, T = doc_ids.shape
    return _flex()[1](block_causal, B, None, T, T, device=doc_ids.device)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.q_proj = Linear(cfg.dim, q_dim, cfg.bias, init_std(cfg, "qk", layer_id, (cfg.dim, q_dim)))
        self.k_proj = Linear(cfg.dim, kv_dim, cfg.bias, init_std(cfg, "qk", layer_id, (cfg.dim, kv_dim)))
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
        # the score scale: 1/√D, or μP's √D₀/D (model/mup.py); the probes read it here, so they see this softmax
        self.scale = attn_scale(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache | None = None,
                doc_mask: DocumentMask | None = None) -> torch.Tensor:
        """x [B, T, dim] → [B, T, dim]. cos/sin cover positions start … start+T−1 (start = cached length), or are
        per row [B, T, D]; `doc_mask` restricts attention to each query's document (training/evaluation only)."""
        if doc_mask is not None and cache is not None:
            raise ValueError("document masking is for training and evaluation; generation with a KV cache runs "
                             "one sequence per row without it")
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
        if doc_mask is not None:
            mask, causal = doc_mask.dense, False
        y_BHTD = self._attend(q_BHTD, k_BKTD, v_BKTD, mask, causal, doc_mask)
        return self.o_proj(y_BHTD.transpose(1, 2).reshape(B, T, -1))


    def _attend(self, q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor, mask: torch.Tensor | None,
                causal: bool, doc_mask: DocumentMask | None) -> torch.Tensor:
        """[B, H, T, D] attention output: flex attention for a block mask, else SDPA, else (softcap) math."""
        gqa = self.n_kv_heads != self.n_heads
        if doc_mask is not None and doc_mask.block is not None:
            return _flex()[0](q_BHTD, k_BKTD, v_BKTD, block_mask=doc_mask.block, scale=self.scale, enable_gqa=gqa)
        if self.softcap is not None:
            return softcapped_attention(q_BHTD, k_BKTD, v_BKTD, mask, self.softcap, self.scale)
        return F.scaled_dot_product_attention(q_BHTD, k_BKTD, v_BKTD, attn_mask=mask, is_causal=causal,
                                              scale=self.scale, enable_gqa=gqa)


def softcapped_attention(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor,
                         mask_TS: torch.Tensor | None, cap: float, scale: float) -> torch.Tensor:
    """Causal attention with the scores soft-capped to c · tanh(s / c) before the softmax (Gemma 2).

    SDPA has no hook between the scores and the softmax, so this is plain math attention: it materializes the
    [B, H, T, S] scores (O(T²) memory, no flash kernel) — the price of `attn_softcap`. `mask_TS`: True where a
    query may see a key, [T, S] or [B, 1, T, S] (document masking); None means causal with T == S. `scale`: the
    score scale (`Attention.scale`).
    """
    H, K = q_BHTD.shape[1], k_BKTD.shape[1]
    k_BHSD = k_BKTD.repeat_interleave(H // K, dim=1)  # GQA: query head h reads kv head h // (H/K)
    v_BHSD = v_BKTD.repeat_interleave(H // K, dim=1)
    scores = (q_BHTD @ k_BHSD.transpose(-1, -2)).float() * scale  # [B, H, T, S]
    scores = cap * torch.tanh(scores / cap)
    if mask_TS is None:
        T, S = scores.shape[-2:]
        mask_TS = torch.ones(T, S, dtype=torch.bool, device=scores.device).tril()
    probs = scores.masked_fill(~mask_TS, float("-inf")).softmax(-1)
    return probs.to(v_BHSD.dtype) @ v_BHSD

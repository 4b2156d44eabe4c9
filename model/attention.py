"""Causal self-attention with grouped-query heads, rotary positions, and these options: QK-norm
(model/qk_norm.py), sink logits and soft-capped scores (model/softmax.py), a sub-norm before the output
projection, and an output gate.

Shapes: B batch, T sequence, H query heads, K key/value heads (H % K == 0), D head_dim, C = H·D.

    y = W_o · (σ(x W_g) ⊙ N_sub(softmax(q·k·s [+ sink]) v))       the gate and N_sub only when configured

Sub-LN (`sub_norm`; Magneto, "Foundation Transformers", Wang et al. 2022, arXiv 2210.06423) normalizes the
attention output over C before W_o, using the block norm's kind. The output gate (`attn_gate`; Qiu et al. 2025,
"Gated Attention for LLMs", arXiv 2505.06708, position G1, as in Qwen3-Next) multiplies the output by a sigmoid
of the sublayer's input x, either one gate per head (`head`, W_g: dim → H) or one per head channel
(`elementwise`, dim → C). When both are on, the norm comes first and the gate last, in the order of Qwen3-Next's
gated norm, so a gate near 0 still silences its head.

`track_max_logit = True` makes every forward store `max_logit_per_head` [H] (detached): the exact maximum of
q·k·s over the batch, the queries and the keys each query sees, after the score scale and before any soft-cap
(`model.softmax.max_logit_per_head`). QK-clip reads it. It is off by default, and then the forward runs nothing
extra.

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
from model.norms import build_norm
from model.qk_norm import build_qk_norms, score_scale
from model.rope import RoPE
from model.softmax import AttentionSink, math_attention, max_logit_per_head, sdpa_with_sink

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
        # QK-norm bounds the attention logits (Dehghani et al. 2023): q_norm, k_norm (and v_norm), model/qk_norm.py
        self.qk_norm = cfg.qk_norm
        for name, norm in build_qk_norms(cfg).items():
            setattr(self, name, norm)
        self.sub_norm = build_norm(cfg, q_dim) if cfg.sub_norm else None
        self.gate_proj = None
        if cfg.attn_gate != "none":  # a matrix like q_proj's gate rows in Qwen3-Next: role "in", N(0, σ)
            width = cfg.n_heads if cfg.attn_gate == "head" else q_dim
            self.gate_proj = Linear(cfg.dim, width, cfg.bias, init_std(cfg, "in", layer_id, (cfg.dim, width)))
        self.sink = AttentionSink(cfg.n_heads, cfg.attn_sink == "learnable") if cfg.attn_sink != "none" else None
        self.rope = RoPE()
        self.softcap = cfg.attn_softcap
        # the score scale: 1/√D, μP's √D₀/D (model/mup.py), or 1 under an l2 QK-norm, whose temperature carries it;
        # the probes read it here, so they see this softmax
        self.scale = score_scale(cfg)
        self.track_max_logit = False
        self.max_logit_per_head: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache | None = None,
                doc_mask: DocumentMask | None = None) -> torch.Tensor:
        """x [B, T, dim] → [B, T, dim]. cos/sin cover positions start … start+T−1 (start = cached length), or are
        per row [B, T, D]; `doc_mask` restricts attention to each query's document (training/evaluation only)."""
        if doc_mask is not None and cache is not None:
            raise ValueError("document masking is for training and evaluation; generation with a KV cache runs "
                             "one sequence per row without it")
        B, T, _ = x.shape
        q_BTHD, k_BTKD, v_BTKD = self._normalized_qkv(x)
        q_BHTD, k_BKTD = self.rope(q_BTHD.transpose(1, 2), k_BTKD.transpose(1, 2), cos, sin)
        v_BKTD = v_BTKD.transpose(1, 2)
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
            if mask is None and (self.sink is not None or self.track_max_logit):  # flex's block mask only
                mask = visible_keys(doc_mask.doc_ids)[:, None]
        if self.track_max_logit:
            self.max_logit_per_head = max_logit_per_head(q_BHTD, k_BKTD, self.scale, mask)
        y = self._attend(q_BHTD, k_BKTD, v_BKTD, mask, causal, doc_mask).transpose(1, 2)  # [B, T, H, D]
        if self.sub_norm is not None:  # Sub-LN: over all heads' channels, before W_o
            y = self.sub_norm(y.reshape(B, T, -1)).view(B, T, self.n_heads, self.head_dim)
        if self.gate_proj is not None:  # G1: σ(x W_g), one gate per head or per channel
            y = y * torch.sigmoid(self.gate_proj(x)).view(B, T, self.n_heads, -1)
        return self.o_proj(y.reshape(B, T, -1))

    def _normalized_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, T, H, D], k and v [B, T, K, D] from x [B, T, dim], with QK-norm applied: the one place it is,
        before RoPE (Qwen3, OLMo 2; HybridNorm's V-norm too)."""
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":  # over the whole projection, before the head split, as in OLMo 2
            q, k = self.q_norm(q), self.k_norm(k)
        q_BTHD = q.view(B, T, self.n_heads, self.head_dim)
        k_BTKD = k.view(B, T, self.n_kv_heads, self.head_dim)
        v_BTKD = v.view(B, T, self.n_kv_heads, self.head_dim)
        if self.qk_norm in ("head", "qkv"):  # per head over D, as in Qwen3
            q_BTHD, k_BTKD = self.q_norm(q_BTHD), self.k_norm(k_BTKD)
        if self.qk_norm == "qkv":  # HybridNorm's values, per head like q and k
            v_BTKD = self.v_norm(v_BTKD)
        return q_BTHD, k_BTKD, v_BTKD

    def _attend(self, q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor, mask: torch.Tensor | None,
                causal: bool, doc_mask: DocumentMask | None) -> torch.Tensor:
        """[B, H, T, D] attention output: flex attention for a block mask, else SDPA; math with a softcap; the
        sink's SDPA form with a sink (model/softmax.py)."""
        gqa = self.n_kv_heads != self.n_heads
        sink = None if self.sink is None else self.sink(q_BHTD)
        if doc_mask is not None and doc_mask.block is not None and sink is None:
            return _flex()[0](q_BHTD, k_BKTD, v_BKTD, block_mask=doc_mask.block, scale=self.scale, enable_gqa=gqa)
        if self.softcap is not None:
            return math_attention(q_BHTD, k_BKTD, v_BKTD, mask, self.scale, self.softcap, sink)
        if sink is not None:
            return sdpa_with_sink(q_BHTD, k_BKTD, v_BKTD, sink, self.scale, mask, gqa)
        return F.scaled_dot_product_attention(q_BHTD, k_BKTD, v_BKTD, attn_mask=mask, is_causal=causal,
                                              scale=self.scale, enable_gqa=gqa)

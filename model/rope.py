"""Rotary position embeddings (Su et al. 2021) in Hugging Face's rotate-half layout.

Each head's features are split into a first and a second half that rotate as pairs (i, i + D/2), as in
`transformers`' Llama, Qwen3 and OLMo 2, so their checkpoints map onto ours with no permutation. (The
interleaved layout of the original paper pairs (2i, 2i+1); mixing the two silently scrambles exported models.)
"""
from __future__ import annotations

import torch
from torch import nn


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device | None = None,
                 start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [seq_len, head_dim] (fp32) for positions start … start+seq_len-1.

    Computed per call rather than stored: it is T·D/2 multiplies, and a buffer would need re-creating for
    models built on the meta device.
    """
    pos = torch.arange(start, start + seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(pos, _inv_freq(head_dim, theta, device))
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def rope_cos_sin_at(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [B, T, head_dim] (fp32) for explicit positions [B, T] — document masking, where
    positions restart at each document of a packed window. The same values `rope_cos_sin` gives a position."""
    angles = position_ids.float()[..., None] * _inv_freq(head_dim, theta, position_ids.device)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def _inv_freq(head_dim: int, theta: float, device: torch.device | None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by position; cos/sin are [T, D] (broadcast over batch and heads) or [B, T, D]
    (per-row positions, broadcast over heads)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class RoPE(nn.Module):
    """`apply_rope` to queries and keys. A (parameter-free) module only so that a forward hook sees the q and k
    attention really uses, after RoPE: the training-health probes read softmax statistics there."""

    def forward(self, q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q_BHTD, cos, sin), apply_rope(k_BKTD, cos, sin)

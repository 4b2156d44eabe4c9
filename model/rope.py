"""Rotary position embeddings (Su et al. 2021) in Hugging Face's rotate-half layout.

Each head's features are split into a first and a second half that rotate as pairs (i, i + D/2), as in
`transformers`' Llama, Qwen3 and OLMo 2, so their checkpoints map onto ours with no permutation. (The
interleaved layout of the original paper pairs (2i, 2i+1); mixing the two silently scrambles exported models.)

Llama 3.1+ rescale the frequencies for a longer context (`RopeScaling`, Meta's `apply_scaling` in
llama-models, `transformers`' `_compute_llama3_parameters`): wavelengths longer than
original_context / low_freq_factor are divided by `factor`, those shorter than original_context /
high_freq_factor are kept, and the band between is a linear blend in original_context / wavelength.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn


class RopeScaling(NamedTuple):
    """Llama 3 RoPE scaling parameters (Hugging Face `rope_parameters` with rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device | None = None,
                 start: int = 0, scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [seq_len, head_dim] (fp32) for positions start … start+seq_len-1.

    Computed per call rather than stored: it is T·D/2 multiplies, and a buffer would need re-creating for
    models built on the meta device.
    """
    pos = torch.arange(start, start + seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq(head_dim, theta, device, scaling))
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def rope_cos_sin_at(position_ids: torch.Tensor, head_dim: int, theta: float,
                    scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [B, T, head_dim] (fp32) for explicit positions [B, T] — document masking, where
    positions restart at each document of a packed window. The same values `rope_cos_sin` gives a position."""
    angles = position_ids.float()[..., None] * inv_freq(head_dim, theta, position_ids.device, scaling)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def inv_freq(head_dim: int, theta: float, device: torch.device | None = None,
             scaling: RopeScaling | None = None) -> torch.Tensor:
    """The D/2 rotation frequencies θ^(−2i/D) (fp32), rescaled by `scaling` when given."""
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return freq
    # The same float32 operations, in the same order, as transformers' _compute_llama3_parameters.
    factor, low, high, context = scaling
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > context / low, freq / factor, freq)
    smooth = (context / wavelen - low) / (high - low)  # 0 at the long-wavelength edge, 1 at the short one
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, blended, scaled)


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

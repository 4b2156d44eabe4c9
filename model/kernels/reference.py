"""The plain-PyTorch composites: the `"torch"` backend, and the semantics every fused path must reproduce.

`cast` decides where the gain is applied below fp32 (they agree exactly in fp32):
- "llama" (Llama, Qwen3): normalize in fp32, cast to the input dtype, then multiply by the gain; the result
  dtype follows torch promotion of gain and input, as in Hugging Face's `LlamaRMSNorm`.
- "gemma" (Gemma, OLMo 2): multiply by the gain in fp32, then cast to the input dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CASTS = ("llama", "gemma")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0,
             cast: str = "llama") -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · (offset + weight), over the last dim."""
    compute = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 input
    h = x.to(compute)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return h.to(x.dtype)
    gain = weight + offset if offset else weight
    if cast == "llama":
        return gain * h.to(x.dtype)
    return (gain.to(compute) * h).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """(x − mean) / sqrt(var + eps) · weight + bias, over the last dim (the native fused op on CPU and CUDA)."""
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)

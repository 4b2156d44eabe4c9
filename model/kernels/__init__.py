"""Normalization kernels: the one entry point the model calls for every norm.

`rms_norm` and `layer_norm` pick a backend per call (see `resolve_backend`). This first version is the
plain-PyTorch reference path; the fused Triton kernels and the fast CPU path plug in behind the same
signatures.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str | None = None) -> str:
    """`NORMLAB_KERNELS` overrides the config's `kernels` field; both accept auto | triton | torch."""
    choice = os.environ.get("NORMLAB_KERNELS") or backend or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"kernels={choice!r} is not one of {BACKENDS} (set via config `kernels` or NORMLAB_KERNELS)")
    return choice


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, cast: str) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return h.to(x.dtype)
    gain = weight + offset if offset else weight
    if cast == "llama":  # normalize in fp32, cast to the input dtype, then multiply (Llama, Qwen3)
        return gain * h.to(x.dtype)
    return (gain.float() * h).to(x.dtype)  # multiply in fp32, then cast (Gemma, OLMo 2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None,
             offset: float = 0.0, cast: str = "llama", backend: str | None = None):
    """RMSNorm over the last dim. With `residual`, returns `(norm(x + residual), x + residual)`."""
    if residual is not None:
        h = x + residual
        return _rms_norm_torch(h, weight, eps, offset, cast), h
    return _rms_norm_torch(x, weight, eps, offset, cast)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None = None, backend: str | None = None):
    """LayerNorm over the last dim. With `residual`, returns `(norm(x + residual), x + residual)`."""
    if residual is not None:
        h = x + residual
        return F.layer_norm(h, h.shape[-1:], weight, bias, eps), h
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)

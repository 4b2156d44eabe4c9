"""Normalization layers, chosen by name from `NORMS`.

LayerNorm (Ba et al. 2016) centres each token's features and scales them to unit variance, then applies a
gain γ and bias β (2·d parameters). RMSNorm (Zhang & Sennrich 2019) skips the centring and divides by the
root mean square, with a gain only (d parameters). On a zero-mean vector the two are identical.

Both call `model.kernels`, which picks the fused Triton kernel, the fast CPU path or the reference.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from model.kernels import layer_norm, rms_norm

if TYPE_CHECKING:
    from model.config import ModelConfig


class Norm(nn.Module):
    """Base: normalize over the last dim. `forward(x, residual=...)` fuses the residual add when given."""

    def __init__(self, dim: int, eps: float, kernels: str = "auto") -> None:
        super().__init__()
        self.dim, self.eps, self.kernels = dim, eps, kernels

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class RMSNorm(Norm):
    """y = x / sqrt(mean(x²) + eps) · g, with g = w (or 1 + w when `offset`, as Gemma stores it).

    `cast`: "llama" normalizes in fp32, casts to the input dtype, then multiplies by the gain;
    "gemma" (also OLMo 2) multiplies in fp32, then casts. They differ only below fp32.
    """

    def __init__(self, dim: int, eps: float = 1e-5, *, offset: bool = False, cast: str = "llama",
                 bias: bool = False, kernels: str = "auto") -> None:
        super().__init__(dim, eps, kernels)
        self.offset, self.cast = offset, cast
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 0.0 if self.offset else 1.0)  # an effective gain of exactly 1

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual=residual, offset=1.0 if self.offset else 0.0,
                        cast=self.cast, backend=self.kernels)


class LayerNorm(Norm):
    """y = (x − mean(x)) / sqrt(var(x) + eps) · γ + β (β only when `bias`)."""

    def __init__(self, dim: int, eps: float = 1e-5, *, offset: bool = False, cast: str = "llama",
                 bias: bool = True, kernels: str = "auto") -> None:
        super().__init__(dim, eps, kernels)
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return layer_norm(x, self.weight, self.bias, self.eps, residual=residual, backend=self.kernels)


NORMS: dict[str, type[Norm]] = {"rmsnorm": RMSNorm, "layernorm": LayerNorm}


def build_norm(cfg: ModelConfig, dim: int | None = None) -> Norm:
    """The norm `cfg` asks for, over `dim` features (default: the model width)."""
    return NORMS[cfg.norm](dim or cfg.dim, cfg.norm_eps, offset=cfg.norm_offset, cast=cfg.norm_cast,
                           bias=cfg.bias, kernels=cfg.kernels)

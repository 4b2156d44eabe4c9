"""Normalization layers, chosen by name from `NORMS`.

LayerNorm (Ba et al. 2016) centres each token's features and scales them to unit variance, then applies a
gain γ and bias β (2·d parameters). RMSNorm (Zhang & Sennrich 2019) skips the centring and divides by the
root mean square, with a gain only (d parameters). On a zero-mean vector the two are identical.
Both call `model.kernels`, which picks the fused Triton kernel, the fast CPU path or the reference.

Two norms are plain PyTorch (no kernel; `torch.compile` fuses them where it runs): `none`, the identity (the
no-normalization baseline), and DyT (Zhu et al. 2025, "Transformers without Normalization"), an elementwise
γ · tanh(α x) + β with a learnable scalar α that replaces the per-token statistics by a squashing function.
Every norm takes `residual=` and then returns (N(x + residual), x + residual), which is how a placement
fuses the deferred residual add (model/residual.py); for the plain-PyTorch norms that is just the add.
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

    @classmethod
    def from_config(cls, cfg: ModelConfig, dim: int) -> Norm:
        return cls(dim, cfg.norm_eps, offset=cfg.norm_offset, cast=cfg.norm_cast, bias=cfg.bias, kernels=cfg.kernels)

    @staticmethod
    def num_params(cfg: ModelConfig, dim: int) -> int:
        """Parameters of one such norm over `dim` features (for `ModelConfig.num_params`)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class _ElementwiseNorm(Norm):
    """A norm without a fused kernel: `normalize(x)` in plain PyTorch, the residual add done before it."""

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.normalize(x)
        h = residual + x  # the deferred residual add the fused kernels do in the same pass
        return self.normalize(h), h


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

    @staticmethod
    def num_params(cfg: ModelConfig, dim: int) -> int:
        return dim


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

    @staticmethod
    def num_params(cfg: ModelConfig, dim: int) -> int:
        return 2 * dim if cfg.bias else dim


class Identity(_ElementwiseNorm):
    """y = x: no normalization and no parameters — the baseline every norm is compared against."""

    def __init__(self, dim: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__(dim, eps)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def num_params(cfg: ModelConfig, dim: int) -> int:
        return 0

    def extra_repr(self) -> str:
        return f"{self.dim}"


class DyT(_ElementwiseNorm):
    """Dynamic Tanh (Zhu et al. 2025): y = γ · tanh(α x) + β, α a learnable scalar, γ (`weight`) and β (`bias`)
    per feature. β is always there (the paper's form), whatever `bias` says for the linear layers.

    α starts at `alpha0` (the paper's default 0.5; it reports that LLMs want smaller values for wider models,
    and that the trained α tracks 1/std of the input). No statistics over features: it is elementwise, so it
    does not make each token's scale independent of its input's as RMSNorm/LayerNorm do.
    """

    def __init__(self, dim: int, eps: float = 1e-5, *, alpha0: float = 0.5, **_: object) -> None:
        super().__init__(dim, eps)
        self.alpha0 = alpha0
        self.alpha = nn.Parameter(torch.empty(()))
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    @classmethod
    def from_config(cls, cfg: ModelConfig, dim: int) -> Norm:
        return cls(dim, cfg.norm_eps, alpha0=cfg.dyt_alpha)

    def reset_parameters(self) -> None:
        nn.init.constant_(self.alpha, self.alpha0)
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.alpha * x) * self.weight + self.bias

    @staticmethod
    def num_params(cfg: ModelConfig, dim: int) -> int:
        return 2 * dim + 1

    def extra_repr(self) -> str:
        return f"{self.dim}, alpha0={self.alpha0}"


NORMS: dict[str, type[Norm]] = {"rmsnorm": RMSNorm, "layernorm": LayerNorm, "none": Identity, "dyt": DyT}


def build_norm(cfg: ModelConfig, dim: int | None = None) -> Norm:
    """The norm `cfg` asks for, over `dim` features (default: the model width)."""
    return NORMS[cfg.norm].from_config(cfg, dim or cfg.dim)

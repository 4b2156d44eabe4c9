"""Normalization layers, chosen by name from `NORMS`.

LayerNorm (Ba et al. 2016) centres each token's features and scales them to unit variance, then applies a
gain γ and bias β (2·d parameters). RMSNorm (Zhang & Sennrich 2019) skips the centring and divides by the
root mean square, with a gain only (d parameters). On a zero-mean vector the two are identical.
Both call `model.kernels`, which picks the fused Triton kernel, the fast CPU path or the reference.

`rmsnorm_scalar` is RMSNorm with one scalar gain per norm instead of one per feature: the Single-Scale RMSNorm
(SSNorm) of Outlier-Safe Pre-training (Park et al. 2025, arXiv 2506.19697), which removes the channel-wise gain
in which outlier features grow.

Three norms are plain PyTorch (no kernel; `torch.compile` fuses them where it runs): `none`, the identity (the
no-normalization baseline), DyT (Zhu et al. 2025, "Transformers without Normalization"), an elementwise
γ · tanh(α x) + β with a learnable scalar α that replaces the per-token statistics by a squashing function, and
its successor Derf (Chen et al. 2025, "Stronger Normalization-Free Transformers", arXiv 2512.10938),
γ · erf(α x + s) + β with a learnable scalar shift s as well.
Every norm takes `residual=` and then returns (N(x + residual), x + residual), which is how a placement
fuses the deferred residual add (model/residual.py); for the plain-PyTorch norms that is just the add.

`ModelConfig.norm_affine=False` builds every norm without its per-feature gain γ and bias β (weightless, as
modded-nanogpt and nanochat): RMSNorm and LayerNorm keep no parameter, `rmsnorm_scalar` loses its scalar too,
DyT keeps its α and Derf its α and s (their shape parameters, not an affine map).

`param_kinds` (a class attribute, {parameter attribute: kind}) names parameters that the optimizer must group by
themselves, e.g. DyT's scalar α (its own learning rate, and never a matrix optimizer such as Muon).
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

    param_kinds: dict[str, str] = {}  # {parameter attribute: optimizer kind}, for those that need their own group

    def __init__(self, dim: int, eps: float, kernels: str = "auto") -> None:
        super().__init__()
        self.dim, self.eps, self.kernels = dim, eps, kernels

    @classmethod
    def from_config(cls, cfg: ModelConfig, dim: int, where: str = "attn") -> Norm:
        """The norm `cfg` asks for over `dim` features; `where` (attn, mlp, final) matters to DyT/Derf's α₀."""
        return cls(dim, cfg.norm_eps, offset=cfg.norm_offset, cast=cfg.norm_cast, bias=cfg.bias, kernels=cfg.kernels,
                   affine=cfg.norm_affine)

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
                 bias: bool = False, kernels: str = "auto", affine: bool = True) -> None:
        super().__init__(dim, eps, kernels)
        self.offset, self.cast = offset, cast
        self.weight = nn.Parameter(torch.empty(self.gain_shape(dim))) if affine else None
        self.reset_parameters()

    @staticmethod
    def gain_shape(dim: int) -> tuple[int, ...]:
        return (dim,)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.constant_(self.weight, 0.0 if self.offset else 1.0)  # an effective gain of exactly 1

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual=residual, offset=1.0 if self.offset else 0.0,
                        cast=self.cast, backend=self.kernels)

    @staticmethod
    def num_params(cfg: ModelConfig, dim: int) -> int:
        return dim if cfg.norm_affine else 0


class ScalarRMSNorm(RMSNorm):
    """y = x / sqrt(mean(x²) + eps) · g with one scalar g per norm: Single-Scale RMSNorm (SSNorm; Park et al. 2025,
    "Outlier-Safe Pre-Training", arXiv 2506.19697; the authors' code is Flax's `RMSNorm(feature_axes=())`, g = 1 at
    init). The fused kernels normalize without a gain and g multiplies after their cast: identical in fp32; below
    it the output keeps the input's dtype whatever `cast` says (a 0-d fp32 gain does not promote a bf16 tensor)."""

    @staticmethod
    def gain_shape(dim: int) -> tuple[int, ...]:
        return ()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out = rms_norm(x, None, self.eps, residual=residual, cast=self.cast, backend=self.kernels)
        if self.weight is None:
            return out
        gain = self.weight + 1.0 if self.offset else self.weight
        return (out[0] * gain, out[1]) if residual is not None else out * gain

    @staticmethod
    def num_params(cfg: ModelConfig, dim: int) -> int:
        return 1 if cfg.norm_affine else 0


class LayerNorm(Norm):
    """y = (x − mean(x)) / sqrt(var(x) + eps) · γ + β (β only when `bias`)."""

    def __init__(self, dim: int, eps: float = 1e-5, *, offset: bool = False, cast: str = "llama",
                 bias: bool = True, kernels: str = "auto", affine: bool = True) -> None:
        super().__init__(dim, eps, kernels)
        self.weight = nn.Parameter(torch.empty(dim)) if affine else None
        self.bias = nn.Parameter(torch.empty(dim)) if bias and affine else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return layer_norm(x, self.weight, self.bias, self.eps, residual=residual, backend=self.kernels)

    @staticmethod
    def num_params(cfg: ModelConfig, dim: int) -> int:
        return (2 * dim if cfg.bias else dim) if cfg.norm_affine else 0


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


class _Pointwise(_ElementwiseNorm):
    """γ · σ(x) + β with an elementwise squashing σ that has a learnable scalar α (from `alpha0`), γ (`weight`) and
    β (`bias`) per feature; without `affine`, σ(x) alone. Subclasses give σ and call `reset_parameters`."""

    param_kinds = {"alpha": "dyt_alpha"}

    def __init__(self, dim: int, eps: float = 1e-5, *, alpha0: float = 0.5, affine: bool = True) -> None:
        super().__init__(dim, eps)
        self.alpha0 = alpha0
        self.alpha = nn.Parameter(torch.empty(()))
        self.weight = nn.Parameter(torch.empty(dim)) if affine else None
        self.bias = nn.Parameter(torch.empty(dim)) if affine else None

    @classmethod
    def from_config(cls, cfg: ModelConfig, dim: int, where: str = "attn") -> Norm:
        return cls(dim, cfg.norm_eps, alpha0=initial_alpha(cfg, where), affine=cfg.norm_affine)

    def reset_parameters(self) -> None:
        nn.init.constant_(self.alpha, self.alpha0)
        if self.weight is not None:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def squash(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        y = self.squash(x)
        return y if self.weight is None else y * self.weight + self.bias

    def extra_repr(self) -> str:
        return f"{self.dim}, alpha0={self.alpha0}"


class DyT(_Pointwise):
    """Dynamic Tanh (Zhu et al. 2025): y = γ · tanh(α x) + β, α a learnable scalar, γ (`weight`) and β (`bias`)
    per feature. β is always there (the paper's form), whatever `bias` says for the linear layers.

    α starts at `alpha0` (the paper's default 0.5; it reports that LLMs want smaller values for wider models,
    and that the trained α tracks 1/std of the input). No statistics over features: it is elementwise, so it
    does not make each token's scale independent of its input's as RMSNorm/LayerNorm do.
    """

    def __init__(self, dim: int, eps: float = 1e-5, *, alpha0: float = 0.5, affine: bool = True, **_: object) -> None:
        super().__init__(dim, eps, alpha0=alpha0, affine=affine)
        self.reset_parameters()

    def squash(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.alpha * x)

    @staticmethod
    def num_params(cfg: ModelConfig, dim: int) -> int:
        return 2 * dim + 1 if cfg.norm_affine else 1


class Derf(_Pointwise):
    """Dynamic erf (Chen et al. 2025, "Stronger Normalization-Free Transformers", arXiv 2512.10938, the DyT authors'
    successor): y = γ · erf(α x + s) + β, with learnable scalars α (from `alpha0`, per location as DyT's) and s
    (`shift`, from 0), γ = 1 and β = 0 at init, as the authors' `Dynamic_erf` (zlab-princeton/Derf). erf is
    torch's, 2Φ(√2·z) − 1 with Φ the standard normal CDF.
    """

    def __init__(self, dim: int, eps: float = 1e-5, *, alpha0: float = 0.5, affine: bool = True, **_: object) -> None:
        super().__init__(dim, eps, alpha0=alpha0, affine=affine)
        self.shift = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.zeros_(self.shift)

    def squash(self, x: torch.Tensor) -> torch.Tensor:
        return torch.erf(self.alpha * x + self.shift)

    @staticmethod
    def num_params(cfg: ModelConfig, dim: int) -> int:
        return 2 * dim + 2 if cfg.norm_affine else 2


NORMS: dict[str, type[Norm]] = {"rmsnorm": RMSNorm, "layernorm": LayerNorm, "none": Identity, "dyt": DyT,
                                 "derf": Derf, "rmsnorm_scalar": ScalarRMSNorm}
NORM_SITES = ("attn", "mlp", "final")  # where a norm sits, for a per-location α₀ (`dyt_alpha` as a mapping)


def initial_alpha(cfg: ModelConfig, where: str) -> float:
    """DyT's / Derf's α₀ for a norm at `where`: `dyt_alpha`, or its entry for `where` when it is a mapping. The
    attention sublayer's norms and QK-norm take `attn`, the MLP sublayer's `mlp`, the final and embedding norms
    `final` — the DyT authors' LLaMA recipe sets them apart (7B: attn 0.8, FFN and final 0.2; jiachenzhu/DyT
    other_tasks/LLaMA), as Derf's language-model recipe does (attn/ffn/dec α₀; zlab-princeton/Derf)."""
    return cfg.dyt_alpha[where] if isinstance(cfg.dyt_alpha, dict) else cfg.dyt_alpha


def build_norm(cfg: ModelConfig, dim: int | None = None, where: str = "attn") -> Norm:
    """The norm `cfg` asks for, over `dim` features (default: the model width), at `where` (one of NORM_SITES)."""
    return NORMS[cfg.norm].from_config(cfg, dim or cfg.dim, where)

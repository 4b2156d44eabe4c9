"""Shapes and dtypes shared by the fake (meta) functions and every fused implementation.

The forward of every fused path returns `(y, h, mean, rstd)`:
- `y`: the normalized tensor, contiguous, shaped like `x`;
- `h`: `x + residual` when a residual is fused, else an empty tensor (a custom op may not return its input);
- `mean`, `rstd`: per-row statistics for the backward (`mean` is empty for RMSNorm), fp32 (fp64 for fp64 input).
Allocating through these helpers keeps the fake and the real outputs identical by construction.
"""
from __future__ import annotations

import torch

MAX_HIDDEN = 65536  # one row is held in registers (GPU) / L1 (CPU); far above any model width we train


def norm_dtype(x: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
    """The dtype of the tensor that is normalized: `x`, or `x + residual` with torch promotion."""
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def out_dtype(h_dtype: torch.dtype, weight: torch.Tensor | None, rms: bool, gemma_cast: bool) -> torch.dtype:
    """Llama-cast RMSNorm multiplies the gain after the cast, so the result follows promotion (HF Llama)."""
    if rms and weight is not None and not gemma_cast:
        return torch.promote_types(weight.dtype, h_dtype)
    return h_dtype


def stats_dtype(h_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if h_dtype == torch.float64 else torch.float32


def check_inputs(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 residual: torch.Tensor | None) -> None:
    n = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or not 0 < n <= MAX_HIDDEN:
        raise ValueError(f"fused norms need a last dim in 1..{MAX_HIDDEN}, got shape {tuple(x.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(p.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}")


def empty_forward(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, rms: bool,
                  gemma_cast: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    h_dtype = norm_dtype(x, residual)
    y = x.new_empty(x.shape, dtype=out_dtype(h_dtype, weight, rms, gemma_cast))
    h = x.new_empty(x.shape if residual is not None else (0,), dtype=h_dtype)
    stats = stats_dtype(h_dtype)
    rstd = x.new_empty(x.shape[:-1], dtype=stats)
    mean = x.new_empty((0,) if rms else x.shape[:-1], dtype=stats)
    return y, h, mean, rstd


def empty_backward(h: torch.Tensor, weight: torch.Tensor | None,
                   bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias); a gradient whose parameter is absent is an empty tensor."""
    def like(p: torch.Tensor | None) -> torch.Tensor:
        return h.new_empty((0,)) if p is None else p.new_empty(p.shape)
    return h.new_empty(h.shape), like(weight), like(bias)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D `[rows, hidden]` view (a copy only when the rows cannot be strided), unit stride along hidden."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()

"""`torch.library` custom ops around the fused implementations, and their eager twin.

A custom op with a fake (meta) function and an autograd formula is the one integration that measured to work
under `torch.compile(fullgraph=True)` and with `torch.library.opcheck` (docs/triton_notes.md): compile treats the op as
opaque, and the backward is a second custom op so the compiled backward graph captures it too. Each
implementation (`IMPLEMENTATIONS`) gets a pair `normlab::<name>_norm_fwd` / `normlab::<name>_norm_bwd`; its
module is imported on first call, so registering the ops never imports Triton.

Eager calls skip the custom-op dispatcher's Python layers, which cost as much as a norm on the CPU shapes: the
C++ CPU RMSNorm runs its own C++ autograd function (`cpu_rms.eager`), Triton goes through `_Eager`, an
autograd.Function with the same forward, saved tensors and backward (`_setup_context`, `_backward`).
`test_compiles_with_fullgraph` checks the compiled and eager paths against each other.
"""
import importlib

import torch
from torch import Tensor

from model.kernels import common, cpu_rms

# name → module with norm_fwd(...) -> (y, h, mean, rstd) and norm_bwd(...) -> (dx, dweight, dbias)
IMPLEMENTATIONS = {"triton": "model.kernels.triton_norm", "cpu": "model.kernels.cpu_rms"}


def _implementation(name: str):
    return importlib.import_module(IMPLEMENTATIONS[name])


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, residual, _eps, offset, rms, gemma_cast = inputs
    _y, h, mean, rstd = output
    # only the normalized input (x, or the fused sum h) and the row statistics are kept
    ctx.save_for_backward(x if residual is None else h, weight, bias, mean, rstd)
    ctx.set_materialize_grads(False)  # no zero tensors for the statistics' (unused) gradients
    ctx.config = (offset, rms, gemma_cast)
    ctx.dtypes = (x.dtype, None if residual is None else residual.dtype)


def _backward(ctx, norm_bwd, dy: Tensor | None, dh: Tensor | None) -> tuple:
    """Gradients for (x, weight, bias, residual, eps, offset, rms, gemma_cast)."""
    h, weight, bias, mean, rstd = ctx.saved_tensors
    x_dtype, residual_dtype = ctx.dtypes
    fused = residual_dtype is not None
    if dy is None:  # only h was used downstream
        dy = torch.zeros_like(h)
    dx, dw, db = norm_bwd(dy, dh if fused else None, h, weight, bias, mean, rstd, *ctx.config)
    return (dx.to(x_dtype), dw if weight is not None else None, db if bias is not None else None,
            dx.to(residual_dtype) if fused else None, None, None, None, None)


def _define(name: str):
    def impl():
        return _implementation(name)

    @torch.library.custom_op(f"normlab::{name}_norm_fwd", mutates_args=())
    def forward(x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None,
                eps: float, offset: float, rms: bool, gemma_cast: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return impl().norm_fwd(x, weight, bias, residual, eps, offset, rms, gemma_cast)

    @forward.register_fake
    def _(x, weight, bias, residual, eps, offset, rms, gemma_cast):
        return common.empty_forward(x, weight, residual, rms, gemma_cast)

    @torch.library.custom_op(f"normlab::{name}_norm_bwd", mutates_args=())
    def backward_op(dy: Tensor, dh: Tensor | None, h: Tensor, weight: Tensor | None, bias: Tensor | None,
                    mean: Tensor, rstd: Tensor, offset: float, rms: bool,
                    gemma_cast: bool) -> tuple[Tensor, Tensor, Tensor]:
        return impl().norm_bwd(dy, dh, h, weight, bias, mean, rstd, offset, rms, gemma_cast)

    @backward_op.register_fake
    def _(dy, dh, h, weight, bias, mean, rstd, offset, rms, gemma_cast):
        return common.empty_backward(h, weight, bias)

    def backward(ctx, dy, dh, _dmean, _drstd):
        return _backward(ctx, backward_op, dy, dh)

    forward.register_autograd(backward, setup_context=_setup_context)
    return forward, backward_op


OPS = {name: _define(name) for name in IMPLEMENTATIONS}


class _Eager(torch.autograd.Function):
    """The custom ops' forward and backward without the custom-op dispatcher; outside `torch.compile` only."""

    @staticmethod
    def forward(ctx, name: str, *inputs):
        output = _implementation(name).norm_fwd(*inputs)
        _setup_context(ctx, inputs, output)
        ctx.name = name
        return output

    @staticmethod
    def backward(ctx, dy, dh, _dmean, _drstd):
        return None, *_backward(ctx, _implementation(ctx.name).norm_bwd, dy, dh)


def fused_norm(implementation: str, x: Tensor, weight: Tensor | None, bias: Tensor | None,
               residual: Tensor | None, eps: float, offset: float, rms: bool, gemma_cast: bool):
    """The normalized tensor, or `(normalized, x + residual)` when `residual` is given."""
    common.check_inputs(x, weight, bias, residual)
    inputs = (x, weight, bias, residual, float(eps), float(offset), rms, gemma_cast)
    if torch.compiler.is_compiling():
        y, h, _, _ = OPS[implementation][0](*inputs)
    elif implementation == "cpu":  # its autograd function is C++ (cpu_rms.cpp): no Python in the backward
        y, h = cpu_rms.eager(*inputs)
    else:
        y, h, _, _ = _Eager.apply(implementation, *inputs)
    return y if residual is None else (y, h)

"""Normalization kernels: the one entry point the model calls for every norm.

`rms_norm` and `layer_norm` pick an implementation per call from the backend (the config's `kernels` field;
the environment variable `NORMLAB_KERNELS` overrides it) and the tensor's device:
- "auto": CUDA → the Triton kernels (`triton_norm.py`; without Triton, the composite and one warning).
  CPU → RMSNorm in fp32/bf16: the fused C++ kernel (`cpu_rms.py`); everything else: the composite, whose
  LayerNorm is the natively fused `F.layer_norm`.
- "triton": the Triton kernels; on CPU tensors they run under the interpreter (`TRITON_INTERPRET=1`, tests).
- "torch": the plain composites of `reference.py`.

Under `torch.compile(fullgraph=True)` the fused paths are `torch.library` custom ops (`ops.py`), and the choice
is made once while tracing (changing `NORMLAB_KERNELS` afterwards needs a recompile).
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings

import torch

from model.kernels import cpu_rms, ops, reference
from model.kernels.common import MAX_HIDDEN
from model.kernels.reference import CASTS

BACKENDS = ("auto", "triton", "torch")

__all__ = ["BACKENDS", "CASTS", "layer_norm", "resolve_backend", "rms_norm"]


def resolve_backend(backend: str | None = None) -> str:
    """`NORMLAB_KERNELS` overrides the config's `kernels` field; both accept auto | triton | torch."""
    choice = os.environ.get("NORMLAB_KERNELS") or backend or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"kernels={choice!r} is not one of {BACKENDS} (set via config `kernels` or NORMLAB_KERNELS)")
    return choice


@functools.cache
def _triton_import_error() -> str | None:
    try:
        importlib.import_module("model.kernels.triton_norm")
    except Exception as error:  # Triton absent, too old for the kernels, or broken (e.g. no driver)
        return f"{type(error).__name__}: {error}"
    return None


@functools.cache
def _triton_on_cuda() -> bool:
    error = _triton_import_error()
    if error:
        warnings.warn(f"normlab: Triton is unavailable ({error}); CUDA norms use the PyTorch composite", stacklevel=2)
    return error is None


def _require_triton(device_type: str) -> None:
    error = _triton_import_error()
    if error:
        raise RuntimeError(f"kernels='triton' needs Triton: {error}")
    if device_type == "cpu" and not importlib.import_module("model.kernels.triton_norm").INTERPRETED:
        raise RuntimeError(
            "kernels='triton' on CPU tensors runs the Triton interpreter: set TRITON_INTERPRET=1 in the environment "
            "before triton is first imported (e.g. `TRITON_INTERPRET=1 pytest`), or use kernels='auto' or 'torch'")


@torch.compiler.assume_constant_result  # decided once while tracing: os.environ and caches stay out of graphs
def _implementation(backend: str | None, device_type: str, rms: bool, cpu_kernel_fits: bool) -> str:
    """"triton" | "cpu" | "torch" (see the table above), for rows the fused kernels can hold."""
    choice = resolve_backend(backend)
    if choice == "triton":
        _require_triton(device_type)
        return "triton"
    if choice == "torch":
        return "torch"
    if device_type == "cuda":
        return "triton" if _triton_on_cuda() else "torch"
    if device_type == "cpu" and rms and cpu_kernel_fits and cpu_rms.library() is not None:
        return "cpu"
    return "torch"  # CPU LayerNorm: F.layer_norm is natively fused there


@torch.compiler.assume_constant_result
def _forced(backend: str | None) -> bool:
    return resolve_backend(backend) != "auto"


def _choose(x: torch.Tensor, backend: str | None, rms: bool, cpu_kernel_fits: bool) -> str:
    impl = _implementation(backend, x.device.type, rms, cpu_kernel_fits)
    if impl == "torch" or x.shape[-1] <= MAX_HIDDEN or _forced(backend):
        return impl  # forced onto a fused kernel with rows too long for it: `check_inputs` says so
    return "torch"


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None,
             offset: float = 0.0, cast: str = "llama", backend: str | None = None):
    """RMSNorm over the last dim with gain `offset + weight`. With `residual`, returns
    `(norm(x + residual), x + residual)` from one fused pass. `cast`: see `reference.py`."""
    if cast not in CASTS:
        raise ValueError(f"cast={cast!r} is not one of {CASTS}")
    impl = _choose(x, backend, True, cpu_rms.supports(x, weight, residual))
    if impl != "torch":
        return ops.fused_norm(impl, x, weight, None, residual, eps, offset, rms=True, gemma_cast=cast == "gemma")
    if residual is None:
        return reference.rms_norm(x, weight, eps, offset, cast)
    h = x + residual
    return reference.rms_norm(h, weight, eps, offset, cast), h


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None = None, backend: str | None = None):
    """LayerNorm over the last dim. With `residual`, returns `(norm(x + residual), x + residual)`."""
    impl = _choose(x, backend, False, False)
    if impl != "torch":
        return ops.fused_norm(impl, x, weight, bias, residual, eps, 0.0, rms=False, gemma_cast=False)
    if residual is None:
        return reference.layer_norm(x, weight, bias, eps)
    h = x + residual
    return reference.layer_norm(h, weight, bias, eps), h

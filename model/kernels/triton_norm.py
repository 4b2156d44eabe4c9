"""Triton RMSNorm / LayerNorm, forward and backward, with the residual add fused in (imported lazily).

One forward and one backward kernel serve both norms (`IS_RMS`), with or without the fused add, gain, bias.
- Forward: each program normalizes a `[BLOCK_M, BLOCK_N]` tile (BLOCK_N ≥ hidden), several rows at once
  when rows are short (QK-norm over head_dim), and saves only rstd (and the mean for LayerNorm).
- Backward: a fixed number of programs each walk a contiguous band of rows, write dx row by row and keep
  dγ / dβ as fp32 partial sums in registers; one `sum(0)` over the `[programs, hidden]` partials finishes them
  (the Liger-Kernel / Apex layout: no atomics, deterministic).
All arithmetic is fp32 (fp64 for fp64 inputs, so `gradcheck` runs on the kernels themselves).

Written for the Triton interpreter too (docs/triton_notes.md): every load is cast to the
accumulator dtype before any arithmetic, no autotuning, no libdevice, scalars stay Python floats.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # a Triton without the interpreter: nothing here can be interpreted
    InterpretedFunction = ()

from model.kernels.common import as_rows, empty_backward, empty_forward


@triton.jit
def _div_n(s, N, ACC: tl.constexpr):
    """s / N with IEEE rounding. A GPU's fp32 `/` is approximate (~2 ulp): with it, a one-element row's
    x − mean(x) is not exactly 0, and rstd = 1/√eps blows that up. fp64 division is already exact-rounded."""
    if ACC == tl.float32:
        return tl.math.div_rn(s, s * 0 + N)
    else:
        return s / N


@triton.jit
def _norm_fwd_kernel(X, RES, W, B, Y, H, MEAN, RSTD, stride_x, stride_res, M, N, eps, offset,
                     IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     ROUND_XHAT: tl.constexpr, ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    rows = rows.to(tl.int64)
    out = rows[:, None] * N + cols[None, :]  # Y and H are contiguous
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(ACC)
    if HAS_RES:
        x += tl.load(RES + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(ACC)
        # normalize the rounded sum: it is what the caller gets back and what the backward reads
        x = x.to(H.dtype.element_ty)
        tl.store(H + out, x, mask=mask)
        x = x.to(ACC)
    if IS_RMS:
        xc = x
    else:
        mean = _div_n(tl.sum(x, axis=1), N, ACC)
        tl.store(MEAN + rows, mean, mask=row_ok)
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(_div_n(tl.sum(xc * xc, axis=1), N, ACC) + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    y = xc * rstd[:, None]
    if HAS_W:
        if ROUND_XHAT:  # Llama order: cast to the input dtype, then multiply by the gain
            y = y.to(H.dtype.element_ty).to(ACC)
        y = y * (tl.load(W + cols, mask=col_ok, other=0.0).to(ACC) + offset)[None, :]
    if HAS_B:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(ACC)[None, :]
    tl.store(Y + out, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(DY, DH, H, W, MEAN, RSTD, DX, DW_PART, DB_PART, stride_dy, stride_dh, stride_h, M, N,
                     rows_per_program, offset,
                     IS_RMS: tl.constexpr, HAS_DH: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     ROUND_XHAT: tl.constexpr, ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(ACC) + offset
    # dγ, dβ accumulate per tile position and are summed over the tile's rows once, at the end
    dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    db = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    # a while loop: the interpreter cannot `range` over a runtime bound with numpy >= 2.4
    start = pid * rows_per_program
    end = start + rows_per_program
    while start < end:
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows = rows.to(tl.int64)
        h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(ACC)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(ACC)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0).to(ACC)
        if IS_RMS:
            xhat = h * rstd[:, None]
        else:
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0).to(ACC)
            xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            g = dy * w[None, :]
            if ROUND_XHAT:  # the gain saw the input-dtype x̂ in the forward
                dw += dy * xhat.to(H.dtype.element_ty).to(ACC)
            else:
                dw += dy * xhat
        else:
            g = dy
        if HAS_B:
            db += dy
        # dx = rstd · (g − mean(g) − x̂ · mean(g · x̂)); RMSNorm has no mean(g) term
        c1 = _div_n(tl.sum(g * xhat, axis=1), N, ACC)
        if IS_RMS:
            dx = (g - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = _div_n(tl.sum(g, axis=1), N, ACC)
            dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
        if HAS_DH:  # gradient that reached the residual stream h = x + residual directly
            dx += tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(ACC)
        tl.store(DX + rows[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        start += BLOCK_M
    if HAS_W:
        tl.store(DW_PART + pid * N + cols, tl.sum(dw, axis=0), mask=col_ok)
    if HAS_B:
        tl.store(DB_PART + pid * N + cols, tl.sum(db, axis=0), mask=col_ok)


def _interpreted() -> bool:
    """True when these kernels and Triton's own jit helpers (the combine functions behind `tl.sum`) were all
    built for the interpreter: Triton reads TRITON_INTERPRET when each `@triton.jit` runs, i.e. at import."""
    jitted = (JITFunction, InterpretedFunction) if InterpretedFunction else JITFunction
    helpers = [f for f in vars(getattr(tl, "standard", tl)).values() if isinstance(f, jitted)]
    return all(isinstance(f, InterpretedFunction) for f in (_norm_fwd_kernel, _norm_bwd_kernel, *helpers))


INTERPRETED = _interpreted()

_ACC = {torch.float32: tl.float32, torch.float64: tl.float64}


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tile(m: int, n: int, elements_per_thread: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): tiles of ≥ 4K elements on a GPU, several short rows per program (QK-norm
    over head_dim), and enough warps that each thread holds `elements_per_thread` of every tile-shaped value
    (the backward keeps more of them live). Under the interpreter each program costs milliseconds whatever
    its size, so tiles are larger there."""
    block_n = triton.next_power_of_2(n)
    elements = 16384 if INTERPRETED else 4096
    block_m = max(1, min(elements // block_n, triton.next_power_of_2(m)))
    num_warps = min(max(block_m * block_n // (32 * elements_per_thread), 4), 32)
    return block_m, block_n, num_warps


def _launch_args(num_warps: int) -> dict:
    return {} if INTERPRETED else {"num_warps": num_warps}


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "the Triton norm kernels got CPU tensors but Triton was not imported in interpreter mode: set "
            "TRITON_INTERPRET=1 in the environment before anything imports triton (e.g. `TRITON_INTERPRET=1 "
            "pytest`), or use kernels='auto' / 'torch' (or NORMLAB_KERNELS) for the CPU paths")


def _device_guard(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
             residual: torch.Tensor | None, eps: float, offset: float, rms: bool, gemma_cast: bool):
    """(y, h, mean, rstd) as described in `model.kernels.common`."""
    _check_device(x)
    y, h, mean, rstd = empty_forward(x, weight, residual, rms, gemma_cast)
    x2 = as_rows(x)
    m, n = x2.shape
    if m == 0:
        return y, h, mean, rstd
    res2 = x2 if residual is None else as_rows(residual)
    block_m, block_n, num_warps = _tile(m, n, elements_per_thread=16)
    with _device_guard(x):
        _norm_fwd_kernel[(triton.cdiv(m, block_m),)](
            x2, res2, x2 if weight is None else weight, x2 if bias is None else bias, y,
            x2 if residual is None else h, rstd if rms else mean, rstd,
            x2.stride(0), res2.stride(0), m, n, eps, offset,
            IS_RMS=rms, HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None,
            ROUND_XHAT=rms and not gemma_cast, ACC=_ACC[rstd.dtype], BLOCK_M=block_m, BLOCK_N=block_n,
            **_launch_args(num_warps))
    return y, h, mean, rstd


def norm_bwd(dy: torch.Tensor, dh: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor | None,
             bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, offset: float, rms: bool,
             gemma_cast: bool):
    """(dx, dweight, dbias) for the forward above; `h` is what was normalized (x, or x + residual)."""
    _check_device(h)
    dx, dw, db = empty_backward(h, weight, bias)
    h2, dy2 = as_rows(h), as_rows(dy)
    dh2 = dy2 if dh is None else as_rows(dh)
    m, n = h2.shape
    if m == 0:
        return dx, dw.zero_(), db.zero_()
    block_m, block_n, num_warps = _tile(m, n, elements_per_thread=8)
    tiles = triton.cdiv(m, block_m)
    # persistent programs, a few per SM: each walks a band of rows, so the dγ partials stay few
    max_programs = 4 if h.device.type != "cuda" else 4 * _sm_count(h.device)
    rows_per_program = triton.cdiv(tiles, min(tiles, max_programs)) * block_m
    programs = triton.cdiv(m, rows_per_program)
    # every program writes its whole row of partials, so they need no zeroing
    dw_part, db_part = (torch.empty((programs, n) if p is not None else (0,), dtype=rstd.dtype, device=h.device)
                        for p in (weight, bias))
    with _device_guard(h):
        _norm_bwd_kernel[(programs,)](
            dy2, dh2, h2, h2 if weight is None else weight, rstd if rms else mean, rstd, dx,
            dw_part if weight is not None else rstd, db_part if bias is not None else rstd,
            dy2.stride(0), dh2.stride(0), h2.stride(0), m, n, rows_per_program, offset,
            IS_RMS=rms, HAS_DH=dh is not None, HAS_W=weight is not None, HAS_B=bias is not None,
            ROUND_XHAT=rms and not gemma_cast, ACC=_ACC[rstd.dtype], BLOCK_M=block_m, BLOCK_N=block_n,
            **_launch_args(num_warps))
    if weight is not None:
        dw.copy_(dw_part.sum(0))
    if bias is not None:
        db.copy_(db_part.sum(0))
    return dx, dw, db


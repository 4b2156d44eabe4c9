"""The fast CPU RMSNorm: one fused C++ loop per row for the forward (with the residual add) and the backward.

Why hand-written C++: on CPU, `F.rms_norm` decomposes into pow/mean/rsqrt/mul (torch 2.13). Measured on the
benchmark shape (fp32, forward+backward, 1 thread), an autograd function whose backward is a few eager ops
still makes ~6 passes over memory, and `torch.compile` (of the composite, or of a hand-written forward/backward
pair) stays ~1.3x behind the native `F.layer_norm`: Inductor computes the dγ column sum in a second pass over
x and dy. Here the backward reads h and dy once, writes dx and keeps dγ in per-thread fp32 partial sums, like
the Triton kernel (scripts/bench_norms.py compares it with the composite, `F.rms_norm`, the compiled composite
and `F.layer_norm`). The source is compiled once per machine with the system C++ compiler (~1 s; the compiler
`torch.compile` needs on CPU too) into `~/.cache/normlab/` and loaded with ctypes; without a compiler the
dispatcher falls back to the composite with one warning.

Supports fp32 and bf16 activations (residual in the same dtype), fp32 or bf16 gains, no bias.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from model.kernels.common import as_rows, empty_backward, empty_forward

_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {
struct bf16 { uint16_t bits; };

inline float load(float v) { return v; }
inline float load(bf16 v) { uint32_t u = uint32_t(v.bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline void store(float* p, float v) { *p = v; }
inline void store(bf16* p, float v) {  // round to nearest even, NaN stays NaN (as torch's conversion)
  uint32_t u; std::memcpy(&u, &v, 4);
  p->bits = v != v ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
template <typename T> inline float round_to(float v) { T t; store(&t, v); return load(t); }

// y = x̂ · (offset + w), x̂ = h · rstd, h = x (+ res). ROUND: Llama order, x̂ is cast to T before the gain.
// The flags are template parameters so that every inner loop is branch-free and vectorizes.
template <typename T, typename W, typename O, bool RES, bool ROUND>
void fwd(const T* x, const T* res, T* h, const W* w, O* y, float* rstd, int64_t rows, int64_t n, int64_t sx,
         int64_t sr, float eps, float offset, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * sx;
    float ss = 0.f;
    if (RES) {
      const T* rr = res + r * sr;
      T* hr = h + r * n;
      #pragma omp simd reduction(+:ss)
      for (int64_t i = 0; i < n; ++i) {
        const float v = round_to<T>(load(xr[i]) + load(rr[i]));  // normalize the stored (rounded) sum
        store(hr + i, v);
        ss += v * v;
      }
      xr = hr;
    } else {
      #pragma omp simd reduction(+:ss)
      for (int64_t i = 0; i < n; ++i) { const float v = load(xr[i]); ss += v * v; }
    }
    const float rs = 1.f / std::sqrt(ss / float(n) + eps);
    rstd[r] = rs;
    O* yr = y + r * n;
    #pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float xh = load(xr[i]) * rs;
      store(yr + i, (ROUND ? round_to<T>(xh) : xh) * (load(w[i]) + offset));
    }
  }
}

// dx = rstd · (g − x̂ · mean(g · x̂)) (+ dh), g = dy · (offset + w); dw as per-thread partial sums
template <typename T, typename W, typename O, bool DH, bool ROUND>
void bwd(const O* dy, const T* dh, const T* h, const W* w, const float* rstd, T* dx, float* dw_part,
         int64_t rows, int64_t n, int64_t sdy, int64_t sdh, int64_t sh, float offset, int threads) {
  #pragma omp parallel num_threads(threads)
  {
    int t = 0, nt = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    float* acc = dw_part + int64_t(t) * n;
    const int64_t per = (rows + nt - 1) / nt;
    const int64_t r0 = std::min(rows, t * per), r1 = std::min(rows, r0 + per);
    for (int64_t r = r0; r < r1; ++r) {
      const O* gr = dy + r * sdy;
      const T* hr = h + r * sh;
      const T* dhr = DH ? dh + r * sdh : nullptr;
      T* dxr = dx + r * n;
      const float rs = rstd[r];
      float c = 0.f;
      #pragma omp simd reduction(+:c)
      for (int64_t i = 0; i < n; ++i) c += load(gr[i]) * (load(w[i]) + offset) * load(hr[i]);
      c *= rs * rs / float(n);  // x̂ · mean(g · x̂) = h · rstd² · mean(g · h)
      #pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float g = load(gr[i]), hi = load(hr[i]);
        const float v = (g * (load(w[i]) + offset) - hi * c) * rs;
        store(dxr + i, DH ? v + load(dhr[i]) : v);
        const float xh = hi * rs;
        acc[i] += g * (ROUND ? round_to<T>(xh) : xh);
      }
    }
  }
}

template <typename F> void with_flags(bool a, bool b, F&& f) {  // two runtime bools → template parameters
  using yes = std::true_type; using no = std::false_type;
  if (a) { if (b) f(yes{}, yes{}); else f(yes{}, no{}); }
  else { if (b) f(no{}, yes{}); else f(no{}, no{}); }
}

template <typename F> int dispatch(int tx, int tw, int to, F&& f) {  // dtype codes: 0 = fp32, 1 = bf16
  auto on_o = [&](auto t, auto w) -> int {
    if (to == 0) { f(t, w, float{}); return 0; }
    if (to == 1) { f(t, w, bf16{}); return 0; }
    return 1;
  };
  auto on_w = [&](auto t) -> int {
    if (tw == 0) return on_o(t, float{});
    if (tw == 1) return on_o(t, bf16{});
    return 1;
  };
  if (tx == 0) return on_w(float{});
  if (tx == 1) return on_w(bf16{});
  return 1;
}
}  // namespace

extern "C" int normlab_rms_fwd(int tx, int tw, int to, const void* x, const void* res, void* h, const void* w,
                               void* y, float* rstd, int64_t rows, int64_t n, int64_t sx, int64_t sr, float eps,
                               float offset, int round_xhat, int threads) {
  return dispatch(tx, tw, to, [&](auto t, auto wt, auto o) {
    using T = decltype(t); using W = decltype(wt); using O = decltype(o);
    auto run = [&](auto has_res, auto round) {
      fwd<T, W, O, decltype(has_res)::value, decltype(round)::value>(
          static_cast<const T*>(x), static_cast<const T*>(res), static_cast<T*>(h), static_cast<const W*>(w),
          static_cast<O*>(y), rstd, rows, n, sx, sr, eps, offset, threads);
    };
    with_flags(res != nullptr, round_xhat != 0, run);
  });
}

extern "C" int normlab_rms_bwd(int th, int tw, int to, const void* dy, const void* dh, const void* h,
                               const void* w, const float* rstd, void* dx, float* dw_part, int64_t rows,
                               int64_t n, int64_t sdy, int64_t sdh, int64_t sh, float offset, int round_xhat,
                               int threads) {
  return dispatch(th, tw, to, [&](auto t, auto wt, auto o) {
    using T = decltype(t); using W = decltype(wt); using O = decltype(o);
    auto run = [&](auto has_dh, auto round) {
      bwd<T, W, O, decltype(has_dh)::value, decltype(round)::value>(
          static_cast<const O*>(dy), static_cast<const T*>(dh), static_cast<const T*>(h), static_cast<const W*>(w),
          rstd, static_cast<T*>(dx), dw_part, rows, n, sdy, sdh, sh, offset, threads);
    };
    with_flags(dh != nullptr, round_xhat != 0, run);
  });
}
"""

_CODES = {torch.float32: 0, torch.bfloat16: 1}
_FLAG_SETS = (["-march=native", "-fopenmp"], ["-fopenmp"], [])  # best first; OpenMP/-march may be missing


def supports(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None) -> bool:
    return (x.device.type == "cpu" and x.dtype in _CODES and (weight is None or weight.dtype in _CODES)
            and (residual is None or residual.dtype == x.dtype))


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "normlab"


def _machine_tag() -> str:
    """-march=native code must not run on another CPU that shares the cache directory."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join([l for l in lines if l.startswith(("model name", "flags"))][:2])
    except OSError:
        cpu = platform.processor()
    return f"{platform.machine()} {cpu}"


def _compile(compiler: str, target: Path) -> str | None:
    """Builds the library at `target` atomically (concurrent ranks may race); returns the failure, if any."""
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / "rms_norm.cpp", Path(tmp) / "rms_norm.so"
        src.write_text(_SOURCE)
        for flags in _FLAG_SETS:
            cmd = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", *flags, str(src), "-o", str(out)]
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired) as error:
                return f"{' '.join(cmd)}: {error}"
            if run.returncode == 0:
                os.replace(out, target)
                return None
            errors.append(f"{' '.join(cmd)}: {run.stderr.strip()[-500:]}")
    return "\n".join(errors)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None (with one warning) when no compiler can build them."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        warnings.warn("normlab: no C++ compiler found; CPU RMSNorm uses the slower PyTorch composite", stacklevel=2)
        return None
    key = hashlib.sha256(f"{_SOURCE}\0{compiler}\0{_machine_tag()}".encode()).hexdigest()[:16]
    target = _cache_dir() / f"rms_norm_{key}.so"
    if not target.exists():
        error = _compile(compiler, target)
        if error:
            warnings.warn(f"normlab: could not build the CPU RMSNorm kernel, using the PyTorch composite:\n{error}",
                          stacklevel=2)
            return None
    lib = ctypes.CDLL(str(target))
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.normlab_rms_fwd.argtypes = [ctypes.c_int] * 3 + [ptr] * 6 + [i64] * 4 + [f32, f32, ctypes.c_int, ctypes.c_int]
    lib.normlab_rms_bwd.argtypes = [ctypes.c_int] * 3 + [ptr] * 7 + [i64] * 5 + [f32, ctypes.c_int, ctypes.c_int]
    return lib


def _threads(numel: int) -> int:
    """Like ATen's parallel_for: ~32K elements per thread at least. A parallel region over a small tensor costs
    more than it saves, and on a busy machine its closing barrier waits for a descheduled thread (ms)."""
    return max(1, min(torch.get_num_threads(), numel // 32768))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _gain(weight: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """No weight is a gain of ones (x̂ · 1 is exact, so the output is unchanged)."""
    return torch.ones(n, device=device) if weight is None else weight.contiguous()


def norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
             residual: torch.Tensor | None, eps: float, offset: float, rms: bool, gemma_cast: bool):
    """(y, h, mean, rstd) as described in `model.kernels.common` (RMSNorm only)."""
    if not rms or bias is not None or not supports(x, weight, residual):
        raise ValueError("the CPU kernel is RMSNorm without bias, on fp32/bf16 CPU tensors")
    y, h, mean, rstd = empty_forward(x, weight, residual, rms, gemma_cast)
    x2 = as_rows(x)
    res2 = None if residual is None else as_rows(residual)
    m, n = x2.shape
    w = _gain(weight, n, x.device)
    err = library().normlab_rms_fwd(
        _CODES[x.dtype], _CODES[w.dtype], _CODES[y.dtype], _ptr(x2), _ptr(res2), _ptr(h) if res2 is not None else None,
        _ptr(w), _ptr(y), _ptr(rstd), m, n, x2.stride(0), 0 if res2 is None else res2.stride(0), eps,
        offset if weight is not None else 0.0, int(weight is not None and not gemma_cast), _threads(m * n))
    if err:
        raise RuntimeError(f"the CPU kernel has no {x.dtype}/{w.dtype}/{y.dtype} variant")
    return y, h, mean, rstd


def norm_bwd(dy: torch.Tensor, dh: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor | None,
             bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, offset: float, rms: bool,
             gemma_cast: bool):
    """(dx, dweight, dbias) for the forward above."""
    dx, dw, db = empty_backward(h, weight, bias)
    h2, dy2 = as_rows(h), as_rows(dy)
    dh2 = None if dh is None else as_rows(dh.to(h.dtype))
    m, n = h2.shape
    w = _gain(weight, n, h.device)
    threads = _threads(m * n)
    dw_part = torch.zeros(threads, n)  # zeroed: OpenMP may run fewer threads than asked
    err = library().normlab_rms_bwd(
        _CODES[h.dtype], _CODES[w.dtype], _CODES[dy.dtype], _ptr(dy2), _ptr(dh2), _ptr(h2), _ptr(w), _ptr(rstd),
        _ptr(dx), _ptr(dw_part), m, n, dy2.stride(0), 0 if dh2 is None else dh2.stride(0), h2.stride(0),
        offset if weight is not None else 0.0, int(weight is not None and not gemma_cast), threads)
    if err:
        raise RuntimeError(f"the CPU kernel has no {h.dtype}/{w.dtype}/{dy.dtype} variant")
    if weight is not None:
        dw.copy_(dw_part.sum(0))
    return dx, dw, db

"""The fast CPU RMSNorm: fused C++ loops for the forward (with the residual add) and the backward, and the
autograd function around them, compiled against libtorch and registered as PyTorch operators (`normlab_cpu::*`,
source: `cpu_rms.cpp`).

Why hand-written C++: on CPU, `F.rms_norm` decomposes into pow/mean/rsqrt/mul (torch 2.13). An autograd function
whose backward is a few eager ops still makes ~6 passes over memory, and `torch.compile` (of the composite, or of
a hand-written forward/backward pair) stays ~1.3x behind the native `F.layer_norm`: Inductor computes the dγ
column sum in a second pass over x and dy. Here the backward reads h and dy once, writes dx and keeps dγ in
per-thread fp32 partial sums, like the Triton kernel.

Why operators rather than ctypes: the loops alone were already faster than `F.layer_norm`, yet the whole call was
up to 1.8x slower at the widths normlab trains (64–512; scripts/bench_norms.py). A profile showed the gap was
the Python around the loops, paid twice per norm: a Python `autograd.Function` (its backward runs under the GIL
from the autograd engine), the ctypes call, and output allocation and argument checks in Python — ~70 µs per
forward+backward at (8, 64, 64), where the loops take ~30 µs. A C++ `torch::autograd::Function` behind the
dispatcher costs what a native op costs. (Threading was not the cause: rows this short run on one thread, as
ATen's do.)

The source is compiled once per machine, torch version and compiler with the system C++ compiler (the one
`torch.compile` needs on CPU too; ~20 s, against libtorch's headers) into `~/.cache/normlab/`; without a
compiler, or where the build fails, the dispatcher falls back to the composite with one warning.

Supports fp32 and bf16 activations (residual in the same dtype), fp32 or bf16 gains, no bias.
"""
from __future__ import annotations

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

_DTYPES = (torch.float32, torch.bfloat16)
_FLAG_SETS = (["-march=native", "-fopenmp"], ["-fopenmp"], [])  # best first; OpenMP/-march may be missing
_SOURCE = Path(__file__).with_name("cpu_rms.cpp")


def supports(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None) -> bool:
    return (x.device.type == "cpu" and x.dtype in _DTYPES and (weight is None or weight.dtype in _DTYPES)
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


def _command(compiler: str, src: Path, out: Path, flags: list[str]) -> list[str]:
    """The compile-and-link line of a libtorch operator library (what torch.utils.cpp_extension would run)."""
    from torch.utils import cpp_extension  # imported only to build: it imports setuptools

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    lib_dirs = cpp_extension.library_paths()
    return [compiler, "-O3", "-std=c++20", "-shared", "-fPIC", abi, *flags,
            *(f"-I{p}" for p in cpp_extension.include_paths()), str(src), "-o", str(out),
            *(f"-L{p}" for p in lib_dirs), *(f"-Wl,-rpath,{p}" for p in lib_dirs), "-lc10", "-ltorch_cpu"]


def _compile(compiler: str, target: Path) -> str | None:
    """Builds the library at `target` atomically (concurrent ranks may race); returns the failure, if any."""
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / "rms_norm.so"
        for flags in _FLAG_SETS:
            cmd = _command(compiler, _SOURCE, out, flags)
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            except (OSError, subprocess.TimeoutExpired) as error:
                return f"{' '.join(cmd)}: {error}"
            if run.returncode == 0:
                os.replace(out, target)
                return None
            errors.append(f"{' '.join(cmd)}: {run.stderr.strip()[-500:]}")
    return "\n".join(errors)


def _registered() -> bool:
    return hasattr(torch.ops.normlab_cpu, "rms_norm")


@functools.cache
def library():
    """The `torch.ops.normlab_cpu` operators, built on first use; None (with one warning) when no compiler can
    build them."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        warnings.warn("normlab: no C++ compiler found; CPU RMSNorm uses the slower PyTorch composite", stacklevel=2)
        return None
    tag = f"{_SOURCE.read_text()}\0{compiler}\0{_machine_tag()}\0{torch.__version__}"
    target = _cache_dir() / f"rms_norm_{hashlib.sha256(tag.encode()).hexdigest()[:16]}.so"
    if not target.exists():
        error = _compile(compiler, target)
        if error:
            warnings.warn(f"normlab: could not build the CPU RMSNorm kernel, using the PyTorch composite:\n{error}",
                          stacklevel=2)
            return None
    if not _registered():  # a second build in one process (another cache dir) must not register the ops twice
        torch.ops.load_library(str(target))
    return torch.ops.normlab_cpu


def norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
             residual: torch.Tensor | None, eps: float, offset: float, rms: bool, gemma_cast: bool):
    """(y, h, mean, rstd) as described in `model.kernels.common` (RMSNorm only)."""
    if not rms or bias is not None or not supports(x, weight, residual):
        raise ValueError("the CPU kernel is RMSNorm without bias, on fp32/bf16 CPU tensors")
    return library().rms_norm_fwd(x, weight, residual, eps, offset, gemma_cast)


def norm_bwd(dy: torch.Tensor, dh: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor | None,
             bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, offset: float, rms: bool,
             gemma_cast: bool):
    """(dx, dweight, dbias) for the forward above."""
    return library().rms_norm_bwd(dy, dh, h, weight, rstd, offset, gemma_cast)


def eager(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, residual: torch.Tensor | None,
          eps: float, offset: float, rms: bool, gemma_cast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) with the C++ autograd node: the eager path, outside `torch.compile`, for inputs `supports` took."""
    return library().rms_norm.default(x, weight, residual, eps, offset, gemma_cast)

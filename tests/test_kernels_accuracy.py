"""The fused norms against float64 math: forward and backward, for every implementation and dtype.

The reference is computed in float64 from the already-rounded inputs. An implementation passes when its error
is at most 2x the error of eager PyTorch (the `"torch"` composite) in the same dtype, plus about one ulp of the
largest value: the Triton interpreter truncates fp32 → bf16/fp16 instead of rounding (docs/triton_notes.md).

Implementations: Triton under the interpreter (CPU-only machines), Triton on CUDA (when a GPU is present; then
the interpreter cases skip, since Triton compiles for the GPU in that process), and the C++ CPU RMSNorm.
Shapes stay tiny (≤ ~100 rows): every interpreted program costs milliseconds.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # read by Triton at import: CPU-only machines interpret the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from model.kernels import cpu_rms, layer_norm, ops, rms_norm  # noqa: E402


def _triton_state() -> str:
    """"cuda", "interpreter", "absent", or "late": Triton was imported before TRITON_INTERPRET could be set
    (e.g. by `import deepspeed` in a test module collected earlier), so it cannot interpret in this process."""
    try:
        from model.kernels import triton_norm
    except ImportError:
        return "absent"
    if HAS_CUDA:
        return "cuda"
    return "interpreter" if triton_norm.INTERPRETED else "late"


TRITON = _triton_state()
# (backend, device): "auto" on CPU is the C++ RMSNorm (LayerNorm there is the native F.layer_norm: not ours)
TRITON_CPU = pytest.param(("triton", "cpu"), id="triton-interpreter", marks=pytest.mark.skipif(
    TRITON != "interpreter", reason=f"Triton state {TRITON!r}: the interpreter runs on CPU-only machines (for "
                                   "'late', see test_interpreter_cases_in_a_fresh_process)"))
TRITON_CUDA = pytest.param(("triton", "cuda"), id="triton-cuda", marks=pytest.mark.skipif(
    TRITON != "cuda", reason="needs CUDA and triton"))
CPU_KERNEL = pytest.param(("auto", "cpu"), id="cpu-kernel")
TRITON_IMPLS = [TRITON_CPU, TRITON_CUDA]
ALL_IMPLS = [*TRITON_IMPLS, CPU_KERNEL]

ULP = {torch.float32: 1e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # relative to the largest value
EPS = 1e-5


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv("NORMLAB_KERNELS", raising=False)  # it would silently replace the backend under test


def _cpu_kernel_has(kind: str, dtype: torch.dtype) -> bool:
    """The C++ CPU kernel is RMSNorm in fp32/bf16: other cases dispatch to PyTorch, so they are not collected for it."""
    return kind == "rmsnorm" and dtype in (torch.float32, torch.bfloat16)


def cases(kinds=("rmsnorm",), dtypes=(torch.float32,)) -> list:
    """(impl, kind, dtype) for every implementation that has that kind and dtype somewhere."""
    out = []
    for impl in ALL_IMPLS:
        (backend, device), = impl.values
        for kind in kinds:
            for dtype in dtypes:
                if impl.id == "cpu-kernel" and not _cpu_kernel_has(kind, dtype):
                    continue
                out.append(pytest.param((backend, device), kind, dtype, marks=impl.marks,
                                        id=f"{impl.id}-{kind}-{str(dtype).removeprefix('torch.')}"))
    return out


def _skip_unsupported(impl) -> None:
    """The one skip of a collected C++-kernel case: a machine without a compiler, where it falls back to PyTorch."""
    if impl == ("auto", "cpu") and cpu_rms.library() is None:
        pytest.skip("no C++ compiler here: the CPU RMSNorm falls back to PyTorch")


def _randn(shape, dtype, device, seed: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype).to(device)


def _norm(kind, backend, x, w, b, residual, offset, cast):
    if kind == "rmsnorm":
        return rms_norm(x, w, EPS, residual=residual, offset=offset, cast=cast, backend=backend)
    return layer_norm(x, w, b, EPS, residual=residual, backend=backend)


def _float64_norm(kind, x, w, b, residual, offset):
    h = x if residual is None else x + residual
    if kind == "rmsnorm":
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    else:
        c = h - h.mean(-1, keepdim=True)
        y = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + EPS)
    y = y if w is None else y * (w + offset)
    y = y if b is None else y + b
    return y if residual is None else (y, h)


def _run(fn, inputs, dy, dh):
    """Outputs and input gradients of fn(*inputs) for the loss <y, dy> (+ <h, dh> for the fused add)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = list(out) if isinstance(out, tuple) else [out]
    torch.autograd.backward(outs, [dy.to(outs[0].dtype)] + ([dh.to(outs[1].dtype)] if len(outs) > 1 else []))
    return outs + [t.grad for t in leaves if t is not None]


def check_against_float64(impl, kind, dtype, shape, *, weight=True, bias=False, residual=False, offset=0.0,
                          cast="llama", make_x=None):
    """Runs `impl`, eager PyTorch and float64 on the same rounded inputs; compares every output and gradient."""
    backend, device = impl
    n = shape[-1]
    x = _randn(shape, dtype, device, 0, shift=0.5 if kind == "layernorm" else 0.0)  # a mean for LayerNorm to remove
    x = make_x(x) if make_x else x
    w = _randn((n,), dtype, device, 1, scale=0.5, shift=1.0) if weight else None
    b = _randn((n,), dtype, device, 2, scale=0.5) if bias else None
    r = _randn(shape, dtype, device, 3) if residual else None
    dy, dh = (_randn(shape, dtype, device, seed).double() for seed in (4, 5))  # output gradients, rounded too
    inputs = (x, w, b, r)

    got = _run(lambda *t: _norm(kind, backend, *t, offset, cast), inputs, dy, dh)
    eager = _run(lambda *t: _norm(kind, "torch", *t, offset, cast), inputs, dy, dh)
    exact = _run(lambda *t: _float64_norm(kind, *t, offset), [None if t is None else t.double() for t in inputs],
                 dy, dh)
    names = ["y", "h"][: 1 + residual] + [f"d{name}" for name, t in zip("xwbr", inputs, strict=True) if t is not None]
    assert len(got) == len(eager) == len(exact) == len(names)
    assert got[0].dtype == eager[0].dtype and got[0].shape == x.shape
    for name, g, e, ref in zip(names, got, eager, exact, strict=True):
        err, err_eager = (g.double() - ref).abs().max().item(), (e.double() - ref).abs().max().item()
        bound = 2 * err_eager + ULP[dtype] * ref.abs().max().item()
        assert err <= bound, f"{name}: error {err:.3g} > {bound:.3g} (eager error {err_eager:.3g})"


@pytest.mark.parametrize("n", [19, 123, 3000])
@pytest.mark.parametrize("impl, kind, dtype", cases(("rmsnorm", "layernorm"),
                                                    (torch.float32, torch.float16, torch.bfloat16)))
def test_forward_and_backward_match_float64(impl, kind, dtype, n):
    _skip_unsupported(impl)
    check_against_float64(impl, kind, dtype, (4, 6, n), bias=kind == "layernorm")


@pytest.mark.parametrize("impl, kind, dtype", cases(("rmsnorm", "layernorm"), (torch.float32, torch.bfloat16)))
def test_fused_residual_add_both_outputs_and_gradients(impl, kind, dtype):
    _skip_unsupported(impl)
    check_against_float64(impl, kind, dtype, (3, 5, 123), residual=True, bias=kind == "layernorm")


@pytest.mark.parametrize("impl, kind, dtype", cases(("rmsnorm", "layernorm"), (torch.bfloat16,)))
def test_fused_add_normalizes_exactly_the_sum_it_returns(impl, kind, dtype):
    """In bf16 the sum is rounded before it is normalized, so N(x + r) is bit-identical to N(h) for the h
    returned — the value the next sublayer sees and the backward reads back."""
    _skip_unsupported(impl)
    backend, device = impl
    x, r = _randn((6, 8, 48), torch.bfloat16, device, 0), _randn((6, 8, 48), torch.bfloat16, device, 1)
    w = _randn((48,), torch.bfloat16, device, 2, shift=1.0)
    y, h = _norm(kind, backend, x, w, None, r, 0.0, "llama")
    assert torch.equal(y, _norm(kind, backend, h, w, None, None, 0.0, "llama"))


@pytest.mark.parametrize("used", ["normalized", "sum"])
@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_fused_add_with_one_output_unused(impl, used):
    """Autograd then hands the backward None for the other output's gradient."""
    _skip_unsupported(impl)
    backend, device = impl
    grads = {}
    for name in (backend, "torch"):
        x, r = (_randn((4, 24), torch.float32, device, i).requires_grad_() for i in (0, 1))
        w = _randn((24,), torch.float32, device, 2, shift=1.0).requires_grad_()
        y, h = rms_norm(x, w, EPS, residual=r, backend=name)
        ((y if used == "normalized" else h) * _randn((4, 24), torch.float32, device, 3)).sum().backward()
        grads[name] = (x.grad, r.grad, w.grad)
    for got, want in zip(grads[backend], grads["torch"], strict=True):
        torch.testing.assert_close(got, want if want is not None else torch.zeros_like(got))


@pytest.mark.parametrize("weight, offset, cast", [(True, 1.0, "llama"), (True, 1.0, "gemma"), (True, 0.0, "gemma"),
                                                  (False, 0.0, "llama")])
@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_rmsnorm_gain_variants(impl, weight, offset, cast):
    _skip_unsupported(impl)
    check_against_float64(impl, "rmsnorm", torch.bfloat16, (4, 8, 64), weight=weight, offset=offset, cast=cast)


@pytest.mark.parametrize("weight, bias", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("impl", TRITON_IMPLS)
def test_layernorm_without_weight_or_bias(impl, weight, bias):
    check_against_float64(impl, "layernorm", torch.float32, (4, 8, 48), weight=weight, bias=bias)


@pytest.mark.parametrize("shape", [(123,), (1, 123), (1, 1, 1)], ids=str)
@pytest.mark.parametrize("impl, kind, dtype", cases(("rmsnorm", "layernorm")))
def test_one_row(impl, kind, dtype, shape):
    _skip_unsupported(impl)
    check_against_float64(impl, kind, torch.float32, shape, residual=True)


NON_CONTIGUOUS = {
    "row-strided": lambda x: torch.cat([x, x[..., :7]], dim=-1)[..., : x.shape[-1]],  # rows viewed in place
    "transposed": lambda x: x.transpose(0, 1).contiguous().transpose(0, 1),  # needs a copy into rows
    "last-dim-strided": lambda x: torch.stack([x, x], dim=-1)[..., 0],
}


@pytest.mark.parametrize("layout", NON_CONTIGUOUS)
@pytest.mark.parametrize("impl, kind, dtype", cases(("rmsnorm", "layernorm")))
def test_non_contiguous_input(impl, kind, dtype, layout):
    _skip_unsupported(impl)
    assert not NON_CONTIGUOUS[layout](torch.zeros(5, 7, 40)).is_contiguous()
    check_against_float64(impl, kind, torch.float32, (5, 7, 40), residual=True, make_x=NON_CONTIGUOUS[layout])


@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_qk_norm_shapes_and_broadcast_gradient(impl):
    """[B, T, H, head_dim] per-head rows (many short rows per program), and `y.sum()`, whose gradient is an
    expanded tensor with zero strides."""
    _skip_unsupported(impl)
    backend, device = impl
    q = _randn((2, 5, 4, 16), torch.float32, device, 0).requires_grad_()
    w = _randn((16,), torch.float32, device, 1, shift=1.0).requires_grad_()
    rms_norm(q, w, EPS, backend=backend).sum().backward()
    q64, w64 = q.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    _float64_norm("rmsnorm", q64, w64, None, None, 0.0).sum().backward()
    torch.testing.assert_close(q.grad.double(), q64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_llama_cast_rounds_before_the_gain(impl):
    """bf16 input, fp32 gain. Llama: x̂ is cast to bf16, then multiplied in fp32 → fp32 output whose every
    element divided by the gain is a bf16 number. Gemma: multiplied in fp32, then cast → bf16 output."""
    _skip_unsupported(impl)
    backend, device = impl
    x = _randn((6, 64), torch.bfloat16, device, 0)
    w = _randn((64,), torch.float32, device, 1, scale=0.3, shift=1.0)
    llama = rms_norm(x, w, EPS, cast="llama", backend=backend)
    gemma = rms_norm(x, w, EPS, cast="gemma", backend=backend)
    assert llama.dtype == torch.float32 and gemma.dtype == torch.bfloat16
    xhat = llama / w
    torch.testing.assert_close(xhat, xhat.bfloat16().float(), rtol=1e-6, atol=0)
    assert not torch.equal(gemma.float() / w, (gemma.float() / w).bfloat16().float())  # the test can fail


@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_empty_batch(impl):
    _skip_unsupported(impl)
    backend, device = impl
    x = torch.zeros(0, 3, 32, device=device, requires_grad=True)
    w = torch.ones(32, device=device, requires_grad=True)
    y, h = rms_norm(x, w, EPS, residual=x, backend=backend)
    (y.sum() + h.sum()).backward()
    assert y.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("impl", TRITON_IMPLS)
def test_float64_gradcheck(impl):
    """The kernels accumulate in fp64 for fp64 inputs, so autograd's numerical check runs on them directly."""
    backend, device = impl

    def leaf(shape, seed, shift=0.0):
        return _randn(shape, torch.float64, device, seed, shift=shift).requires_grad_()

    x, r, w, b = leaf((3, 7), 0), leaf((3, 7), 1), leaf((7,), 2, shift=1.0), leaf((7,), 3)
    assert torch.autograd.gradcheck(
        lambda x, r, w: rms_norm(x, w, EPS, residual=r, offset=0.5, backend=backend), (x, r, w), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x, r, w, b: layer_norm(x, w, b, EPS, residual=r, backend=backend),
                                    (x, r, w, b), fast_mode=True)


OPCHECK_CASES = {  # (x, weight, bias, residual, eps, offset, rms, gemma_cast) built from (device, dtype)
    "rms-add-offset": lambda t: (t(6, 19), t(19), None, t(6, 19), EPS, 1.0, True, False),
    "rms-no-weight-gemma": lambda t: (t(2, 3, 19), None, None, None, EPS, 0.0, True, True),
    "layernorm-add": lambda t: (t(6, 19), t(19), t(19), t(6, 19), EPS, 0.0, False, False),
}


@pytest.mark.parametrize("impl, case", [pytest.param(impl.values[0], case, id=f"{impl.id}-{case}", marks=impl.marks)
                                        for impl in ALL_IMPLS for case in OPCHECK_CASES
                                        if impl.id != "cpu-kernel" or _cpu_kernel_has(
                                            "layernorm" if case == "layernorm-add" else "rmsnorm", torch.float32)])
def test_opcheck(impl, case):
    backend, device = impl
    _skip_unsupported(impl)
    forward, _ = ops.OPS["triton" if backend == "triton" else "cpu"]
    gen = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(shape, generator=gen).to(device).requires_grad_()

    torch.library.opcheck(forward, OPCHECK_CASES[case](t))


def test_compiles_with_fullgraph():
    """Both op families in one compiled graph (fused add + QK-style rows + LayerNorm), forward and backward,
    with symbolic sizes (dynamic=True) as a recompiled training run would get."""
    backend = "torch" if TRITON in ("absent", "late") else "triton"
    device = "cuda" if HAS_CUDA else "cpu"

    def f(x, r, w, b):
        y, h = rms_norm(x, w, EPS, residual=r, backend="auto")
        z = layer_norm(y.view(4, 6, 4, 8), w[:8], b[:8], EPS, backend=backend)
        return (z.flatten(2) * h).sum()

    args = [_randn(shape, torch.float32, device, i).requires_grad_() for i, shape in
            enumerate([(4, 6, 32), (4, 6, 32), (32,), (32,)])]
    compiled = torch.compile(f, fullgraph=True, dynamic=True)(*args)
    compiled.backward()
    grads = [a.grad for a in args]
    for a in args:
        a.grad = None
    eager = f(*args)
    eager.backward()
    torch.testing.assert_close(compiled, eager)
    for g, a in zip(grads, args, strict=True):
        torch.testing.assert_close(g, a.grad)


@pytest.mark.skipif(TRITON != "late", reason="the interpreter cases ran in this process")
def test_interpreter_cases_in_a_fresh_process():
    """Triton was imported before this module could set TRITON_INTERPRET (a full-suite run where an earlier test
    module imports DeepSpeed, which imports Triton): run the kernel tests where it is set from the start."""
    env = {k: v for k, v in os.environ.items() if k != "NORMLAB_KERNELS"} | {"TRITON_INTERPRET": "1"}
    files = [Path(__file__), Path(__file__).with_name("test_kernels_model.py")]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, files)],
                         cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]

"""Which implementation runs: the config's `kernels`, the NORMLAB_KERNELS override, and the fallbacks."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # read by Triton at import: CPU-only machines interpret the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import model.kernels as kernels  # noqa: E402
from model.kernels import cpu_rms, reference, resolve_backend, rms_norm  # noqa: E402
from model.kernels.common import MAX_HIDDEN, check_inputs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv("NORMLAB_KERNELS", raising=False)


def test_environment_overrides_the_config(monkeypatch):
    assert resolve_backend(None) == "auto" and resolve_backend("torch") == "torch"
    monkeypatch.setenv("NORMLAB_KERNELS", "triton")
    assert resolve_backend("torch") == "triton"


@pytest.mark.parametrize("bad", ["cuda", "Triton"])
def test_unknown_backend_names_the_valid_ones(monkeypatch, bad):
    with pytest.raises(ValueError, match=r"'auto', 'triton', 'torch'"):
        resolve_backend(bad)
    monkeypatch.setenv("NORMLAB_KERNELS", bad)
    with pytest.raises(ValueError, match="NORMLAB_KERNELS"):
        rms_norm(torch.ones(2, 4), None, 1e-5)


def test_unknown_cast_is_refused():
    with pytest.raises(ValueError, match="llama"):
        rms_norm(torch.ones(2, 4), None, 1e-5, cast="olmo")


@pytest.mark.parametrize("dtype, weight_dtype, residual_dtype, expected", [
    (torch.float32, torch.float32, None, "cpu"),
    (torch.bfloat16, torch.float32, torch.bfloat16, "cpu"),
    (torch.bfloat16, None, None, "cpu"),
    (torch.float16, torch.float16, None, "torch"),  # no fp16 in the C++ kernel (nor in CPU training)
    (torch.float64, torch.float64, None, "torch"),
    (torch.bfloat16, torch.float32, torch.float32, "torch"),  # mixed-dtype residual add
])
def test_auto_on_cpu_uses_the_cpu_kernel_for_rmsnorm(dtype, weight_dtype, residual_dtype, expected):
    x = torch.zeros(2, 8, dtype=dtype)
    w = None if weight_dtype is None else torch.ones(8, dtype=weight_dtype)
    r = None if residual_dtype is None else torch.zeros(2, 8, dtype=residual_dtype)
    fits = cpu_rms.supports(x, w, r)
    assert kernels._implementation("auto", "cpu", True, fits) == expected
    assert kernels._implementation("auto", "cpu", False, fits) == "torch"  # F.layer_norm is fused on CPU


def test_rows_too_long_for_the_kernels_go_to_pytorch_unless_forced():
    long_row = torch.empty(1, MAX_HIDDEN + 1)
    assert kernels._choose(long_row, "auto", True, True) == "torch"
    assert kernels._choose(long_row[:, :MAX_HIDDEN], "auto", True, True) == ("cpu" if cpu_rms.library() else "torch")
    assert kernels._forced("triton")  # so `_choose` keeps the fused kernel, whose input check refuses the row:
    with pytest.raises(ValueError, match="last dim"):
        check_inputs(long_row, None, None, None)


def test_torch_backend_is_the_reference_composite():
    x, w = torch.randn(3, 16), torch.randn(16)
    assert torch.equal(rms_norm(x, w, 1e-5, offset=1.0, cast="gemma", backend="torch"),
                       reference.rms_norm(x, w, 1e-5, 1.0, "gemma"))


def test_missing_triton_on_cuda_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(kernels, "_triton_import_error", lambda: "ImportError: No module named 'triton'")
    kernels._triton_on_cuda.cache_clear()
    try:
        with pytest.warns(UserWarning, match="Triton is unavailable") as record:
            assert kernels._implementation("auto", "cuda", True, False) == "torch"
            assert kernels._implementation("auto", "cuda", False, False) == "torch"
        assert len(record) == 1
        with pytest.raises(RuntimeError, match="needs Triton"):
            kernels._implementation("triton", "cuda", True, False)
    finally:
        kernels._triton_on_cuda.cache_clear()


def test_forced_triton_on_cpu_without_the_interpreter_says_how_to_fix_it():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NORMLAB_KERNELS")}
    code = ("import torch; from model.kernels import rms_norm; "
            "rms_norm(torch.ones(2, 8), None, 1e-5, backend='triton')")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if "needs Triton" in run.stderr:
        pytest.skip("triton is not installed")
    assert run.returncode != 0 and "TRITON_INTERPRET=1" in run.stderr, run.stderr[-2000:]


def test_model_imports_and_runs_where_triton_is_absent():
    code = ("import sys; sys.modules['triton'] = None  # any `import triton` now fails\n"
            "import torch, model\n"
            "from model.kernels import rms_norm, layer_norm\n"
            "x = torch.randn(3, 8, requires_grad=True)\n"
            "rms_norm(x, None, 1e-5).sum().backward(); layer_norm(x, None, None, 1e-5)\n"
            "try:\n    rms_norm(x, None, 1e-5, backend='triton')\n"
            "except RuntimeError as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "NORMLAB_KERNELS"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "kernels='triton' needs Triton" in run.stdout


def test_cpu_kernel_without_a_compiler_falls_back_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached there
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_rms.library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="could not build the CPU RMSNorm kernel"):
            assert cpu_rms.library() is None
        assert kernels._implementation("auto", "cpu", True, True) == "torch"
    finally:
        cpu_rms.library.cache_clear()


def test_cpu_kernel_under_inference_mode_and_its_autograd_node():
    """The C++ operator runs without autograd (inference mode: its plain CPU kernel) to the same values, and with
    autograd its backward is the C++ node, not a Python function."""
    if cpu_rms.library() is None:
        pytest.skip("no C++ compiler here: the CPU RMSNorm falls back to PyTorch")
    x, w, r = torch.randn(3, 5, 16), torch.randn(16), torch.randn(3, 5, 16)
    with torch.inference_mode():
        y, h = rms_norm(x, w, 1e-5, residual=r)
    torch.testing.assert_close(y, reference.rms_norm(x + r, w, 1e-5))
    assert torch.equal(h, x + r)
    y_grad = rms_norm(x.requires_grad_(), w, 1e-5)
    assert torch.equal(y_grad.detach(), rms_norm(x.detach(), w, 1e-5))
    assert "RMSNormFunction" in y_grad.grad_fn.name()

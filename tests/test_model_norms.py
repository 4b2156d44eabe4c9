"""The seeds' worked examples, exactly, and the LayerNorm/RMSNorm relations they state."""
import math

import pytest
import scipy.stats
import torch

from model.config import ModelConfig
from model.norms import NORMS, DyT, LayerNorm, RMSNorm, build_norm

# The articles' own numbers (rounded as they print them).
SEED_EXAMPLES = [
    # (input, LayerNorm, RMSNorm, half a unit in the last printed digit)
    ([2.0, 4.0, 6.0, 8.0], [-1.3416, -0.4472, 0.4472, 1.3416], [0.3651, 0.7303, 1.0954, 1.4606], 5e-5),
    ([12.3, -0.5, 8.1, 0.2], [1.350, -1.025, 0.571, -0.895], [1.669, -0.068, 1.099, 0.027], 5e-4),
]


@pytest.mark.parametrize("x, ln_expected, rms_expected, tol", SEED_EXAMPLES)
def test_seed_worked_examples(x, ln_expected, rms_expected, tol):
    x = torch.tensor([x])
    ln = LayerNorm(4, eps=1e-5)(x).detach()
    rms = RMSNorm(4, eps=1e-5)(x).detach()
    # The articles divide by sqrt(var) / sqrt(mean(x²)) without eps for RMSNorm; eps=1e-5 moves nothing at 4 digits.
    assert torch.allclose(ln, torch.tensor([ln_expected]), atol=tol, rtol=0)
    assert torch.allclose(rms, torch.tensor([rms_expected]), atol=tol, rtol=0)


def test_seed_intermediate_statistics():
    x = torch.tensor([12.3, -0.5, 8.1, 0.2], dtype=torch.float64)
    assert x.mean().item() == pytest.approx(5.025)
    assert x.var(unbiased=False).item() == pytest.approx(29.046875)
    assert x.pow(2).mean().sqrt().item() == pytest.approx(7.369, abs=5e-4)
    # RMSNorm keeps the offset: the mean of its output is ~0.68, LayerNorm's is 0.
    assert RMSNorm(4)(x.float()[None]).mean().item() == pytest.approx(0.68, abs=5e-3)
    assert LayerNorm(4)(x.float()[None]).mean().item() == pytest.approx(0.0, abs=1e-6)


def test_layernorm_equals_rmsnorm_on_zero_mean_input():
    x = torch.tensor([[-3.0, -1.0, 1.0, 3.0]])
    assert torch.equal(LayerNorm(4)(x), RMSNorm(4)(x))
    z = torch.randn(64, 512, dtype=torch.float64)
    z = z - z.mean(-1, keepdim=True)
    assert torch.allclose(LayerNorm(512).double()(z), RMSNorm(512).double()(z), atol=1e-12)
    # ...and differ on input with a mean, as the seeds show.
    assert not torch.allclose(LayerNorm(4)(x + 1), RMSNorm(4)(x + 1), atol=1e-3)


@pytest.mark.parametrize("d", [4, 4096])
def test_parameter_counts(d):
    assert sum(p.numel() for p in LayerNorm(d).parameters()) == 2 * d  # gain and bias
    assert sum(p.numel() for p in RMSNorm(d).parameters()) == d  # gain only


def _float64_definition(kind: str, norm, x64: torch.Tensor) -> torch.Tensor:
    """Each registered norm's formula, written out in float64 from its parameters."""
    if kind == "layernorm":
        ref = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-6)
        return ref * norm.weight.double() + norm.bias.double()
    if kind == "rmsnorm":
        return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    if kind == "rmsnorm_scalar":  # one scalar gain (SSNorm)
        assert norm.weight.shape == ()
        return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    if kind == "dyt":
        return norm.weight.double() * torch.tanh(norm.alpha.double() * x64) + norm.bias.double()
    if kind == "derf":  # γ · erf(α x + s) + β, erf(z) = 2Φ(√2 z) − 1 with Φ from scipy
        z = (norm.alpha.double() * x64 + norm.shift.double()).detach().numpy()
        return norm.weight.double() * torch.from_numpy(2 * scipy.stats.norm.cdf(math.sqrt(2) * z) - 1) \
            + norm.bias.double()
    if kind == "none":
        return x64
    raise AssertionError(f"no float64 reference for the new norm {kind!r}: add one here")


@pytest.mark.parametrize("kind", sorted(NORMS))
def test_norms_match_float64_definition(kind):
    torch.manual_seed(0)
    x = torch.randn(8, 37) * 3 + 1
    norm = NORMS[kind](37, eps=1e-6)
    with torch.no_grad():
        for p in norm.parameters():  # away from init, so a swapped or unused parameter shows
            p.normal_()
    assert torch.allclose(norm(x).double(), _float64_definition(kind, norm, x.double()), atol=1e-5)


@pytest.mark.parametrize("kind", sorted(NORMS))
def test_fused_residual_form_returns_norm_of_sum_and_sum(kind):
    """`norm(y, residual=x)` is how placements fuse the deferred add: (N(x + y), x + y) for every norm."""
    torch.manual_seed(0)
    x, y = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    norm = build_norm(ModelConfig(norm=kind, bias=True, kernels="torch"), 16)
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
    out, h = norm(y, residual=x)
    assert torch.equal(h, x + y)
    assert torch.allclose(out, norm(x + y), atol=1e-6)


def test_dyt_forward_and_gradients_match_float64():
    """DyT's output and the gradients of x, γ, β and the scalar α against float64 autograd of the formula."""
    torch.manual_seed(0)
    x = (torch.randn(4, 6, 24) * 2).requires_grad_()
    norm = DyT(24, alpha0=0.7)
    assert norm.alpha.item() == pytest.approx(0.7) and norm.alpha.shape == ()
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    upstream = torch.randn(4, 6, 24)
    (norm(x) * upstream).sum().backward()
    params64 = [t.detach().double().requires_grad_() for t in (x, norm.alpha, norm.weight, norm.bias)]
    x64, a64, g64, b64 = params64
    ref = g64 * torch.tanh(a64 * x64) + b64
    (ref * upstream.double()).sum().backward()
    assert torch.allclose(norm(x).double(), ref, atol=1e-6)
    for got, want in zip((x.grad, norm.alpha.grad, norm.weight.grad, norm.bias.grad), params64, strict=True):
        assert torch.allclose(got.double(), want.grad, rtol=1e-5, atol=1e-5)
    # α's gradient by hand: Σ upstream · γ · x · (1 − tanh²(α x))
    t = torch.tanh(a64 * x64).detach()
    by_hand = (upstream.double() * g64.detach() * x64.detach() * (1 - t * t)).sum()
    assert torch.allclose(norm.alpha.grad.double(), by_hand, rtol=1e-5)


def test_dyt_alpha_from_config_and_identity_has_no_parameters():
    cfg = ModelConfig(norm="dyt", dyt_alpha=0.25)
    assert build_norm(cfg).alpha.item() == 0.25
    assert list(build_norm(ModelConfig(norm="none")).parameters()) == []
    with pytest.raises(ValueError, match="dyt_alpha"):
        ModelConfig(norm="dyt", dyt_alpha=0.0)
    with pytest.raises(ValueError, match=r"norm='dyn'.*'dyt'"):
        ModelConfig(norm="dyn")


def test_gemma_offset_gain_starts_at_one_and_applies_one_plus_w():
    norm = RMSNorm(8, offset=True)
    assert torch.equal(norm.weight, torch.zeros(8))
    x = torch.randn(3, 8)
    assert torch.allclose(norm(x), RMSNorm(8)(x))
    with torch.no_grad():
        norm.weight.fill_(0.5)
    assert torch.allclose(norm(x), 1.5 * RMSNorm(8)(x), atol=1e-6)


def test_cast_orders_differ_only_below_fp32():
    x = torch.randn(16, 64).bfloat16()
    w = torch.randn(64)
    llama, gemma = RMSNorm(64, cast="llama"), RMSNorm(64, cast="gemma")
    with torch.no_grad():
        llama.weight.copy_(w), gemma.weight.copy_(w)
    y_llama, y_gemma = llama(x), gemma(x)
    assert y_gemma.dtype == torch.bfloat16  # multiplied in fp32, then cast to the input dtype
    assert y_llama.dtype == torch.float32  # cast to bf16 first, then promoted by the fp32 gain (as HF Llama)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(y_llama, w * ref.bfloat16())
    assert torch.equal(y_gemma, (w * ref).bfloat16())
    assert torch.equal(llama(x.float()), gemma(x.float()))


def test_build_norm_follows_config():
    cfg = ModelConfig(norm="layernorm", bias=False)
    n = build_norm(cfg)
    assert isinstance(n, LayerNorm) and n.bias is None
    assert isinstance(build_norm(ModelConfig(norm="rmsnorm"), 12), RMSNorm)

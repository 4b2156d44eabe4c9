"""The residual-stream, embedding and norm fields against their formulas, written out here in float64.

What every field shares (parameter count, gradients, causality, meta-device build, export refusal, μP) is checked
by the field matrix (tests/test_model_fields.py); this file checks each field's own math and its bad values.
"""
import math

import pytest
import scipy.stats
import torch

from model import ModelConfig, Transformer
from model.norms import NORMS, Derf, Norm, ScalarRMSNorm, build_norm
from model.probes import record
from model.residual import PLACEMENTS, Stream
from model.rope import rope_cos_sin
from tests.helpers.fields import ALPHA_BY_SITE
from tests.helpers.model import tiny_config

EPS = 1e-5  # ModelConfig.norm_eps's default


def rms64(x: torch.Tensor, gain: torch.Tensor | None = None) -> torch.Tensor:
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return y if gain is None else y * gain


def erf64(z: torch.Tensor) -> torch.Tensor:
    """erf from scipy's normal CDF, erf(z) = 2Φ(√2 z) − 1: a reference outside torch (values only, no grad)."""
    return torch.from_numpy(2 * scipy.stats.norm.cdf(math.sqrt(2) * z.detach().numpy()) - 1)


# Each placement with the stream's scalars: α on the stream term, g on the update, s on what the sublayer reads
# through its pre-norm. N maps the placement's norm names to float64 RMSNorms with its gains.
STREAM_FORMULAS = {
    "pre": lambda N, x, f, a, g, s: a * x + g * f(s * N["norm_in"](x)),
    "post": lambda N, x, f, a, g, s: N["norm_out"](a * x + g * f(x)),
    "sandwich": lambda N, x, f, a, g, s: a * x + g * N["norm_out"](f(s * N["norm_in"](x))),
    "output": lambda N, x, f, a, g, s: a * x + g * N["norm_out"](f(x)),
    "none": lambda N, x, f, a, g, s: a * x + g * f(x),
}


def _norms64(placement: torch.nn.Module) -> dict:
    return {name: (lambda x, m=module: rms64(x, m.weight)) for name, module in placement.named_children()}


def _randomize(module: torch.nn.Module, std: float = 0.5) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(std * torch.randn_like(p))


@pytest.mark.parametrize("branch", ["scalar", "vector"])
@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_placement_with_the_stream_scalars_equals_its_formula(name, branch):
    """α·x, g·update and LayerNorm Scaling's s = 1/√l (layer 3, 1-based) in each placement: the fused forward on a
    deferred stream and the formula against float64 math, gradients against the math's and finite differences."""
    assert set(STREAM_FORMULAS) == set(PLACEMENTS), "write the new placement's formula into STREAM_FORMULAS"
    torch.manual_seed(0)
    cfg = tiny_config(dim=8, n_heads=2, n_kv_heads=1, residual_scale=1.7, branch_scale=branch, branch_scale_init=0.3,
                      norm_depth_scale=True, kernels="torch")
    placement = PLACEMENTS[name](cfg, layer_id=2, sublayer="mlp").double()
    _randomize(placement)
    lin = torch.nn.Linear(8, 8).double()
    f = lambda h: torch.tanh(lin(h))  # noqa: E731
    x, pending = (torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    want = STREAM_FORMULAS[name](_norms64(placement), x + pending, f, 1.7, placement.branch_scale, 1 / math.sqrt(3))
    got = placement(Stream(x, pending), f).value()
    assert torch.allclose(got, want, atol=1e-12) and torch.allclose(placement.formula(x + pending, f), want)
    inputs = [x, pending, *placement.parameters(), *lin.parameters()]
    upstream = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((got * upstream).sum(), inputs),
                    torch.autograd.grad((want * upstream).sum(), inputs), strict=True):
        assert torch.allclose(a, b, atol=1e-10)
    assert torch.autograd.gradcheck(lambda x, p: placement(Stream(x, p), f).value(), (x, pending), fast_mode=True)


def test_probes_report_the_update_beside_the_scaled_stream():
    """The residual probes' update is what joins the stream, g·f(N(x)), not new − x (which would add (α − 1)·x)."""
    torch.manual_seed(0)
    model = Transformer(tiny_config(residual_scale=1.5, branch_scale="vector", branch_scale_init=0.5))
    tokens = torch.randint(0, 97, (2, 8))
    with record(model) as rec:
        model(tokens)
    layer, cos_sin = model.layers[0], rope_cos_sin(8, model.cfg.head_dim, model.cfg.rope_theta)
    with torch.no_grad():
        x = model.embed(tokens).double()
        update = layer.attn_res.branch_scale * layer.attn(rms64(x, layer.attn_res.norm_in.weight).float(), *cos_sin)
    want = update.double().pow(2).mean(-1).sqrt().mean().item()
    assert rec.scalars()["resid/update_rms/attn/L0"] == pytest.approx(want, rel=1e-5)


def test_deepnorm_is_deepnets_decoder_only_alpha_and_beta():
    """DeepNet (Wang et al. 2022), decoder-only: α = (2L)^¼ on the stream, β = (8L)^-¼ on the init of the value,
    output and FFN matrices (torchscale: fc1, fc2, out_proj, v_proj), q and k untouched. L = 2: α = √2, β = 1/2."""
    cfg = tiny_config(residual_scale="deepnorm", placement="post", init="xavier", dim=256, ffn_dim=256, n_heads=4,
                      n_kv_heads=4)
    assert cfg.residual_alpha == pytest.approx(math.sqrt(2)) and cfg.deepnorm_beta == pytest.approx(0.5)
    torch.manual_seed(0)
    model = Transformer(cfg)
    xavier = math.sqrt(2 / 512)  # Glorot's std of every 256 × 256 block matrix
    for layer in model.layers:
        assert layer.attn_res.residual_scale == layer.mlp_res.residual_scale == pytest.approx(math.sqrt(2))
        assert layer.attn.q_proj.std == layer.attn.k_proj.std == pytest.approx(xavier)
        for m in (layer.attn.v_proj, layer.attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            assert m.std == pytest.approx(0.5 * xavier)
            assert m.weight.std().item() == pytest.approx(0.5 * xavier, rel=0.05)


def test_layernorm_scaling_survives_the_meta_device():
    """s = 1/√l is a Python float: a meta-device build, `to_empty` and `init_weights` keep it (a buffer, even a
    non-persistent one, would come back as uninitialized memory: OLMo-core PR #698)."""
    cfg = tiny_config(n_layers=3, norm_depth_scale=True, kernels="torch")
    with torch.device("meta"):
        meta = Transformer(cfg)
    meta.to_empty(device="cpu")
    torch.manual_seed(0)
    meta.init_weights()
    torch.manual_seed(0)
    eager = Transformer(cfg)
    for l, layer in enumerate(meta.layers):
        assert layer.attn_res.depth_scale == layer.mlp_res.depth_scale == 1 / math.sqrt(l + 1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    with torch.no_grad():
        assert torch.equal(meta(tokens), eager(tokens))


def _reference_hidden(model: Transformer, tokens: torch.Tensor, names: list[tuple[str, str]],
                      depth_scaled: bool = False) -> torch.Tensor:
    """The final hidden states from STREAM_FORMULAS applied sublayer by sublayer with the placements `names` the
    test expects per layer (float64 model)."""
    cos, sin = rope_cos_sin(tokens.shape[1], model.cfg.head_dim, model.cfg.rope_theta)
    x = model.tok_embeddings(tokens)
    for l, (layer, (attn_name, mlp_name)) in enumerate(zip(model.layers, names, strict=True)):
        s = 1 / math.sqrt(l + 1) if depth_scaled else 1.0
        attn = lambda h, layer=layer: layer.attn(h, cos, sin)  # noqa: E731
        x = STREAM_FORMULAS[attn_name](_norms64(layer.attn_res), x, attn, 1.0, 1.0, s)
        x = STREAM_FORMULAS[mlp_name](_norms64(layer.mlp_res), x, layer.mlp, 1.0, 1.0, s)
    return x if model.norm is None else rms64(x, model.norm.weight)


def test_mix_ln_runs_the_lowest_layers_post_norm():
    """Mix-LN (Li et al. 2024): post-norm in the lowest ⌊αL⌋ layers, the rest pre-norm (the paper's α: 25%, and
    6.25% of LLaMA-7B's 32 layers); here with LayerNorm Scaling on the pre-norm layers."""
    assert tiny_config(n_layers=24, mix_ln=0.25).n_post_layers == 6
    assert tiny_config(n_layers=32, mix_ln=0.0625).n_post_layers == 2
    torch.manual_seed(0)
    cfg = tiny_config(n_layers=4, mix_ln=0.5, norm_depth_scale=True, kernels="torch")
    model = Transformer(cfg).double()
    _randomize(model, 0.1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    want = _reference_hidden(model, tokens, [("post", "post")] * 2 + [("pre", "pre")] * 2, depth_scaled=True)
    assert torch.allclose(model.hidden_states(tokens), want, atol=1e-10)


def test_final_norm_follows_the_top_layers_mlp_placement():
    assert Transformer(tiny_config(placement="pre", placement_mlp="post")).norm is None
    assert Transformer(tiny_config(placement="post", placement_mlp="none")).norm is not None
    assert Transformer(tiny_config(placement="post", mix_ln=0.5)).norm is None  # Mix-LN never reaches the top


HYBRIDNORM = dict(placement="post", placement_mlp="none", qk_norm="qkv")  # docs/research-options.md


def test_hybridnorm_is_the_papers_block():
    """HybridNorm (Zhuo et al. 2025; the authors' BryceZhuo/HybridNorm: attn_norm false, ffn_norm and
    ffn_residual_after_norm true): Y = X + Attn(X), with the norms inside attention; X' = N(Y) + FFN(N(Y));
    a final norm. N is the attention sublayer's post-norm here (`attn_res.norm_out`): the same computation."""
    torch.manual_seed(0)
    cfg = tiny_config(n_layers=3, kernels="torch", **HYBRIDNORM)
    model = Transformer(cfg).double()
    _randomize(model, 0.1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    cos, sin = rope_cos_sin(8, cfg.head_dim, cfg.rope_theta)
    x = model.tok_embeddings(tokens)
    for layer in model.layers:
        y = x + layer.attn(x, cos, sin)
        n = rms64(y, layer.attn_res.norm_out.weight)
        x = n + layer.mlp(n)
    assert torch.allclose(model.hidden_states(tokens), rms64(x, model.norm.weight), atol=1e-10)


@pytest.mark.parametrize("norm", ["rmsnorm", "dyt"])
def test_embedding_scale_then_norm(norm):
    """h₀ = N(s·E[t]) with s = √dim (Gemma) and N the embedding norm; DyT's α (the `final` α₀) tells the order."""
    torch.manual_seed(0)
    cfg = tiny_config(embed_norm=True, embed_scale="sqrt_dim", norm=norm, dyt_alpha=ALPHA_BY_SITE, kernels="torch")
    model = Transformer(cfg).double()
    _randomize(model.embed_norm)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    e, n = math.sqrt(32) * model.tok_embeddings.weight[tokens], model.embed_norm
    want = rms64(e, n.weight) if norm == "rmsnorm" else torch.tanh(n.alpha * e) * n.weight + n.bias
    seen = []
    model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].value()))
    model(tokens)
    assert torch.allclose(model.embed(tokens), want, atol=1e-12) and torch.equal(seen[0], model.embed(tokens))
    params = [model.tok_embeddings.weight, *n.parameters()]
    for a, b in zip(torch.autograd.grad(model.embed(tokens).sum(), params), torch.autograd.grad(want.sum(), params),
                    strict=True):
        assert torch.allclose(a, b, atol=1e-10)
    plain = Transformer(tiny_config(embed_scale=4.0)).double()
    assert torch.equal(plain.embed(tokens), 4.0 * plain.tok_embeddings.weight[tokens])


WEIGHTLESS = {  # norm_affine=False: what each norm kind computes without γ and β, in float64
    "rmsnorm": lambda n, x: rms64(x),
    "rmsnorm_scalar": lambda n, x: rms64(x),
    "layernorm": lambda n, x: rms64(x - x.mean(-1, keepdim=True)),
    "dyt": lambda n, x: torch.tanh(n.alpha * x),
    "derf": lambda n, x: erf64(n.alpha * x + n.shift),
    "none": lambda n, x: x,
}


@pytest.mark.parametrize("kind", sorted(NORMS))
def test_weightless_norms_keep_only_their_shape_parameters(kind):
    assert set(WEIGHTLESS) == set(NORMS), "write the new norm's weightless formula into WEIGHTLESS"
    torch.manual_seed(0)
    cfg = ModelConfig(norm=kind, norm_affine=False, bias=True, kernels="torch")
    norm = build_norm(cfg, 16).double()
    assert {n for n, _ in norm.named_parameters()} == {"dyt": {"alpha"}, "derf": {"alpha", "shift"}}.get(kind, set())
    assert sum(p.numel() for p in norm.parameters()) == NORMS[kind].num_params(cfg, 16)
    _randomize(norm)
    x, r = torch.randn(3, 5, 16, dtype=torch.float64) * 2, torch.randn(3, 5, 16, dtype=torch.float64)
    assert torch.allclose(norm(x), WEIGHTLESS[kind](norm, x), atol=1e-10)
    out, h = norm(x, residual=r)
    assert torch.equal(h, x + r) and torch.allclose(out, WEIGHTLESS[kind](norm, x + r), atol=1e-10)


def test_derf_forward_gradients_and_initial_values():
    """Derf (Chen et al. 2025): γ · erf(α x + s) + β; α = α₀, s = 0, γ = 1, β = 0 at init (zlab-princeton/Derf)."""
    norm = Derf(24, alpha0=0.7)
    assert (norm.alpha.item(), norm.shift.item()) == (pytest.approx(0.7), 0.0) and norm.shift.shape == ()
    assert torch.equal(norm.weight, torch.ones(24)) and torch.equal(norm.bias, torch.zeros(24))
    torch.manual_seed(0)
    _randomize(norm)
    x = (torch.randn(4, 6, 24) * 2).requires_grad_()
    upstream = torch.randn(4, 6, 24)
    (norm(x) * upstream).sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (x, norm.alpha, norm.shift, norm.weight, norm.bias)]
    x64, a64, s64, g64, b64 = leaves
    want = g64 * erf64(a64 * x64 + s64) + b64
    assert torch.allclose(norm(x).double(), want, atol=1e-6)
    # d/dz erf(z) = 2/√π · exp(−z²): the gradients by hand
    z = (a64 * x64 + s64).detach()
    dz = upstream.double() * g64.detach() * 2 / math.sqrt(math.pi) * torch.exp(-z * z)
    by_hand = [dz * a64.detach(), (dz * x64.detach()).sum(), dz.sum(), (upstream.double() * erf64(z)).sum((0, 1)),
               upstream.double().sum((0, 1))]
    for got, want_grad in zip((x.grad, norm.alpha.grad, norm.shift.grad, norm.weight.grad, norm.bias.grad), by_hand,
                              strict=True):
        assert torch.allclose(got.double(), want_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_single_scale_rmsnorm_has_one_gain(kernels):
    """Single-Scale RMSNorm (OSP, Park et al. 2025): x / rms(x) · γ with one scalar γ, from 1."""
    norm = ScalarRMSNorm(16, kernels=kernels)
    assert norm.weight.shape == () and norm.weight.item() == 1.0
    with torch.no_grad():
        norm.weight.fill_(1.7)
    x = torch.randn(3, 5, 16, requires_grad=True)
    upstream = torch.randn(3, 5, 16)
    (norm(x) * upstream).sum().backward()
    x64, g64 = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    want = rms64(x64, g64)
    (want * upstream.double()).sum().backward()
    assert torch.allclose(norm(x).double(), want, atol=1e-6)
    assert torch.allclose(x.grad.double(), x64.grad, atol=1e-5) and norm.weight.grad.item() == pytest.approx(
        g64.grad.item(), rel=1e-5)
    for cast in ("llama", "gemma"):  # a 0-d fp32 gain keeps bf16 activations bf16
        assert ScalarRMSNorm(16, cast=cast)(x.detach().bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["dyt", "derf"])
def test_per_location_alpha0(kind):
    """`dyt_alpha` as {attn, mlp, final}: the attention sublayer's norms and QK-norm take attn, the MLP sublayer's
    mlp, the final and embedding norms final (the DyT authors' LLaMA recipe sets attention apart)."""
    cfg = tiny_config(norm=kind, dyt_alpha=ALPHA_BY_SITE, qk_norm="head", placement="sandwich", embed_norm=True)
    seen = set()
    for name, module in Transformer(cfg).named_modules():
        if isinstance(module, Norm):
            site = "attn" if ("attn_res" in name or ".attn." in name) else "mlp" if "mlp_res" in name else "final"
            assert module.alpha.item() == pytest.approx(ALPHA_BY_SITE[site]), name
            seen.add(site)
    assert seen == set(ALPHA_BY_SITE)


@pytest.mark.parametrize("field, value, fragment", [
    ("residual_scale", "deepnet", "residual_scale='deepnet' is not valid; give a positive number or 'deepnorm'"),
    ("residual_scale", 0.0, "residual_scale=0.0"),
    ("branch_scale", "matrix", "branch_scale='matrix' is not valid; choose one of ['none', 'scalar', 'vector']"),
    ("branch_scale_init", float("nan"), "branch_scale_init=nan must be a finite number"),
    ("placement_mlp", "middle", "placement_mlp='middle' is not valid; choose one of ['pre', 'post', 'sandwich'"),
    ("mix_ln", 1.0, "mix_ln=1.0 must be a fraction in [0, 1)"),
    ("mix_ln", 0.25, "0 layers in post-norm; use 0 (off) or at least 1/n_layers = 0.5"),
    ("embed_scale", "sqrt", "embed_scale='sqrt' is not valid; give a positive number or 'sqrt_dim'"),
    ("dyt_alpha", {"attn": 0.5}, "of each of ['attn', 'mlp', 'final']"),
    ("dyt_alpha", -1.0, "dyt_alpha=-1.0 must be a positive number"),
])
def test_bad_values_name_the_field_and_the_valid_values(field, value, fragment):
    with pytest.raises(ValueError) as err:
        tiny_config(**{field: value})
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_refused_combinations_say_why():
    with pytest.raises(ValueError, match=r"norm_depth_scale=True .* \['pre', 'sandwich'\]"):
        tiny_config(norm_depth_scale=True, placement="post")
    tiny_config(norm_depth_scale=True, placement="post", placement_mlp="pre")  # one pre-norm is enough
    with pytest.raises(ValueError, match="norm_offset=True .* norm_affine=True"):
        tiny_config(norm_offset=True, norm_affine=False)

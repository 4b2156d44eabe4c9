"""Invariants of the model's parts: placements, attention, init, config validation, import boundaries."""
import dataclasses
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from model import ModelConfig, Transformer
from model.attention import Attention, LayerCache
from model.config import INITS
from model.init import init_std
from model.mlp import MLPS
from model.norms import NORMS, Norm
from model.residual import PLACEMENTS, Stream
from model.rope import rope_cos_sin
from tests.helpers.model import tiny_config

FORMULAS = {  # the one line of math of each built-in placement, written independently of residual.py
    "pre": lambda p, x, f: x + f(p.norm_in(x)),
    "post": lambda p, x, f: p.norm_out(x + f(x)),
    "sandwich": lambda p, x, f: x + p.norm_out(f(p.norm_in(x))),
    "output": lambda p, x, f: x + p.norm_out(f(x)),
    "none": lambda p, x, f: x + f(x),
}


def _randomize(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()


def check_placement(name: str, norm: str) -> None:
    """A placement's formula is its math (built-ins); its fused `forward` on a deferred stream computes the same;
    it owns the norms it names."""
    torch.manual_seed(0)
    placement = PLACEMENTS[name](tiny_config(norm=norm, kernels="torch"))
    _randomize(placement)
    assert sum(isinstance(m, Norm) for m in placement.modules()) == len(placement.norms)
    lin = torch.nn.Linear(32, 32)
    x = torch.randn(2, 5, 32) * 4
    if name in FORMULAS:
        assert torch.allclose(placement.formula(x, lin), FORMULAS[name](placement, x, lin), atol=1e-6)
    # The deferred form (the pending residual add fused into the next norm) is the same computation.
    pending = torch.randn(2, 5, 32)
    assert torch.allclose(placement(Stream(x, pending), lin).value(), placement.formula(x + pending, lin), atol=1e-5)
    assert torch.allclose(placement(Stream(x), lin).value(), placement.formula(x, lin), atol=1e-5)


def check_blocks_equal_formulas(name: str) -> None:
    """The model's blocks (one fused forward, the add deferred across blocks) equal the placements' plain
    formulas applied sublayer by sublayer."""
    torch.manual_seed(0)
    model = Transformer(tiny_config(placement=name, kernels="torch"))
    x = torch.randn(2, 8, 32)
    cos, sin = rope_cos_sin(8, model.cfg.head_dim, model.cfg.rope_theta)
    plain, stream = x, Stream(x)
    for layer in model.layers:
        plain = layer.attn_res.formula(plain, lambda h, layer=layer: layer.attn(h, cos, sin))
        plain = layer.mlp_res.formula(plain, layer.mlp)
        stream = layer(stream, cos, sin)
    assert torch.allclose(plain, stream.value(), atol=1e-5), name


@pytest.mark.parametrize("norm", sorted(NORMS))
@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_placement_equals_its_formula(name, norm):
    assert set(FORMULAS) <= set(PLACEMENTS)
    check_placement(name, norm)


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_blocks_equal_the_plain_formulas(name):
    check_blocks_equal_formulas(name)


def test_final_norm_is_a_property_of_the_placement():
    assert {n: PLACEMENTS[n].needs_final_norm for n in FORMULAS} == {
        "pre": True, "post": False, "sandwich": True, "output": True, "none": True}
    assert Transformer(tiny_config(placement="post")).norm is None
    assert Transformer(tiny_config(placement="post", final_norm=True)).norm is not None
    assert Transformer(tiny_config(placement="pre", final_norm=False)).norm is None


@pytest.mark.parametrize("qk_norm", ["none", "head", "full"])
def test_gqa_equals_mha_with_repeated_kv(qk_norm):
    torch.manual_seed(0)
    gqa_cfg = tiny_config(n_heads=4, n_kv_heads=2, qk_norm=qk_norm, kernels="torch")
    mha_cfg = gqa_cfg.replace(n_kv_heads=4)
    gqa, mha = Attention(gqa_cfg, 0), Attention(mha_cfg, 0)
    _randomize(gqa)
    D, rep = gqa_cfg.head_dim, 2
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.o_proj.weight.copy_(gqa.o_proj.weight)
        for name in ("k_proj", "v_proj"):  # kv head j serves query heads 2j and 2j+1
            w = getattr(gqa, name).weight.view(2, D, -1)
            getattr(mha, name).weight.copy_(w.repeat_interleave(rep, dim=0).reshape(4 * D, -1))
        if qk_norm == "head":
            mha.q_norm.weight.copy_(gqa.q_norm.weight)
            mha.k_norm.weight.copy_(gqa.k_norm.weight)
        elif qk_norm == "full":  # repeating K's features leaves its RMS unchanged; its gain is repeated with them
            mha.q_norm.weight.copy_(gqa.q_norm.weight)
            mha.k_norm.weight.copy_(gqa.k_norm.weight.view(2, D).repeat_interleave(rep, dim=0).flatten())
    x = torch.randn(2, 7, 32)
    cos, sin = rope_cos_sin(7, D, 10000.0)
    assert torch.allclose(gqa(x, cos, sin), mha(x, cos, sin), atol=1e-5)


def test_attention_matches_explicit_softmax():
    torch.manual_seed(0)
    cfg = tiny_config(n_kv_heads=4, kernels="torch")
    attn = Attention(cfg, 0)
    x = torch.randn(1, 6, 32)
    cos, sin = rope_cos_sin(6, cfg.head_dim, cfg.rope_theta)
    from model.rope import apply_rope

    q = apply_rope(attn.q_proj(x).view(1, 6, 4, 8).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_proj(x).view(1, 6, 4, 8).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(1, 6, 4, 8).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    scores = scores.masked_fill(torch.triu(torch.ones(6, 6, dtype=torch.bool), 1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 6, 32)
    assert torch.allclose(attn(x, cos, sin), attn.o_proj(y), atol=1e-6)


@pytest.mark.parametrize("cached", [False, True])
def test_attention_softcap_matches_hand_written_attention(cached):
    """attn_softcap: scores c·tanh(s/c) before the mask and softmax (Gemma 2), GQA, with and without a cache."""
    torch.manual_seed(0)
    cap = 0.7
    cfg = tiny_config(attn_softcap=cap)  # 4 query heads, 2 kv heads
    attn = Attention(cfg, 0)
    with torch.no_grad():
        attn.q_proj.weight.mul_(20)  # scores far beyond the cap
    x = torch.randn(1, 6, 32)
    cos, sin = rope_cos_sin(6, cfg.head_dim, cfg.rope_theta)
    from model.rope import apply_rope

    q = apply_rope(attn.q_proj(x).view(1, 6, 4, 8).transpose(1, 2), cos, sin).double()
    k = apply_rope(attn.k_proj(x).view(1, 6, 2, 8).transpose(1, 2), cos, sin).double()
    v = attn.v_proj(x).view(1, 6, 2, 8).transpose(1, 2).double()
    k, v = k[:, [0, 0, 1, 1]], v[:, [0, 0, 1, 1]]  # query head h reads kv head h // 2
    scores = cap * torch.tanh((q @ k.transpose(-1, -2)) / math.sqrt(8) / cap)
    scores = scores.masked_fill(torch.triu(torch.ones(6, 6, dtype=torch.bool), 1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 6, 32).float()
    if cached:  # prompt of 4, then 2 more tokens against the cache
        cache = LayerCache(1, 2, 8, 8, x.device, x.dtype)
        got = torch.cat([attn(x[:, :4], cos[:4], sin[:4], cache), attn(x[:, 4:], cos[4:], sin[4:], cache)], 1)
    else:
        got = attn(x, cos, sin)
    assert torch.allclose(got, attn.o_proj(y), atol=1e-5)
    uncapped = Attention(cfg.replace(attn_softcap=None), 0)
    uncapped.load_state_dict(attn.state_dict())
    assert not torch.allclose(uncapped(x, cos, sin), got, atol=1e-4)  # the cap changes the output here


WIDE = dict(vocab_size=64, dim=1024, n_layers=6, n_heads=8, ffn_dim=1024, max_seq_len=8)


@pytest.mark.parametrize("scheme", INITS)
def test_init_statistics(scheme):
    torch.manual_seed(0)
    cfg = ModelConfig(**WIDE, init=scheme, init_std=0.02)
    model = Transformer(cfg)
    L = cfg.n_layers
    for l, layer in enumerate(model.layers):
        xavier = math.sqrt(2 / (1024 + 1024))  # Glorot: fan_in = fan_out = 1024 for every block matrix of WIDE
        target = {"normal": 0.02, "scaled": 0.02 / math.sqrt(2 * L), "depth": 0.02 / math.sqrt(2 * (l + 1)),
                  "zero": 0.0, "xavier": xavier}[scheme]
        assert init_std(cfg, "out", l, (1024, 1024)) == pytest.approx(target)
        for w in (layer.attn.o_proj.weight, layer.mlp.down_proj.weight):
            if target == 0:
                assert torch.count_nonzero(w) == 0
            else:
                assert abs(w.std().item() - target) <= 0.1 * target
        target_in = xavier if scheme == "xavier" else 0.02
        assert abs(layer.attn.q_proj.weight.std().item() - target_in) <= 0.1 * target_in
        for norm in (layer.attn_res.norm_in, layer.mlp_res.norm_in):
            assert torch.equal(norm.weight, torch.ones_like(norm.weight))
    assert abs(model.tok_embeddings.weight.std().item() - 0.02) <= 0.002


MLP_FORMULAS = {  # float64 definitions, by hand, of every registered MLP
    "swiglu": lambda m, x: F.linear(F.silu(F.linear(x, m.gate_proj.weight.double(), m.gate_proj.bias.double()))
                                    * F.linear(x, m.up_proj.weight.double(), m.up_proj.bias.double()),
                                    m.down_proj.weight.double(), m.down_proj.bias.double()),
    "relu": lambda m, x: F.linear((F.linear(x, m.up_proj.weight.double(), m.up_proj.bias.double())).clamp_min(0),
                                  m.down_proj.weight.double(), m.down_proj.bias.double()),
    "gelu": lambda m, x: F.linear(_gelu_erf(F.linear(x, m.up_proj.weight.double(), m.up_proj.bias.double())),
                                  m.down_proj.weight.double(), m.down_proj.bias.double()),
}


def _gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


@pytest.mark.parametrize("kind", sorted(MLPS))
def test_mlp_matches_float64_formula_and_default_width(kind):
    assert set(MLP_FORMULAS) == set(MLPS), "add the new MLP's float64 definition to MLP_FORMULAS"
    torch.manual_seed(0)
    cfg = tiny_config(mlp=kind, ffn_dim=None, bias=True)
    mlp = MLPS[kind](cfg, 0)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 5, cfg.dim)
    assert torch.allclose(mlp(x).double(), MLP_FORMULAS[kind](mlp, x.double()), atol=1e-5)
    width = {"swiglu": 128, "relu": 4 * cfg.dim, "gelu": 4 * cfg.dim}[kind]  # swiglu: 8/3·32 → 64·⌈85/64⌉
    assert cfg.hidden_dim == width and mlp.up_proj.weight.shape == (width, cfg.dim)
    assert tiny_config(mlp=kind, ffn_dim=40).hidden_dim == 40
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_xavier_uses_each_matrix_fans():
    cfg = tiny_config(init="xavier", mlp="relu")  # dim 32, 4 heads, 2 kv heads (head_dim 8), ffn 48
    attn, mlp = Attention(cfg, 0), MLPS["relu"](cfg, 0)
    assert attn.k_proj.std == pytest.approx(math.sqrt(2 / (32 + 16)))
    assert attn.q_proj.std == attn.o_proj.std == pytest.approx(math.sqrt(2 / (32 + 32)))
    assert mlp.up_proj.std == mlp.down_proj.std == pytest.approx(math.sqrt(2 / (32 + 48)))
    assert Transformer(cfg).tok_embeddings.std == cfg.init_std  # embeddings and head keep σ


def test_init_biases_zero_and_offset_gains_zero():
    m = Transformer(tiny_config(bias=True, norm="layernorm"))
    for name, p in m.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
    m = Transformer(tiny_config(norm_offset=True))
    assert all(torch.count_nonzero(p) == 0 for n, p in m.named_parameters() if "norm" in n)


def test_init_is_deterministic_and_works_on_meta_device():
    cfg = tiny_config(init="depth", qk_norm="head")
    torch.manual_seed(7)
    a = Transformer(cfg).state_dict()
    torch.manual_seed(7)
    b = Transformer(cfg).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    with torch.device("meta"):
        meta = Transformer(cfg)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(7)
    meta.init_weights()
    c = meta.state_dict()
    assert all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("field, value, fragment", [
    ("placement", "middle", "placement='middle'"),
    ("norm", "batchnorm", "['rmsnorm', 'layernorm', 'none', 'dyt', 'derf', 'rmsnorm_scalar']"),
    ("mlp", "geglu", "['swiglu', 'relu', 'gelu']"),
    ("qk_norm", "yes", "['none', 'head', 'full', 'qkv']"),
    ("init", "glorot", "'normal', 'scaled', 'depth', 'zero', 'xavier'"),
    ("final_norm", "maybe", "final_norm='maybe'"),
    ("n_kv_heads", 3, "n_kv_heads=3"),
    ("dim", 30, "dim=30"),
    ("vocab_size", 0, "vocab_size=0"),
    ("kernels", "cuda", "kernels='cuda'"),
    ("qk_norm_kind", "cos", "qk_norm_kind='cos' is not valid; choose one of ['auto', 'rmsnorm', 'layernorm', 'l2']"),
    ("sub_norm", "yes", "sub_norm='yes' is not valid; choose one of [False, True]"),
    ("attn_gate", "channel", "attn_gate='channel' is not valid; choose one of ['none', 'head', 'elementwise']"),
    ("attn_sink", "zero", "attn_sink='zero' is not valid; choose one of ['none', 'learnable', 'off_by_one']"),
])
def test_config_errors_name_the_value(field, value, fragment):
    with pytest.raises(ValueError) as err:
        tiny_config(**{field: value})
    assert fragment in str(err.value)


def test_presets_and_overrides():
    cfg = ModelConfig.preset("qwen3", dim=64, n_heads=4)
    assert (cfg.placement, cfg.norm, cfg.qk_norm, cfg.dim) == ("pre", "rmsnorm", "head", 64)
    assert ModelConfig.preset("olmo2").placement == "output"
    assert ModelConfig.preset("olmo2").qk_norm == "full"
    assert ModelConfig.preset("gpt2").norm == "layernorm"
    assert ModelConfig.preset("post").placement == "post"
    with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
        ModelConfig.preset("gpt5")
    with pytest.raises(ValueError, match="widht"):
        ModelConfig.preset("llama", widht=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 3  # frozen


def test_seq_len_above_max_is_a_clear_error():
    model = Transformer(tiny_config(max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_model_imports_no_framework():
    code = (
        "import sys, model, model.hf_compat, model.kernels\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'deepspeed',"
        " 'data', 'training', 'transformers')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    cfg = ModelConfig.preset("llama", vocab_size=64, dim=64, n_layers=2, n_heads=4, max_seq_len=32)
    model = Transformer(cfg)
    tokens = torch.randint(0, 64, (4, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    steps = 0
    for steps in range(1, 301):  # noqa: B007 (the count is reported below)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        if loss.item() < 0.1:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1, f"loss {loss.item():.3f} after {steps} steps"

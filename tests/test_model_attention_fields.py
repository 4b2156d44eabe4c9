"""The attention-side fields against float64 math written here: qk_norm qkv, qk_norm_kind, sub_norm, attn_gate,
attn_sink, and the exact per-head max logit; plus the sink against transformers' gpt-oss eager attention, the l2
QK-norm against Llama 4's, generation with a KV cache, the probes' view of the sunk softmax, and μP's folding.
The shared checks (count, gradients, causality, meta device, export, μP) run in tests/test_model_fields.py; the
config surface (parameter kinds, bad values, CLI) in tests/test_model_attention_config.py."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from model import Transformer
from model.attention import Attention, DocumentMask
from model.mlp import MLPS
from model.mup import to_standard
from model.probes import record
from model.rope import apply_rope, rope_cos_sin, rope_cos_sin_at
from model.softmax import max_logit_per_head, sdpa_with_sink
from tests.helpers.model import tiny_config

B, T = 2, 10
DOCS = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])  # positions of packed docs


def _norm(kind: str, x: torch.Tensor, p: dict, name: str, eps: float = 1e-5) -> torch.Tensor:
    """The norm `name` of kind `kind` in float64, from its definition."""
    w, b = p.get(f"{name}.weight"), p.get(f"{name}.bias")
    if kind == "rmsnorm":
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    if kind == "layernorm":
        centred = x - x.mean(-1, keepdim=True)
        y = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * w
        return y if b is None else y + b
    if kind == "dyt":
        return torch.tanh(p[f"{name}.alpha"] * x) * w + b
    if kind == "l2":  # x/‖x‖ (eps as RMSNorm's, per feature), times the temperature on the query side
        y = x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + x.shape[-1] * eps)
        return y * p[f"{name}.temperature"] if f"{name}.temperature" in p else y
    assert kind == "none"
    return x


def _visible(positions: torch.Tensor | None) -> torch.Tensor:
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if positions is None:
        return causal
    doc = (positions == 0).cumsum(-1)
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # [B, 1, T, T]


def reference_scores(cfg, p: dict, x: torch.Tensor, positions: torch.Tensor | None):
    """(post-RoPE q·k·scale [B, H, T, T], v [B, H, T, D]) of the attention sublayer of `cfg` with parameters `p`."""
    H, K, D = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    q, k, v = (_linear(p, n, x) for n in ("q_proj", "k_proj", "v_proj"))
    kind = cfg.norm if cfg.qk_norm_kind == "auto" else cfg.qk_norm_kind
    if cfg.qk_norm == "full":
        q, k = _norm(kind, q, p, "q_norm"), _norm(kind, k, p, "k_norm")
    q, k, v = q.view(B, T, H, D), k.view(B, T, K, D), v.view(B, T, K, D)
    if cfg.qk_norm in ("head", "qkv"):
        q, k = _norm(kind, q, p, "q_norm"), _norm(kind, k, p, "k_norm")
    if cfg.qk_norm == "qkv":
        v = _norm(kind, v, p, "v_norm")
    theta = cfg.rope_theta
    cos, sin = rope_cos_sin(T, D, theta) if positions is None else rope_cos_sin_at(positions, D, theta)
    cos, sin = cos.double(), sin.double()
    q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
    k, v = k.repeat_interleave(H // K, 1), v.transpose(1, 2).repeat_interleave(H // K, 1)
    scale = 1.0 if cfg.qk_norm_kind == "l2" else D ** -0.5  # l2: the temperature is the scale
    return q @ k.transpose(-1, -2) * scale, v


def reference_probs(cfg, p: dict, scores: torch.Tensor, positions: torch.Tensor | None):
    """(probabilities on the keys [B, H, T, T], on the explicit sink [B, H, T] or None), softmax with a sink:
    p_j = exp(s_j) / (exp(σ) + Σ_i exp(s_i))."""
    if cfg.attn_softcap is not None:
        scores = cfg.attn_softcap * torch.tanh(scores / cfg.attn_softcap)
    scores = scores.masked_fill(~_visible(positions), float("-inf"))
    if cfg.attn_sink == "none":
        return scores.softmax(-1), None
    sigma = p["sink.logit"] if cfg.attn_sink == "learnable" else torch.zeros(cfg.n_heads, dtype=torch.float64)
    sigma = sigma.view(1, -1, 1, 1)
    top = torch.maximum(scores.amax(-1, keepdim=True), sigma)
    num, den_sink = torch.exp(scores - top), torch.exp(sigma - top)
    den = den_sink + num.sum(-1, keepdim=True)
    return num / den, (den_sink / den).squeeze(-1)


def _linear(p: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    y = x @ p[f"{name}.weight"].T
    return y + p[f"{name}.bias"] if f"{name}.bias" in p else y


def reference_attention(cfg, p: dict, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """y = W_o · (σ(x W_g) ⊙ N_sub(softmax(q·k·s [+ σ]) v)) in float64, from the parameters `p` [B, T, dim]."""
    scores, v = reference_scores(cfg, p, x, positions)
    y = (reference_probs(cfg, p, scores, positions)[0] @ v).transpose(1, 2)  # [B, T, H, D]
    if cfg.sub_norm:
        y = _norm(cfg.norm, y.reshape(B, T, -1), p, "sub_norm").view(y.shape)
    if cfg.attn_gate != "none":
        y = y * torch.sigmoid(_linear(p, "gate_proj", x)).view(B, T, cfg.n_heads, -1)
    return _linear(p, "o_proj", y.reshape(B, T, -1))


def _perturbed(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter moved off its init (gains off 1, sink logits and temperature off their start), so a formula
    that ignores one of them fails."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return module


CASES = {
    "qkv": dict(qk_norm="qkv"),
    "l2": dict(qk_norm="head", qk_norm_kind="l2"),
    "dyt-blocks-rmsnorm-qk": dict(norm="dyt", qk_norm="head", qk_norm_kind="rmsnorm"),
    "no-norm-layernorm-qk-full": dict(norm="none", qk_norm="full", qk_norm_kind="layernorm", bias=True),
    "sub_norm-gate-elementwise": dict(norm="layernorm", sub_norm=True, attn_gate="elementwise"),
    "gate-head-sink-learnable": dict(attn_gate="head", attn_sink="learnable"),
    "sink-learnable-docs": dict(attn_sink="learnable", docs=True),
    "sink-off_by_one-softcap-docs": dict(attn_sink="off_by_one", attn_softcap=3.0, docs=True),
}


@pytest.mark.parametrize("kw", CASES.values(), ids=CASES.keys())
def test_attention_forward_and_gradients_equal_float64_math(kw):
    kw = dict(kw)
    positions = DOCS if kw.pop("docs", False) else None
    cfg = tiny_config(kernels="torch", **kw)
    attn = _perturbed(Attention(cfg, 0))
    torch.manual_seed(2)
    x = torch.randn(B, T, cfg.dim)
    if positions is None:
        cos, sin = rope_cos_sin(T, cfg.head_dim, cfg.rope_theta)
        doc_mask = None
    else:
        cos, sin = rope_cos_sin_at(positions, cfg.head_dim, cfg.rope_theta)
        doc_mask = DocumentMask.from_positions(positions, cfg.attn_softcap)
    got = attn(x, cos, sin, doc_mask=doc_mask)
    p64 = {n: p.detach().double().requires_grad_() for n, p in attn.named_parameters()}
    want = reference_attention(cfg, p64, x.double(), positions)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    upstream = torch.randn_like(got)
    got.backward(upstream)
    want.backward(upstream.double())
    for name, p in attn.named_parameters():
        torch.testing.assert_close(p.grad.double(), p64[name].grad, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("mlp", list(MLPS))
def test_mlp_sub_norm_is_a_norm_over_the_hidden_width_before_down(mlp):
    cfg = tiny_config(kernels="torch", mlp=mlp, sub_norm=True)
    module = _perturbed(MLPS[mlp](cfg, 0))
    x = torch.randn(B, T, cfg.dim)
    p = {n: t.detach().double() for n, t in module.named_parameters()}
    x64 = x.double()
    if mlp == "swiglu":
        h = torch.nn.functional.silu(_linear(p, "gate_proj", x64)) * _linear(p, "up_proj", x64)
    else:
        h = {"relu": torch.relu, "gelu": torch.nn.functional.gelu}[mlp](_linear(p, "up_proj", x64))
    assert module.sub_norm.weight.shape == (cfg.hidden_dim,)
    want = _linear(p, "down_proj", _norm("rmsnorm", h, p, "sub_norm"))
    torch.testing.assert_close(module(x).double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "kv-cache-mask"])
def test_sink_equals_gpt_oss_eager_attention_and_passes_gradcheck(masked):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    H, K, D, Tq, S = 2, 1, 4, 2 if masked else 4, 4
    q = torch.randn(1, H, Tq, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, K, S, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sink = torch.randn(H, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(Tq, S, dtype=torch.bool).tril(S - Tq) if masked else None  # the cache's: decode rows last
    ours = sdpa_with_sink(q, k, v, sink, 0.4, mask, enable_gqa=True)
    module = SimpleNamespace(sinks=sink, num_key_value_groups=H // K, training=False)
    additive = torch.zeros(Tq, S, dtype=torch.float64).masked_fill(~torch.ones(Tq, S, dtype=torch.bool).tril(S - Tq),
                                                                   float("-inf"))
    theirs, _ = eager_attention_forward(module, q, k, v, additive[None, None], scaling=0.4)
    torch.testing.assert_close(ours, theirs.transpose(1, 2), rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *a: sdpa_with_sink(*a, 0.4, mask, enable_gqa=True), (q, k, v, sink))


def test_l2_qk_norm_starts_as_llama4_qk_norm():
    """g = √D at init: g·q̂·k̂ equals Llama 4's weightless RMSNorm on q and k after RoPE, with the 1/√D scale."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextL2Norm

    cfg = tiny_config(qk_norm="head", qk_norm_kind="l2")
    attn = Attention(cfg, 0)
    seen = {}
    attn.rope.register_forward_hook(lambda m, a, out: seen.update(q=out[0], k=out[1]))
    x = torch.randn(B, T, cfg.dim)
    cos, sin = rope_cos_sin(T, cfg.head_dim, cfg.rope_theta)
    attn(x, cos, sin)
    ours = seen["q"] @ seen["k"].repeat_interleave(2, 1).transpose(-1, -2) * attn.scale
    q = apply_rope(attn.q_proj(x).view(B, T, 4, -1).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_proj(x).view(B, T, 2, -1).transpose(1, 2), cos, sin).repeat_interleave(2, 1)
    norm = Llama4TextL2Norm(cfg.norm_eps)
    theirs = norm(q) @ norm(k).transpose(-1, -2) / math.sqrt(cfg.head_dim)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(attn_sink="learnable", attn_gate="head", sub_norm=True, qk_norm="qkv"),
                                dict(attn_sink="off_by_one", attn_softcap=3.0, attn_gate="elementwise")],
                         ids=["learnable", "off_by_one-softcap"])
def test_generation_with_a_kv_cache_equals_the_full_forward(kw):
    model = _perturbed(Transformer(tiny_config(kernels="torch", max_seq_len=24, **kw))).eval()
    tokens = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2)
        parts = [model(tokens[:, :5], cache), model(tokens[:, 5:8], cache)]  # prefill, a chunk, single steps
        parts += [model(tokens[:, t:t + 1], cache) for t in range(8, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
def test_max_logit_per_head_is_exact(docs):
    cfg = tiny_config(kernels="torch", attn_sink="learnable", n_layers=1)
    model = _perturbed(Transformer(cfg))
    attn = model.layers[0].attn
    assert attn.max_logit_per_head is None  # off by default: nothing computed
    attn.track_max_logit = True
    seen = {}
    attn.rope.register_forward_hook(lambda m, a, out: seen.update(q=out[0].double(), k=out[1].double()))
    positions = DOCS if docs else None
    with torch.no_grad():
        model(torch.randint(0, 97, (B, T)), position_ids=positions)
    scores = seen["q"] @ seen["k"].repeat_interleave(2, 1).transpose(-1, -2) * attn.scale
    want = scores.masked_fill(~_visible(positions), float("-inf")).amax((0, 2, 3))
    torch.testing.assert_close(attn.max_logit_per_head.double(), want, rtol=1e-6, atol=1e-6)
    assert not attn.max_logit_per_head.requires_grad
    mask = _visible(positions)
    chunked = max_logit_per_head(seen["q"].float(), seen["k"].float(), attn.scale, mask, budget=B * 4 * T * 3)
    whole = max_logit_per_head(seen["q"].float(), seen["k"].float(), attn.scale, mask)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)


def test_probes_read_the_sunk_gated_softmax_of_a_float64_forward():
    cfg = tiny_config(kernels="torch", n_layers=1, attn_sink="learnable", attn_gate="head")
    model = _perturbed(Transformer(cfg))
    attn = model.layers[0].attn
    seen = {}
    attn.register_forward_pre_hook(lambda m, a: seen.update(x=a[0].detach().double()))
    with record(model, attn_rows=T, attn_batch=B) as rec, torch.no_grad():
        model(torch.randint(0, 97, (B, T)))
    got = rec.scalars()
    p = {n: t.detach().double() for n, t in attn.named_parameters()}
    scores, _ = reference_scores(cfg, p, seen["x"], None)
    probs, sink = reference_probs(cfg, p, scores, None)  # [B, H, T, T], [B, H, T]
    rows = slice(1, T)  # row 0 sees only itself and is left out
    keys = probs[:, :, rows]
    n = torch.arange(3, T + 2, dtype=torch.float64)  # outcomes of row t: keys 0…t and the sink
    entropy = -(keys * keys.clamp_min(1e-300).log()).sum(-1) - sink[:, :, rows] * sink[:, :, rows].log()
    want = {
        "max_prob": keys.amax(-1).mean((0, 2)),
        "entropy": (entropy / n.log()).mean((0, 2)),
        "sink_logit_mass": sink[:, :, rows].mean((0, 2)),
        "sink_mass": keys[..., 0].mean((0, 2)),
    }
    for key, per_head in want.items():
        assert got[f"attn/{key}/L0"] == pytest.approx(per_head.mean().item(), rel=1e-5), key
        worst = per_head.min() if key == "entropy" else per_head.max()  # the least spread head, else the largest
        assert got[f"attn/{key}_worst/L0"] == pytest.approx(worst.item(), rel=1e-5), key
    gate = torch.sigmoid(_linear(p, "gate_proj", seen["x"])).mean()
    assert got["attn/gate_mean/L0"] == pytest.approx(gate.item(), rel=1e-6)


def test_mup_folds_into_a_standard_model_with_l2_sink_and_gate():
    """An l2 QK-norm's temperature carries the score scale under μP too, so folding μP leaves it as it is."""
    cfg = tiny_config(kernels="torch", parametrization="mup", mup_base_width=16, qk_norm="head",
                      qk_norm_kind="l2", attn_sink="learnable", attn_gate="head")
    model = _perturbed(Transformer(cfg))
    tokens = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(to_standard(model)(tokens), model(tokens), rtol=1e-5, atol=1e-5)

"""Probe values checked by hand, and the probes' effect (none) on the model's output."""
import copy
import itertools
import math

import pytest
import torch

from model import ModelConfig, Transformer
from model.attention import DocumentMask
from model.norms import NORMS
from model.probes import Recorder, attention_rows, attention_stats, record, token_rms
from model.residual import PLACEMENTS
from model.rope import rope_cos_sin
from tests.test_model_structure import FORMULAS


def test_uniform_attention():
    q = torch.zeros(1, 2, 8, 4)  # all logits equal → every visible key equally likely
    k = torch.randn(1, 1, 8, 4)
    s = attention_stats(q, k, torch.arange(8), scale=0.5)
    assert torch.allclose(s["entropy"], torch.ones(2), atol=1e-6)
    assert torch.equal(s["saturated_frac"], torch.zeros(2))
    expected_max_prob = torch.tensor([1 / (r + 1) for r in range(1, 8)]).mean()  # row 0 is skipped
    assert torch.allclose(s["max_prob"], expected_max_prob.expand(2), atol=1e-6)
    assert torch.equal(s["max_logit"], torch.zeros(2))


def test_one_hot_attention():
    T, D = 6, 4
    k = torch.zeros(1, 1, T, D)
    k[0, 0, 0, 0] = 1.0  # only key 0 has a non-zero logit...
    q = torch.zeros(1, 1, T, D)
    q[0, 0, :, 0] = 200.0  # ...and it is huge: every row puts all its mass there
    s = attention_stats(q, k, torch.arange(1, T), scale=1 / math.sqrt(D))
    assert s["max_prob"].item() == pytest.approx(1.0)
    assert s["saturated_frac"].item() == 1.0
    assert s["entropy"].item() == pytest.approx(0.0, abs=1e-6)
    assert s["max_logit"].item() == pytest.approx(200.0 / math.sqrt(D))
    with pytest.raises(ValueError, match="past position 0"):
        attention_stats(q, k, torch.tensor([0]), scale=1 / math.sqrt(D))


def test_saturation_threshold_is_configurable():
    q = torch.zeros(1, 1, 4, 2)
    q[..., 0] = 3.0
    k = torch.zeros(1, 1, 4, 2)
    k[0, 0, 0, 0] = 1.0
    rows = torch.tensor([1])  # two visible keys with logits 3/√2 and 0 → p ≈ 0.894
    assert attention_stats(q, k, rows, 1 / math.sqrt(2), threshold=0.99)["saturated_frac"].item() == 0.0
    assert attention_stats(q, k, rows, 1 / math.sqrt(2), threshold=0.85)["saturated_frac"].item() == 1.0


def test_known_residual_stream():
    x = torch.tensor([[[3.0, 4.0], [0.0, 0.0]]])  # token RMS: √12.5 and 0
    assert token_rms(x).item() == pytest.approx(math.sqrt(12.5) / 2)
    rec = Recorder()
    stream = torch.full((1, 3, 4), 2.0)
    rec.sublayer(0, "attn", stream=stream, read=stream / 2, update=torch.full((1, 3, 4), 0.5))
    s = rec.scalars()
    assert s["resid/update_ratio/attn/L0"] == pytest.approx(0.25)
    assert s["resid/read_rms/attn/L0"] == pytest.approx(1.0)
    assert s["resid/update_rms/attn/L0"] == pytest.approx(0.5)


def check_probes_cover_every_layer(placement: str, norm: str = "rmsnorm") -> None:
    """The probes leave the output unchanged, report every layer, and take their hooks away on exit."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2,
                                    placement=placement, qk_norm="head", norm=norm))
    tokens = torch.randint(0, 64, (2, 16))
    plain = model(tokens)
    with record(model) as rec:
        probed = model(tokens)
    assert torch.equal(plain, probed)  # the same forward, only observed
    tags = rec.scalars()
    for i in range(3):
        for stem in ("resid/rms", "resid/rms_out", "attn/max_prob", "attn/entropy", "attn/saturated_frac",
                     "attn/max_logit", "attn/max_prob_worst"):
            assert f"{stem}/L{i}" in tags
        for sub in ("attn", "mlp"):
            for stem in ("update_ratio", "update_rms", "read_rms"):
                assert f"resid/{stem}/{sub}/L{i}" in tags
    assert "resid/final_in" in tags
    rec.values.clear()
    model(tokens)
    assert rec.values == {}, "hooks left behind after the with block"


def residual_reference(model: Transformer, tokens: torch.Tensor) -> dict[str, float]:
    """The residual probes from a hand-written float64 forward: each placement's plain formula (written out in
    test_model_structure for the built-ins), sublayer by sublayer, on a float64 copy of the model. The update is
    new stream − old stream, or under a renormalizing placement (post-norm) the sublayer's output."""
    ref = copy.deepcopy(model).double()
    cos, sin = rope_cos_sin(tokens.shape[1], ref.cfg.head_dim, ref.cfg.rope_theta)
    out = {}
    x = ref.tok_embeddings(tokens)
    for i, layer in enumerate(ref.layers):
        out[f"resid/rms/L{i}"] = _rms(x)
        attn = lambda h, layer=layer: layer.attn(h, cos, sin)  # noqa: E731
        for name, res, f in (("attn", layer.attn_res, attn), ("mlp", layer.mlp_res, layer.mlp)):
            seen = {}

            def sublayer(h, f=f, seen=seen):
                seen["read"], seen["out"] = h, f(h)
                return seen["out"]

            formula = FORMULAS.get(ref.cfg.placement, lambda p, x, f: p.formula(x, f))
            new = formula(res, x, sublayer)
            update = new - x if res.adds_to_stream else seen["out"]
            out[f"resid/update_rms/{name}/L{i}"] = _rms(update)
            out[f"resid/update_ratio/{name}/L{i}"] = _rms(update) / _rms(x)
            out[f"resid/read_rms/{name}/L{i}"] = _rms(seen["read"])
            x = new
        out[f"resid/rms_out/L{i}"] = _rms(x)
    out["resid/final_in"] = _rms(x)
    return out


def _rms(x: torch.Tensor) -> float:
    """Mean over tokens of each token's RMS, in float64."""
    return x.double().pow(2).mean(-1).sqrt().mean().item()


def check_residual_probes_match_float64(placement: str, norm: str = "rmsnorm") -> None:
    torch.manual_seed(0)
    # Without a norm (none, or a placement without one) the sublayers read the raw 0.02-scale embeddings and their
    # updates are ~1e-5 of the stream, too small for the fp32 forward to be compared at rel 1e-5: a larger init
    # keeps them visible.
    unnormalized = norm == "none" or not PLACEMENTS[placement].norms
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, placement=placement,
                                    init="normal", kernels="auto", norm=norm, init_std=0.3 if unnormalized else 0.02))
    with torch.no_grad():  # gains away from 1, so a norm's output differs from its input in RMS
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    tokens = torch.randint(0, 64, (2, 12))
    with record(model) as rec:
        model(tokens)
    got, want = rec.scalars(), residual_reference(model, tokens)
    for tag, value in want.items():
        assert got[tag] == pytest.approx(value, rel=1e-5), tag


# Every placement and every norm at least once (the hooks sit on placements and sublayers, not on norms); the
# float64 test below takes every pair.
EACH_ONCE = [(sorted(PLACEMENTS)[i % len(PLACEMENTS)], sorted(NORMS)[i % len(NORMS)])
             for i in range(max(len(PLACEMENTS), len(NORMS)))]


@pytest.mark.parametrize("placement, norm", EACH_ONCE)
def test_probes_leave_the_output_unchanged_and_cover_every_layer(placement, norm):
    check_probes_cover_every_layer(placement, norm)


@pytest.mark.parametrize("norm", sorted(NORMS))
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_residual_probes_match_a_float64_forward(placement, norm):
    check_residual_probes_match_float64(placement, norm)


def test_pre_norm_stream_grows_with_depth_at_init():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=128, dim=64, n_layers=8, n_heads=4, init="normal", placement="pre"))
    with record(model) as rec:
        model(torch.randint(0, 128, (4, 32)))
    s = rec.scalars()
    rms = [s[f"resid/rms/L{l}"] for l in range(8)] + [s["resid/final_in"]]
    assert all(b > a for a, b in itertools.pairwise(rms)), rms


def test_grad_norms_per_layer_and_global():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4))
    model(torch.randint(0, 64, (2, 8)), targets=torch.randint(0, 64, (2, 8))).backward()
    from model.probes import grad_norms

    norms = grad_norms(model)
    for l in range(3):
        expected = torch.cat([p.grad.flatten() for p in model.layers[l].parameters()]).norm().item()
        assert norms[f"grad/norm/L{l}"] == pytest.approx(expected, rel=1e-5)
    total = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    assert norms["grad/global"] == pytest.approx(total, rel=1e-5)
    assert {"grad/norm/tok_embeddings", "grad/norm/output"} <= set(norms)


def test_probes_identical_with_fused_kernels_on_and_off():
    """The probes read the same stream whichever norm implementation runs (Triton in its interpreter here)."""
    values = {}
    for kernels in ("torch", "triton"):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, qk_norm="head",
                                        kernels=kernels))
        with record(model) as rec:
            model(torch.randint(0, 32, (1, 6)), targets=torch.randint(0, 32, (1, 6))).backward()
        from model.probes import grad_norms

        values[kernels] = {**rec.scalars(), **grad_norms(model)}
    assert values["torch"].keys() == values["triton"].keys()
    for tag, v in values["torch"].items():
        assert values["triton"][tag] == pytest.approx(v, rel=1e-5, abs=1e-7), tag


def test_attention_stats_use_the_softcapped_scores_and_the_model_passes_its_cap():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 6, 8) * 4, torch.randn(1, 2, 6, 8) * 4
    rows, cap = torch.tensor([3, 5]), 1.5
    stats = attention_stats(q, k, rows, 1 / math.sqrt(8), softcap=cap)
    s = (q[:, :, rows] @ k.transpose(-1, -2)) / math.sqrt(8)  # [1, 2, R, 6]
    visible = torch.arange(6)[None, :] <= rows[:, None]
    p = (cap * torch.tanh(s / cap)).masked_fill(~visible, float("-inf")).softmax(-1)
    assert torch.allclose(stats["max_prob"], p.amax(-1).mean((0, 2)), atol=1e-6)
    assert torch.allclose(stats["max_logit"], s.masked_fill(~visible, float("-inf")).amax((0, 2, 3)))  # uncapped
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, attn_softcap=cap))
    with torch.no_grad():
        model.layers[0].attn.q_proj.weight.mul_(100)  # scores well beyond the cap
    seen = {}
    model.layers[0].attn.rope.register_forward_hook(lambda m, a, out: seen.update(q=out[0], k=out[1]))
    with record(model) as rec:
        model(torch.randint(0, 64, (1, 8)))
    all_rows = torch.arange(8)
    scale = model.layers[0].attn.scale
    want = attention_stats(seen["q"], seen["k"], all_rows, scale, softcap=cap)["max_prob"].mean().item()
    assert rec.scalars()["attn/max_prob/L0"] == pytest.approx(want, rel=1e-6)
    uncapped = attention_stats(seen["q"], seen["k"], all_rows, scale)["max_prob"].mean().item()
    assert want != pytest.approx(uncapped, rel=1e-3)


def module_softmax(attn, q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, doc_mask=None) -> torch.Tensor:
    """The attention module's own probabilities [B, H, T, T]: its kernel (`_attend`: SDPA, or math attention under
    a softcap) run with value rows e_s, so each output row is the softmax row itself (needs head_dim ≥ T)."""
    B, K, T, D = k_BKTD.shape
    v = torch.eye(T, D).expand(B, K, T, D)
    mask = None if doc_mask is None else doc_mask.dense
    return attn._attend(q_BHTD, k_BKTD, v, mask, doc_mask is None, doc_mask)[..., :T]


SCALES = {  # dim 64, 4 heads; μP base width 16 (base head dim 4)
    "standard": dict(),
    "standard-head_dim": dict(head_dim=32),
    "mup": dict(parametrization="mup"),
    "mup-head_dim-grows": dict(parametrization="mup", head_dim=32, mup_base_head_dim=8),
    "mup-gqa-softcap-docs": dict(parametrization="mup", n_kv_heads=2, attn_softcap=2.0),
}


@pytest.mark.parametrize("kw", SCALES.values(), ids=SCALES.keys())
def test_probe_softmax_is_the_attention_modules_own(kw):
    """The probes' softmax equals the attention kernel's under standard, μP (score scale √D₀/D, not 1/√D) and an
    explicit head_dim; the recorded max_prob and sink mass are those of the module's probabilities."""
    torch.manual_seed(0)
    T = 12
    model = Transformer(ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, max_seq_len=T,
                                    mup_base_width=16, **kw))
    attn = model.layers[0].attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(40)  # peaked attention, so a wrong scale changes the probabilities visibly
    seen = {}
    attn.rope.register_forward_hook(lambda m, a, out: seen.update(q=out[0], k=out[1]))
    tokens = torch.randint(0, 64, (1, T))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]]) if attn.softcap else None
    with record(model, attn_rows=T) as rec:
        model(tokens, position_ids=positions)
    doc_mask = None if positions is None else DocumentMask.from_positions(positions, attn.softcap)
    with torch.no_grad():
        want = module_softmax(attn, seen["q"], seen["k"], doc_mask)  # [1, H, T, T]
    rows = torch.arange(T)
    doc_ids = None if doc_mask is None else doc_mask.doc_ids
    got = attention_rows(seen["q"], seen["k"], rows, attn.scale, attn.softcap, doc_ids)
    torch.testing.assert_close(got.probs, want, rtol=0, atol=1e-5)
    if kw.get("parametrization") == "mup":  # μP's scale is not 1/√D: the textbook scale gives another softmax
        textbook = attention_rows(seen["q"], seen["k"], rows, attn.head_dim ** -0.5, attn.softcap, doc_ids)
        assert (textbook.probs - want).abs().max() > 0.05
    # what the recorder logged (through its hooks) is computed from those same probabilities
    valid = got.valid[0]  # rows that see more than one key
    sinks = got.visible[0].float().argmax(-1)
    s = rec.scalars()
    assert s["attn/max_prob/L0"] == pytest.approx(want[0].amax(-1)[:, valid].mean().item(), rel=1e-5)
    at_sink = want[0].gather(-1, sinks[None, :, None].expand(want.shape[1], -1, 1)).squeeze(-1)
    assert s["attn/sink_mass/L0"] == pytest.approx(at_sink[:, valid].mean().item(), rel=1e-5)

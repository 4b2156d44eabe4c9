"""Probe values checked by hand, and the probes' effect (none) on the model's output."""
import math

import pytest
import torch

from model import ModelConfig, Transformer
from model.probes import Recorder, attention_stats, record, token_rms


def test_uniform_attention():
    q = torch.zeros(1, 2, 8, 4)  # all logits equal → every visible key equally likely
    k = torch.randn(1, 1, 8, 4)
    s = attention_stats(q, k, torch.arange(8))
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
    s = attention_stats(q, k, torch.arange(1, T))
    assert s["max_prob"].item() == pytest.approx(1.0)
    assert s["saturated_frac"].item() == 1.0
    assert s["entropy"].item() == pytest.approx(0.0, abs=1e-6)
    assert s["max_logit"].item() == pytest.approx(200.0 / math.sqrt(D))
    with pytest.raises(ValueError, match="past position 0"):
        attention_stats(q, k, torch.tensor([0]))


def test_saturation_threshold_is_configurable():
    q = torch.zeros(1, 1, 4, 2)
    q[..., 0] = 3.0
    k = torch.zeros(1, 1, 4, 2)
    k[0, 0, 0, 0] = 1.0
    rows = torch.tensor([1])  # two visible keys with logits 3/√2 and 0 → p ≈ 0.894
    assert attention_stats(q, k, rows, threshold=0.99)["saturated_frac"].item() == 0.0
    assert attention_stats(q, k, rows, threshold=0.85)["saturated_frac"].item() == 1.0


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


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "output"])
def test_probes_leave_the_output_unchanged_and_cover_every_layer(placement):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2,
                                    placement=placement, qk_norm="head"))
    tokens = torch.randint(0, 64, (2, 16))
    plain = model(tokens)
    with record(model) as rec:
        probed = model(tokens)
    assert torch.allclose(plain, probed, atol=1e-6)
    tags = rec.scalars()
    for l in range(3):
        for stem in ("resid/rms", "resid/rms_out", "attn/max_prob", "attn/entropy", "attn/saturated_frac",
                     "attn/max_logit", "attn/max_prob_worst"):
            assert f"{stem}/L{l}" in tags
        for sub in ("attn", "mlp"):
            assert f"resid/update_ratio/{sub}/L{l}" in tags
    assert model.recorder is None and all(layer.attn.probe is None for layer in model.layers)
    assert "resid/final_in" in tags


def test_update_ratio_matches_stream_difference_under_pre_norm():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4))
    with record(model) as rec:
        model(torch.randint(0, 64, (1, 8)))
    s = rec.scalars()
    # Under pre-norm, the stream leaving the block is the stream entering it plus both updates.
    assert s["resid/rms_out/L0"] == pytest.approx(s["resid/rms/L1"])


def test_pre_norm_stream_grows_with_depth_at_init():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=128, dim=64, n_layers=8, n_heads=4, init="normal", placement="pre"))
    with record(model) as rec:
        model(torch.randint(0, 128, (4, 32)))
    s = rec.scalars()
    rms = [s[f"resid/rms/L{l}"] for l in range(8)] + [s["resid/final_in"]]
    assert all(b > a for a, b in zip(rms, rms[1:])), rms


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

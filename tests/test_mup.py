"""μP (`model.parametrization: mup`): its multipliers, the coordinate check that proves them, and HF export."""
from __future__ import annotations

import math

import pytest
import torch

from model import ModelConfig, Transformer
from model.hf_compat import to_hf
from model.mup import to_standard
from training.coordcheck import CheckSpec, main, run
from training.optim import OptimConfig, param_groups

BASE = 32


def config(dim: int, parametrization: str = "mup", **kw) -> ModelConfig:
    fields = dict(vocab_size=64, n_layers=2, n_heads=4, max_seq_len=16, mup_base_width=BASE) | kw
    return ModelConfig.preset(fields.pop("preset", "llama"), dim=dim, parametrization=parametrization, **fields)


@pytest.mark.parametrize("kw", [{}, dict(head_dim=16, mup_base_head_dim=16)], ids=["derived", "head_dim"])
def test_at_the_base_width_mup_is_the_standard_model(kw):
    torch.manual_seed(0)
    std = Transformer(config(BASE, "standard", **kw))
    torch.manual_seed(0)
    mup = Transformer(config(BASE, **kw))
    tokens = torch.randint(0, 64, (2, 12))
    assert all(torch.equal(p, q) for p, q in zip(std.parameters(), mup.parameters(), strict=True))
    torch.testing.assert_close(mup(tokens), std(tokens), rtol=0, atol=1e-6)
    lrs = {g["name"]: g["lr"] for g in param_groups(mup, OptimConfig(lr=1e-3))}
    assert lrs == {"decay": 1e-3, "no_decay": 1e-3, "decay/hidden": 1e-3}


def test_mup_scales_init_lr_logits_and_attention_with_width():
    """At 4× the base width: hidden matrices' std and Adam LR / 4^(1/2) and / 4; logits / 4; scores · √D₀/D."""
    m, wide = 4, config(4 * BASE)
    torch.manual_seed(0)
    model = Transformer(wide)
    std = Transformer(wide.replace(parametrization="standard"))
    assert model.layers[0].attn.q_proj.std == pytest.approx(std.layers[0].attn.q_proj.std / math.sqrt(m))
    assert model.layers[1].mlp.down_proj.std == pytest.approx(std.layers[1].mlp.down_proj.std / math.sqrt(m))
    assert model.tok_embeddings.std == std.tok_embeddings.std and model.output.std == std.output.std
    assert model.layers[0].attn.scale == pytest.approx(math.sqrt(BASE / 4) / (4 * BASE / 4))
    groups = {g["name"]: g for g in param_groups(model, OptimConfig(lr=1e-3))}
    hidden = {id(p) for p in groups["decay/hidden"]["params"]}
    assert groups["decay/hidden"]["lr"] == pytest.approx(1e-3 / m) and groups["decay"]["lr"] == 1e-3
    assert hidden == {id(p) for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("layers.")}
    # the readout multiplier: the same weights, standard, give m× the logits (no softcap, no attention change
    # with one position)
    std.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 64, (2, 1))
    torch.testing.assert_close(model(tokens) * m, std(tokens), rtol=1e-5, atol=1e-6)


def test_mup_attention_scale_with_an_explicit_head_dim():
    """An explicit head_dim (≠ dim/n_heads) says through mup_base_head_dim how the head dim scales: held fixed as
    the model widens (more heads, as in the Qwen3 family) the scale is 1/√D at every width; grown with the width
    it is √D₀/D as for a derived head dim. Without it the config is refused rather than guessed."""
    with pytest.raises(ValueError, match=r"ModelConfig.head_dim=16 is not dim/n_heads.*set mup_base_head_dim"):
        config(BASE, head_dim=16)
    for width, heads in ((BASE, 4), (2 * BASE, 8), (4 * BASE, 16)):  # fixed head dim, more heads
        cfg = config(width, head_dim=16, mup_base_head_dim=16, n_heads=heads)
        assert Transformer(cfg).layers[0].attn.scale == pytest.approx(1 / 4)
    for width in (BASE, 4 * BASE):  # head dim 2·dim/heads, growing with the width
        head_dim, base_head_dim = 2 * width // 4, 2 * BASE // 4
        cfg = config(width, head_dim=head_dim, mup_base_head_dim=base_head_dim)
        assert Transformer(cfg).layers[0].attn.scale == pytest.approx(math.sqrt(base_head_dim) / head_dim)


@pytest.mark.parametrize("kw", [dict(preset="llama"), dict(preset="qwen3", bias=False), dict(preset="olmo2")],
                         ids=["llama", "qwen3-qk-head", "olmo2-qk-full"])
def test_to_standard_folds_the_multipliers_with_the_same_logits(kw):
    torch.manual_seed(0)
    model = Transformer(config(4 * BASE, **kw))
    with torch.no_grad():  # trained-looking gains, so folding into a QK-norm gain is really exercised
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    folded = to_standard(model)
    tokens = torch.randint(0, 64, (2, 12))
    assert folded.cfg.parametrization == "standard"
    torch.testing.assert_close(folded(tokens), model(tokens), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the μP model is untouched
    # ... and Hugging Face runs the folded weights to the μP model's logits (what `normlab export` writes)
    torch.testing.assert_close(to_hf(folded)(tokens).logits, model(tokens), rtol=1e-4, atol=1e-5)


def test_export_refuses_what_cannot_be_folded():
    with pytest.raises(ValueError, match="tie_embeddings=True cannot|shared embedding"):
        to_standard(Transformer(config(64, tie_embeddings=True)))


def coordcheck(parametrization: str) -> dict[str, float]:
    spec = CheckSpec(widths=(32, 64, 128), base_width=32, n_layers=1, vocab_size=64, seq_len=16, batch_size=4,
                     steps=3, lr=1e-2)
    return run(spec, [dict(placement="pre", norm="rmsnorm", parametrization=parametrization)])[0]["slopes"]


MUP_FLAT = 0.4  # |slope| bound under μP (measured: within ±0.25 at these tiny widths and 3 steps)


def test_coordinate_check_mup_is_flat_and_standard_logits_grow():
    mup, std = coordcheck("mup"), coordcheck("standard")
    assert set(mup) == {"stream/L0", "attn/L0", "mlp/L0", "logits"}
    assert all(abs(s) < MUP_FLAT for s in mup.values()), mup
    assert std["logits"] > 0.6, std  # Adam under SP: logits ∝ width after a few steps (measured ≈ +1)


def test_coordcheck_command_writes_plot_and_table(tmp_path, capsys):
    out = tmp_path / "cc"
    assert main(["--widths", "32", "64", "--base_width", "32", "--n_layers", "1", "--steps", "1", "--seq_len", "8",
                 "--batch_size", "2", "--vocab_size", "32", "--placements", "post", "--parametrizations", "mup",
                 "--output", str(out)]) == 0
    assert (out / "coordcheck.png").stat().st_size > 0
    assert "| post | rmsnorm | mup | logits |" in capsys.readouterr().out
    from training.cli import main as normlab  # (a user error is printed by the one entry point)

    assert normlab(["coordcheck", "--widths", "32", "66", "--output", str(out)]) == 2
    assert capsys.readouterr().err.startswith("normlab coordcheck: error: width 66, {'placement': 'pre', 'norm': "
                                              "'rmsnorm', 'parametrization': 'standard'}: ModelConfig.dim=66 must be "
                                              "divisible by n_heads=4")

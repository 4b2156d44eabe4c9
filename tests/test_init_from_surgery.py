"""Norm surgery's parameter transfer (training/checkpointing/surgery.py), in process on tiny models: what is copied,
converted, initialized and dropped, and the distance it reports."""
from __future__ import annotations

import pytest
import torch

from model import ModelConfig, Transformer
from training.checkpointing.surgery import distance, transfer
from training.errors import UserError

SIZES = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, head_dim=12, max_seq_len=16)


def source_model(**fields) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("qwen3", **SIZES, **fields)).eval()
    with torch.no_grad():  # gains away from 1, so a gain that is not carried over shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def after_surgery(src: Transformer, **changes) -> tuple[Transformer, object]:
    cfg = src.cfg.replace(**changes)
    torch.manual_seed(1)  # another random init: everything that matters must come from the transfer
    model = Transformer(cfg).eval()
    return model, transfer(src.state_dict(), src.cfg, model, cfg)


def kl(a: Transformer, b: Transformer) -> dict[str, float]:
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return distance(a(tokens), b(tokens))


def test_unchanged_fields_copy_everything_and_give_kl_zero():
    src = source_model()
    model, report = after_surgery(src)
    assert not report.initialized and not report.dropped and len(report.copied) == len(src.state_dict())
    assert kl(src, model) == {"surgery/kl": 0.0, "surgery/max_abs_logit_diff": 0.0}


def test_norm_offset_is_converted_so_the_function_is_kept():
    src = source_model()
    model, report = after_surgery(src, norm_offset=True)
    assert report.converted and not report.initialized
    assert torch.allclose(model.norm.weight, src.norm.weight - 1)
    assert kl(src, model)["surgery/max_abs_logit_diff"] < 1e-5


def test_pre_to_post_drops_and_initializes_as_declared():
    src = source_model()
    model, report = after_surgery(src, placement="post")
    assert "norm.weight" in report.dropped and "layers.0.attn_res.norm_in.weight" in report.dropped
    assert report.initialized["layers.1.mlp_res.norm_out.weight"] == "1"
    assert torch.equal(model.layers[1].mlp_res.norm_out.weight, torch.ones(32))
    assert torch.equal(model.layers[0].attn.q_norm.weight, src.layers[0].attn.q_norm.weight)  # common: copied
    assert kl(src, model)["surgery/kl"] > 1e-4


@pytest.mark.parametrize("norm", ["dyt", "layernorm", "none"])
def test_norm_kind_changes(norm):
    src = source_model()
    model, report = after_surgery(src, norm=norm, dyt_alpha=0.3, bias=norm == "layernorm")
    if norm == "dyt":
        assert model.norm.alpha.item() == pytest.approx(0.3) and torch.equal(model.norm.bias, torch.zeros(32))
        assert torch.equal(model.norm.weight, src.norm.weight)  # RMSNorm's gain becomes DyT's γ
        assert report.initialized["norm.alpha"] == "model.dyt_alpha (0.3)"
    if norm == "none":
        assert "norm.weight" in report.dropped and not report.initialized
    assert kl(src, model)["surgery/kl"] > 0


def test_the_newer_fields_start_as_the_new_model_builds_them():
    """Surgery onto the 2024–2026 fields: a parameter the source lacks starts at its initialization (a branch scale
    at branch_scale_init, a sink logit at 0, Derf's α at its location's α₀ and its shift at 0, an l2 temperature at
    √D); a matrix the source lacks (an output gate) is refused."""
    src = source_model()
    model, report = after_surgery(src, norm="derf", dyt_alpha={"attn": 0.8, "mlp": 0.2, "final": 0.4},
                                  branch_scale="vector", branch_scale_init=0.1, attn_sink="learnable",
                                  qk_norm_kind="l2")
    assert torch.equal(model.layers[1].mlp_res.branch_scale, torch.full((32,), 0.1))
    assert report.initialized["layers.1.mlp_res.branch_scale"] == "0.1"
    assert torch.equal(model.layers[0].attn.sink.logit, torch.zeros(4)) and model.norm.shift.item() == 0.0
    assert model.norm.alpha.item() == pytest.approx(0.4) and report.initialized["norm.alpha"] == \
        "model.dyt_alpha (0.4)"
    assert report.initialized["layers.0.mlp_res.norm_in.alpha"] == "model.dyt_alpha (0.2)"
    assert model.layers[0].attn.q_norm.temperature.item() == pytest.approx(12 ** 0.5)  # √head_dim
    assert torch.equal(model.norm.weight, src.norm.weight)  # RMSNorm's gain becomes Derf's γ
    cfg = src.cfg.replace(attn_gate="head")
    with pytest.raises(UserError, match=r"'layers.0.attn.gate_proj.weight' is not in the source and is not a norm"):
        transfer(src.state_dict(), src.cfg, Transformer(cfg), cfg)


def test_a_changed_size_is_refused():
    src = source_model()
    cfg = src.cfg.replace(ffn_dim=96)
    with pytest.raises(UserError, match=r"mlp.gate_proj.weight has shape \(\d+, 32\) in the source and \(96, 32\)"):
        transfer(src.state_dict(), src.cfg, Transformer(cfg), cfg)

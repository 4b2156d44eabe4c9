"""The attention-side fields' config surface: parameter kinds for the optimizer, gain telemetry roles, QK-norm's
kind independent of the block norm, a learnable sink's start, combinations refused in one line, and parsing from
the command line. Their math is in tests/test_model_attention_fields.py."""
from __future__ import annotations

import pytest
import torch

from model import Transformer
from model.attention import Attention
from model.probes import gain_tags
from tests.helpers.model import tiny_config


def test_parameters_outside_matrices_and_gains_declare_their_kind():
    model = Transformer(tiny_config(qk_norm="head", qk_norm_kind="l2", attn_sink="learnable"))
    declared = {f"{prefix}.{attr}": kind for prefix, m in model.named_modules()
                for attr, kind in getattr(type(m), "param_kinds", {}).items() if getattr(m, attr) is not None}
    want = {f"layers.{i}.attn.{name}": kind for i in range(2)
            for name, kind in (("q_norm.temperature", "qk_temperature"), ("sink.logit", "attn_sink"))}
    assert {k: v for k, v in declared.items() if v in ("qk_temperature", "attn_sink")} == want
    params = dict(model.named_parameters())
    assert all(params[name].ndim < 2 for name in want)
    assert "layers.0.attn.k_norm.temperature" not in params  # the key side has no temperature


def test_a_learnable_sink_starts_as_off_by_one():
    def logits(sink: str) -> torch.Tensor:
        torch.manual_seed(0)
        return Transformer(tiny_config(kernels="torch", attn_sink=sink))(torch.arange(12)[None])

    torch.testing.assert_close(logits("learnable"), logits("off_by_one"), rtol=0, atol=0)
    assert not torch.allclose(logits("learnable"), logits("none"))


def test_new_norms_have_gain_telemetry_roles():
    tags = gain_tags(Transformer(tiny_config(qk_norm="qkv", sub_norm=True)))
    assert {tags[f"layers.1.{n}.weight"][0] for n in ("attn.v_norm", "attn.sub_norm", "mlp.sub_norm")} == {
        "v/L1", "attn_sub/L1", "mlp_sub/L1"}


def test_qk_norm_kind_is_independent_of_the_block_norm():
    def q_norm(**kw):
        return type(Attention(tiny_config(**kw), 0).q_norm).__name__

    assert q_norm(norm="dyt", qk_norm="head") == "DyT"  # auto: today's behaviour
    assert q_norm(norm="dyt", qk_norm="head", qk_norm_kind="rmsnorm") == "RMSNorm"
    assert q_norm(norm="none", qk_norm="qkv", qk_norm_kind="layernorm") == "LayerNorm"
    assert q_norm(qk_norm="head", qk_norm_kind="l2") == "L2Norm"


@pytest.mark.parametrize("overrides, fragment", [
    (dict(qk_norm_kind="l2"), "qk_norm_kind='l2' needs a QK-norm: set qk_norm to one of ['head', 'full', 'qkv']"),
    (dict(qk_norm="full", qk_norm_kind="l2"), "qk_norm_kind='l2' normalizes each head's q and k"),
    (dict(qk_norm="qkv", qk_norm_kind="l2"), "needs qk_norm='head' (got qk_norm='qkv'"),
    (dict(norm="none", sub_norm=True), "sub_norm=True uses the block norm's kind, and norm='none'"),
])
def test_combinations_without_a_meaning_are_refused_in_one_line(overrides, fragment):
    with pytest.raises(ValueError) as err:
        tiny_config(**overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
@pytest.mark.parametrize("argv", [
    ["--model.qk_norm", "head", "--model.qk_norm_kind", "l2", "--model.sub_norm", "true", "--model.attn_gate",
     "elementwise", "--model.attn_sink", "learnable"],
    ["--model.qk_norm", "qkv", "--model.qk_norm_kind", "layernorm", "--model.attn_gate", "head",
     "--model.attn_sink", "off_by_one"],
], ids=["l2-sub-elementwise-learnable", "qkv-layernorm-head-off_by_one"])
def test_the_fields_parse_from_the_command_line(argv, capsys):
    from tests.test_cli import _resolved_model, print_config

    cfg = _resolved_model(print_config(argv, capsys))
    want = dict(zip((a.removeprefix("--model.") for a in argv[::2]), argv[1::2], strict=True))
    want["sub_norm"] = want.get("sub_norm") == "true"
    assert {k: getattr(cfg, k) for k in want} == want

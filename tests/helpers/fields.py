"""The ModelConfig fields outside the registries, as cases for the field matrix (tests/test_model_fields.py).

Each `FieldCase` names the field it exercises and a set of overrides of the tiny config that turns it on. Every case
runs the same checks: the parameter count from the config, finite gradients for every parameter, causality, a
meta-device build equal to an eager one, HF export refused naming the field, and μP either covering it or refusing
it in one line. A new field joins by adding a case to one of the lists below.
"""
from __future__ import annotations

from typing import Any, NamedTuple


class FieldCase(NamedTuple):
    field: str  # the ModelConfig field the case is about (named by export's and μP's refusals)
    overrides: dict[str, Any]
    mup: bool = True  # True: μP covers the field (it builds and trains under parametrization=mup); False: refused
    identity_at_init: bool = False  # every sublayer's contribution is 0 at step 0 (ReZero): its inputs get no grad yet

    @property
    def id(self) -> str:
        return "-".join(f"{k}={v}" for k, v in self.overrides.items())


# Scalars on the stream and the branches, depth-aware norms, embeddings, gains, new norm kinds.
ALPHA_BY_SITE = {"attn": 0.8, "mlp": 0.2, "final": 0.3}
STREAM_CASES: list[FieldCase] = [
    FieldCase("residual_scale", dict(residual_scale=1.5)),
    FieldCase("residual_scale", dict(residual_scale="deepnorm", placement="post", init="xavier")),  # DeepNet
    FieldCase("branch_scale", dict(branch_scale="scalar"), identity_at_init=True),  # ReZero: g = 0
    FieldCase("branch_scale", dict(branch_scale="vector", branch_scale_init=0.1)),  # LayerScale
    FieldCase("norm_depth_scale", dict(norm_depth_scale=True, placement="sandwich")),  # LayerNorm Scaling
    FieldCase("placement_mlp", dict(placement="post", placement_mlp="none")),  # HybridNorm's residual structure
    FieldCase("mix_ln", dict(mix_ln=0.5)),  # Mix-LN: layer 0 post-norm, layer 1 pre-norm
    FieldCase("embed_norm", dict(embed_norm=True)),
    FieldCase("norm", dict(norm="dyt", dyt_alpha=ALPHA_BY_SITE, embed_norm=True)),
    FieldCase("embed_scale", dict(embed_scale=4.0)),
    FieldCase("embed_scale", dict(embed_scale="sqrt_dim"), mup=False),  # grows with the width
    FieldCase("norm_affine", dict(norm_affine=False, qk_norm="head")),
    FieldCase("norm", dict(norm="derf", dyt_alpha=ALPHA_BY_SITE, norm_affine=False)),
    FieldCase("norm", dict(norm="derf", placement="output", qk_norm="full")),
    FieldCase("norm", dict(norm="rmsnorm_scalar", qk_norm="head")),
]

# Attention: QK-norm kinds, V-norm, sub-norms, gates, sinks. (A case's other overrides must keep some HF family
# one field away, so that export names this field: a DyT model with RMSNorm QK-norm is tested in
# tests/test_model_attention_fields.py instead.)
ATTENTION_CASES: list[FieldCase] = [
    FieldCase("qk_norm", {"qk_norm": "qkv"}),
    FieldCase("qk_norm_kind", {"qk_norm": "head", "qk_norm_kind": "l2"}),
    FieldCase("qk_norm_kind", {"qk_norm": "full", "qk_norm_kind": "layernorm", "bias": True}),
    FieldCase("sub_norm", {"sub_norm": True}),
    FieldCase("attn_gate", {"attn_gate": "head"}),
    FieldCase("attn_gate", {"attn_gate": "elementwise", "bias": True}),
    FieldCase("attn_sink", {"attn_sink": "learnable"}),
    FieldCase("attn_sink", {"attn_sink": "off_by_one"}),
]

FIELD_CASES: list[FieldCase] = STREAM_CASES + ATTENTION_CASES

"""Conversion to and from Hugging Face `transformers` models: one name table, used by tests and export.

A normlab config maps to a `transformers` family only when every structural field matches that family;
otherwise the error names the first field that prevents it. `transformers` is imported lazily, so `model`
works without it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from model.config import ModelConfig
from model.names import split_layer
from model.transformer import Transformer


@dataclass(frozen=True)
class Family:
    model_type: str
    config_class: str
    model_class: str
    requires: dict[str, Any]  # ModelConfig fields that must have exactly these values
    norm_names: dict[str, str] = field(default_factory=dict)  # our placement norms → HF layer norms
    bias_fields: tuple[str, ...] = ()  # HF config flags that follow ModelConfig.bias


# Names shared by every family; `{i}` is the layer index.
COMMON_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    **{f"layers.{{i}}.attn.{p}.{t}": f"model.layers.{{i}}.self_attn.{p}.{t}"
       for p in ("q_proj", "k_proj", "v_proj", "o_proj") for t in ("weight", "bias")},
    **{f"layers.{{i}}.mlp.{p}.{t}": f"model.layers.{{i}}.mlp.{p}.{t}"
       for p in ("gate_proj", "up_proj", "down_proj") for t in ("weight", "bias")},
    "layers.{i}.attn.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.attn.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}

# Llama/Qwen3: `post_attention_layernorm` is the norm *before the MLP*, despite its name.
_PRE_NORM_NAMES = {
    "layers.{i}.attn_res.norm_in.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.mlp_res.norm_in.weight": "model.layers.{i}.post_attention_layernorm.weight",
}
_STRUCTURE = dict(norm="rmsnorm", norm_offset=False, mlp="swiglu", logit_softcap=None, attn_softcap=None,
                  has_final_norm=True)
# The 2024–2026 fields (residual stream, attention): transformers' families have none of them.
_STRUCTURE.update(norm_affine=True, qk_norm_kind="auto", sub_norm=False, attn_gate="none",
                  attn_sink="none", residual_scale=1.0, branch_scale="none", norm_depth_scale=False,
                  placement_mlp=None, mix_ln=0.0, embed_norm=False, embed_scale=1.0)

_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}

FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaConfig", "LlamaForCausalLM",
                    dict(_STRUCTURE, placement="pre", qk_norm="none", norm_cast="llama"),
                    _PRE_NORM_NAMES, bias_fields=("attention_bias", "mlp_bias")),
    "qwen3": Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM",
                    dict(_STRUCTURE, placement="pre", qk_norm="head", norm_cast="llama", bias=False),
                    _PRE_NORM_NAMES),
    # OLMo 2 normalizes sublayer outputs: its two norms sit after attention and after the MLP.
    "olmo2": Family("olmo2", "Olmo2Config", "Olmo2ForCausalLM",
                    dict(_STRUCTURE, placement="output", qk_norm="full", norm_cast="gemma", bias=False),
                    {"layers.{i}.attn_res.norm_out.weight": "model.layers.{i}.post_attention_layernorm.weight",
                     "layers.{i}.mlp_res.norm_out.weight": "model.layers.{i}.post_feedforward_layernorm.weight"}),
}


def _value(cfg: ModelConfig, name: str) -> Any:
    if name == "placement_mlp" and cfg.placement_mlp == cfg.placement:
        return None  # the same model as None (the MLP follows `placement`)
    return getattr(cfg, name)


def hf_family(cfg: ModelConfig) -> Family:
    """The `transformers` family `cfg` is equivalent to, or a ValueError naming the field that prevents it."""
    best, best_misses = None, None
    for fam in FAMILIES.values():
        misses = [k for k, v in fam.requires.items() if _value(cfg, k) != v]
        misses.sort(key=lambda k: k not in _FIELDS)  # a field before what follows from it (has_final_norm)
        if not misses:
            return fam
        if best_misses is None or len(misses) < len(best_misses):
            best, best_misses = fam, misses
    name = best_misses[0]
    options = ", ".join(f"{f.model_type}: {name}={f.requires[name]!r}" for f in FAMILIES.values() if name in f.requires)
    raise ValueError(
        f"ModelConfig.{name}={_value(cfg, name)!r} has no Hugging Face equivalent (closest family "
        f"{best.model_type!r} needs {options}); export with --format safetensors to keep normlab's own format"
    )


def _name_table(fam: Family) -> dict[str, str]:
    return {**COMMON_NAMES, **fam.norm_names}


def _translate(key: str, table: dict[str, str]) -> str:
    block = split_layer(key)
    template = f"{block[0]}{{i}}.{block[2]}" if block else key
    if template not in table:
        raise KeyError(f"no Hugging Face name for parameter {key!r}")
    return table[template].replace("{i}", str(block[1])) if block else table[template]


def to_hf_config(cfg: ModelConfig, **extra: Any):
    """The `transformers` config equivalent to `cfg`; `extra` sets other HF fields (e.g. token ids)."""
    import transformers

    fam = hf_family(cfg)
    kwargs = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rope_parameters=_rope_parameters(cfg),
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu",
        initializer_range=cfg.init_std, attention_dropout=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    kwargs.update({f: cfg.bias for f in fam.bias_fields})
    kwargs.update(extra)
    return getattr(transformers, fam.config_class)(**kwargs)


def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    table = _name_table(hf_family(model.cfg))
    return {_translate(k, table): v for k, v in model.state_dict().items()}


def to_hf(model: Transformer):
    """A `transformers` *ForCausalLM equivalent to `model`, with its weights copied (fp32, eval mode)."""
    import transformers

    hf_cfg = to_hf_config(model.cfg)
    hf_model = getattr(transformers, hf_family(model.cfg).model_class)(hf_cfg)
    state = {k: v.detach().clone() for k, v in to_hf_state_dict(model).items()}
    if model.cfg.tie_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    hf_model.load_state_dict(state, strict=True)
    return hf_model.eval()


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        factor, low, high, context = cfg.rope_scaling
        params.update(factor=factor, low_freq_factor=low, high_freq_factor=high,
                      original_max_position_embeddings=context)
    return params


def _rope_fields(hf_cfg) -> dict[str, Any]:
    """The ModelConfig rope_* fields of a `transformers` config (its `rope_parameters`, or the older top-level
    `rope_theta` / `rope_scaling`)."""
    params = dict(getattr(hf_cfg, "rope_parameters", None) or getattr(hf_cfg, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", getattr(hf_cfg, "rope_theta", None) or 10000.0))
    if float(params.get("partial_rotary_factor", getattr(hf_cfg, "partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported (normlab rotates every feature of a head)")
    if rope_type == "default":
        return {"rope_theta": theta}
    if rope_type == "llama3":
        return {"rope_theta": theta, "rope_type": "llama3", "rope_factor": float(params["factor"]),
                "rope_low_freq_factor": float(params["low_freq_factor"]),
                "rope_high_freq_factor": float(params["high_freq_factor"]),
                "rope_original_max_seq_len": int(params["original_max_position_embeddings"])}
    raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported; supported: 'default', 'llama3'")


def _bias(hf_cfg, fam: Family) -> bool:
    """normlab's one `bias` flag: every linear layer has biases, or none has."""
    flags = {f: bool(getattr(hf_cfg, f, False)) for f in ("attention_bias", *fam.bias_fields)}
    if len(set(flags.values())) > 1:
        raise ValueError(f"{flags} mixes biased and unbiased layers; normlab's `bias` is one flag for all of them")
    if any(flags.values()) and not fam.bias_fields:  # Qwen3's / OLMo 2's MLPs have no bias to match
        raise ValueError(f"attention_bias=True is not supported for model_type={fam.model_type!r}")
    return any(flags.values())


def config_from_hf(hf_cfg, **overrides: Any) -> ModelConfig:
    """The normlab config equivalent to a `transformers` config of a supported family; a ValueError naming the
    first field that has no normlab equivalent."""
    fam = FAMILIES.get(hf_cfg.model_type)
    if fam is None:
        raise ValueError(f"model_type={hf_cfg.model_type!r} is not supported; choose one of {sorted(FAMILIES)}")
    if getattr(hf_cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_cfg.hidden_act!r} is not supported (SwiGLU needs 'silu')")
    if getattr(hf_cfg, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported (normlab attends to the whole context)")
    if getattr(hf_cfg, "pretraining_tp", 1) not in (None, 1):
        raise ValueError(f"pretraining_tp={hf_cfg.pretraining_tp} is not supported (set it to 1: it only splits "
                         "matmuls for tensor parallelism)")
    structure = {k: v for k, v in fam.requires.items() if k != "has_final_norm"}
    return ModelConfig(**{
        **structure, "bias": _bias(hf_cfg, fam), "init_std": hf_cfg.initializer_range,
        "vocab_size": hf_cfg.vocab_size, "dim": hf_cfg.hidden_size, "n_layers": hf_cfg.num_hidden_layers,
        "n_heads": hf_cfg.num_attention_heads, "n_kv_heads": hf_cfg.num_key_value_heads,
        "head_dim": getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads,
        "ffn_dim": hf_cfg.intermediate_size, "max_seq_len": hf_cfg.max_position_embeddings,
        **_rope_fields(hf_cfg), "norm_eps": hf_cfg.rms_norm_eps,
        "tie_embeddings": bool(hf_cfg.tie_word_embeddings), **overrides,
    })


def state_dict_from_hf(cfg: ModelConfig, hf_state: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """(Hugging Face name, tensor) pairs of a model of `cfg`'s family → normlab's state dict (same tensors).
    A tied model's `lm_head.weight` is dropped (the embedding holds it); rotary buffers are not weights."""
    reverse = {v: k for k, v in _name_table(hf_family(cfg)).items()}
    state = {}
    for key, value in hf_state:
        if (cfg.tie_embeddings and key == "lm_head.weight") or key.endswith("rotary_emb.inv_freq"):
            continue
        state[_translate(key, reverse)] = value
    return state


def from_hf(hf_model, **overrides: Any) -> Transformer:
    """A normlab `Transformer` equivalent to a `transformers` *ForCausalLM, with its weights copied."""
    cfg = config_from_hf(hf_model.config, **overrides)
    with torch.device("meta"):
        model = Transformer(cfg)
    state = state_dict_from_hf(cfg, ((k, v.detach().clone()) for k, v in hf_model.state_dict().items()))
    model.load_state_dict(state, strict=True, assign=True)
    return model

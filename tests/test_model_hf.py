"""Logit parity with Hugging Face `transformers` models holding the same (random) weights, both directions."""
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally; never reach for the hub
import transformers  # noqa: E402  a test dependency: if it does not import, the parity tests fail (never skip)

from model import ModelConfig, Transformer  # noqa: E402
from model.hf_compat import config_from_hf, from_hf, hf_family, to_hf  # noqa: E402

SIZES = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=32,
             rope_theta=500000.0)
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}


def _random_model(preset: str, **overrides) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset(preset, **{**SIZES, **overrides}, init_std=0.1)).eval()
    with torch.no_grad():  # gains away from 1 so a swapped or missing norm cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("preset", sorted(HF_CLASSES))
def test_logits_equal_transformers(preset, tie):
    model = _random_model(preset, tie_embeddings=tie)
    hf = to_hf(model)
    assert type(hf).__name__ == HF_CLASSES[preset]
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5

    back = from_hf(hf)
    assert back.cfg == model.cfg
    sd, sd_back = model.state_dict(), back.state_dict()
    assert sd.keys() == sd_back.keys()
    assert all(torch.equal(sd[k], sd_back[k]) for k in sd)


@pytest.mark.parametrize("preset", ["llama", "qwen3"])
def test_from_independently_built_transformers_model(preset):
    """The other direction: a model `transformers` built and initialized itself, converted to ours."""
    cfg_class = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[preset]
    hf_cfg = cfg_class(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                       rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(1)
    hf = getattr(transformers, HF_CLASSES[preset])(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ours = from_hf(hf)
    assert ours.cfg.qk_norm == ("head" if preset == "qwen3" else "none")
    tokens = torch.randint(0, 128, (3, 40))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5


def test_save_pretrained_round_trip(tmp_path):
    model = _random_model("olmo2")
    to_hf(model).save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    tokens = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert (model(tokens) - loaded(tokens).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("override, field", [
    (dict(placement="sandwich"), "placement"),
    (dict(norm="layernorm"), "norm"),
    (dict(norm_offset=True), "norm_offset"),
    (dict(qk_norm="full"), "qk_norm"),
    (dict(final_norm=False), "has_final_norm"),
])
def test_unexportable_config_names_the_field(override, field):
    cfg = ModelConfig.preset("llama", **SIZES, **override)
    with pytest.raises(ValueError, match=f"ModelConfig.{field}="):
        hf_family(cfg)


def test_post_and_gpt2_presets_have_no_equivalent():
    for preset in ("post", "gpt2"):
        with pytest.raises(ValueError, match="--format safetensors"):
            hf_family(ModelConfig.preset(preset, **SIZES))


def test_unsupported_hf_config_is_refused():
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        config_from_hf(cfg)

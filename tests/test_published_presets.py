"""configs/model/ presets of published models: each gives the published parameter count, counted three ways —
our model built on the meta device, `ModelConfig.num_params`, and `transformers` building the model's own
config.json (copied below from the Hub) on the meta device — and its config is what `config_from_hf` reads."""
import os
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  a test dependency

from model import ModelConfig, Transformer  # noqa: E402
from model.hf_compat import config_from_hf  # noqa: E402

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "model"

# The architecture fields of each model's config.json on the Hugging Face Hub, and its published size: the
# exact count where the model card or safetensors metadata gives one, else the rounded figure of the card.
PUBLISHED = {
    "smollm2_135m": (dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                          tie_word_embeddings=True, initializer_range=0.041666666666666664),
                     134_515_008, "135M"),
    "qwen3_0_6b": (dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                        tie_word_embeddings=True, initializer_range=0.02),
                   596_049_920, "0.6B"),
    "llama3_2_1b": (dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         initializer_range=0.02, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
                    1_235_814_400, "1.23B"),
    "olmo2_0425_1b": (dict(model_type="olmo2", vocab_size=100352, hidden_size=2048, intermediate_size=8192,
                           num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                           max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-6,
                           tie_word_embeddings=False, initializer_range=0.02),
                      1_484_916_736, "1.48B"),
}


def preset_config(name: str) -> ModelConfig:
    model = dict(yaml.safe_load((PRESETS / f"{name}.yaml").read_text())["model"])
    return ModelConfig.preset(model.pop("preset"), **model)


def _near(n: int, figure: str) -> bool:
    """`n` within one unit of the figure's last digit ("1.23B": ±0.01B; cards round or truncate)."""
    scale = {"M": 1e6, "B": 1e9}[figure[-1]]
    unit = 10.0 ** -len(figure[:-1].partition(".")[2])
    return abs(n / scale - float(figure[:-1])) < unit


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_has_the_published_parameter_count(name):
    hf_fields, exact, figure = PUBLISHED[name]
    cfg = preset_config(name)
    with torch.device("meta"):
        ours = sum(p.numel() for p in Transformer(cfg).parameters())
        hf_cfg = transformers.AutoConfig.for_model(**hf_fields)
        theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_cfg).parameters())
    assert ours == cfg.num_params() == theirs == exact
    assert _near(exact, figure)
    # the preset is the model's own config, field for field (rope scaling, head_dim, tying, eps, …)
    assert config_from_hf(hf_cfg) == cfg

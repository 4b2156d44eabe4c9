"""The shapes of today's published 0.1–1B models at tiny size: explicit head_dim, Llama 3 RoPE scaling, tied
embeddings — parity with `transformers` models built here from configs (random weights), both directions,
through the fused kernels too, and greedy generation with the KV cache."""
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  a test dependency: if it does not import, these tests fail (never skip)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from model import ModelConfig  # noqa: E402
from model.generate import generate  # noqa: E402
from model.hf_compat import config_from_hf, from_hf, to_hf  # noqa: E402
from model.rope import RopeScaling, inv_freq  # noqa: E402
from tests.test_kernels_accuracy import TRITON  # noqa: E402  (sets TRITON_INTERPRET first on CPU-only machines)

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
COMMON = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
              max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.1)


def tiny_hf_config(kind: str, **changes):
    """Tiny `transformers` configs with each published model's features (the sizes are not theirs)."""
    common = {**COMMON, **changes}
    if kind == "llama3":  # Llama 3.2: llama3 RoPE scaling, GQA, tied embeddings
        return transformers.LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2,
                                        rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=True)
    if kind == "smollm2":  # SmolLM2: the Llama structure with 3 heads sharing 1 KV head, tied embeddings
        return transformers.LlamaConfig(**common, num_attention_heads=3, num_key_value_heads=1,
                                        rope_parameters=dict(rope_type="default", rope_theta=100000.0),
                                        tie_word_embeddings=True)
    if kind == "qwen3":  # Qwen3-0.6B: head_dim 2× hidden/heads, QK-norm per head, tied
        return transformers.Qwen3Config(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
                                        tie_word_embeddings=True)
    if kind == "olmo2":  # OLMo 2: output norms, QK-norm over the projection, untied; plus llama3 RoPE here
        return transformers.Olmo2Config(**common, num_attention_heads=4, num_key_value_heads=4,
                                        rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False)
    raise KeyError(kind)


KINDS = ["llama3", "smollm2", "qwen3", "olmo2"]


def tiny_hf_model(kind: str, seed: int = 0, **changes):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(kind, **changes)).eval()
    with torch.no_grad():  # gains away from 1, so a swapped or missing norm cannot hide
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return hf


def _llama3_float64(head_dim: int, theta: float, s: RopeScaling) -> list[float]:
    """Meta's `apply_scaling` (llama-models, Llama 3.1 reference code) in Python floats (float64)."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < s.original_max_seq_len / s.high_freq_factor:
            out.append(freq)
        elif wavelen > s.original_max_seq_len / s.low_freq_factor:
            out.append(freq / s.factor)
        else:
            smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
            out.append((1 - smooth) * freq / s.factor + smooth * freq)
    return out


@pytest.mark.parametrize("head_dim, context", [(16, 64), (64, 8192), (128, 8192)])
def test_llama3_frequencies_match_transformers_and_float64(head_dim, context):
    rope = dict(LLAMA3_ROPE, original_max_position_embeddings=context)
    hf_cfg = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, rope_parameters=rope,
                                      max_position_embeddings=2 * context)
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, None)
    cfg = config_from_hf(hf_cfg)
    ours = inv_freq(cfg.head_dim, cfg.rope_theta, scaling=cfg.rope_scaling)
    assert attention_factor == 1.0 and cfg.rope_type == "llama3"
    assert torch.equal(ours, theirs)  # bit for bit: the same fp32 operations
    ref = torch.tensor(_llama3_float64(head_dim, cfg.rope_theta, cfg.rope_scaling), dtype=torch.float64)
    assert ((ours.double() - ref).abs() / ref).max() < 1e-6
    plain = inv_freq(cfg.head_dim, cfg.rope_theta)
    assert (ours < plain).any() and (ours == plain).any()  # the scaling took effect and kept the short waves


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_round_trip_with_transformers(kind):
    hf = tiny_hf_model(kind)
    ours = from_hf(hf).eval()
    if kind == "qwen3":
        assert ours.cfg.head_dim == 24 != ours.cfg.dim // ours.cfg.n_heads
    tokens = torch.randint(0, 96, (2, 100))  # beyond the original context of 64: the rescaled waves matter
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5
    back = to_hf(ours)  # the other direction: our model written as a transformers model
    assert config_from_hf(back.config) == ours.cfg
    theirs_sd, back_sd = hf.state_dict(), back.state_dict()
    assert theirs_sd.keys() == back_sd.keys()
    assert all(torch.equal(theirs_sd[k], back_sd[k]) for k in theirs_sd)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)


@pytest.mark.skipif(TRITON not in ("cuda", "interpreter"), reason=f"Triton state {TRITON!r}")
@pytest.mark.parametrize("kind", ["llama3", "qwen3", "olmo2"])
def test_logits_through_fused_kernels(kind):
    hf = tiny_hf_model(kind)
    ours = from_hf(hf, kernels="triton").eval()
    tokens = torch.randint(0, 96, (1, 72))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_with_cache_equals_transformers(kind):
    hf = tiny_hf_model(kind, seed=1)
    ours = from_hf(hf).eval()
    prompt = torch.randint(0, 96, (2, 6))
    mine = generate(ours, prompt, 70)  # past the original context of 64
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=70, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    assert torch.equal(mine, theirs)


@pytest.mark.parametrize("change, message", [
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=64)),
     "rope_type='yarn'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True), "mixes biased and unbiased"),
])
def test_unsupported_features_are_named(change, message):
    hf_cfg = tiny_hf_config("smollm2")
    for key, value in change.items():
        setattr(hf_cfg, key, value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        config_from_hf(hf_cfg)


def test_head_dim_defaults_and_follows_width():
    cfg = ModelConfig(dim=64, n_heads=4)
    assert cfg.head_dim == 16 and cfg.to_dict()["head_dim"] == 16
    assert cfg.replace(dim=128).head_dim == 32  # a derived head_dim follows the width
    wide = ModelConfig(dim=64, n_heads=4, head_dim=32)
    assert wide.replace(dim=128).head_dim == 32  # an explicit one is kept
    assert wide.num_params() == sum(p.numel() for p in __import__("model").Transformer(wide).parameters())
    with pytest.raises(ValueError, match="head_dim=15 must be even"):
        ModelConfig(dim=60, n_heads=4, head_dim=15)
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        ModelConfig(rope_type="yarn")

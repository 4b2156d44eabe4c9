"""Tiny configs shared by the model tests."""
from model import ModelConfig

TINY = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})

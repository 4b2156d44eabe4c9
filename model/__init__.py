"""normlab's model: a Llama-style decoder whose normalization is pluggable on independent axes.

Plain PyTorch — nothing here imports Lightning, DeepSpeed, `data` or `training`.
"""
from model.config import PRESETS, ModelConfig
from model.transformer import Transformer

__all__ = ["ModelConfig", "Transformer", "PRESETS"]

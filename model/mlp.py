"""SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) ⊙ up(x)), as in Llama, Qwen3 and OLMo 2."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.init import init_std
from model.layers import Linear


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        d, h = cfg.dim, cfg.hidden_dim
        self.gate_proj = Linear(d, h, cfg.bias, init_std(cfg, "in", layer_id))
        self.up_proj = Linear(d, h, cfg.bias, init_std(cfg, "in", layer_id))
        self.down_proj = Linear(h, d, cfg.bias, init_std(cfg, "out", layer_id))  # writes to the residual stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

"""Feed-forward sublayers, chosen by name from `MLPS`: SwiGLU (Llama, Qwen3, OLMo 2) or a two-matrix MLP with
ReLU (the original Transformer) or GELU (GPT-2, BERT). Width: `ModelConfig.hidden_dim`."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from model.init import init_std
from model.layers import Linear

if TYPE_CHECKING:
    from model.config import ModelConfig


class SwiGLU(nn.Module):
    """down(silu(gate(x)) ⊙ up(x)) (Shazeer 2020)."""

    n_matrices = 3

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        d, h = cfg.dim, cfg.hidden_dim
        self.gate_proj = Linear(d, h, cfg.bias, init_std(cfg, "in", layer_id, (d, h)))
        self.up_proj = Linear(d, h, cfg.bias, init_std(cfg, "in", layer_id, (d, h)))
        self.down_proj = Linear(h, d, cfg.bias, init_std(cfg, "out", layer_id, (h, d)))  # writes to the stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TwoLayerMLP(nn.Module):
    """down(act(up(x))): Vaswani et al. 2017 with ReLU, GPT-2/BERT with GELU (exact erf form)."""

    n_matrices = 2
    activation: Callable[[torch.Tensor], torch.Tensor]

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        d, h = cfg.dim, cfg.hidden_dim
        self.up_proj = Linear(d, h, cfg.bias, init_std(cfg, "in", layer_id, (d, h)))
        self.down_proj = Linear(h, d, cfg.bias, init_std(cfg, "out", layer_id, (h, d)))  # writes to the stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.up_proj(x)))


class ReLUMLP(TwoLayerMLP):
    activation = staticmethod(F.relu)


class GELUMLP(TwoLayerMLP):
    activation = staticmethod(F.gelu)


MLPS: dict[str, type[nn.Module]] = {"swiglu": SwiGLU, "relu": ReLUMLP, "gelu": GELUMLP}

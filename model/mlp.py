"""Feed-forward sublayers, chosen by name from `MLPS`: SwiGLU (Llama, Qwen3, OLMo 2) or a two-matrix MLP with
ReLU (the original Transformer) or GELU (GPT-2, BERT). Width: `ModelConfig.hidden_dim`.

With `sub_norm` (Sub-LN; Magneto, "Foundation Transformers", Wang et al. 2022, arXiv 2210.06423) the hidden
activations are normalized over the hidden width before the down projection: down(N(φ(x))), N of the block
norm's kind."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from model.init import init_std
from model.layers import Linear
from model.norms import build_norm

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
        self.sub_norm = build_norm(cfg, h, where="mlp") if cfg.sub_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(h if self.sub_norm is None else self.sub_norm(h))


class TwoLayerMLP(nn.Module):
    """down(act(up(x))): Vaswani et al. 2017 with ReLU, GPT-2/BERT with GELU (exact erf form)."""

    n_matrices = 2
    activation: Callable[[torch.Tensor], torch.Tensor]

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        d, h = cfg.dim, cfg.hidden_dim
        self.up_proj = Linear(d, h, cfg.bias, init_std(cfg, "in", layer_id, (d, h)))
        self.down_proj = Linear(h, d, cfg.bias, init_std(cfg, "out", layer_id, (h, d)))  # writes to the stream
        self.sub_norm = build_norm(cfg, h, where="mlp") if cfg.sub_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.activation(self.up_proj(x))
        return self.down_proj(h if self.sub_norm is None else self.sub_norm(h))


class ReLUMLP(TwoLayerMLP):
    activation = staticmethod(F.relu)


class GELUMLP(TwoLayerMLP):
    activation = staticmethod(F.gelu)


MLPS: dict[str, type[nn.Module]] = {"swiglu": SwiGLU, "relu": ReLUMLP, "gelu": GELUMLP}

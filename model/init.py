"""All initialization decisions in one place.

`init_std(cfg, role, layer_id)` is the table; every layer asks it for its std when it is constructed
(see `model/layers.py` for why construction time), and `init_weights` re-draws a whole model — the way
to initialize one built on the meta device.

| module                                   | normal      | scaled              | depth                   | zero |
|------------------------------------------|-------------|---------------------|-------------------------|------|
| token embedding, LM head                 | N(0, σ)     | N(0, σ)             | N(0, σ)                 | N(0, σ) |
| q/k/v, MLP gate/up ("in")                | N(0, σ)     | N(0, σ)             | N(0, σ)                 | N(0, σ) |
| attention out, MLP down ("out")          | N(0, σ)     | N(0, σ/√(2L))       | N(0, σ/√(2(l+1)))       | 0    |
| norm gains                               | 1 (stored as 0 when `norm_offset`, applied as 1 + w)              ||||
| biases                                   | 0                                                                 ||||

σ = `init_std`, L = n_layers, l = the 0-based layer index. "out" projections are the two that write into
the residual stream: `scaled` is GPT-2 / Megatron, `depth` is torchtitan / OLMo, `zero` is modded-nanogpt
(each block starts as the identity). Deterministic under `torch.manual_seed`: layers draw in construction
order.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from model.config import ModelConfig

ROLES = ("embed", "in", "out", "head")


def init_std(cfg: ModelConfig, role: str, layer_id: int = 0) -> float:
    """The std of a weight by its role (see the module docstring's table)."""
    if role not in ROLES:
        raise ValueError(f"unknown init role {role!r}; choose one of {ROLES}")
    if role != "out" or cfg.init == "normal":
        return cfg.init_std
    if cfg.init == "scaled":
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    if cfg.init == "depth":
        return cfg.init_std / math.sqrt(2 * (layer_id + 1))
    return 0.0  # "zero"


def init_weights(model: nn.Module) -> None:
    """Re-initialize every parameter of `model` by the table above, in construction order."""
    for module in model.modules():
        if module is not model and hasattr(module, "reset_parameters"):
            module.reset_parameters()

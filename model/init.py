"""All initialization decisions in one place.

`init_std(cfg, role, layer_id, fans)` is the table; every layer asks it for its std when it is constructed
(see `model/layers.py` for why construction time), and `init_weights` re-draws a whole model — the way
to initialize one built on the meta device.

| module                          | normal  | scaled         | depth               | zero    | xavier          |
|---------------------------------|---------|----------------|---------------------|---------|-----------------|
| token embedding, LM head        | N(0, σ) | N(0, σ)        | N(0, σ)             | N(0, σ) | N(0, σ)         |
| q/k/v, MLP gate/up ("in")       | N(0, σ) | N(0, σ)        | N(0, σ)             | N(0, σ) | N(0, √(2/(i+o)))|
| attention out, MLP down ("out") | N(0, σ) | N(0, σ/√(2L))  | N(0, σ/√(2(l+1)))   | 0       | N(0, √(2/(i+o)))|
| norm gains (DyT's γ)            | 1 (stored as 0 when `norm_offset`, applied as 1 + w)                          |||||
| DyT's α                         | `dyt_alpha`                                                                   |||||
| biases (DyT's β)                | 0                                                                             |||||

σ = `init_std`, L = n_layers, l = the 0-based layer index, i/o = the matrix's fan-in/fan-out. "out"
projections are the two that write into the residual stream: `scaled` is GPT-2 / Megatron, `depth` is
torchtitan / OLMo, `zero` is modded-nanogpt (each block starts as the identity). `xavier` is Glorot & Bengio
(2010)'s fan-based variance 2/(i+o) — the variance of fairseq's `xavier_uniform_`, drawn from a normal — on
every block matrix, the setup Xiong et al. (2020) analyse post-LN vs pre-LN in; embedding and head keep σ.
Under `parametrization="mup"` the q/k/v/o and MLP stds above (not xavier's, already fan-based) are multiplied by
√(mup_base_width/dim) (model/mup.py). Deterministic under `torch.manual_seed`: layers draw in construction order.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch import nn

from model.mup import hidden_init_mult

if TYPE_CHECKING:
    from model.config import ModelConfig

ROLES = ("embed", "in", "out", "head")


def init_std(cfg: ModelConfig, role: str, layer_id: int = 0, fans: tuple[int, int] | None = None) -> float:
    """The std of a weight by its role (see the module docstring's table); `fans` = (fan_in, fan_out) of a
    block matrix ("in"/"out"), which `xavier` needs."""
    if role not in ROLES:
        raise ValueError(f"unknown init role {role!r}; choose one of {ROLES}")
    if cfg.init == "xavier" and role in ("in", "out"):
        if fans is None:
            raise ValueError(f"init='xavier' needs the fans of the {role!r} matrix")
        return math.sqrt(2.0 / sum(fans))
    mult = hidden_init_mult(cfg) if role in ("in", "out") else 1.0
    if role != "out" or cfg.init in ("normal", "xavier"):
        return cfg.init_std * mult
    if cfg.init == "scaled":
        return cfg.init_std * mult / math.sqrt(2 * cfg.n_layers)
    if cfg.init == "depth":
        return cfg.init_std * mult / math.sqrt(2 * (layer_id + 1))
    return 0.0  # "zero"


def init_weights(model: nn.Module) -> None:
    """Re-initialize every parameter of `model` by the table above, in construction order."""
    for module in model.modules():
        if module is not model and hasattr(module, "reset_parameters"):
            module.reset_parameters()

"""All initialization decisions in one place.

`init_std(cfg, role, layer_id, fans)` is the table; every layer asks it for its std when it is constructed
(see `model/layers.py` for why construction time), and `init_weights` re-draws a whole model — the way
to initialize one built on the meta device.

| module                              | normal  | scaled        | depth             | zero    | xavier          |
|-------------------------------------|---------|---------------|-------------------|---------|-----------------|
| token embedding, LM head            | N(0, σ) | N(0, σ)       | N(0, σ)           | N(0, σ) | N(0, σ)         |
| q, k ("qk")                         | N(0, σ) | N(0, σ)       | N(0, σ)           | N(0, σ) | N(0, √(2/(i+o)))|
| v, MLP gate/up ("in"), × β          | N(0, σ) | N(0, σ)       | N(0, σ)           | N(0, σ) | N(0, √(2/(i+o)))|
| attention out, MLP down ("out"), × β| N(0, σ) | N(0, σ/√(2L)) | N(0, σ/√(2(l+1))) | 0       | N(0, √(2/(i+o)))|
| norm gains (DyT's, Derf's γ)        | 1 (stored as 0 when `norm_offset`, applied as 1 + w)                       |||||
| DyT's, Derf's α                     | `dyt_alpha` (the entry for the norm's location when it is a mapping)       |||||
| biases (DyT's, Derf's β), Derf's s  | 0                                                                          |||||
| branch scales g                     | `branch_scale_init`                                                        |||||

σ = `init_std`, L = n_layers, l = the 0-based layer index, i/o = the matrix's fan-in/fan-out. "out"
projections are the two that write into the residual stream: `scaled` is GPT-2 / Megatron, `depth` is
torchtitan / OLMo, `zero` is modded-nanogpt (each block starts as the identity). `xavier` is Glorot & Bengio
(2010)'s fan-based variance 2/(i+o) — the variance of fairseq's `xavier_uniform_`, drawn from a normal — on
every block matrix, the setup Xiong et al. (2020) analyse post-LN vs pre-LN in; embedding and head keep σ.
β = 1, except under `residual_scale="deepnorm"`: DeepNet's decoder-only β = (8L)^-¼ (Wang et al. 2022, arXiv
2203.00555; `xavier_normal_(w, gain=β)` on the value, output and FFN matrices in the authors' torchscale, so
`init: xavier` is the paper's exact setting); it leaves q and k alone.
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

ROLES = ("embed", "qk", "in", "out", "head")
BLOCK_ROLES = ("qk", "in", "out")  # the blocks' matrices


def init_std(cfg: ModelConfig, role: str, layer_id: int = 0, fans: tuple[int, int] | None = None) -> float:
    """The std of a weight by its role (see the module docstring's table); `fans` = (fan_in, fan_out) of a
    block matrix ("qk"/"in"/"out"), which `xavier` needs."""
    if role not in ROLES:
        raise ValueError(f"unknown init role {role!r}; choose one of {ROLES}")
    std = _table_std(cfg, role, layer_id, fans)
    beta = cfg.deepnorm_beta
    return std * beta if beta is not None and role in ("in", "out") else std


def _table_std(cfg: ModelConfig, role: str, layer_id: int, fans: tuple[int, int] | None) -> float:
    if cfg.init == "xavier" and role in BLOCK_ROLES:
        if fans is None:
            raise ValueError(f"init='xavier' needs the fans of the {role!r} matrix")
        return math.sqrt(2.0 / sum(fans))
    mult = hidden_init_mult(cfg) if role in BLOCK_ROLES else 1.0
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

"""Norm surgery: start a model whose normalization differs from its source's from the source's weights.

`transfer` fills a freshly built model from a source state dict (normlab names):
| target parameter                       | value                                                             |
|----------------------------------------|-------------------------------------------------------------------|
| in the source, same shape              | copied (a norm gain between `norm_offset` settings: w ↔ w − 1, so |
|                                        | the effective gain, and the function, is kept)                    |
| norm gain (`weight`), not in source    | 1 (0 with `norm_offset`: an effective gain of 1)                  |
| a bias (norm, DyT, or linear layers     | 0                                                                 |
| with `bias` on), not in source         |                                                                   |
| DyT/Derf α, not in source              | `model.dyt_alpha` (its value at that location)                    |
| any other norm parameter or declared   | as the new model builds it (Derf's shift 0, a branch scale's      |
| scalar (`param_kinds`), not in source  | `branch_scale_init`, a sink logit 0, an l2 temperature √D)        |
| `output.weight` of an untied model     | the source's (tied) embedding                                     |
| anything else not in the source        | refused: surgery changes norms, not sizes or matrices             |
Source parameters the target has no place for (a placement's norms moved, a final norm removed, LayerNorm's
bias under RMSNorm, …) are dropped and listed. `distance` measures how far the surgery moved the model.

Under ZeRO-3 the target's parameters are partitioned: each is gathered whole (one at a time), set on rank 0,
and re-partitioned (`deepspeed.zero.GatheredParameters`), so no rank holds the model twice.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from model import ModelConfig
from model.norms import Norm
from training.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class Transfer:
    """What `transfer` did, by parameter name."""

    copied: list[str] = field(default_factory=list)
    converted: list[str] = field(default_factory=list)  # copied with the norm_offset change applied
    initialized: dict[str, str] = field(default_factory=dict)  # name → the declared initialization
    dropped: list[str] = field(default_factory=list)

    def summary(self) -> str:
        inits = ", ".join(f"{k} = {v}" for k, v in self.initialized.items()) or "none"
        return (f"{len(self.copied)} parameters copied ({len(self.converted)} converted for norm_offset), "
                f"{len(self.initialized)} new ({inits}), {len(self.dropped)} dropped "
                f"({', '.join(self.dropped) or 'none'})")


def _norm_params(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Every parameter surgery may add: a norm's, or a scalar a module declares (`param_kinds`: a branch scale, a
    sink logit, an l2 QK-norm's temperature): name → (its module, its attribute name)."""
    out = {}
    for prefix, module in model.named_modules():
        declared = getattr(module, "param_kinds", {})
        for attr, _ in module.named_parameters(recurse=False):
            if isinstance(module, Norm) or attr in declared:
                out[f"{prefix}.{attr}" if prefix else attr] = (module, attr)
    return out


def _declared(param: nn.Parameter, owner: nn.Module | None, attr: str, name: str) -> tuple[torch.Tensor, str]:
    """What a parameter the source lacks starts as: its value as the new model builds it (its initialization, the
    table above), and how to say so."""
    if name.endswith(".bias"):  # norms' β, and linear layers' biases with `bias` switched on: adds nothing yet
        return torch.zeros_like(param), "0"
    if owner is None:
        raise UserError(f"--init_from: parameter {name!r} is not in the source and is not a norm parameter; "
                        "surgery changes normalization fields only (keep the source's sizes and MLP)")
    value = param.detach().clone()
    shown = f"{value.flatten()[0].item():g}" if value.numel() and bool((value == value.flatten()[0]).all()) else \
        "as built"
    if attr == "alpha" and getattr(owner, "param_kinds", {}).get(attr) == "dyt_alpha":
        return value, f"model.dyt_alpha ({shown})"
    if attr == "weight" and isinstance(owner, Norm):
        return value, "0 (gain 1 + w = 1)" if getattr(owner, "offset", False) else "1"
    return value, shown


def _gathered(param: nn.Parameter) -> contextlib.AbstractContextManager:
    """The whole parameter, writable on rank 0 and re-partitioned on exit, under ZeRO-3; else as it is."""
    if hasattr(param, "ds_id"):
        import deepspeed

        return deepspeed.zero.GatheredParameters([param], modifier_rank=0)
    return contextlib.nullcontext()


def transfer(source: dict[str, torch.Tensor] | None, src_cfg: ModelConfig, model: nn.Module, cfg: ModelConfig,
             writer: bool = True) -> Transfer:
    """Fill `model` (built from `cfg`) from `source` (normlab names; on a ZeRO-3 rank other than 0 None: only
    rank 0 writes). Every rank must call it, in the same order, under ZeRO-3 (the gathers are collective)."""
    norms, report = _norm_params(model), Transfer()
    names = dict(model.named_parameters())
    for name, param in names.items():
        with _gathered(param), torch.no_grad():
            owner, attr = norms.get(name, (None, ""))
            value = _value(name, param, source, src_cfg, cfg, owner, attr, report) if writer else None
            if value is None:
                continue
            if isinstance(value, torch.Tensor) and value.shape != param.shape:
                raise UserError(f"--init_from: {name} has shape {tuple(value.shape)} in the source and "
                                f"{tuple(param.shape)} here; give the source's sizes (or leave them unset)")
            if isinstance(value, float):
                param.fill_(value)
            else:
                param.copy_(value)
    if writer and source is not None:
        report.dropped = sorted(k for k in source if k not in names)
    return report


def _value(name: str, param: nn.Parameter, source: dict[str, torch.Tensor], src_cfg: ModelConfig, cfg: ModelConfig,
           owner: nn.Module | None, attr: str, report: Transfer) -> torch.Tensor | float:
    if name in source:
        value = source[name]
        if isinstance(owner, Norm) and attr == "weight" and src_cfg.norm_offset != cfg.norm_offset:
            value = value - 1.0 if cfg.norm_offset else value + 1.0  # keep the effective gain (1 + w) = w'
            report.converted.append(name)
        report.copied.append(name)
        return value
    if name == "output.weight" and src_cfg.tie_embeddings:  # untying: the head starts as the tied embedding
        report.initialized[name] = "the source's tied embedding"
        return source["tok_embeddings.weight"]
    fill, how = _declared(param, owner, attr, name)
    report.initialized[name] = how
    return fill


@torch.no_grad()
def distance(source_logits: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    """How far `logits` moved from `source_logits` (both [B, T, V]): the mean over tokens of
    KL(source ‖ model) and the largest absolute logit difference."""
    log_p, log_q = source_logits.float().log_softmax(-1), logits.float().log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return {"surgery/kl": max(kl.item(), 0.0),
            "surgery/max_abs_logit_diff": (source_logits.float() - logits.float()).abs().max().item()}


def changed_fields(src_cfg: ModelConfig, cfg: ModelConfig) -> Iterator[tuple[str, object, object]]:
    """(field, source value, this run's value) for each model field that differs (kernels aside: not a weight)."""
    a, b = src_cfg.to_dict(), cfg.to_dict()
    for key in a:
        if key != "kernels" and a[key] != b[key]:
            yield key, a[key], b[key]

"""Stability telemetry on the health callback's metrics steps (callbacks/health.py calls it), two precursors of
instability as continuous curves rather than forensics after a spike:

- the exact maximum pre-softmax attention logit of each layer over the probed micro-batch, from the attention
  module's own primitive (`Attention.track_max_logit`, `model.softmax.max_logit_per_head`: every query against
  every key it sees, after the score scale, before any soft-cap) — `attn/max_logit_exact/L{l}` the mean over
  heads, `attn/max_logit_exact_worst/L{l}` the largest head. (The probes' `attn/max_logit/L{l}` reads only sampled
  query rows.) Wortsman et al. 2023 read attention-logit growth as the instability QK-norm removes;
- ‖update‖/‖parameter‖ of the optimizer step, per block and parameter group — `optim/update_ratio/{attn,mlp,norm}/
  L{l}`: the attention matrices (with a gate and a sink logit), the MLP matrices, and every norm's gains in the
  block (the stream norms, QK-norm, sub-norms) — whatever the optimizer (AdamW, Muon): the change the step made,
  measured as θ_after − θ_before. Marin's 32B run (marin-community/marin #1368) saw update-norm spikes before its
  loss spikes, larger in the lower layers.

Under ZeRO the parameters are read whole in fp32 (`training.distributed.full_param`, a collective every rank calls
in the same order, as the health callback's other parameter statistics are). Cost: the max-logit pass is one
more QKᵀ per layer on the probed micro-batch; the update ratio keeps one copy of the blocks' parameters from
before the step to after it on metrics steps only (measured in scripts/bench_metrics.py, docs/monitoring.md).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model.names import split_layer
from model.norms import Norm
from training import health_tags as T
from training.distributed import full_param


def attentions(model: nn.Module) -> list[nn.Module]:
    """Every block's attention module, in layer order."""
    return [block.attn for block in model.layers]


def update_groups(model: nn.Module) -> dict[str, str]:
    """{parameter name: its update-ratio tag} for every parameter of the blocks: a norm's (any `Norm` module in the
    block), else the attention's or the MLP's by the sublayer it lives in; other block parameters (a residual
    branch scale) have none."""
    norms = {f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, Norm)
             for p, _ in m.named_parameters(recurse=False)}
    out = {}
    for name, _ in model.named_parameters():
        parts = split_layer(name.replace("_orig_mod.", ""))
        if parts is None:
            continue
        _, index, rest = parts
        group = "norm" if name in norms else rest.split(".")[0]
        if group in T.UPDATE_GROUPS:
            out[name] = T.layer(T.UPDATE_PARAM_RATIO, index, group)
    return out


class StabilityProbe:
    """The two measurements of one metrics step: `start` before its probed forward, `logits` after it, `before_step`
    before the optimizer step and `after_step` after it (returning the tags and values to log)."""

    def __init__(self) -> None:
        self._tracked: list[tuple[nn.Module, bool]] = []
        self._before: dict[str, torch.Tensor] | None = None
        self._groups: dict[str, str] = {}  # before_step's update_groups, read again by after_step

    def start(self, model: nn.Module) -> None:
        """Have every attention record its per-head max logit in the next forward (restored by `logits`)."""
        self._tracked = [(attn, attn.track_max_logit) for attn in attentions(model)]
        for attn, _ in self._tracked:
            attn.track_max_logit = True

    def logits(self) -> dict[str, torch.Tensor]:
        """The probed forward's exact max logit per layer: mean over heads and the largest head (0-d tensors)."""
        out = {}
        for index, (attn, was) in enumerate(self._tracked):
            per_head = attn.max_logit_per_head
            attn.track_max_logit = was  # (left on when QK-clip reads it every step)
            if per_head is not None:
                out[T.layer(T.ATTN_MAX_LOGIT_EXACT, index)] = per_head.mean()
                out[T.layer(T.ATTN_MAX_LOGIT_EXACT + T.WORST, index)] = per_head.amax()
        self._tracked = []
        return out

    def before_step(self, model: nn.Module, deepspeed: bool) -> None:
        """Keep the blocks' parameters as the optimizer step will find them (fp32, whole; on every rank)."""
        self._groups = update_groups(model)
        self._before = {name: full_param(p, deepspeed).float().clone() for name, p in model.named_parameters()
                        if name in self._groups}

    def after_step(self, model: nn.Module, deepspeed: bool) -> dict[str, float]:
        """‖θ_after − θ_before‖ / ‖θ_before‖ per block and group, once the optimizer step is done ({} when no step
        was kept)."""
        before, self._before = self._before, None
        if before is None:
            return {}
        groups = self._groups
        change: dict[str, Any] = {}
        size: dict[str, Any] = {}
        for name, p in model.named_parameters():
            if name in before:
                tag = groups[name]
                change[tag] = change.get(tag, 0) + (full_param(p, deepspeed).float() - before[name]).pow(2).sum()
                size[tag] = size.get(tag, 0) + before[name].pow(2).sum()
        tags = list(change)
        ratios = (torch.stack([change[t] for t in tags]) / torch.stack([size[t] for t in tags]).clamp_min(1e-30))
        return dict(zip(tags, ratios.sqrt().tolist(), strict=True))

"""Collectives for the callbacks: plain Python objects (the strategy's own `broadcast` covers rank 0 → all), and a
parameter's full value under DeepSpeed ZeRO."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank (`[value]` in a single process). A collective: every
    rank must call it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def full_param(param: torch.nn.Parameter, deepspeed: bool) -> torch.Tensor:
    """The whole fp32 value of `param` on every rank: under DeepSpeed, gathered from its ZeRO partitions (a
    collective for ZeRO-3: every rank must call it, in the same order); otherwise the parameter itself, detached."""
    if deepspeed:
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(param)
        if full is not None:
            return full
    return param.detach()

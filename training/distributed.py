"""Collectives for the callbacks: plain Python objects (the strategy's own `broadcast` covers rank 0 → all), one
error for all ranks, and a parameter's full value under DeepSpeed ZeRO."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from training.errors import CheckpointError

T = TypeVar("T")


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank (`[value]` in a single process). A collective: every
    rank must call it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def together(fn: Callable[[], T]) -> T:
    """`fn()` on every rank; if it raised anywhere, every rank raises the first failing rank's error (a
    CheckpointError as itself, anything else as a RuntimeError with its message): a rank that raised alone would
    leave the others waiting in the next collective. A collective: every rank must call it."""
    result, error = None, None
    try:
        result = fn()
    except Exception as err:  # any failure must reach the other ranks
        error = (type(err) if isinstance(err, CheckpointError) else RuntimeError, str(err))
    failed = [e for e in gather_objects(error) if e is not None]
    if failed:
        cls, message = failed[0]
        raise cls(message)
    return result


def full_param(param: torch.nn.Parameter, deepspeed: bool) -> torch.Tensor:
    """The whole fp32 value of `param` on every rank: under DeepSpeed, gathered from its ZeRO partitions (a
    collective for ZeRO-3: every rank must call it, in the same order); otherwise the parameter itself, detached."""
    if deepspeed:
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(param)
        if full is not None:
            return full
    return param.detach()

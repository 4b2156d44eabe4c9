"""Collectives for the callbacks and the checkpoint code: plain Python objects (the strategy's own `broadcast`
covers rank 0 → all), one error for all ranks, and a parameter's full value and gradient under DeepSpeed ZeRO
and under FSDP2 (a DTensor's rows gathered from every rank)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy, Strategy
from torch.distributed.tensor import DTensor

from training.errors import CheckpointError

T = TypeVar("T")


def is_deepspeed(strategy: Strategy) -> bool:
    """Whether `strategy` is DeepSpeed's: its checkpoints are DeepSpeed directories (vs. Lightning files) and its
    parameters and gradients are partitioned (`full_param`, `full_grad`)."""
    return isinstance(strategy, DeepSpeedStrategy)


def is_fsdp2(strategy: Strategy) -> bool:
    """Whether `strategy` shards with FSDP2 (training/fsdp2.py, a Lightning `ModelParallelStrategy`): its
    checkpoints are DCP directories and its parameters and gradients DTensors (`full_param`, `full_grad`)."""
    return isinstance(strategy, ModelParallelStrategy)


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank (`[value]` in a single process). A collective: every
    rank must call it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def together(fn: Callable[[], T]) -> T:
    """`fn()` on every rank; if it raised anywhere, every rank raises the first failing rank's error (see
    `shared_failure`). A collective: every rank must call it."""
    return shared_failure(fn, gather_objects)


def shared_failure(fn: Callable[[], T], share: Callable[[Any], list[Any]], run: bool = True) -> T | None:
    """`fn()` on the ranks where `run` (None elsewhere); if it raised on any of them, every rank raises the first
    failing rank's error — a CheckpointError as itself (still one line to the user), anything else as a
    RuntimeError with its message — since a rank that raised alone would leave the others waiting in the next
    collective. `share(error)` hands each rank's error (None: none) to every rank, as a list in rank order: the
    `gather_objects` of `together`, or a strategy's broadcast from rank 0 when only rank 0 runs `fn`."""
    result, error = None, None
    if run:
        try:
            result = fn()
        except Exception as err:  # any failure must reach the other ranks
            error = (type(err) if isinstance(err, CheckpointError) else RuntimeError, str(err))
    failed = [e for e in share(error) if e is not None]
    if failed:
        cls, message = failed[0]
        raise cls(message)
    return result


def full_param(param: torch.nn.Parameter, deepspeed: bool) -> torch.Tensor:
    """The whole fp32 value of `param` on every rank: under DeepSpeed, gathered from its ZeRO partitions (a
    collective for ZeRO-3: every rank must call it, in the same order); a DTensor (FSDP2) gathered from every
    rank's rows (a collective too); otherwise the parameter itself, detached."""
    if isinstance(param, DTensor):
        return param.detach().full_tensor()
    if deepspeed:
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(param)
        if full is not None:
            return full
    return param.detach()


def full_grad(param: torch.nn.Parameter, deepspeed: bool) -> torch.Tensor | None:
    """The whole gradient of `param` on every rank (None without one): under DeepSpeed, gathered from its ZeRO
    partitions, where `param.grad` is partitioned or None (a collective: every rank must call it, in the same
    order); a DTensor gradient (FSDP2: reduce-scattered, each rank holds its rows) gathered the same way;
    otherwise `param.grad`."""
    if isinstance(param.grad, DTensor):
        return param.grad.full_tensor()
    if deepspeed:
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(param)
    return param.grad


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: a DTensor's local shard (FSDP2), any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor

"""Collectives on plain Python objects, for the callbacks (the strategy's own `broadcast` covers rank 0 → all)."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank (`[value]` in a single process). A collective: every
    rank must call it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values

"""One optimizer update outside Lightning: the plain training loop of the study and the benchmarks."""
from __future__ import annotations

import torch
from torch import nn


def plain_update(model: nn.Module, optimizer: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LRScheduler,
                 loss: torch.Tensor, clip: float = 1.0) -> None:
    """One update of a plain training loop (the study, the benchmarks: no Lightning): backward, clip the
    gradient norm to `clip`, optimizer step, schedule step, clear the gradients — what `normlab fit` does per
    update with `gradient_clip_val=clip` and no accumulation."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)

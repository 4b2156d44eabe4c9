"""The warm-up + decay LR schedule every parameter group follows, the optimizer built with it, and a branch's own
schedule put on an optimizer loaded from its parent."""
from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from training.optim.config import OptimConfig
from training.optim.groups import param_groups

GROUP_HPARAMS = "normlab_group_hparams"  # the optimizer attribute holding its groups' hyper-parameters as built


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The multiplier on `cfg.lr` for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps  # the first step already moves: lr/warmup, not 0
    end = cfg.decay_steps or total_steps
    floor = cfg.min_lr / cfg.lr
    if cfg.schedule == "constant" or end <= cfg.warmup_steps:
        return 1.0
    start, shape = cfg.warmup_steps, cfg.schedule
    if cfg.schedule == "wsd":  # stable at 1 until the last decay_fraction of the steps
        start, shape = max(cfg.warmup_steps, end - round(cfg.decay_fraction * end)), cfg.decay_shape
        if step < start:
            return 1.0
    progress = min(1.0, (step - start) / (end - start))
    if shape == "linear":
        return 1.0 - (1.0 - floor) * progress
    if shape == "1-sqrt":
        return 1.0 - (1.0 - floor) * math.sqrt(progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer over `param_groups` and a per-step LambdaLR. `total_steps` is used when `cfg.decay_steps` is
    None. The groups' own hyper-parameters are kept on the optimizer (`GROUP_HPARAMS`) for `restart_schedule`."""
    if cfg.decay_steps is None and not (0 < total_steps < math.inf):
        raise ValueError("optim.decay_steps is unset and the trainer's total steps are unknown: set one of "
                         "--optim.decay_steps or --trainer.max_steps")
    groups = param_groups(model, cfg)
    optimizer = cfg.optimizer().build(groups, cfg)
    setattr(optimizer, GROUP_HPARAMS, [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, cfg=cfg, total_steps=int(total_steps)))
    return optimizer, schedule


def restart_schedule(schedule: torch.optim.lr_scheduler.LambdaLR, cfg: OptimConfig, step: int) -> None:
    """Put this run's own group hyper-parameters and LR schedule, evaluated at optimizer step `step`, on an
    optimizer whose state was just loaded from another run (a cooldown branch, training/checkpointing/branch.py).

    Loading a checkpoint restores the parent's param-group values (name, lr, initial_lr, lr multiplier, betas,
    eps, weight decay, Muon's settings) and its scheduler's position and base LRs; the moments and step counts
    stay as loaded. `schedule` must be the LambdaLR `build_optimizer` made from `cfg`: its optimizer carries this
    run's groups as built (position by position: the parameters of group i are the parent's group i, which the
    load checked by size), and its lambda is this run's schedule (a LambdaLR keeps its own lambdas when it loads a
    state). The next update of group g then uses lr · lr_mult_g · lr_factor(step, cfg, total).
    """
    groups, own = schedule.optimizer.param_groups, getattr(schedule.optimizer, GROUP_HPARAMS)
    for group, hparams in zip(groups, own, strict=True):
        group.update({k: v for k, v in hparams.items() if k != "lr"}, initial_lr=hparams["lr"])
    schedule.base_lrs = [h["lr"] for h in own]
    schedule.last_epoch = step - 1
    schedule.step()  # → last_epoch = step: sets every group's lr (and get_last_lr) from the lambda

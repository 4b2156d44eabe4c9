"""AdamW with parameter groups, and the warm-up + decay learning-rate schedule.

Weight decay pulls weights towards zero. On norm gains that fights the gain's job (it should sit near 1),
on biases it buys nothing, and on embeddings it shrinks rarely-seen tokens' rows every step — so by default
those three kinds get no decay (GPT-3, LLaMA, OLMo all exclude gains and biases; most exclude embeddings).
Kinds are read from the module that owns the parameter, not from its name, so a new norm class or layer
name cannot silently fall into the wrong group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from model.layers import Embedding
from model.norms import Norm

SCHEDULES = ("cosine", "linear", "constant", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")
PARAM_KINDS = ("norm", "bias", "embedding", "weight")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW hyper-parameters and the LR schedule: `warmup_steps` linear warm-up to `lr`, then `schedule` down
    to `min_lr` at step `decay_steps` (None: the trainer's total steps), then `min_lr`.

    `wsd` (warmup–stable–decay; Hu et al. 2024, Hägele et al. 2024) holds `lr` after the warm-up and decays
    only over the last `decay_fraction` of the run's steps, in `decay_shape`: linear, cosine or 1-sqrt
    (lr·(1 − (1 − min_lr/lr)·√progress), Hägele et al.'s best cooldown)."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 30
    schedule: str = "cosine"
    decay_steps: int | None = None
    weight_decay: float = 0.1
    no_decay: tuple[str, ...] = ("norm", "bias", "embedding")
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    decay_fraction: float = 0.2  # wsd: the share of all steps spent decaying
    decay_shape: str = "linear"  # wsd: linear | cosine | 1-sqrt
    z_loss: float = 0.0  # w of the z-loss w · log²Z (PaLM: 1e-4); 0: off. Inside the chunked LM-head loss.

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule={self.schedule!r} is not valid; choose one of {list(SCHEDULES)}")
        if self.decay_shape not in DECAY_SHAPES:
            raise ValueError(f"optim.decay_shape={self.decay_shape!r} is not valid; choose one of {list(DECAY_SHAPES)}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"optim.decay_fraction={self.decay_fraction} must be in (0, 1] "
                             "(0.2: the last 20% of steps)")
        if not self.z_loss >= 0:
            raise ValueError(f"optim.z_loss={self.z_loss} must be >= 0 (0 turns it off; PaLM uses 1e-4)")
        unknown = set(self.no_decay) - set(PARAM_KINDS)
        if unknown:
            raise ValueError(f"optim.no_decay has unknown kind(s) {sorted(unknown)}; valid: {list(PARAM_KINDS)}")
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"optim needs lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup_steps < 0 or (self.decay_steps is not None and self.decay_steps <= self.warmup_steps):
            raise ValueError(
                f"optim needs warmup_steps >= 0 and decay_steps > warmup_steps, "
                f"got warmup_steps={self.warmup_steps}, decay_steps={self.decay_steps}"
            )


def param_kind(owner: nn.Module, name: str) -> str:
    """Which of PARAM_KINDS the parameter `name` of module `owner` is."""
    if isinstance(owner, Norm):
        return "norm"  # gains, and LayerNorm's bias: a norm parameter first
    if isinstance(owner, (Embedding, nn.Embedding)):
        return "embedding"
    return "bias" if name == "bias" else "weight"


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Two AdamW groups, "decay" and "no_decay" (empty ones dropped); each parameter appears once, even when
    tied (the LM head sharing the embedding is one parameter and counts as an embedding)."""
    seen: set[int] = set()
    groups: dict[str, list[nn.Parameter]] = {"decay": [], "no_decay": []}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            groups["no_decay" if param_kind(module, name) in cfg.no_decay else "decay"].append(p)
    return [{"name": k, "params": ps, "weight_decay": group_weight_decay(k, cfg)} for k, ps in groups.items() if ps]


def group_weight_decay(name: str, cfg: OptimConfig) -> float:
    """The weight decay of the parameter group `name` ("decay" or "no_decay")."""
    return cfg.weight_decay if name == "decay" else 0.0


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
    """AdamW over `param_groups` and a per-step LambdaLR. `total_steps` is used when `cfg.decay_steps` is None."""
    if cfg.decay_steps is None and not (0 < total_steps < math.inf):
        raise ValueError("optim.decay_steps is unset and the trainer's total steps are unknown: set one of "
                         "--optim.decay_steps or --trainer.max_steps")
    groups = param_groups(model, cfg)
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=use_fused(groups))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, cfg=cfg, total_steps=int(total_steps)))
    return optimizer, schedule


def use_fused(groups: list[dict]) -> bool:
    """torch's fused AdamW (one kernel for the whole update, no per-step host reads of its step counters) when
    every parameter is on a CUDA device — on one GPU and under DDP, where Lightning moves the model before it
    builds the optimizer. Not under ZeRO: Lightning builds the optimizer before DeepSpeed moves the model, and
    DeepSpeed then steps it over its own fp32 partitions (foreach AdamW)."""
    params = [p for group in groups for p in group["params"]]
    return bool(params) and all(p.is_cuda for p in params)


def restart_schedule(schedule: torch.optim.lr_scheduler.LambdaLR, cfg: OptimConfig, step: int) -> None:
    """Put `cfg`'s own hyper-parameters and LR schedule, evaluated at optimizer step `step`, on an optimizer
    whose state was just loaded from another run (a cooldown branch, training/checkpointing/branch.py).

    Loading a checkpoint restores the parent's param-group values (lr, initial_lr, betas, eps, weight decay)
    and its scheduler's position and base LRs; the moments and step counts stay as loaded. `schedule` must
    be the LambdaLR `build_optimizer` made from `cfg`: its lambda is this run's schedule (a LambdaLR keeps its
    own lambdas when it loads a state). The next update then uses lr · lr_factor(step, cfg, total).
    """
    groups = schedule.optimizer.param_groups
    for group in groups:
        group.update(initial_lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
        if group.get("name") in ("decay", "no_decay"):
            group["weight_decay"] = group_weight_decay(group["name"], cfg)
    schedule.base_lrs = [cfg.lr] * len(groups)
    schedule.last_epoch = step - 1
    schedule.step()  # → last_epoch = step: sets every group's lr (and get_last_lr) from the lambda


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

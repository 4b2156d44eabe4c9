"""The optimizer's config, its parameter groups, and the warm-up + decay LR schedule; the optimizers themselves
(AdamW, Muon with AdamW) are a registry in training/optimizers.py (`optim.name`, `optim.options`).

Weight decay pulls weights towards zero. On norm gains that fights the gain's job (it should sit near 1),
on biases it buys nothing, and on embeddings it shrinks rarely-seen tokens' rows every step — so by default
those three kinds get no decay (GPT-3, LLaMA, OLMo all exclude gains and biases; most exclude embeddings).
Kinds are read from the module that owns the parameter, not from its name, so a new norm class or layer
name cannot silently fall into the wrong group.

`optim.groups` gives chosen parameters their own LR multiplier and weight decay (torchtitan's regex groups,
nanochat's embedding / unembedding / matrix LRs): each entry selects by `kind` (PARAM_KINDS) and/or by `pattern`
(a regex searched in the qualified name); every group follows the one schedule (its LR is lr · lr_mult · factor).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from model.layers import Embedding
from model.mup import hidden_lr_mult
from model.norms import DyT, Norm
from training.errors import UserError
from training.optimizers import Optimizer, lookup

if TYPE_CHECKING:
    from model.config import ModelConfig

SCHEDULES = ("cosine", "linear", "constant", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")
# norm: gains (and LayerNorm's / DyT's β); dyt_alpha: DyT's scalar α; head: an untied LM head; weight: the blocks'
# matrices. As `no_decay` entries, "norm" also covers dyt_alpha and "weight" the head (KIND_PARENT).
PARAM_KINDS = ("norm", "dyt_alpha", "bias", "embedding", "head", "weight")
KIND_PARENT = {"dyt_alpha": "norm", "head": "weight"}
GROUP_HPARAMS = "normlab_group_hparams"  # the optimizer attribute holding its groups' hyper-parameters as built


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """One `optim.groups` entry: which parameters (`kind` and/or `pattern`, both must hold) and their settings."""

    kind: str | None = None
    pattern: str | None = None
    lr_mult: float = 1.0
    weight_decay: float | None = None  # None: optim.weight_decay, or 0 for the kinds in optim.no_decay

    def matches(self, qualified_name: str, kind: str) -> bool:
        return (self.kind is None or self.kind == kind) and (
            self.pattern is None or re.search(self.pattern, qualified_name) is not None)

    def describe(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in (("kind", self.kind), ("pattern", self.pattern)) if v is not None)


def group_specs(cfg: OptimConfig) -> dict[str, GroupSpec]:
    """`optim.groups` as GroupSpecs (validated by OptimConfig)."""
    return {name: GroupSpec(**entry) for name, entry in cfg.groups.items()}


def _check_group(name: str, entry: Any) -> None:
    where = f"optim.groups.{name}"
    if name in ("decay", "no_decay") or "/" in name:
        raise ValueError(f"{where}: the name is reserved or has a '/'; choose another group name")
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a mapping like {{kind: embedding, lr_mult: 0.5}}, got {entry!r}")
    unknown = set(entry) - {"kind", "pattern", "lr_mult", "weight_decay"}
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {sorted(unknown)}; valid: kind, pattern, lr_mult, weight_decay")
    spec = GroupSpec(**entry)
    if spec.kind is None and spec.pattern is None:
        raise ValueError(f"{where} selects nothing: give a kind (one of {list(PARAM_KINDS)}) and/or a pattern")
    if spec.kind is not None and spec.kind not in PARAM_KINDS:
        raise ValueError(f"{where}.kind={spec.kind!r} is not valid; choose one of {list(PARAM_KINDS)}")
    if spec.pattern is not None:
        try:
            re.compile(spec.pattern)
        except re.error as err:
            raise ValueError(f"{where}.pattern={spec.pattern!r} is not a valid regex ({err})") from None
    numbers = [spec.lr_mult] + ([] if spec.weight_decay is None else [spec.weight_decay])
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in numbers):
        raise ValueError(f"{where} needs numbers lr_mult >= 0 and weight_decay >= 0, got {entry!r} (YAML reads 3e-3 "
                         "as a string: write 3.0e-3)")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Optimizer hyper-parameters and the LR schedule: `warmup_steps` linear warm-up to `lr`, then `schedule` down
    to `min_lr` at step `decay_steps` (None: the trainer's total steps), then `min_lr`.

    `name`: the optimizer, one of training/optimizers.py's `OPTIMIZERS` — adamw, or muon (torch.optim.Muon on the
    blocks' 2-D matrices, AdamW with `betas` and `eps` on the rest); `options`: that optimizer's own settings, its
    fields (muon: momentum, nesterov, ns_steps, adjust_lr), e.g. {momentum: 0.9}; unset ones take its defaults.

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
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)  # name → {kind, pattern, lr_mult, weight_decay}
    name: str = "adamw"  # adamw | muon (training/optimizers.py)
    options: dict[str, Any] = field(default_factory=dict)  # the chosen optimizer's own settings

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
        self.optimizer()  # a name or option that is not valid: one error line
        for name, entry in (self.groups or {}).items():
            _check_group(name, entry)
        unknown = set(self.no_decay) - set(PARAM_KINDS)
        if unknown:
            raise ValueError(f"optim.no_decay has unknown kind(s) {sorted(unknown)}; valid: {list(PARAM_KINDS)}")
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"optim needs lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        # (torch checks betas and eps only when the optimizer is built, after the run directory is written, and
        # AdamW checks weight_decay only for its defaults, not for the groups that carry it)
        if not (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)):
            raise ValueError(f"optim.betas={list(self.betas)} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
        if not 0 < self.eps < math.inf:
            raise ValueError(f"optim.eps={self.eps} must be a positive number, e.g. 1.0e-8")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"optim.weight_decay={self.weight_decay} must be >= 0 (0: no decay)")
        if self.warmup_steps < 0 or (self.decay_steps is not None and self.decay_steps <= self.warmup_steps):
            raise ValueError(
                f"optim needs warmup_steps >= 0 and decay_steps > warmup_steps, "
                f"got warmup_steps={self.warmup_steps}, decay_steps={self.decay_steps}"
            )


    def optimizer(self) -> Optimizer:
        """The optimizer `name` with its `options` (training/optimizers.py)."""
        return lookup(self.name, self.options)


# The flat Muon fields that `optim.options` replaced: an old config naming one gets one line naming the new key.
RENAMED = {f"optim.muon_{key}": f"optim.options.{key}" for key in ("momentum", "nesterov", "ns_steps", "adjust_lr")}


def renamed_option(message: str) -> str | None:
    """For a parse error `message` that names a renamed option: the one line saying what it is called now."""
    old = next((name for name in RENAMED if re.search(rf"\b{re.escape(name)}\b", message)), None)
    return None if old is None else (f"{old} is now {RENAMED[old]} (with optim.name: muon); rename it in the config "
                                     "file or on the command line")


def param_kind(owner: nn.Module, name: str, head: nn.Parameter | None = None) -> str:
    """Which of PARAM_KINDS the parameter `name` of module `owner` is; `head` is the model's LM-head weight (an
    untied head is a Linear like the block matrices: only identity tells them apart)."""
    if isinstance(owner, Norm):
        return "dyt_alpha" if isinstance(owner, DyT) and name == "alpha" else "norm"  # LayerNorm's bias: a norm's
    if isinstance(owner, (Embedding, nn.Embedding)):
        return "embedding"
    if name == "bias":
        return "bias"
    return "head" if head is not None and getattr(owner, name) is head else "weight"


def named_kinds(model: nn.Module) -> list[tuple[str, nn.Parameter, str]]:
    """(qualified name, parameter, kind) of every trainable parameter, each once (a tied LM head is the embedding)."""
    head = getattr(model, "head_weight", None)
    seen: set[int] = set()
    out = []
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            out.append((f"{prefix}.{name}" if prefix else name, p, param_kind(module, name, head)))
    return out


def _decays(kind: str, cfg: OptimConfig) -> bool:
    return not ({kind, KIND_PARENT.get(kind)} & set(cfg.no_decay))


def _assign(model: nn.Module, cfg: OptimConfig) -> list[tuple[nn.Parameter, str, str]]:
    """(parameter, base group, kind) for every parameter: its `optim.groups` entry, else "decay"/"no_decay".
    A parameter that two entries claim, or an entry that claims nothing, is a UserError."""
    specs = group_specs(cfg)
    claimed = {name: 0 for name in specs}
    out = []
    for qual, p, kind in named_kinds(model):
        hits = [name for name, spec in specs.items() if spec.matches(qual, kind)]
        if len(hits) > 1:
            raise UserError(f"optim.groups: parameter '{qual}' (kind {kind}) is matched by both '{hits[0]}' and "
                            f"'{hits[1]}'; make the kinds/patterns disjoint")
        for name in hits:
            claimed[name] += 1
        out.append((p, hits[0] if hits else ("decay" if _decays(kind, cfg) else "no_decay"), kind))
    empty = [name for name, n in claimed.items() if not n]
    if empty:
        spec = specs[empty[0]]
        raise UserError(f"optim.groups.{empty[0]} ({spec.describe()}) matches no parameter of this model; fix its "
                        f"kind (one of {list(PARAM_KINDS)}) or pattern (a regex on names like 'layers.0.attn.q_proj."
                        "weight'), or remove it")
    return out


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """The optimizer's parameter groups, each {"name", "params", "lr", "lr_mult", "weight_decay", "algorithm"}.

    A parameter lands in its `optim.groups` entry, else in "decay" / "no_decay" (by `no_decay`); within a group,
    block matrices that the optimizer drives by another algorithm (its `matrix_algorithm`, e.g. Muon's) go to
    "<group>/<that algorithm>", and under μP (`mup`, the model's
    config, `model.cfg`, says parametrization="mup") AdamW's hidden matrices go to "<group>/hidden" with the
    LR × base/width (model/mup.py).
    Empty groups are dropped; each parameter appears once, even when tied."""
    specs = group_specs(cfg)
    optimizer = cfg.optimizer()
    mup: ModelConfig | None = getattr(model, "cfg", None)
    buckets: dict[str, dict] = {}
    for p, base, kind in _assign(model, cfg):
        spec = specs.get(base)
        lr_mult = spec.lr_mult if spec else 1.0
        if spec and spec.weight_decay is not None:
            wd = spec.weight_decay
        else:
            wd = cfg.weight_decay if (_decays(kind, cfg) if spec else base == "decay") else 0.0
        name, algorithm = base, optimizer.algorithm
        if kind == "weight" and optimizer.matrix_algorithm and p.ndim == 2:
            algorithm = optimizer.matrix_algorithm
            name = f"{base}/{algorithm}"
        elif kind == "weight" and getattr(mup, "parametrization", "standard") == "mup":
            name, lr_mult = f"{base}/hidden", lr_mult * hidden_lr_mult(mup)
        group = buckets.setdefault(name, {"name": name, "params": [], "lr": cfg.lr * lr_mult, "lr_mult": lr_mult,
                                          "weight_decay": wd, "algorithm": algorithm})
        if group["weight_decay"] != wd:
            raise UserError(f"optim.groups.{base} mixes kinds with and without weight decay; give it an explicit "
                            "weight_decay")
        group["params"].append(p)
    # "decay" before "no_decay" as they always were: a checkpoint's groups load by position
    return sorted(buckets.values(), key=lambda g: {"decay": 0, "no_decay": 1}.get(g["name"], 2))


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


def check_group_names(saved: list[str | None], groups: list[dict]) -> None:
    """A checkpoint's optimizer groups (names, in order) must be this run's: its state loads group by position."""
    names = [g["name"] for g in groups]
    if saved != names:
        raise UserError(f"the checkpoint's optimizer groups are {saved} and this run's {names}: resume or branch with "
                        "the checkpoint's optim.groups / optim.name / model.parametrization (multipliers may differ)")


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

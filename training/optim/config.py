"""`OptimConfig`: the `optim.*` group — the optimizer and its options, the parameter groups' settings, the LR
schedule — validated when built, each refusal one line naming the field and the valid values.

Weight decay pulls weights towards zero. On norm gains that fights the gain's job (it should sit near 1),
on biases it buys nothing, and on embeddings it shrinks rarely-seen tokens' rows every step — so by default
those three kinds get no decay (GPT-3, LLaMA, OLMo all exclude gains and biases; most exclude embeddings).
Kinds are read from the module that owns the parameter, not from its name (groups.py), so a new norm class or
layer name cannot silently fall into the wrong group.

`optim.groups` gives chosen parameters their own LR multiplier and weight decay (torchtitan's regex groups,
nanochat's embedding / unembedding / matrix LRs): each entry selects by `kind` (PARAM_KINDS) and/or by `pattern`
(a regex searched in the qualified name); every group follows the one schedule (its LR is lr · lr_mult · factor,
schedule.py).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from training.optim.registry import Optimizer, lookup

SCHEDULES = ("cosine", "linear", "constant", "wsd")
# A resume whose schedule length or fields changed since the checkpoint (continuation.py): refuse it, hold the
# checkpoint's schedule (then its final LR), or recompute the schedule over the new settings.
CONTINUATIONS = ("refuse", "hold", "recompute")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")
# norm: gains (and LayerNorm's / DyT's β, Derf's shift); dyt_alpha: DyT's and Derf's scalar α; branch_scale: the
# learnable g on each sublayer's update (ReZero, LayerScale); attn_sink: the sink logits; qk_temperature: an l2
# QK-norm's learned temperature; head: an untied LM head; weight: the blocks' matrices (the attention gate's
# included). The kinds a model declares come from its modules' `param_kinds` (model/residual.py). As `no_decay`
# entries, "norm" also covers the scalar kinds and "weight" the head (KIND_PARENT): none of them decays by default.
PARAM_KINDS = ("norm", "dyt_alpha", "branch_scale", "attn_sink", "qk_temperature", "bias", "embedding", "head",
               "weight")
KIND_PARENT = {"dyt_alpha": "norm", "branch_scale": "norm", "attn_sink": "norm", "qk_temperature": "norm",
               "head": "weight"}


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

    `name`: the optimizer, one of registry.py's `OPTIMIZERS` — adamw, or muon (torch.optim.Muon on the
    blocks' 2-D matrices, AdamW with `betas` and `eps` on the rest); `options`: that optimizer's own settings, its
    fields (muon: momentum, nesterov, ns_steps, adjust_lr), e.g. {momentum: 0.9}; unset ones take its defaults.

    `wsd` (warmup–stable–decay; Hu et al. 2024, Hägele et al. 2024) holds `lr` after the warm-up and decays
    only over the last `decay_fraction` of the run's steps, in `decay_shape`: linear, cosine or 1-sqrt
    (lr·(1 − (1 − min_lr/lr)·√progress), Hägele et al.'s best cooldown).

    `qk_clip`: MuonClip's τ (Kimi K2): after every optimizer step, each attention head whose largest pre-softmax
    logit in the step's forward exceeded τ has its query and key rows scaled back to τ (qk_clip.py; with any
    optimizer).

    `continuation`: what a resume does when the schedule's length or fields differ from the checkpoint's — refuse
    (the default), hold the checkpoint's schedule, or recompute it over the new settings (continuation.py)."""

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
    name: str = "adamw"  # adamw | muon (registry.py)
    options: dict[str, Any] = field(default_factory=dict)  # the chosen optimizer's own settings
    qk_clip: float | None = None  # τ: after each step, heads whose max logit exceeded τ are scaled back (qk_clip.py)
    continuation: str = "refuse"  # a resume whose schedule changed: refuse | hold | recompute (continuation.py)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule={self.schedule!r} is not valid; choose one of {list(SCHEDULES)}")
        if self.continuation not in CONTINUATIONS:
            raise ValueError(f"optim.continuation={self.continuation!r} is not valid; choose one of "
                             f"{list(CONTINUATIONS)}")
        if self.decay_shape not in DECAY_SHAPES:
            raise ValueError(f"optim.decay_shape={self.decay_shape!r} is not valid; choose one of {list(DECAY_SHAPES)}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"optim.decay_fraction={self.decay_fraction} must be in (0, 1] "
                             "(0.2: the last 20% of steps)")
        if self.qk_clip is not None and not self.qk_clip > 0:
            raise ValueError(f"optim.qk_clip={self.qk_clip} must be a logit threshold τ > 0 (Kimi K2 used 100), or "
                             "null for none")
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
        """The optimizer `name` with its `options` (registry.py)."""
        return lookup(self.name, self.options)


# The flat Muon fields that `optim.options` replaced: an old config naming one gets one line naming the new key.
RENAMED = {f"optim.muon_{key}": f"optim.options.{key}" for key in ("momentum", "nesterov", "ns_steps", "adjust_lr")}


def renamed_option(message: str) -> str | None:
    """For a parse error `message` that names a renamed option: the one line saying what it is called now."""
    old = next((name for name in RENAMED if re.search(rf"\b{re.escape(name)}\b", message)), None)
    return None if old is None else (f"{old} is now {RENAMED[old]} (with optim.name: muon); rename it in the config "
                                     "file or on the command line")

"""The optimizers `optim.name` chooses from: a registry, one small class per optimizer.

An entry is a frozen dataclass whose fields are that optimizer's own settings, given as `optim.options`
(`--optim.name muon --optim.options.momentum 0.9`; typed and checked when the config is built), plus what the
rest of the training code asks of it instead of its name:
- `algorithm`: what drives the parameter groups (each group records it under "algorithm");
- `matrix_algorithm`: what drives the blocks' 2-D matrices instead, if anything else does (their groups are then
  "<group>/<matrix_algorithm>", groups.py's `param_groups`);
- `zero_refusal`: why it cannot run under DeepSpeed ZeRO, if it cannot (`LitLM.configure_optimizers` refuses the
  combination with one line);
- `build(groups, cfg)`: the `torch.optim.Optimizer` over `param_groups`, one to Lightning; `cfg` is anything with
  AdamW's defaults (`AdamWDefaults`: the run's `OptimConfig`), so this registry needs no import of the config,
  which looks optimizers up here.

Adding an optimizer is one subclass and one `OPTIMIZERS` entry: `optim.name`'s valid values, its options and their
checks, the parameter groups, the DeepSpeed check and the registry-driven tests follow.
The LR, its schedule and the groups' multipliers and weight decay (`optim.*`) apply to every optimizer; AdamW's
`optim.betas` and `optim.eps` stay there too, since both optimizers here run AdamW on the parameters they do not
drive otherwise.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch

from training.optim.muon import MuonWithAdamW

OPTIONS = "optim.options"  # where an optimizer's own settings are given


class AdamWDefaults(Protocol):
    """What an optimizer's `build` reads of the run's `optim.*` (config.py's `OptimConfig` has it): the LR every
    group's own multiplier scales, and AdamW's betas and eps."""

    lr: float
    betas: tuple[float, float]
    eps: float


@dataclass(frozen=True, kw_only=True)
class Optimizer:
    """One optimizer `optim.name` can name; its fields are its options. Subclasses check ranges in
    `__post_init__` (after `super().__post_init__()`, which checks the fields' types)."""

    algorithm: ClassVar[str]
    matrix_algorithm: ClassVar[str | None] = None
    zero_refusal: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])

    def build(self, groups: list[dict], cfg: AdamWDefaults) -> torch.optim.Optimizer:
        raise NotImplementedError


def _check_type(name: str, value: Any, hint: Any) -> None:
    """A YAML or command-line value of the annotated type (an int is a float; a bool is neither)."""
    if typing.get_origin(hint) is Literal:
        if value not in typing.get_args(hint):
            raise ValueError(f"{OPTIONS}.{name}={value!r} is not valid; choose one of {list(typing.get_args(hint))}")
        return
    kinds = {float: ((int, float), "a number"), int: ((int,), "an integer"), bool: ((bool,), "true or false"),
             str: ((str,), "a string")}
    if hint in kinds and (not isinstance(value, kinds[hint][0]) or (hint is not bool and isinstance(value, bool))):
        yaml = " (YAML reads 3e-3 as a string: write 3.0e-3)" if hint is float and isinstance(value, str) else ""
        raise ValueError(f"{OPTIONS}.{name}={value!r} must be {kinds[hint][1]}{yaml}")


def adamw_settings(cfg: AdamWDefaults) -> dict[str, Any]:
    """AdamW's defaults from `optim.*` (each group carries its own lr and weight decay)."""
    return dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def use_fused(groups: list[dict]) -> bool:
    """torch's fused AdamW (one kernel for the whole update, no per-step host reads of its step counters) when
    every parameter is on a CUDA device — on one GPU and under DDP, where Lightning moves the model before it
    builds the optimizer. Not under ZeRO: Lightning builds the optimizer before DeepSpeed moves the model, and
    DeepSpeed then steps it over its own fp32 partitions (foreach AdamW)."""
    params = [p for group in groups for p in group["params"]]
    return bool(params) and all(p.is_cuda for p in params)


@dataclass(frozen=True, kw_only=True)
class AdamW(Optimizer):
    """torch.optim.AdamW on every parameter (`optim.betas`, `optim.eps`); no options of its own."""

    algorithm: ClassVar[str] = "adamw"

    def build(self, groups: list[dict], cfg: AdamWDefaults) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, **adamw_settings(cfg), fused=use_fused(groups))


@dataclass(frozen=True, kw_only=True)
class Muon(Optimizer):
    """torch.optim.Muon on the blocks' 2-D matrices and AdamW on the rest (embeddings, LM head, norms, biases), as
    modded-nanogpt and nanochat split them, as one optimizer (muon.py). Muon's LR is `optim.lr` (× its
    group's lr_mult) adjusted by `adjust_lr`: match_rms_adamw (0.2·√max(fan_out, fan_in): AdamW's update RMS, so one
    `lr` and `weight_decay` serve both) or original (√max(1, fan_out/fan_in), Keller Jordan's)."""

    algorithm: ClassVar[str] = "adamw"
    matrix_algorithm: ClassVar[str | None] = "muon"
    # Measured (tests/test_muon.py): one update of the same weights and batch, DeepSpeed 0.19's Muon set as alike as
    # it allows (standard bfloat16 Newton–Schulz, adjust_lr original). Without ZeRO its block updates agree to ~1%.
    zero_refusal: ClassVar[str | None] = (
        "ZeRO hands the optimizer flat 1-D shards while Muon's Newton–Schulz needs each whole matrix, and DeepSpeed's "
        "own Muon for ZeRO computes another update: under ZeRO-1/2 each block matrix moved by 4-5% of this Muon's "
        "step (cosine 0.84-0.96 on the same weights and batch), and it drives the LM head with Muon too")

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton–Schulz iterations
    adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not hasattr(torch.optim, "Muon"):  # (pyproject allows torch >= 2.6)
            raise ValueError(f"optim.name=muon needs torch.optim.Muon, which PyTorch added in 2.9; this is torch "
                             f"{torch.__version__}: pip install 'torch>=2.9', or use optim.name=adamw")
        if not (0 <= self.momentum < 1 and 0 < self.ns_steps < 100):
            raise ValueError(f"{OPTIONS} needs 0 <= momentum < 1 and 0 < ns_steps < 100 (optim.name=muon), got "
                             f"momentum={self.momentum}, ns_steps={self.ns_steps}")

    def build(self, groups: list[dict], cfg: AdamWDefaults) -> torch.optim.Optimizer:
        muon = dict(lr=cfg.lr, momentum=self.momentum, nesterov=self.nesterov, ns_steps=self.ns_steps,
                    adjust_lr_fn=self.adjust_lr)
        return MuonWithAdamW(groups, adamw=adamw_settings(cfg), muon=muon)


OPTIMIZERS: dict[str, type[Optimizer]] = {"adamw": AdamW, "muon": Muon}


def lookup(name: str, options: dict[str, Any]) -> Optimizer:
    """The optimizer `name` (`optim.name`) with `options` (`optim.options`), or one error line naming what is wrong
    and what is valid."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name={name!r} is not valid; choose one of {list(OPTIMIZERS)}")
    kind = OPTIMIZERS[name]
    if not isinstance(options, dict):
        raise ValueError(f"{OPTIONS} must be a mapping of {name}'s settings, like {{momentum: 0.9}}, got {options!r}")
    valid = [f.name for f in dataclasses.fields(kind)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"{OPTIONS}.{unknown[0]} is not an option of optim.name={name}; "
                         + (f"its options are {valid}" if valid else f"{name} has no options"))
    return kind(**options)

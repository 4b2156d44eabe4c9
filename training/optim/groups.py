"""The optimizer's parameter groups: each parameter's kind, read from the module that owns it (PARAM_KINDS), and
the group it lands in — its `optim.groups` entry, else "decay" / "no_decay" — with its LR multiplier, weight decay
and the algorithm that drives it (Muon's block matrices, μP's hidden matrices get groups of their own)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from model.layers import Embedding
from model.mup import hidden_lr_mult
from model.norms import Norm
from training.errors import UserError
from training.optim.config import KIND_PARENT, PARAM_KINDS, OptimConfig, group_specs

if TYPE_CHECKING:
    from model.config import ModelConfig


def param_kind(owner: nn.Module, name: str, head: nn.Parameter | None = None) -> str:
    """Which of PARAM_KINDS the parameter `name` of module `owner` is; `head` is the model's LM-head weight (an
    untied head is a Linear like the block matrices: only identity tells them apart)."""
    declared = getattr(owner, "param_kinds", {}).get(name)  # a module names its scalars' kinds (model/residual.py)
    if declared is not None:
        return declared
    if isinstance(owner, Norm):
        return "norm"  # LayerNorm's bias too: a norm's
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


def check_group_names(saved: list[str | None], groups: list[dict]) -> None:
    """A checkpoint's optimizer groups (names, in order) must be this run's: its state loads group by position."""
    names = [g["name"] for g in groups]
    if saved != names:
        raise UserError(f"the checkpoint's optimizer groups are {saved} and this run's {names}: resume or branch with "
                        "the checkpoint's optim.groups / optim.name / model.parametrization (multipliers may differ)")

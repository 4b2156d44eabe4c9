"""The study's run grid: sizes (`Scale`), trained configurations (`Train`) and at-init measurements (`AtInit`).

A configuration is a frozen value, so two claims that need the same run share it: the grid is the set union of
what the selected claims ask for (`training.study.claims`), times the seeds. The seed sets the initialization
only; every run reads the same batches in the same order, so seed-to-seed spread is init noise, and a
comparison between two configurations at one seed changes one factor.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from model import ModelConfig


@dataclass(frozen=True)
class Scale:
    """Model and run sizes of one study (default or `--quick`). Sizes were set from a measured step: on one
    core of the 2-core CPU a 6-layer dim-64 step (seq 64, batch 8) takes ≈ 50 ms and a 24-layer one ≈ 190 ms."""

    dim: int
    n_heads: int
    seq_len: int
    batch_size: int
    shallow: int  # layers of the ordinary runs
    deep: int  # layers of the deep-narrow arm (claims 1-3, 9)
    steps: int  # training steps at `shallow` depth
    deep_steps: int
    post_depths: tuple[int, ...]  # claim 4's two depths
    xiong_depths: tuple[int, ...]  # claim 5's depth sweep (the first is Xiong et al.'s 6)
    lrs: tuple[float, ...]  # claim 6's sweep; lrs[0] is the base learning rate of every other run
    seeds: int  # per trained configuration
    init_seeds: int  # per at-init measurement
    vocab_size: int = 2048
    high_lr: float = 1e-2  # claims 4 and 10: the stress setting
    timing_rounds: int = 30

    @property
    def lr(self) -> float:
        return self.lrs[0]


SCALES = {
    "default": Scale(dim=64, n_heads=4, seq_len=64, batch_size=8, shallow=6, deep=24, steps=200, deep_steps=150,
                     post_depths=(6, 12), xiong_depths=(6, 12, 24), lrs=(3e-3, 1e-2, 3e-2), seeds=3, init_seeds=10),
    # A smoke test of the whole pipeline: too few seeds and steps for its verdicts to mean anything.
    "quick": Scale(dim=32, n_heads=2, seq_len=32, batch_size=4, shallow=2, deep=4, steps=10, deep_steps=10,
                   post_depths=(2,), xiong_depths=(2, 4), lrs=(3e-3, 3e-2), seeds=2, init_seeds=2, vocab_size=512,
                   timing_rounds=2),
}


@dataclass(frozen=True)
class Arch:
    """The architecture fields a study run varies; everything else is ModelConfig's default."""

    layers: int
    placement: str = "pre"
    norm: str = "rmsnorm"
    qk_norm: str = "none"
    init: str = "normal"
    bias: bool = False  # True: biases in linear layers and LayerNorm's β (GPT-2, Xiong et al.)
    mlp: str = "swiglu"
    final_norm: str | bool = "auto"

    def config(self, scale: Scale, vocab_size: int) -> ModelConfig:
        return ModelConfig(vocab_size=vocab_size, dim=scale.dim, n_layers=self.layers, n_heads=scale.n_heads,
                           max_seq_len=scale.seq_len, placement=self.placement, norm=self.norm,
                           qk_norm=self.qk_norm, init=self.init, bias=self.bias, mlp=self.mlp,
                           final_norm=self.final_norm, kernels="auto")

    def label(self) -> str:
        parts = [f"{self.placement}-{self.norm}", f"L{self.layers}"]
        parts += [f"qk-{self.qk_norm}"] if self.qk_norm != "none" else []
        parts += [f"init-{self.init}"] if self.init != "normal" else []
        parts += ["bias"] if self.bias else []
        parts += [self.mlp] if self.mlp != "swiglu" else []
        parts += ["no-final-norm"] if self.final_norm is False else []
        return " ".join(parts)


@dataclass(frozen=True)
class Train:
    """One trained configuration: an architecture, its learning rate and warm-up, its number of steps."""

    arch: Arch
    lr: float
    steps: int
    warmup: bool = True

    def label(self) -> str:
        return f"{self.arch.label()} lr {self.lr:g}{'' if self.warmup else ' no-warmup'} {self.steps} steps"


@dataclass(frozen=True)
class AtInit:
    """One measurement at initialization: `what` is "profile" (stream probes on one real batch) or "xiong"
    (the per-layer gradient norm of the FFN's second matrix after one backward on a real batch)."""

    arch: Arch
    what: str

    def label(self) -> str:
        return f"{self.what}: {self.arch.label()} at init"


Spec = Train | AtInit


def shallow(scale: Scale, **fields) -> Arch:
    return Arch(layers=scale.shallow, **fields)


def deep(scale: Scale, **fields) -> Arch:
    return Arch(layers=scale.deep, **fields)


def train(scale: Scale, arch: Arch, lr: float | None = None, warmup: bool = True) -> Train:
    steps = scale.deep_steps if arch.layers > scale.shallow * 2 else scale.steps
    return Train(arch, scale.lr if lr is None else lr, steps, warmup)


def xiong(scale: Scale, placement: str, layers: int | None = None) -> Arch:
    """Xiong et al. (2020)'s setup: LayerNorm with bias, a ReLU FFN of width 4·dim, Xavier init."""
    return Arch(layers=layers or scale.xiong_depths[0], placement=placement, norm="layernorm", bias=True,
                mlp="relu", init="xavier")


def with_layers(arch: Arch, layers: int) -> Arch:
    return replace(arch, layers=layers)

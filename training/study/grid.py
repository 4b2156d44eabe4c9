"""The study's run grid: sizes (`Scale`), trained configurations (`Train`) and at-init measurements (`AtInit`).

A configuration is a frozen value, so two claims that need the same run share it: the grid is the set union of
what the selected claims ask for (`training.study.claims`), times the seeds. A seed sets the initialization and
the order of the training batches, so two configurations compared at one seed start from the same random
weights (norm gains are constants and draw no random numbers) and read the same batches: the study's design is
paired, and its differences are taken seed by seed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from model import ModelConfig


@dataclass(frozen=True)
class Scale:
    """Model and run sizes of one study (default or `--quick`). Sizes were set from a measured step: on one
    core of the 2-core CPU a dim-64 step (seq 64, batch 8) takes ≈ 38 ms at 6 layers, 64 ms at 12 and 115 ms at
    24; a 6-layer step at dim 128 ≈ 78 ms, at dim 256 ≈ 231 ms (2026-12-02, AMD EPYC, load ≈ 0.5)."""

    dim: int
    n_heads: int
    seq_len: int
    batch_size: int
    shallow: int  # layers of the ordinary runs
    mid: int  # layers of the post- vs pre-LN runs (claims 4, 14-16)
    deep: int  # layers of the deep-narrow arm (claims 1-3, 9, 12, 17, 22)
    steps: int  # training steps at `shallow` and `mid` depth
    deep_steps: int
    long_steps: int  # the long deep run of claims 1 and 2 (block ablation)
    xiong_depths: tuple[int, ...]  # claims 5 and 13 (the first is Xiong et al.'s 6)
    lrs: tuple[float, ...]  # claim 6's QK-norm sweep; lrs[0] is the base learning rate of every other run
    post_lrs: tuple[float, ...]  # claims 4, 14-16: post- vs pre-LN; the last is the "high" LR
    high_post_lrs: tuple[float, ...]  # claim 16: 10% warm-up on a grid that brackets both arms' best LR
    warmups: tuple[float, ...]  # warm-up lengths, fractions of the run (claims 14-16); warmups[1] is the default
    nonorm_lrs: tuple[float, ...]  # claim 17: the no-norm model's LR sweep
    placement_lrs: tuple[float, ...]  # claim 10: pre / sandwich / output
    widths: tuple[int, ...]  # trained width ladder (claims 7, 8); widths[0] is `dim`
    ladder_widths: tuple[int, ...]  # at-init width × depth ladder (claims 1, 5)
    ladder_depths: tuple[int, ...]
    init_stds: tuple[float, ...]  # claims 9 and 22: no-norm init std (the last is 1/√dim)
    seeds: int  # per trained configuration
    init_seeds: int  # per at-init measurement
    ladder_seeds: int  # per at-init ladder cell
    vocab_size: int = 2048
    val_batches: int = 8  # held-out batches every trained run is scored on
    timing_rounds: int = 30  # of claims 20 and 21, split over `timing_runs`
    # Repetitions of a whole timing measurement; the per-run medians are the judged sample. Six: with fewer, the
    # exact sign-flip test (smallest two-sided p 2/2ⁿ) could never reject at α = 0.05, and the verdict would rest
    # on a t-test with a handful of degrees of freedom alone.
    timing_runs: int = 6
    wide_dim: int = 512  # claims 19 and 21: the cost at a realistic width
    seed_start: int = 0  # the seeds are seed_start, seed_start + 1, ...: a confirmatory run takes fresh ones

    def seed_range(self, n: int) -> range:
        """The `n` seeds of a configuration in this study."""
        return range(self.seed_start, self.seed_start + n)

    def longer(self, factor: int) -> Scale:
        """The same study with every trained run `factor` times longer (warm-up stays the same fraction): the
        horizon check."""
        return replace(self, steps=self.steps * factor, deep_steps=self.deep_steps * factor,
                       long_steps=self.long_steps * factor)

    @property
    def lr(self) -> float:
        return self.lrs[0]

    @property
    def high_lr(self) -> float:
        return self.post_lrs[-1]

    @property
    def warmup(self) -> float:
        return self.warmups[1]


SCALES = {
    "default": Scale(dim=64, n_heads=4, seq_len=64, batch_size=8, shallow=6, mid=12, deep=24, steps=200,
                     deep_steps=150, long_steps=1000, xiong_depths=(6, 12, 24), lrs=(3e-3, 1e-2, 3e-2, 0.1, 0.3),
                     post_lrs=(1e-3, 3e-3, 1e-2), high_post_lrs=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
                     warmups=(0.0, 0.1, 0.3), nonorm_lrs=(1e-4, 3e-4, 1e-3, 3e-3),
                     placement_lrs=(3e-3, 3e-2, 0.1), widths=(64, 128, 256), ladder_widths=(64, 128, 256, 512),
                     ladder_depths=(6, 12, 24, 48), init_stds=(0.02, 0.08, 0.125), seeds=6, init_seeds=10,
                     ladder_seeds=5),
    # A smoke test of the whole pipeline: too few seeds and steps for its verdicts to mean anything.
    "quick": Scale(dim=32, n_heads=2, seq_len=32, batch_size=4, shallow=2, mid=3, deep=4, steps=10, deep_steps=10,
                   long_steps=12, xiong_depths=(2, 4), lrs=(3e-3, 3e-2), post_lrs=(1e-2,),
                   high_post_lrs=(1e-3, 1e-2, 0.1), warmups=(0.0, 0.1, 0.3), nonorm_lrs=(3e-4, 3e-3),
                   placement_lrs=(0.1,),
                   widths=(32, 40, 48),
                   ladder_widths=(32, 48), ladder_depths=(2, 4), init_stds=(0.02, 0.08, 32 ** -0.5), seeds=2,
                   init_seeds=2, ladder_seeds=2, vocab_size=512, val_batches=2, timing_rounds=3, timing_runs=2,
                   wide_dim=64),
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
    dim: int | None = None  # None: the scale's width
    init_std: float = 0.02
    unit_embedding: bool = False  # rescale the embedding to unit RMS after init (fairseq's √d-scaled embedding)

    def config(self, scale: Scale, vocab_size: int) -> ModelConfig:
        return ModelConfig(vocab_size=vocab_size, dim=self.dim or scale.dim, n_layers=self.layers,
                           n_heads=scale.n_heads, max_seq_len=scale.seq_len, placement=self.placement, norm=self.norm,
                           qk_norm=self.qk_norm, init=self.init, init_std=self.init_std, bias=self.bias, mlp=self.mlp,
                           final_norm=self.final_norm, kernels="auto")

    def label(self) -> str:
        parts = [f"{self.placement}-{self.norm}", f"L{self.layers}"]
        parts += [f"d{self.dim}"] if self.dim else []
        parts += [f"qk-{self.qk_norm}"] if self.qk_norm != "none" else []
        parts += [f"init-{self.init}"] if self.init != "normal" else []
        parts += [f"std {self.init_std:.3g}"] if self.init_std != 0.02 else []
        parts += ["unit-embedding"] if self.unit_embedding else []
        parts += ["bias"] if self.bias else []
        parts += [self.mlp] if self.mlp != "swiglu" else []
        parts += ["no-final-norm"] if self.final_norm is False else []
        return " ".join(parts)


@dataclass(frozen=True)
class Train:
    """One trained configuration: an architecture, its learning rate, warm-up (a fraction of the steps), number
    of steps, gradient clipping, and whether the trained model gets the block-ablation measurement."""

    arch: Arch
    lr: float
    steps: int
    warmup: float = 0.1
    clip: bool = True
    ablate: bool = False

    def label(self) -> str:
        extra = "" if self.clip else " no-clip"
        return f"{self.arch.label()} lr {self.lr:g} warm-up {self.warmup:.0%} {self.steps} steps{extra}"


@dataclass(frozen=True)
class AtInit:
    """One measurement at initialization: `what` is "profile" (stream probes on one real batch), "xiong" (the
    per-layer gradient norm of the FFN's second matrix after one backward on a real batch, Xiong et al.'s W²) or
    "grads" (every block's gradient norm after one backward)."""

    arch: Arch
    what: str
    ladder: bool = False  # a cell of a scale ladder: `Scale.ladder_seeds` seeds instead of `init_seeds`

    def label(self) -> str:
        return f"{self.what}: {self.arch.label()} at init"


Job = Train | AtInit


def shallow(scale: Scale, **fields) -> Arch:
    return Arch(layers=scale.shallow, **fields)


def deep(scale: Scale, **fields) -> Arch:
    return Arch(layers=scale.deep, **fields)


def train(scale: Scale, arch: Arch, lr: float | None = None, warmup: float | None = None, **fields) -> Train:
    steps = scale.deep_steps if arch.layers > scale.mid else scale.steps
    return Train(arch, scale.lr if lr is None else lr, steps, scale.warmup if warmup is None else warmup, **fields)


def long_run(scale: Scale, placement: str = "pre") -> Train:
    """The long deep run (claims 1 and 2): RMSNorm (pre-norm, or claim 2's sandwich control) at the deep arm's
    depth, with block ablation."""
    return Train(deep(scale, placement=placement), scale.lr, scale.long_steps, scale.warmup, ablate=True)


def xiong(scale: Scale, placement: str, layers: int | None = None, **fields) -> Arch:
    """Xiong et al. (2020)'s setup: LayerNorm with bias, a ReLU FFN of width 4·dim, Xavier init."""
    return Arch(layers=layers or scale.xiong_depths[0], placement=placement, norm="layernorm", bias=True,
                mlp="relu", **({"init": "xavier"} | fields))


def with_layers(arch: Arch, layers: int) -> Arch:
    return replace(arch, layers=layers)

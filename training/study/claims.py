"""The claims the study tests, as data: each claim's source, its setup (the runs it needs, by role), and its
tests — statistic, comparison and threshold, fixed here before any run.

A test's statistic is a per-seed sample (a function in `training.study.judge.STATISTICS` applied to the
runs of role `a`, and of role `b` when given: then the statistic is the difference a − b, with a Welch interval).
`kind` and `threshold` say how the interval is judged (see `training.stats`); kind "report" shows the
numbers with no verdict. `if_not_pass` is printed when a test does not pass: it says what the literature
expects at this scale and is worded as a hypothesis unless the study measures it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from training.study.grid import AtInit, Scale, Spec, deep, shallow, train, with_layers, xiong

MARGIN = 0.1  # nats: the equivalence margin for final losses (≈ 2% of the loss these runs reach)
ZERO_MEAN = 0.1  # |mean| / RMS below this counts as "close to zero mean"


@dataclass(frozen=True)
class Test:
    id: str
    text: str
    stat: str
    a: str
    b: str | None = None
    kind: str = "greater"
    threshold: float = 0.0
    tolerance: float = 0.0
    params: dict = field(default_factory=dict)
    needs_depth: int = 0  # claim 4: the test reads Scale.post_depths[needs_depth]; skipped where it is absent


@dataclass(frozen=True)
class Claim:
    number: int
    title: str
    source: str
    setup: Callable[[Scale], dict[str, Spec]]
    tests: tuple[Test, ...]
    if_not_pass: str = ""


def _deep_arm(scale: Scale) -> dict[str, Spec]:
    roles: dict[str, Spec] = {}
    for init in ("normal", "scaled", "depth"):
        roles[f"init-{init}"] = AtInit(deep(scale, init=init), "profile")
        roles[f"trained-{init}"] = train(scale, deep(scale, init=init))
    return roles


def _post_vs_pre(scale: Scale) -> dict[str, Spec]:
    roles: dict[str, Spec] = {}
    for i, layers in enumerate(scale.post_depths):
        for placement in ("post", "pre"):
            arch = shallow(scale, placement=placement, norm="layernorm", bias=True)
            for warm in (True, False):
                roles[f"{placement}-{'warm' if warm else 'nowarm'}@{i}"] = train(
                    scale, with_layers(arch, layers), lr=scale.high_lr, warmup=warm)
    return roles


def _xiong(scale: Scale) -> dict[str, Spec]:
    return {f"{p}@{i}": AtInit(xiong(scale, p, layers), "xiong")
            for p in ("post", "pre") for i, layers in enumerate(scale.xiong_depths)}


def _qk_sweep(scale: Scale) -> dict[str, Spec]:
    return {f"{qk}@{i}": train(scale, shallow(scale, qk_norm=qk), lr=lr)
            for qk in ("none", "head", "full") for i, lr in enumerate(scale.lrs)}


def _rms_vs_ln(scale: Scale) -> dict[str, Spec]:
    return {"rmsnorm": train(scale, shallow(scale, norm="rmsnorm", bias=True)),
            "layernorm": train(scale, shallow(scale, norm="layernorm", bias=True))}


def _no_norm(scale: Scale) -> dict[str, Spec]:
    return {"init-none": AtInit(deep(scale, norm="none"), "profile"), "init-rms": AtInit(deep(scale), "profile"),
            "trained-none": train(scale, deep(scale, norm="none")), "trained-rms": train(scale, deep(scale))}


def _placements(scale: Scale) -> dict[str, Spec]:
    return {p: train(scale, shallow(scale, placement=p), lr=scale.high_lr) for p in ("pre", "sandwich", "output")}


def _final_norm(scale: Scale) -> dict[str, Spec]:
    return {"final": train(scale, shallow(scale)), "no-final": train(scale, shallow(scale, final_norm=False))}


LAST = -1  # index of the highest learning rate in Scale.lrs
CLAIMS: tuple[Claim, ...] = (
    Claim(1, "Under pre-norm the residual stream's RMS grows with depth.",
          "Xiong et al. 2020; Nguyen & Salazar 2019 (linear growth in trained pre-LN); the 'curse of depth' "
          "papers (2025)", _deep_arm,
          (Test("1a", "at init: slope of log stream RMS vs log depth > 0", "growth_slope", "init-normal"),
           Test("1b", "after training: the same slope > 0", "growth_slope", "trained-normal")),
          "Hypothesis: after training, the learned weights, not the init, set each block's update size."),
    Claim(2, "Each block's relative contribution (update RMS / stream RMS) shrinks with depth under pre-norm.",
          "the curse-of-depth literature (2025): deep pre-LN blocks contribute less", _deep_arm,
          (Test("2a", "after training, attention: slope of log update ratio vs log depth (blocks ≥ 1) < 0",
                "ratio_slope", "trained-normal", kind="less", params={"sub": "attn"}),
           Test("2b", "after training, MLP: the same slope < 0", "ratio_slope", "trained-normal", kind="less",
                params={"sub": "mlp"}),
           Test("2c", "at init, attention: the same slope < 0", "ratio_slope", "init-normal", kind="less",
                params={"sub": "attn"}),
           Test("2d", "at init, MLP: the same slope < 0", "ratio_slope", "init-normal", kind="less",
                params={"sub": "mlp"})),
          "Hypothesis: with few training steps the later blocks' updates grow with the stream."),
    Claim(3, "Depth-scaled initialization (GPT-2's σ/√(2L), or per-layer σ/√(2(l+1))) reduces that growth.",
          "GPT-2 (Radford et al. 2019); Megatron-LM; torchtitan / OLMo per-layer init", _deep_arm,
          tuple(Test(f"3{c}", f"{when}: log(final / block-1 stream RMS), normal − {init} > 0", "log_growth",
                     f"{role}-normal", f"{role}-{init}")
                for c, when, role, init in (("a", "at init", "init", "scaled"), ("b", "at init", "init", "depth"),
                                            ("c", "after training", "trained", "scaled"),
                                            ("d", "after training", "trained", "depth"))),
          "Hypothesis: the init sets the block outputs only until training has moved the weights away from it."),
    Claim(4, "Post-norm at a high learning rate without warm-up trains worse than pre-norm, and warm-up is what "
             "rescues it (both LayerNorm).",
          "Xiong et al. 2020; Liu et al. 2020; the original Transformer's warm-up", _post_vs_pre,
          tuple(t for i in (0, 1) for t in (
              Test(f"4a{i}", f"depth #{i + 1}: final loss, post no-warm-up − pre no-warm-up > 0", "final_loss",
                   f"post-nowarm@{i}", f"pre-nowarm@{i}", needs_depth=i),
              Test(f"4b{i}", f"depth #{i + 1}: final loss, post no-warm-up − post with warm-up > 0", "final_loss",
                   f"post-nowarm@{i}", f"post-warm@{i}", needs_depth=i),
              Test(f"4c{i}", f"depth #{i + 1}: final loss, post with warm-up − pre with warm-up (context: post-LN "
                   "is competitive when shallow, Takase et al. 2023)", "final_loss", f"post-warm@{i}",
                   f"pre-warm@{i}", kind="report", needs_depth=i))),
          "Hypothesis: gradient clipping at 1.0 bounds each step, so at this depth and LR post-LN is slowed, "
          "not broken."),
    Claim(5, "At initialization, post-LN's FFN gradients grow toward the output while pre-LN's do not, and "
             "pre-LN's last-layer gradient shrinks with depth (∝ 1/√L) where post-LN's does not.",
          "Xiong et al. 2020 (Fig. 3 and Theorem 1: W² of the FFN, LayerNorm with bias, ReLU FFN 4d, Xavier)",
          _xiong,
          (Test("5a", "log(last/first layer ‖∇W²‖), post − pre > 0 (first depth)", "w2_top_heavy", "post@0",
                "pre@0"),
           Test("5b", "post-LN log(last/first ‖∇W²‖) > 0 (top-heavy)", "w2_top_heavy", "post@0"),
           Test("5c", "pre-LN: slope of log last-layer ‖∇W²‖ vs log L < 0", "w2_depth_slope", "pre", kind="less"),
           Test("5d", "slope post − slope pre > 0", "w2_depth_slope", "post", "pre")),
          "Hypothesis: Xiong et al.'s flat pre-LN profile is a mean-field expectation for large width."),
    Claim(6, "QK-norm bounds the attention logits at a high learning rate, where the model without it grows them "
             "and trains worse.",
          "Dehghani et al. 2023; Wortsman et al. 2023 (small-model LR sweeps)", _qk_sweep,
          (Test("6a", "highest LR: log max attention logit, none − head > 0", "log_max_logit",
                f"none@{LAST}", f"head@{LAST}"),
           Test("6b", "highest LR: saturated fraction (max prob ≥ 0.99), none − head > 0", "saturated",
                f"none@{LAST}", f"head@{LAST}"),
           Test("6c", "highest LR: final loss, none − head > 0", "final_loss", f"none@{LAST}", f"head@{LAST}"),
           Test("6d", "highest LR: RMS of the per-head QK gains after training (not weight-decayed)", "qk_gain",
                f"head@{LAST}", kind="report"),
           Test("6e", "base LR: final loss, none − head (context)", "final_loss", "none@0", "head@0",
                kind="report")),
          "Hypothesis: at this size and length the logits do not grow far enough to saturate the softmax."),
    Claim(7, "RMSNorm reaches the same loss as LayerNorm and costs less.",
          "Zhang & Sennrich 2019", _rms_vs_ln,
          (Test("7a", f"final loss RMSNorm − LayerNorm within ±{MARGIN} nats", "final_loss", "rmsnorm",
                "layernorm", kind="equivalent", threshold=MARGIN),
           Test("7b", "op time RMSNorm / LayerNorm, eager composites (fwd+bwd) < 1", "op_ratio", "composite",
                kind="less", threshold=1.0),
           Test("7c", "op time RMSNorm / LayerNorm, fused C++ kernels (normlab's CPU RMSNorm vs ATen's "
                "F.layer_norm; fwd+bwd) < 1", "op_ratio", "fused", kind="less", threshold=1.0),
           Test("7d", "norms' share of a training step (torch.profiler), RMSNorm model", "norm_share", "rmsnorm",
                kind="report"),
           Test("7e", "norms' share of a training step (torch.profiler), LayerNorm model", "norm_share",
                "layernorm", kind="report"),
           Test("7f", "op time F.rms_norm / F.layer_norm (context: F.rms_norm is not fused on CPU in torch 2.13)",
                "op_ratio", "aten", kind="report")),
          "Literature, not measured here: Zhang & Sennrich's 7–64% savings are mainly RNN results; they call "
          "the overhead small for small, shallow models. An op ratio measures kernels as much as algorithms."),
    Claim(8, "In trained models the norm inputs are close to zero mean, so LayerNorm's centring changes little "
             "and RMSNorm can drop it.",
          "Zhang & Sennrich 2019 (re-centring is dispensable); the caution that the mean need not be zero",
          _rms_vs_ln,
          (Test("8a", f"RMSNorm model: mean over norm inputs of |mean|/RMS < {ZERO_MEAN}", "mean_over_rms",
                "rmsnorm", kind="less", threshold=ZERO_MEAN),
           Test("8b", f"RMSNorm model: ‖LN(x) − RMSNorm(x)‖ / ‖RMSNorm(x)‖ on those inputs < {ZERO_MEAN}",
                "ln_vs_rms", "rmsnorm", kind="less", threshold=ZERO_MEAN),
           Test("8c", "LayerNorm model: |mean|/RMS of its norm inputs", "mean_over_rms", "layernorm",
                kind="report"),
           Test("8d", "RMSNorm model: the worst norm input's |mean|/RMS", "mean_over_rms", "rmsnorm",
                kind="report", params={"reduce": "max"})),
          "The mean need not be zero: RMSNorm leaves it wherever training puts it (measured by 8a/8d)."),
    Claim(9, "Without a norm, deep layers see ever larger inputs; with one, every layer sees RMS ≈ 1; and a deep "
             "model without norms trains worse.",
          "the 24-random-layer residual toy (d = 512, W ~ N(0, 1/d), seed 0: 1.0, 5.6, 45.9, 2738.7)", _no_norm,
          (Test("9a", "toy: RMS seen by layer 24 without a norm = 2738.7 (printed rounding)", "toy", "plain",
                kind="exact", threshold=2738.7, tolerance=0.05),
           Test("9b", "toy: RMS seen by layer 24 with a norm = 1.0", "toy", "norm", kind="exact", threshold=1.0,
                tolerance=0.05),
           Test("9c", "real model at init: log(last/first block's sublayer-input RMS), none − RMSNorm > 0",
                "log_read_growth", "init-none", "init-rms"),
           Test("9d", "after training: final loss, none − RMSNorm > 0", "final_loss", "trained-none",
                "trained-rms")),
          "Hypothesis: with std-0.02 init the real model's blocks start near the identity, so without a norm "
          "the stream barely grows at init (unlike the toy's unit-gain layers)."),
    Claim(10, "A second norm on the sublayer output (sandwich, output placement) tames what the sublayer adds "
              "to the stream at a high learning rate.",
          "Gemma 2/3 (sandwich), OLMo 2 (output norm), Peri-LN (2025)", _placements,
          (Test("10a", "log mean update RMS (blocks ≥ 1) after training, pre − sandwich > 0", "log_update_rms",
                "pre", "sandwich"),
           Test("10b", "log mean update RMS, pre − output > 0", "log_update_rms", "pre", "output"),
           Test("10c", "final loss, pre − sandwich (context)", "final_loss", "pre", "sandwich", kind="report"),
           Test("10d", "final loss, pre − output (context)", "final_loss", "pre", "output", kind="report")),
          "Hypothesis: at this LR the pre-norm updates stay small enough that a unit-RMS output norm enlarges them."),
    Claim(11, "QK-norm per head (Qwen3) and over the whole projection (OLMo 2) train alike.",
          "Qwen3 and OLMo 2 model code", _qk_sweep,
          (Test("11a", f"base LR: final loss head − full within ±{MARGIN}", "final_loss", "head@0", "full@0",
                kind="equivalent", threshold=MARGIN),
           Test("11b", f"highest LR: final loss head − full within ±{MARGIN}", "final_loss", f"head@{LAST}",
                f"full@{LAST}", kind="equivalent", threshold=MARGIN),
           Test("11c", "highest LR: log max logit head − full (context)", "log_max_logit", f"head@{LAST}",
                f"full@{LAST}", kind="report"))),
    Claim(12, "Pre-norm needs its final norm before the LM head.",
          "GPT-2; every pre-norm model since", _final_norm,
          (Test("12a", "final loss, without − with the final norm > 0", "final_loss", "no-final", "final"),),
          "Hypothesis: in a shallow model the stream's scale is learnable by the head, so the final norm matters "
          "less."),
)

BY_NUMBER = {c.number: c for c in CLAIMS}


def select(numbers: list[int] | None) -> tuple[Claim, ...]:
    """The claims with these numbers, in order (all when None)."""
    if numbers is None:
        return CLAIMS
    return tuple(BY_NUMBER[n] for n in sorted(set(numbers)))

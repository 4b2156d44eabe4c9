"""The study's plots: each shows its claim's own statistic, the mean over seeds with a band from the lowest to
the highest seed (`training.plotting.band`, the sweeps' convention too), labelled axes with units."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from training import health_tags as T
from training.plotting import band, pyplot, save_figure
from training.study.measure import final_loss
from training.study.statistics import Context, capped_final_loss, probes, stream_profile

SMOOTH = 10  # steps of the moving average over training losses


def smooth(losses: Sequence[float]) -> np.ndarray:
    k = min(SMOOTH, len(losses))
    return np.convolve(losses, np.ones(k) / k, mode="valid")


def _loss_bands(ax, ctx: Context, roles: dict[str, str]) -> None:
    for role, label in roles.items():
        runs = [r for r in ctx.runs(role) if r["diverged_at"] is None]
        if not runs:
            continue
        curves = [smooth(r["losses"]) for r in runs]
        n = min(len(c) for c in curves)
        band(ax, np.arange(n) + SMOOTH, [c[:n] for c in curves], label)
    ax.set(xlabel="step", ylabel=f"train loss (nats/token, {SMOOTH}-step mean)")
    ax.legend(fontsize=7)


def _profile(ctx: Context, role: str, key: Callable[[dict, int], list[float]]) -> tuple[list, list]:
    spec = ctx.spec(role)
    per_seed = [key(probes(r, spec), spec.arch.layers) for r in ctx.runs(role)]
    return list(range(1, len(per_seed[0]) + 1)), per_seed


def _lr_curve(ax, ctx: Context, family: str, label: str, stat=None, **kw) -> None:
    """Per seed, a statistic (default: the held-out loss, a diverged run at its loss at init) across the
    family's learning rates, as a band over seeds."""
    roles = ctx.family(family)
    lrs = [ctx.roles[r].lr for r in roles]
    stat = stat or (lambda r, spec: capped_final_loss(r))
    per_lr = [[stat(r, ctx.roles[role]) for r in ctx.runs(role)] for role in roles]
    band(ax, lrs, list(zip(*per_lr, strict=True)), label, marker="o", **kw)
    ax.set(xlabel="peak learning rate", xscale="log")


def residual_growth(ctx: Context, ax_pair) -> None:
    for ax, when in zip(ax_pair, ("init", "trained"), strict=True):
        for init in ("normal", "scaled", "depth"):
            x, ys = _profile(ctx, f"{when}-{init}", stream_profile)
            band(ax, x, ys, f"init {init}" + ("" if when == "init" else f", {ctx.spec(f'trained-{init}').steps} steps"),
                 marker=".")
        ax.set(xlabel="blocks applied", ylabel="stream RMS", xscale="log", yscale="log",
               title="at init" if when == "init" else "after training")
    x, ys = _profile(ctx, "long", stream_profile)
    band(ax_pair[1], x, ys, f"init normal, {ctx.spec('long').steps} steps", marker="x")
    for ax in ax_pair:
        ax.legend(fontsize=7)


def update_ratio(ctx: Context, ax_pair) -> None:
    runs = [r for r in ctx.runs("long") if "ablation" in r]
    if runs:
        band(ax_pair[0], range(len(runs[0]["ablation"])), [[x - r["val_loss"] for x in r["ablation"]] for r in runs],
             "one block removed", marker="o")
        ax_pair[0].set(xlabel="block removed", ylabel="held-out loss increase (nats)", yscale="symlog",
                       title=f"block ablation after {ctx.spec('long').steps} steps")
        ax_pair[0].legend(fontsize=7)
    for sub in ("attn", "mlp"):
        for role, label in (("init-normal", "at init"), ("long", "after the long run")):
            x, ys = _profile(ctx, role, lambda p, L, sub=sub: [p[T.layer(T.UPDATE_RATIO, l, sub)]
                                                                for l in range(1, L)])
            band(ax_pair[1], x, ys, f"{sub}, {label}", marker=".")
    ax_pair[1].set(xlabel="block l (≥ 1)", ylabel="update RMS / stream RMS", xscale="log", yscale="log")
    ax_pair[1].legend(fontsize=7)


def xiong_w2(ctx: Context, ax_pair) -> None:
    for p in ("post", "pre"):
        runs = ctx.runs(f"{p}@0")
        band(ax_pair[0], range(1, len(runs[0]["w2_grad"]) + 1), [r["w2_grad"] for r in runs], f"{p}-LN", marker="o")
        depths = sorted((r for r in ctx.roles if r.startswith(f"{p}@")), key=lambda r: int(r.split("@")[1]))
        Ls = [ctx.roles[r].arch.layers for r in depths]
        per_seed = list(zip(*[[x["w2_grad"][-1] for x in ctx.runs(r)] for r in depths], strict=True))
        band(ax_pair[1], Ls, per_seed, f"{p}-LN", marker="o")
    ax_pair[0].set(xlabel="layer", ylabel="‖∇W²‖ (FFN second matrix)", yscale="log",
                   title="Xiong et al.'s setup at init (LN+bias, ReLU 4d, Xavier)")
    ax_pair[1].set(xlabel="layers L", ylabel="last layer's ‖∇W²‖", xscale="log", yscale="log",
                   title="last layer's W² gradient vs depth")
    for ax in ax_pair:
        ax.legend(fontsize=7)


def post_vs_pre(ctx: Context, ax_pair) -> None:
    for ax, p in zip(ax_pair, ("post", "pre"), strict=True):
        for wi, warm in enumerate(ctx.scale.warmups):
            _lr_curve(ax, ctx, f"{p}-w{wi}", f"warm-up {warm:.0%}")
        ax.set(ylabel="held-out loss (nats/token)", title=f"{p}-LN, {ctx.scale.mid} layers")
        ax.legend(fontsize=7)


def qk_sweep(ctx: Context, ax_pair) -> None:
    for qk in ("none", "head", "full"):
        _lr_curve(ax_pair[0], ctx, qk, f"QK-norm {qk}")
        _lr_curve(ax_pair[1], ctx, qk, f"QK-norm {qk}", stat=lambda r, spec: max(
            probes(r, spec)[T.layer(T.ATTN_MAX_LOGIT, l)] for l in range(spec.arch.layers)))
    ax_pair[0].set(ylabel="held-out loss (nats/token)", title="LR sensitivity")
    ax_pair[1].set(ylabel="max attention logit after training", yscale="log", title="attention logits")
    for ax in ax_pair:
        ax.legend(fontsize=7)


def rms_vs_ln(ctx: Context, ax_pair) -> None:
    _loss_bands(ax_pair[0], ctx, {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm (with β)"})
    ax_pair[0].set(title=f"pre-norm, biases on, width {ctx.scale.dim}")
    widths = ctx.scale.widths
    for norm in ("rmsnorm", "layernorm"):
        per_w = [[final_loss(r) for r in ctx.runs(norm + (f"-w{i}" if i else ""))] for i in range(len(widths))]
        band(ax_pair[1], widths, list(zip(*per_w, strict=True)), norm, marker="o")
    ax_pair[1].set(xlabel="width", ylabel="held-out loss (nats/token)", xscale="log", title="width ladder")
    ax_pair[1].legend(fontsize=7)


def zero_mean(ctx: Context, ax_pair) -> None:
    for ax, key, label in zip(ax_pair, ("isotropy", "ln_vs_rms"),
                              ("d·E[mean²]/E[RMS²] of the norm input (1 = isotropic)",
                               "‖LN(x) − RMSNorm(x)‖ / ‖RMSNorm(x)‖"), strict=True):
        for role in ("rmsnorm", "layernorm"):
            runs = [r for r in ctx.runs(role) if "norm_inputs" in r]
            if not runs:
                continue
            names = list(runs[0]["norm_inputs"])
            band(ax, range(len(names)), [[r["norm_inputs"][n][key] for n in names] for r in runs],
                 f"{role} model, trained", marker=".")
        ax.set(xlabel="norm (block order; last: final norm)", ylabel=label, title="trained activations")
        ax.legend(fontsize=7)
    ax_pair[0].axhline(2.0, color="grey", lw=0.8)


def no_norm(ctx: Context, ax_pair) -> None:
    toy = ctx.extra.get("toy")
    if toy:
        layers = sorted(toy)
        ax_pair[0].plot(layers, [toy[l][0] for l in layers], marker="o", label="no norm")
        ax_pair[0].plot(layers, [toy[l][1] for l in layers], marker="o", label="bare RMSNorm")
        ax_pair[0].set(xlabel="layer", ylabel="RMS of the layer's input", yscale="log",
                       title="toy: 24 random residual layers, d=512")
        ax_pair[0].legend(fontsize=7)
    for i, std in enumerate(ctx.scale.init_stds[:2]):
        for role, label in ((f"none-std{i}", "no norm"), (f"rms-std{i}", "RMSNorm")):
            x, ys = _profile(ctx, role, lambda p, L: [p[T.layer(T.READ_RMS, l, "attn")] for l in range(L)])
            band(ax_pair[1], x, ys, f"{label}, init std {std:g}", marker=".")
    ax_pair[1].set(xlabel="block", ylabel="RMS of the attention sublayer's input", yscale="log",
                   title="real model at init (pre-norm placement)")
    ax_pair[1].legend(fontsize=7)


def placements(ctx: Context, ax_pair) -> None:
    for p in ("pre", "sandwich", "output"):
        _lr_curve(ax_pair[0], ctx, p, p, stat=lambda r, spec: probes(r, spec)[T.FINAL_IN])
        _lr_curve(ax_pair[1], ctx, p, p)
    ax_pair[0].set(ylabel="final stream RMS after training", yscale="log", title="stream growth")
    ax_pair[1].set(ylabel="held-out loss (nats/token)", title="loss")
    for ax in ax_pair:
        ax.legend(fontsize=7)


def final_norm(ctx: Context, ax_pair) -> None:
    _loss_bands(ax_pair[0], ctx, {"final": "with final norm", "no-final": "without"})
    ax_pair[0].set(title=f"pre-norm RMSNorm, {ctx.spec('final').arch.layers} layers")
    _loss_bands(ax_pair[1], ctx, {"deep-final": "with final norm", "deep-no-final": "without"})
    ax_pair[1].set(title=f"pre-norm RMSNorm, {ctx.spec('deep-final').arch.layers} layers")


def no_norm_lr(ctx: Context, ax_pair) -> None:
    _lr_curve(ax_pair[0], ctx, "none", "no norm")
    _lr_curve(ax_pair[0], ctx, "rms", "RMSNorm")
    ax_pair[0].set(ylabel="held-out loss (nats/token; diverged = loss at init)",
                   title=f"{ctx.spec('none@0').arch.layers} layers")
    ax_pair[0].legend(fontsize=7)
    _loss_bands(ax_pair[1], ctx, {r: f"no norm, lr {ctx.roles[r].lr:g}" for r in ctx.family("none")})


PLOTS: dict[int, tuple[str, Callable]] = {
    1: ("residual_growth.png", residual_growth), 2: ("update_ratio.png", update_ratio),
    4: ("post_vs_pre.png", post_vs_pre), 5: ("xiong_w2.png", xiong_w2), 6: ("qk_sweep.png", qk_sweep),
    7: ("rms_vs_ln.png", rms_vs_ln), 8: ("zero_mean.png", zero_mean), 9: ("no_norm.png", no_norm),
    10: ("placements.png", placements), 12: ("final_norm.png", final_norm), 17: ("no_norm_lr.png", no_norm_lr),
}


def plot(number: int, ctx: Context, out: Path) -> str | None:
    """Write claim `number`'s plot into `out`; its file name, or None when the claim has none."""
    if number not in PLOTS:
        return None
    name, draw = PLOTS[number]
    plt = pyplot()
    panels = 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    draw(ctx, list(axes[0]))
    fig.tight_layout()
    save_figure(fig, out / name, dpi=100)
    return name

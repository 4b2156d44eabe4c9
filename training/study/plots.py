"""The study's plots: each shows its claim's own statistic, the mean over seeds with a ±1 sd band, labelled
axes with units. Written with matplotlib's Agg backend (no display)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from training.study.judge import Context, probes, stream_profile
from training.study.measure import final_loss

SMOOTH = 10  # steps of the moving average over training losses


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def band(ax, x: Sequence[float], per_seed: Sequence[Sequence[float]], label: str, **kw) -> None:
    """Mean over seeds with a ±1 sd band."""
    ys = np.asarray(per_seed, dtype=float)
    mean, sd = ys.mean(0), ys.std(0, ddof=1) if len(ys) > 1 else np.zeros(ys.shape[1])
    (line,) = ax.plot(x, mean, label=f"{label} (n={len(ys)})", **kw)
    ax.fill_between(x, mean - sd, mean + sd, color=line.get_color(), alpha=0.2, lw=0)


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


def residual_growth(ctx: Context, ax_pair) -> None:
    for ax, when in zip(ax_pair, ("init", "trained"), strict=True):
        for init in ("normal", "scaled", "depth"):
            x, ys = _profile(ctx, f"{when}-{init}", stream_profile)
            band(ax, x, ys, f"init {init}", marker=".")
        ax.set(xlabel="blocks applied (last point: final-norm input)", ylabel="stream RMS (linear)",
               title=f"pre-norm RMSNorm, {ctx.spec('init-normal').arch.layers} layers, "
                     f"{'at init' if when == 'init' else 'after training'}")
        ax.legend(fontsize=7)


def update_ratio(ctx: Context, ax_pair) -> None:
    for ax, sub in zip(ax_pair, ("attn", "mlp"), strict=True):
        for role, label in (("init-normal", "at init"), ("trained-normal", "after training")):
            x, ys = _profile(ctx, role, lambda p, L, sub=sub: [p[f"resid/update_ratio/{sub}/L{l}"]
                                                               for l in range(1, L)])
            band(ax, x, ys, label, marker=".")
        ax.set(xlabel="block l (≥ 1)", ylabel=f"{sub} update RMS / stream RMS", xscale="log", yscale="log",
               title=f"{sub}: relative contribution (log-log; the claim's slope)")
        ax.legend(fontsize=7)


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


def post_vs_pre(ctx: Context, axes) -> None:
    warmups = {"warm": "warm-up", "nowarm": "no warm-up"}
    for i, ax in enumerate(axes):
        _loss_bands(ax, ctx, {f"{p}-{w}@{i}": f"{p}-LN, {text}"
                              for p in ("post", "pre") for w, text in warmups.items()})
        spec = ctx.spec(f"post-warm@{i}")
        ax.set(title=f"LayerNorm, lr {spec.lr:g}, {spec.arch.layers} layers")


def qk_sweep(ctx: Context, ax_pair) -> None:
    lrs = sorted({ctx.roles[r].lr for r in ctx.roles})
    for qk in ("none", "head", "full"):
        roles = [f"{qk}@{i}" for i in range(len(lrs))]
        losses = [[min(final_loss(r), 12.0) for r in ctx.runs(role)] for role in roles]
        band(ax_pair[0], lrs, list(zip(*losses, strict=True)), f"QK-norm {qk}", marker="o")
        logits = [[max(probes(r, ctx.spec(role))[f"attn/max_logit/L{l}"] for l in range(ctx.spec(role).arch.layers))
                   for r in ctx.runs(role)] for role in roles]
        band(ax_pair[1], lrs, list(zip(*logits, strict=True)), f"QK-norm {qk}", marker="o")
    ax_pair[0].set(xlabel="peak learning rate", ylabel="final train loss (nats/token)", xscale="log",
                   title="LR sensitivity")
    ax_pair[1].set(xlabel="peak learning rate", ylabel="max attention logit after training", xscale="log",
                   yscale="log", title="attention logits")
    for ax in ax_pair:
        ax.legend(fontsize=7)


def rms_vs_ln(ctx: Context, ax_pair) -> None:
    _loss_bands(ax_pair[0], ctx, {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm (with β)"})
    ax_pair[0].set(title="pre-norm, biases on")
    ratios = ctx.extra.get("op_ratios")
    if ratios:
        ax_pair[1].boxplot(list(ratios.values()), tick_labels=list(ratios))
        ax_pair[1].axhline(1.0, color="grey", lw=0.8)
        ax_pair[1].set(ylabel="time RMSNorm / LayerNorm (fwd+bwd)", title=f"op timing, shape {ctx.extra['op_shape']}")


def zero_mean(ctx: Context, ax_pair) -> None:
    for ax, key, label in zip(ax_pair, ("mean_over_rms", "ln_vs_rms"),
                              ("|mean| / RMS of the norm input", "‖LN(x) − RMSNorm(x)‖ / ‖RMSNorm(x)‖"), strict=True):
        for role in ("rmsnorm", "layernorm"):
            runs = [r for r in ctx.runs(role) if "norm_inputs" in r]
            if not runs:
                continue
            names = list(runs[0]["norm_inputs"])
            band(ax, range(len(names)), [[r["norm_inputs"][n][key] for n in names] for r in runs],
                 f"{role} model, trained", marker=".")
        ax.set(xlabel="norm (block order; last: final norm)", ylabel=label, title="trained activations")
        ax.legend(fontsize=7)


def no_norm(ctx: Context, ax_pair) -> None:
    toy = ctx.extra.get("toy")
    if toy:
        layers = sorted(toy)
        ax_pair[0].plot(layers, [toy[l][0] for l in layers], marker="o", label="no norm")
        ax_pair[0].plot(layers, [toy[l][1] for l in layers], marker="o", label="bare RMSNorm")
        ax_pair[0].set(xlabel="layer", ylabel="RMS of the layer's input", yscale="log",
                       title="toy: 24 random residual layers, d=512")
        ax_pair[0].legend(fontsize=7)
    for role, label in (("init-none", "no norm"), ("init-rms", "RMSNorm")):
        x, ys = _profile(ctx, role, lambda p, L: [p[f"resid/read_rms/attn/L{l}"] for l in range(L)])
        band(ax_pair[1], x, ys, label, marker=".")
    ax_pair[1].set(xlabel="block", ylabel="RMS of the attention sublayer's input", yscale="log",
                   title="real model at init (pre-norm placement)")
    ax_pair[1].legend(fontsize=7)


def placements(ctx: Context, ax_pair) -> None:
    for role in ("pre", "sandwich", "output"):
        x, ys = _profile(ctx, role, lambda p, L: [(p[f"resid/update_rms/attn/L{l}"] + p[f"resid/update_rms/mlp/L{l}"])
                                                  / 2 for l in range(1, L)])
        band(ax_pair[0], x, ys, role, marker="o")
    ax_pair[0].set(xlabel="block l (≥ 1)", ylabel="update RMS (attn, mlp mean)", yscale="log",
                   title=f"after training at lr {ctx.spec('pre').lr:g}")
    ax_pair[0].legend(fontsize=7)
    _loss_bands(ax_pair[1], ctx, {"pre": "pre", "sandwich": "sandwich", "output": "output"})


def final_norm(ctx: Context, ax_pair) -> None:
    _loss_bands(ax_pair[0], ctx, {"final": "with final norm", "no-final": "without"})
    ax_pair[0].set(title="pre-norm RMSNorm")
    ax_pair[1].axis("off")


PLOTS: dict[int, tuple[str, Callable]] = {
    1: ("residual_growth.png", residual_growth), 2: ("update_ratio.png", update_ratio),
    4: ("post_vs_pre.png", post_vs_pre), 5: ("xiong_w2.png", xiong_w2), 6: ("qk_sweep.png", qk_sweep),
    7: ("rms_vs_ln.png", rms_vs_ln), 8: ("zero_mean.png", zero_mean), 9: ("no_norm.png", no_norm),
    10: ("placements.png", placements), 12: ("final_norm.png", final_norm),
}


def plot(number: int, ctx: Context, out: Path) -> str | None:
    """Write claim `number`'s plot into `out`; its file name, or None when the claim has none."""
    if number not in PLOTS:
        return None
    name, draw = PLOTS[number]
    plt = _plt()
    panels = len(ctx.scale.post_depths) if number == 4 else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    draw(ctx, list(axes[0]))
    fig.tight_layout()
    tmp = out / f".{name}.tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out / name)
    return name

"""The statistics the claims name (`STATISTICS`): each maps the runs of one role (a list of per-seed results, in
seed order) to one number per seed, read by `training.study.judge`.

Probes are read after the last step for trained runs (`Train`) and on one real batch for at-init ones
(`AtInit`). Stream RMS `resid/rms/L{l}` is the stream entering block l, i.e. after l blocks; the final norm's
input is the stream after all L blocks. A diverged run's held-out loss is +inf (`measure.final_loss`); where a
statistic needs a number for every run of a learning-rate grid, it counts as the seed's loss at init
(`training.stats.initial_loss_cap`), and "at its own best LR" is cross-fitted (`training.stats.crossfit_best`);
those statistics of a learning-rate sweep are in `training.study.lr_statistics`.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from training import health_tags as T
from training.stats import capped_loss, slope
from training.study.grid import AtInit, Job, Scale
from training.study.lr_statistics import (
    best_lr_index,
    best_lr_loss,
    capped_final_loss,
    capped_grid,
    diverged_runs,
    high_lr_sensitivity,
    lr_reach_censored,
    lr_reach_widths,
    lr_sensitivities,
    max_trainable_lr,
    unbracketed,
)
from training.study.measure import final_loss, initial_loss

# The LR-sweep statistics live in lr_statistics.py; the report, the plots and the judge import them from here.
__all__ = ["COUNT_STATISTICS", "STATISTICS", "Context", "best_lr_index", "capped_final_loss", "capped_grid",
           "lr_reach_censored", "probes", "stream_profile", "unbracketed"]

ABLATION_FLOOR = 1e-4  # nats: a removed block's loss increase counts as at least this (log of a ratio)


@dataclass
class Context:
    """What one claim's statistics read: its roles' specs, every job's results, and the main-process
    measurements (`extra`: "timing", "norm_share", "toy")."""

    scale: Scale
    roles: dict[str, Job]
    results: dict[Job, list[dict]]
    extra: dict = field(default_factory=dict)

    def family(self, name: str) -> list[str]:
        """The roles `name@0`, `name@1`, ... in index order (a learning-rate sweep)."""
        members = [r for r in self.roles if r.split("@")[0] == name and "@" in r]
        return sorted(members, key=lambda r: int(r.split("@")[1]))

    def resolve(self, role: str) -> str:
        """`family@-1` names the last index of that family (the highest learning rate of a sweep)."""
        if role.endswith("@-1"):
            return self.family(role[:-3])[-1]
        return role

    def spec(self, role: str) -> Job:
        return self.roles[self.resolve(role)]

    def runs(self, role: str) -> list[dict]:
        return self.results[self.spec(role)]


def probes(result: dict, spec: Job) -> dict[str, float]:
    """The probe scalars a statistic reads: at init, or after the last training step — for a run that diverged,
    its last probe before the loss became non-finite (the report marks the run 'diverged')."""
    if isinstance(spec, AtInit):
        return result["probes"]
    return result["probes"][max(result["probes"])]


def _per_seed(fn: Callable[[dict[str, float], int], float]) -> Callable[..., list[float]]:
    def stat(ctx: Context, role: str, **_) -> list[float]:
        spec = ctx.spec(role)
        out = []
        for r in ctx.runs(role):
            try:
                out.append(fn(probes(r, spec), spec.arch.layers))
            except (ValueError, ZeroDivisionError, KeyError):
                out.append(math.nan)  # a probe that overflowed (log of 0, inf or NaN)
        return out
    return stat


def stream_profile(p: dict[str, float], layers: int) -> list[float]:
    """Stream RMS after 1..L blocks."""
    return [p[T.layer(T.RESID_RMS, l)] for l in range(1, layers)] + [p[T.FINAL_IN]]


def _growth_slope(p: dict[str, float], layers: int, first: int = 1) -> float:
    depth = range(first, layers + 1)
    prof = stream_profile(p, layers)[first - 1:]
    return slope([math.log(l) for l in depth], [math.log(x) for x in prof])


def _log_read_growth(p: dict[str, float], layers: int) -> float:
    return math.log(p[T.layer(T.READ_RMS, layers - 1, "attn")] / p[T.layer(T.READ_RMS, 0, "attn")])


def _log_update_rms(p: dict[str, float], layers: int) -> float:
    return math.log(statistics.fmean(p[T.layer(T.UPDATE_RMS, l, s)] for s in T.SUBLAYERS
                                     for l in range(1, layers)))


def _update_slope(p: dict[str, float], layers: int) -> float:
    ys = [math.log((p[T.layer(T.UPDATE_RMS, l, "attn")] + p[T.layer(T.UPDATE_RMS, l, "mlp")]) / 2)
          for l in range(1, layers)]
    return slope([math.log(l) for l in range(1, layers)], ys)


def _non_finite(p: dict[str, float], layers: int) -> float:
    return float(not all(math.isfinite(v) for k, v in p.items() if k.startswith(T.RESIDUAL)))


def ratio_slope(ctx: Context, role: str, sub: str) -> list[float]:
    """Per seed, the slope of log(update RMS / stream RMS) of sublayer `sub` against log l, blocks 1..L−1
    (block 0 reads the raw embedding, whose scale is the init's, not depth's)."""
    spec = ctx.spec(role)
    L = spec.arch.layers
    xs = [math.log(l) for l in range(1, L)]
    return [slope(xs, [math.log(probes(r, spec)[T.layer(T.UPDATE_RATIO, l, sub)]) for l in range(1, L)])
            for r in ctx.runs(role)]


def final_losses(ctx: Context, role: str) -> list[float]:
    return [final_loss(r) for r in ctx.runs(role)]


def loss_gap(ctx: Context, role: str, swap: tuple[str, str]) -> list[float]:
    """Per seed, the held-out loss of `role` minus that of the role named with `swap[0]` replaced by `swap[1]`
    (claim 4e: post-LN's gap to pre-LN at the same LR and warm-up); ±inf when one of them diverged."""
    other = ctx.resolve(role).replace(*swap, 1)
    return [x - y if math.isfinite(x) or math.isfinite(y) else math.nan
            for x, y in zip(final_losses(ctx, role), final_losses(ctx, other), strict=True)]


def ablation_ratio(ctx: Context, role: str) -> list[float]:
    """Per seed, log(mean loss increase from removing one of the last ⌊L/3⌋ blocks / the same for blocks
    1..⌊L/3⌋), each mean floored at ABLATION_FLOOR."""
    out = []
    for r in ctx.runs(role):
        if "ablation" not in r:
            out.append(math.nan)
            continue
        inc = [x - r["val_loss"] for x in r["ablation"]]
        third = max(1, len(inc) // 3)
        early, late = statistics.fmean(inc[1:1 + third]), statistics.fmean(inc[-third:])
        out.append(math.log(max(late, ABLATION_FLOOR) / max(early, ABLATION_FLOOR)))
    return out


def w2_top_heavy(ctx: Context, role: str) -> list[float]:
    """Per seed, log(‖∇W²‖ of the last layer / of the first) at init."""
    return [math.log(r["w2_grad"][-1] / r["w2_grad"][0]) for r in ctx.runs(role)]


def w2_depth_slope(ctx: Context, role: str) -> list[float]:
    """Per seed, the slope of log last-layer ‖∇W²‖ against log L over the depth sweep (`role` is the
    placement; the roles are `{placement}@{i}`)."""
    depths = ctx.family(role)
    layers = [math.log(ctx.roles[r].arch.layers) for r in depths]
    per_depth = [[math.log(x["w2_grad"][-1]) for x in ctx.runs(r)] for r in depths]
    return [slope(layers, list(seed)) for seed in zip(*per_depth, strict=True)]


def grad_log_ratio(ctx: Context, role: str) -> list[float]:
    """Per seed, log(first block's gradient norm / last block's) at init: > 0 when the gradients grow toward the
    input (explode going backward), < 0 when they shrink (vanish); NaN when one of them is not finite."""
    out = []
    for r in ctx.runs(role):
        g = r["block_grad"]
        ok = all(math.isfinite(x) and x > 0 for x in (g[0], g[-1]))
        out.append(math.log(g[0] / g[-1]) if ok else math.nan)
    return out


def abs_grad_log_ratio(ctx: Context, role: str) -> list[float]:
    """Per seed, |`grad_log_ratio`|: how far the gradient norm changes across depth in either direction, a
    non-finite gradient counting as the largest (+inf)."""
    return [abs(x) if math.isfinite(x) else math.inf for x in grad_log_ratio(ctx, role)]


def qk_gain(ctx: Context, role: str) -> list[float]:
    return [statistics.fmean(r["gains"].values()) for r in ctx.runs(role)]


def _norm_input_stat(key: str, log: bool = False) -> Callable[..., list[float]]:
    def stat(ctx: Context, role: str, reduce: str = "mean") -> list[float]:
        agg = max if reduce == "max" else statistics.fmean
        vals = [agg(v[key] for v in r["norm_inputs"].values()) if "norm_inputs" in r else math.nan
                for r in ctx.runs(role)]
        return [math.log(v) if log and v > 0 else v for v in vals]
    return stat


def mean_over_floor(ctx: Context, role: str) -> list[float]:
    dim = ctx.spec(role).arch.dim or ctx.scale.dim
    floor = math.sqrt(2 / (math.pi * dim))
    return [x / floor for x in _norm_input_stat("mean_over_rms")(ctx, role)]


def input_scale_cost(ctx: Context, role: str, k: float) -> list[float]:
    """Per seed, the held-out loss with the middle block's input × k (capped at the loss at init) minus the
    intact model's; NaN for a run that diverged in training."""
    return [capped_loss(r["input_scaling"][k], initial_loss(r)) - r["val_loss"] if "input_scaling" in r
            else math.nan for r in ctx.runs(role)]


def dim_spread_growth(ctx: Context, role: str) -> list[float]:
    return [r["dim_spread"] - r["dim_spread_init"] for r in ctx.runs(role)]


def log_time(ctx: Context, role: str) -> list[float]:
    return [math.log(x) for x in ctx.extra["timing"].get(role, [math.nan])]


# Statistics whose per-seed values are counts of events: judged by exact tests on their totals
# (`training.stats.count_p_values`), never by a t-test of the per-seed differences.
COUNT_STATISTICS = frozenset({"diverged_runs"})

STATISTICS: dict[str, Callable[..., list[float]]] = {
    "growth_slope": _per_seed(_growth_slope),
    "growth_slope_2": _per_seed(lambda p, L: _growth_slope(p, L, first=2)),
    "log_final_rms": _per_seed(lambda p, L: math.log(p[T.FINAL_IN])),
    "log_max_over_rms": _per_seed(lambda p, L: math.log(p[f"{T.MAX_OVER_RMS}/final_in"])),
    "kurtosis": _per_seed(lambda p, L: p[f"{T.KURTOSIS}/final_in"]),
    "log_read_growth": _per_seed(_log_read_growth),
    "log_update_rms": _per_seed(_log_update_rms),
    "update_slope": _per_seed(_update_slope),
    "log_max_logit": _per_seed(lambda p, L: math.log(max(p[T.layer(T.ATTN_MAX_LOGIT, l)] for l in range(L)))),
    "saturated": _per_seed(lambda p, L: statistics.fmean(p[T.layer(T.ATTN_SATURATED, l)] for l in range(L))),
    "non_finite": _per_seed(_non_finite),
    "ratio_slope": ratio_slope,
    "final_loss": final_losses,
    "best_lr_loss": best_lr_loss,
    "lr_sensitivity": lr_sensitivities,
    "max_trainable_lr": max_trainable_lr,
    "ablation_ratio": ablation_ratio,
    "drift": lambda ctx, role: [statistics.fmean(r["drift"]) for r in ctx.runs(role)],
    "w2_top_heavy": w2_top_heavy,
    "w2_depth_slope": w2_depth_slope,
    "grad_log_ratio": grad_log_ratio,
    "abs_grad_log_ratio": abs_grad_log_ratio,
    "high_lr_sensitivity": high_lr_sensitivity,
    "lr_reach": lr_reach_widths,
    "diverged_runs": diverged_runs,
    "loss_gap": loss_gap,
    "non_finite_grad": lambda ctx, role: [float(not all(math.isfinite(x) for x in r["block_grad"]))
                                          for r in ctx.runs(role)],
    "qk_gain": qk_gain,
    "log_isotropy": _norm_input_stat("isotropy", log=True),
    "mean_over_floor": mean_over_floor,
    "input_scale_cost": input_scale_cost,
    "dim_spread_growth": dim_spread_growth,
    "log_time": log_time,
    "share": lambda ctx, role: ctx.extra["norm_share"][role],
    "toy": lambda ctx, role: [ctx.extra["toy"][24][0 if role == "plain" else 1]],
}

"""From measured runs to verdicts: the statistics the claims name, and `judge_all`, which applies every test.

Each statistic maps the runs of one role (a list of per-seed results, in seed order) to one number per seed.
Probes are read after the last step for trained runs (`Train`) and on one real batch for at-init ones
(`AtInit`). Stream RMS `resid/rms/L{l}` is the stream entering block l, i.e. after l blocks; the final norm's
input is the stream after all L blocks.

A test comparing two roles takes the per-seed differences (the arms share each seed's weights and batches: a
paired design); the Welch interval is kept beside it for the report. A trained run that diverged has no
held-out loss: seeds where one arm diverged and the other did not are counted (McNemar's exact test on those
discordant seeds), and the loss difference is taken over the seeds where both arms trained (`decide`).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from training.stats import (
    ALPHA,
    BETTER,
    EQUIVALENT,
    FAIL,
    PASS,
    WORSE,
    Estimate,
    capped_loss,
    comparison_verdict,
    difference,
    estimate,
    holm,
    lr_sensitivity,
    min_detectable,
    no_estimate,
    outcome_test,
    power_at,
    slope,
)
from training.study.claims import MECHANISM, PRIMARY, REPORT, Claim, Test
from training.study.grid import AtInit, Scale, Spec, Train
from training.study.measure import final_loss, initial_loss, outcome

ABLATION_FLOOR = 1e-4  # nats: a removed block's loss increase counts as at least this (log of a ratio)


@dataclass
class Context:
    """What one claim's statistics read: its roles' specs, every job's results, and the main-process
    measurements (`extra`: "timing", "norm_share", "toy")."""

    scale: Scale
    roles: dict[str, Spec]
    results: dict[Spec, list[dict]]
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

    def spec(self, role: str) -> Spec:
        return self.roles[self.resolve(role)]

    def runs(self, role: str) -> list[dict]:
        return self.results[self.spec(role)]


def probes(result: dict, spec: Spec) -> dict[str, float]:
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
    return [p[f"resid/rms/L{l}"] for l in range(1, layers)] + [p["resid/final_in"]]


def _growth_slope(p: dict[str, float], layers: int, first: int = 1) -> float:
    depth = range(first, layers + 1)
    prof = stream_profile(p, layers)[first - 1:]
    return slope([math.log(l) for l in depth], [math.log(x) for x in prof])


def _log_read_growth(p: dict[str, float], layers: int) -> float:
    return math.log(p[f"resid/read_rms/attn/L{layers - 1}"] / p["resid/read_rms/attn/L0"])


def _log_update_rms(p: dict[str, float], layers: int) -> float:
    return math.log(statistics.fmean(p[f"resid/update_rms/{s}/L{l}"] for s in ("attn", "mlp")
                                     for l in range(1, layers)))


def _update_slope(p: dict[str, float], layers: int) -> float:
    ys = [math.log((p[f"resid/update_rms/attn/L{l}"] + p[f"resid/update_rms/mlp/L{l}"]) / 2) for l in range(1, layers)]
    return slope([math.log(l) for l in range(1, layers)], ys)


def _non_finite(p: dict[str, float], layers: int) -> float:
    return float(not all(math.isfinite(v) for k, v in p.items() if k.startswith("resid/")))


def ratio_slope(ctx: Context, role: str, sub: str) -> list[float]:
    """Per seed, the slope of log(update RMS / stream RMS) of sublayer `sub` against log l, blocks 1..L−1
    (block 0 reads the raw embedding, whose scale is the init's, not depth's)."""
    spec = ctx.spec(role)
    L = spec.arch.layers
    xs = [math.log(l) for l in range(1, L)]
    return [slope(xs, [math.log(probes(r, spec)[f"resid/update_ratio/{sub}/L{l}"]) for l in range(1, L)])
            for r in ctx.runs(role)]


def final_losses(ctx: Context, role: str) -> list[float]:
    return [final_loss(r) for r in ctx.runs(role)]


def capped_final_loss(r: dict) -> float:
    """The held-out loss, a diverged run counting as the loss at init (no better than not training)."""
    return capped_loss(final_loss(r), initial_loss(r))


def _sweep(ctx: Context, family: str) -> list[list[dict]]:
    """Per LR index of the family, its runs (seed order)."""
    return [ctx.runs(r) for r in ctx.family(family)]


def best_lr_index(ctx: Context, family: str) -> int:
    """The LR index with the lowest mean capped held-out loss over seeds (chosen from these runs: a selection,
    so the best-vs-best comparison is optimistic for both arms alike)."""
    sweep = _sweep(ctx, family)
    return min(range(len(sweep)), key=lambda i: statistics.fmean(capped_final_loss(r) for r in sweep[i]))


def best_lr_loss(ctx: Context, role: str) -> list[float]:
    """Per seed, the capped held-out loss at the family's best LR (a diverged run: the loss at init)."""
    return [capped_final_loss(r) for r in _sweep(ctx, role)[best_lr_index(ctx, role)]]


def lr_sensitivities(ctx: Context, role: str) -> list[float]:
    """Per seed, Wortsman et al.'s LR sensitivity over the family's sweep (`training.stats.lr_sensitivity`)."""
    sweep, lrs = _sweep(ctx, role), [ctx.roles[r].lr for r in ctx.family(role)]
    return [lr_sensitivity({lr: final_loss(runs[s]) for lr, runs in zip(lrs, sweep, strict=True)},
                           initial_loss(sweep[0][s])) for s in range(len(sweep[0]))]


def max_trainable_lr(ctx: Context, role: str) -> list[float]:
    sweep, lrs = _sweep(ctx, role), [ctx.roles[r].lr for r in ctx.family(role)]
    return [max([lr for lr, runs in zip(lrs, sweep, strict=True) if outcome(runs[s]) == "trains"], default=0.0)
            for s in range(len(sweep[0]))]


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


STATISTICS: dict[str, Callable[..., list[float]]] = {
    "growth_slope": _per_seed(_growth_slope),
    "growth_slope_2": _per_seed(lambda p, L: _growth_slope(p, L, first=2)),
    "log_final_rms": _per_seed(lambda p, L: math.log(p["resid/final_in"])),
    "log_max_over_rms": _per_seed(lambda p, L: math.log(p["outlier/max_over_rms/final_in"])),
    "kurtosis": _per_seed(lambda p, L: p["outlier/kurtosis/final_in"]),
    "log_read_growth": _per_seed(_log_read_growth),
    "log_update_rms": _per_seed(_log_update_rms),
    "update_slope": _per_seed(_update_slope),
    "log_max_logit": _per_seed(lambda p, L: math.log(max(p[f"attn/max_logit/L{l}"] for l in range(L)))),
    "saturated": _per_seed(lambda p, L: statistics.fmean(p[f"attn/saturated_frac/L{l}"] for l in range(L))),
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


@dataclass
class Outcome:
    """One test's result: its per-seed samples, estimates (a; b and the paired difference when the test compares
    two roles, with the Welch interval beside it), its p-values and the verdict."""

    test: Test
    samples_a: list[float]
    samples_b: list[float] | None
    a: Estimate
    b: Estimate | None = None
    diff: Estimate | None = None
    welch: Estimate | None = None
    discordant: tuple[int, int] = (0, 0)  # seeds that diverged in a only, in b only
    p: dict[str, float] = field(default_factory=dict)  # difference, equivalence, outcome (raw)
    p_adjusted: dict[str, float] = field(default_factory=dict)  # the same after Holm (primaries only)
    verdict: str = "—"
    power: float = math.nan  # at a true effect of one margin (equivalence: at a true difference of 0)
    mde: float = math.nan  # the smallest effect detected with 80% power at this n and sd

    @property
    def judged(self) -> Estimate:
        """The estimate the verdict reads, shifted by the test's threshold."""
        return self.diff if self.diff is not None else self.a

    @property
    def shown(self) -> Estimate:
        """The estimate a reader compares with the threshold: one role's statistic, or the paired difference."""
        return self.a if self.b is None else self.judged

    def numbers(self) -> str:
        t = self.test
        if self.b is None:
            return f"{t.a}: {self.a}"
        text = f"{t.a}: {self.a}; {t.b}: {self.b}; paired difference {self.diff}"
        if self.welch is not None and math.isfinite(self.welch.mean) and self.welch.df:
            text += f" (Welch: CI [{self.welch.lo:.3g}, {self.welch.hi:.3g}], df {self.welch.df:.1f})"
        if sum(self.discordant):
            text += f"; diverged in {t.a} only: {self.discordant[0]}, in {t.b} only: {self.discordant[1]}"
        return text


def _samples(ctx: Context, test: Test) -> tuple[list[float], list[float] | None]:
    fn = STATISTICS[test.stat]
    a = fn(ctx, test.a, **test.params)
    return a, (fn(ctx, test.b, **test.params) if test.b is not None else None)


def measure(ctx: Context, test: Test) -> Outcome:
    """A test's samples and estimates, and its unadjusted p-values."""
    a, b = _samples(ctx, test)
    ea = estimate(a) if a else no_estimate()
    out = Outcome(test, a, b, ea)
    if b is None:
        if test.threshold and test.kind != "exact":
            out.diff = estimate([x - test.threshold for x in a])
    else:
        out.b = estimate(b)
        both = [(x, y) for x, y in zip(a, b, strict=True) if math.isfinite(x) and math.isfinite(y)]
        only_a = sum(1 for x, y in zip(a, b, strict=True) if not math.isfinite(x) and math.isfinite(y))
        only_b = sum(1 for x, y in zip(a, b, strict=True) if math.isfinite(x) and not math.isfinite(y))
        out.discordant = (only_a, only_b)
        out.diff = estimate([x - y - test.threshold for x, y in both]) if both else no_estimate(len(a))
        out.welch = difference([x for x, _ in both], [y for _, y in both]) if len(both) > 1 else None
    e = out.judged
    if test.kind == "exact":
        return out
    m = test.margin
    out.p = {"difference": e.p_exceeds(m) if test.kind == "equivalent" else e.p_value(),
             "equivalence": e.p_equivalent(m) if m else math.nan,
             "outcome": outcome_test(0, 0, 0, 0, discordant=out.discordant) if sum(out.discordant) else math.nan}
    if e.n > 1 and math.isfinite(e.sd) and e.sd > 0:
        out.mde = min_detectable(e, ALPHA)
        if m:
            out.power = power_at(e, m, ALPHA, equivalence=test.kind == "equivalent")
    return out


def decide(test: Test, e: Estimate, p: dict[str, float], discordant: tuple[int, int]) -> str:
    """The four-way verdict of one test from its (adjusted) p-values: `training.stats.comparison_verdict` (the
    rule the sweeps' report applies, with a loss-like "lower is better" reading of the statistic a − b), named
    for the claim:

    - directional claims (`greater` / `less`): EQUIVALENT when the interval lies inside ±margin (a measured null:
      no effect of the size that matters), else PASS / FAIL when the interval excludes 0 on the claimed / the
      other side, else INCONCLUSIVE;
    - `nonzero` claims (an effect of either sign): EQUIVALENT inside ±margin, PASS when the interval excludes 0;
    - `equivalent` claims (nothing changes; the "difference" p tests |effect| > margin): PASS when the 95%
      interval lies inside ±margin (TOST), FAIL when the effect is shown to exceed the margin, else
      INCONCLUSIVE.
    Seeds that diverged in one arm only are outcomes: when McNemar's exact test on them rejects, the arm that
    diverged more is the worse (larger loss) one, and that decides unless the loss difference says the
    opposite (then INCONCLUSIVE); an equivalence claim then FAILs; when it does not reject, INCONCLUSIVE."""
    if test.kind == "exact":
        return PASS if abs(e.mean - test.threshold) <= test.tolerance else FAIL
    p_outcome = p.get("outcome", math.nan)
    if test.kind == "equivalent" and sum(discordant) and p_outcome < ALPHA:
        return FAIL  # one arm diverges more often: not the same, whatever the seeds that trained say
    verdict = comparison_verdict(e, p.get("difference", math.nan), p.get("equivalence", math.nan), "lower", ALPHA,
                                 discordant, p_outcome)
    named = {"greater": {WORSE: PASS, BETTER: FAIL}, "less": {BETTER: PASS, WORSE: FAIL},
             "nonzero": {BETTER: PASS, WORSE: PASS}, "equivalent": {EQUIVALENT: PASS, BETTER: FAIL, WORSE: FAIL}}
    return named[test.kind].get(verdict, verdict)


def judge_all(claims: Sequence[Claim], contexts: Sequence[Context]) -> list[tuple[str, list[Outcome]]]:
    """Every claim's verdict (its primary test's, Holm-adjusted across all the primaries) and its outcomes."""
    measured = [[measure(ctx, t) for t in claim.tests] for claim, ctx in zip(claims, contexts, strict=True)]
    primaries = [o for outs in measured for o in outs if o.test.tier == PRIMARY and o.test.kind != "exact"]
    for key in ("difference", "equivalence", "outcome"):
        for o, adj in zip(primaries, holm([o.p.get(key, math.nan) for o in primaries]), strict=True):
            o.p_adjusted[key] = adj
    judged = []
    for outs in measured:
        for o in outs:
            if o.test.tier == REPORT:
                continue
            p = o.p_adjusted if o.test.tier == PRIMARY and o.test.kind != "exact" else o.p
            o.verdict = decide(o.test, o.judged, p, o.discordant)
        primary = next(o for o in outs if o.test.tier == PRIMARY)
        judged.append((primary.verdict, outs))
    return judged


def is_judged(test: Test) -> bool:
    return test.tier not in (REPORT, MECHANISM)


def trained(spec: Spec) -> bool:
    return isinstance(spec, Train)

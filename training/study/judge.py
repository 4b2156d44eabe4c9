"""From measured runs to verdicts: the statistics the claims name, and `judge`, which applies a claim's tests.

Each statistic maps the runs of one role (a list of per-seed results, in seed order) to one number per seed.
Probes are read after the last step for trained runs (`Train`) and on one real batch for at-init ones
(`AtInit`). Stream RMS `resid/rms/L{l}` is the stream entering block l, i.e. after l blocks; the final norm's
input is the stream after all L blocks.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from training.stats import Estimate, combine, difference, estimate, slope, verdict
from training.study.claims import Claim, Test
from training.study.grid import AtInit, Scale, Spec
from training.study.measure import final_loss


@dataclass
class Context:
    """What one claim's statistics read: its roles' specs, every job's results, and the main-process
    measurements (`extra`: "op_ratios", "norm_share", "toy")."""

    scale: Scale
    roles: dict[str, Spec]
    results: dict[Spec, list[dict]]
    extra: dict = field(default_factory=dict)

    def resolve(self, role: str) -> str:
        """`family@-1` names the last index of that family (the highest learning rate of a sweep)."""
        if role.endswith("@-1"):
            family = role[:-2]
            return max((r for r in self.roles if r.startswith(family)), key=lambda r: int(r.split("@")[1]))
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


def _per_seed(fn: Callable[[dict[str, float], int], float]) -> Callable[[Context, str], list[float]]:
    def stat(ctx: Context, role: str, **_) -> list[float]:
        spec = ctx.spec(role)
        return [fn(probes(r, spec), spec.arch.layers) for r in ctx.runs(role)]
    return stat


def stream_profile(p: dict[str, float], layers: int) -> list[float]:
    """Stream RMS after 1..L blocks."""
    return [p[f"resid/rms/L{l}"] for l in range(1, layers)] + [p["resid/final_in"]]


def _growth_slope(p: dict[str, float], layers: int) -> float:
    return slope([math.log(l) for l in range(1, layers + 1)], [math.log(x) for x in stream_profile(p, layers)])


def _log_growth(p: dict[str, float], layers: int) -> float:
    return math.log(p["resid/final_in"] / p["resid/rms/L1"])


def _log_read_growth(p: dict[str, float], layers: int) -> float:
    return math.log(p[f"resid/read_rms/attn/L{layers - 1}"] / p["resid/read_rms/attn/L0"])


def _log_update_rms(p: dict[str, float], layers: int) -> float:
    return math.log(statistics.fmean(p[f"resid/update_rms/{s}/L{l}"] for s in ("attn", "mlp")
                                     for l in range(1, layers)))


def _log_max_logit(p: dict[str, float], layers: int) -> float:
    return math.log(max(p[f"attn/max_logit/L{l}"] for l in range(layers)))


def _saturated(p: dict[str, float], layers: int) -> float:
    return statistics.fmean(p[f"attn/saturated_frac/L{l}"] for l in range(layers))


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


def w2_top_heavy(ctx: Context, role: str) -> list[float]:
    """Per seed, log(‖∇W²‖ of the last layer / of the first) at init."""
    return [math.log(r["w2_grad"][-1] / r["w2_grad"][0]) for r in ctx.runs(role)]


def w2_depth_slope(ctx: Context, role: str) -> list[float]:
    """Per seed, the slope of log last-layer ‖∇W²‖ against log L over the depth sweep (`role` is the
    placement; the roles are `{placement}@{i}`)."""
    depths = [r for r in ctx.roles if r.startswith(f"{role}@")]
    layers = [math.log(ctx.roles[r].arch.layers) for r in depths]
    per_depth = [[math.log(x["w2_grad"][-1]) for x in ctx.runs(r)] for r in depths]
    return [slope(layers, list(seed)) for seed in zip(*per_depth, strict=True)]


def qk_gain(ctx: Context, role: str) -> list[float]:
    return [statistics.fmean(r["gains"].values()) for r in ctx.runs(role)]


def _norm_input_stat(key: str) -> Callable[..., list[float]]:
    def stat(ctx: Context, role: str, reduce: str = "mean") -> list[float]:
        agg = max if reduce == "max" else statistics.fmean
        return [agg(v[key] for v in r["norm_inputs"].values()) if "norm_inputs" in r else math.nan
                for r in ctx.runs(role)]
    return stat


STATISTICS: dict[str, Callable[..., list[float]]] = {
    "growth_slope": _per_seed(_growth_slope),
    "log_growth": _per_seed(_log_growth),
    "log_read_growth": _per_seed(_log_read_growth),
    "log_update_rms": _per_seed(_log_update_rms),
    "log_max_logit": _per_seed(_log_max_logit),
    "saturated": _per_seed(_saturated),
    "ratio_slope": ratio_slope,
    "final_loss": final_losses,
    "w2_top_heavy": w2_top_heavy,
    "w2_depth_slope": w2_depth_slope,
    "qk_gain": qk_gain,
    "mean_over_rms": _norm_input_stat("mean_over_rms"),
    "ln_vs_rms": _norm_input_stat("ln_vs_rms"),
    # (no "fused" pair where normlab's CPU RMSNorm could not be compiled: NaN, so INCONCLUSIVE)
    "op_ratio": lambda ctx, role: ctx.extra["op_ratios"].get(role, [math.nan]),
    "norm_share": lambda ctx, role: ctx.extra["norm_share"][role],
    "toy": lambda ctx, role: [ctx.extra["toy"][24][0 if role == "plain" else 1]],
}


@dataclass
class Outcome:
    """One test's result: its estimates (a; b and the difference when the test compares two roles)."""

    test: Test
    verdict: str  # PASS / FAIL / INCONCLUSIVE, or "—" for a report row
    a: Estimate
    b: Estimate | None = None
    diff: Estimate | None = None

    @property
    def judged(self) -> Estimate:
        return self.diff if self.diff is not None else self.a

    def numbers(self) -> str:
        t = self.test
        if self.b is None:
            return f"{t.a}: {self.a}"
        return f"{t.a}: {self.a}; {t.b}: {self.b}; difference {self.diff}"


def run_test(ctx: Context, test: Test) -> Outcome:
    """Evaluate one test on measured runs (or given samples) and judge it."""
    fn = STATISTICS[test.stat]
    a = fn(ctx, test.a, **test.params)
    if test.b is None:
        est = estimate(a)
        return Outcome(test, "—" if test.kind == "report" else verdict(est, test.kind, test.threshold,
                                                                        test.tolerance), est)
    b = fn(ctx, test.b, **test.params)
    d = difference(a, b)
    v = "—" if test.kind == "report" else verdict(d, test.kind, test.threshold, test.tolerance)
    return Outcome(test, v, estimate(a), estimate(b), d)


def tests_for(claim: Claim, scale: Scale) -> list[Test]:
    return [t for t in claim.tests if t.needs_depth < len(scale.post_depths)]


def judge(claim: Claim, ctx: Context) -> tuple[str, list[Outcome]]:
    """A claim's verdict (see `stats.combine`) and its tests' outcomes."""
    outcomes = [run_test(ctx, t) for t in tests_for(claim, ctx.scale)]
    return combine([o.verdict for o in outcomes if o.test.kind != "report"]), outcomes

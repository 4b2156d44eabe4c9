"""The study's statistics and verdicts on synthetic numbers (no training): intervals and power against scipy and
simulation, each of the four verdicts for directional and equivalence claims, divergence as an outcome, Holm
across the primaries, and the grid's seeds and sharing."""
import math
import statistics

import numpy as np
import pytest
import scipy.stats as scipy_stats

from training.stats import (
    EQUIVALENT,
    FAIL,
    INCONCLUSIVE,
    PASS,
    difference,
    estimate,
    min_detectable,
    paired_difference,
    power_at,
    slope,
)
from training.study import claims as claims_module
from training.study.claims import LOSS
from training.study.claims import Test as ClaimTest
from training.study.grid import SCALES, AtInit, Train, shallow
from training.study.judge import Context, decide, judge_all, measure

SCALE = SCALES["quick"]


def test_estimate_and_intervals_match_scipy():
    a, b = [5.1, 5.3, 4.9, 5.2], [4.6, 4.9, 4.7, 4.8]
    e = estimate(a)
    lo, hi = scipy_stats.t.interval(0.95, len(a) - 1, loc=statistics.fmean(a), scale=scipy_stats.sem(a))
    assert (e.mean, e.sd, e.lo, e.hi) == pytest.approx((statistics.fmean(a), statistics.stdev(a), lo, hi), rel=1e-9)
    w = difference(a, b)
    ci = scipy_stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert (w.lo, w.hi) == pytest.approx((ci.low, ci.high), rel=1e-9)
    p = paired_difference(a, b)
    rel = scipy_stats.ttest_rel(a, b)
    assert (p.lo, p.hi) == pytest.approx(tuple(rel.confidence_interval(0.95)), rel=1e-9)
    assert p.p_value() == pytest.approx(rel.pvalue, rel=1e-9)
    assert slope([1, 2, 3], [2, 4, 6]) == pytest.approx(2.0)


def test_power_and_minimum_detectable_effect_against_simulation():
    """power_at: the fraction of simulated paired t-tests (n = 6, sd 1) that reject at a true effect of 1.2;
    min_detectable: the effect at which that power is 80%."""
    n, sd, effect = 6, 1.0, 1.2
    e = estimate(list(np.random.default_rng(0).normal(0, sd, n) * 0 + np.linspace(-1, 1, n) * sd / 0.748))
    e = type(e)(0.0, sd, n, 0, 0, sd / math.sqrt(n), n - 1)  # exactly sd 1 over 6 seeds
    rng = np.random.default_rng(1)
    draws = rng.normal(effect, sd, size=(40000, n))
    rejected = scipy_stats.ttest_1samp(draws, 0.0, axis=1).pvalue < 0.05
    assert power_at(e, effect) == pytest.approx(rejected.mean(), abs=0.01)
    mde = min_detectable(e)
    at_mde = scipy_stats.ttest_1samp(rng.normal(mde, sd, size=(40000, n)), 0.0, axis=1).pvalue < 0.05
    assert at_mde.mean() == pytest.approx(0.8, abs=0.03)  # the usual approximation, not exact
    # equivalence: the fraction of TOST successes (90%-per-side at α/2: the 95% CI inside ±m) at a true 0
    m = 1.5
    d = rng.normal(0, sd, size=(40000, n))
    lo, hi = scipy_stats.t.interval(0.95, n - 1, loc=d.mean(1), scale=d.std(1, ddof=1) / math.sqrt(n))
    assert power_at(e, m, equivalence=True) == pytest.approx(((lo > -m) & (hi < m)).mean(), abs=0.05)


def _t(kind="greater", margin=LOSS, threshold=0.0):
    return ClaimTest("x", "x", "final_loss", "a", "b", kind=kind, margin=margin, threshold=threshold)


def _decide(kind: str, diffs: list[float], discordant=(0, 0), margin=LOSS) -> str:
    test = _t(kind, margin)
    e = estimate(diffs)
    p = {"difference": e.p_value() if kind != "equivalent" else e.p_exceeds(margin),
         "equivalence": e.p_equivalent(margin), "outcome": math.nan}
    if sum(discordant):
        p["outcome"] = scipy_stats.binomtest(discordant[0], sum(discordant), 0.5).pvalue
    return decide(test, e, p, discordant)


@pytest.mark.parametrize("kind, diffs, expected", [
    ("greater", [0.30, 0.32, 0.28, 0.31], PASS),  # clearly > 0 and not inside ±0.05
    ("greater", [-0.30, -0.32, -0.28, -0.31], FAIL),
    ("greater", [0.001, -0.002, 0.0015, 0.0], EQUIVALENT),  # a precise null: inside ±0.05
    ("greater", [0.3, -0.4, 0.5, -0.2], INCONCLUSIVE),  # the interval is wider than the margin and holds 0
    ("less", [-0.30, -0.32, -0.28, -0.31], PASS),
    ("nonzero", [-0.30, -0.32, -0.28, -0.31], PASS),  # either sign
    ("nonzero", [0.001, -0.002, 0.0015, 0.0], EQUIVALENT),
    ("nonzero", [0.3, -0.4, 0.5, -0.2], INCONCLUSIVE),
    ("equivalent", [0.001, -0.002, 0.0015, 0.0], PASS),
    ("equivalent", [0.30, 0.32, 0.28, 0.31], FAIL),  # shown to exceed the margin
    ("equivalent", [0.06, 0.04, 0.05, 0.055], INCONCLUSIVE),  # a real difference, but not shown beyond ±0.05
])
def test_four_way_verdicts(kind, diffs, expected):
    assert _decide(kind, diffs) == expected


def test_divergence_is_an_outcome():
    # six seeds diverged in arm a only: McNemar p = 2/64 < 0.05, and "a is worse" is what a "greater" claim says
    assert _decide("greater", [0.0, 0.0], discordant=(6, 0)) == PASS
    assert _decide("less", [0.0, 0.0], discordant=(6, 0)) == FAIL
    assert _decide("greater", [0.3, 0.31, 0.29], discordant=(2, 0)) == INCONCLUSIVE  # p = 0.5: not shown
    assert _decide("equivalent", [0.0, 0.0], discordant=(0, 6)) == FAIL


def _run(loss: float, steps: int = 10, diverged: bool = False, probes: dict | None = None) -> dict:
    return {"losses": [7.0] + [loss] * (steps - 1), "diverged_at": 3 if diverged else None,
            "val_loss": math.inf if diverged else loss, "probes": {steps: probes or {}}}


def _ctx(claim: claims_module.Claim, per_role: dict[str, list[dict]]) -> Context:
    roles = claim.setup(SCALE)
    return Context(SCALE, roles, {roles[r]: runs for r, runs in per_role.items()})


def test_paired_difference_counts_diverged_seeds_apart():
    """Claim 12's primary with one seed diverged in 'deep-no-final' only: the difference runs over the seeds
    where both trained, the diverged one is counted, and the Welch interval is kept beside the paired one."""
    claim = claims_module.BY_NUMBER[12]
    without = [_run(4.5), _run(4.7), _run(0, diverged=True), _run(4.6)]
    with_ = [_run(4.0), _run(4.3), _run(4.1), _run(4.05)]
    o = measure(_ctx(claim, {"deep-no-final": without, "deep-final": with_}), claim.primary)
    assert o.discordant == (1, 0)
    ref = scipy_stats.ttest_rel([4.5, 4.7, 4.6], [4.0, 4.3, 4.05])
    assert (o.diff.lo, o.diff.hi) == pytest.approx(tuple(ref.confidence_interval(0.95)), rel=1e-9)
    assert o.welch is not None and o.p["outcome"] == pytest.approx(1.0)


def test_holm_runs_across_the_primaries():
    """Two claims' primaries judged together: each adjusted p is Holm's (smallest × 2, then max(·, larger × 1)),
    and a verdict that passes alone can become INCONCLUSIVE after the adjustment."""
    c12, c7 = claims_module.BY_NUMBER[12], claims_module.BY_NUMBER[7]
    ctx12 = _ctx(c12, {"deep-no-final": [_run(x) for x in (4.10, 4.07, 4.16, 4.05)],
                       "deep-final": [_run(x) for x in (4.0, 4.03, 4.01, 4.0)],
                       "no-final": [_run(4.0)] * 4, "final": [_run(4.0)] * 4})
    ctx7 = _ctx(c7, {"rmsnorm": [_run(x) for x in (4.0, 4.1, 4.05, 4.2)],
                     "layernorm": [_run(x) for x in (4.3, 4.05, 4.0, 4.1)]}
                | {f"{n}-w{i}": [_run(4.0)] * 4 for n in ("rmsnorm", "layernorm") for i in (1, 2)})
    alone = measure(ctx12, c12.primary)
    raw = [alone.p["difference"], measure(ctx7, c7.primary).p["difference"]]
    (v12, outs12), _ = judge_all([c12, c7], [ctx12, ctx7])
    small, large = sorted(raw)
    expected = min(1.0, 2 * small) if raw[0] == small else max(min(1.0, 2 * small), large)
    assert outs12[0].p_adjusted["difference"] == pytest.approx(expected)
    assert alone.p["difference"] < 0.05 and expected > 0.05 and v12 == INCONCLUSIVE


def test_lr_sensitivity_and_best_lr_per_seed():
    """Claim 6's LR sensitivity per seed, by hand: mean over the LRs of min(loss, loss at init) minus the best,
    a diverged run counting as the loss at init (7.0)."""
    claim = claims_module.BY_NUMBER[6]
    roles = claim.setup(SCALE)
    n_lr = len(SCALE.lrs)
    none = {f"none@{i}": [_run(4.0 + i), _run(4.2 + i)] for i in range(n_lr)}
    none[f"none@{n_lr - 1}"] = [_run(0, diverged=True), _run(4.5)]
    head = {f"head@{i}": [_run(4.0), _run(4.1)] for i in range(n_lr)}
    full = {f"full@{i}": [_run(4.0), _run(4.1)] for i in range(n_lr)}
    ctx = Context(SCALE, roles, {roles[r]: v for r, v in (none | head | full).items()})
    o = measure(ctx, claim.primary)
    seed0 = [4.0 + i for i in range(n_lr - 1)] + [7.0]
    seed1 = [4.2 + i for i in range(n_lr - 1)] + [4.5]
    by_hand = [statistics.fmean(s) - min(s) for s in (seed0, seed1)]
    assert o.samples_a == pytest.approx(by_hand) and o.samples_b == pytest.approx([0.0, 0.0])


def test_setups_use_the_required_seeds_and_share_runs():
    from training.study.runner import plan

    scale = SCALES["default"]
    jobs = plan(claims_module.CLAIMS, scale)
    assert len(jobs) == len(set(jobs))
    seeds: dict = {}
    for spec, seed in jobs:
        seeds.setdefault(spec, set()).add(seed)
    for spec, s in seeds.items():
        assert len(s) >= (5 if isinstance(spec, AtInit) else 6), spec
    # claims 7 and 8 read the same runs: one job per (spec, seed), not one per claim
    rms = Train(shallow(scale, bias=True), scale.lr, scale.steps, scale.warmup)
    assert sum(spec == rms for spec, _ in jobs) == scale.seeds
    assert max(spec.arch.layers for spec in seeds) >= 48
    assert any(isinstance(s, Train) and s.steps >= 1000 and s.ablate for s in seeds)
    assert all(sum(t.tier == "primary" for t in c.tests) == 1 for c in claims_module.CLAIMS)

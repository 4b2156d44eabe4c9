"""What the verdict rules guarantee, checked by simulation against the product's own code (training/stats/):
- within one family (a study claim's primaries, a sweep's question), Holm keeps the chance of any false verdict
  ≤ α under a simulated null, where the same tests unadjusted would not;
- Benjamini–Hochberg across many claims keeps the share of false findings ≤ α;
- power and the minimum detectable effect at the adjusted level α/k equal the rejection rates of simulated
  t-tests (and TOSTs) at that level, and `seeds_needed` is the first n that reaches the asked power.
Simulations are vectorized (scipy on arrays) or a few thousand calls of the product's functions: seconds each."""
import math

import numpy as np
import pytest
import scipy.stats as scipy_stats

from training.stats import (
    BETTER,
    EQUIVALENT,
    WORSE,
    Estimate,
    benjamini_hochberg,
    estimate,
    judge_family,
    min_detectable,
    power_at,
    seeds_needed,
)

ALPHA = 0.05


def _family_error_rate(k: int, families: int, truth: float, margin: float, adjust: bool, wrong: set[str]) -> float:
    """Share of simulated families (k comparisons, 6 seeds, per-seed sd 1, true difference `truth` in each)
    that give any verdict in `wrong`; each comparison judged alone when not `adjust`."""
    rng = np.random.default_rng(12345)
    bad = 0
    for _ in range(families):
        diffs = {f"c{i}": estimate(list(rng.normal(truth, 1.0, 6))) for i in range(k)}
        if adjust:
            verdicts = [j.verdict for j in judge_family(diffs, margin).values()]
        else:
            verdicts = [judge_family({n: d}, margin)[n].verdict for n, d in diffs.items()]
        bad += any(v in wrong for v in verdicts)
    return bad / families


def test_holm_keeps_a_familys_chance_of_any_false_verdict_at_most_alpha():
    families = 700
    slack = 2.5 * math.sqrt(ALPHA * (1 - ALPHA) / families)  # Monte Carlo error
    # no difference anywhere: any BETTER or WORSE is false
    assert _family_error_rate(3, families, 0.0, 0.5, True, {BETTER, WORSE}) <= ALPHA + slack
    unadjusted = _family_error_rate(3, families, 0.0, 0.5, False, {BETTER, WORSE})
    assert unadjusted > ALPHA + slack  # ≈ 1 − 0.95³: what pooling nothing would cost
    # a true difference of exactly one margin everywhere: any EQUIVALENT is false
    assert _family_error_rate(3, families, 1.5, 1.5, True, {EQUIVALENT}) <= ALPHA + slack


def test_benjamini_hochberg_keeps_the_share_of_false_findings_at_most_alpha():
    """200 scorecards of 22 claims each, 12 null (p uniform) and 10 real (a paired t-test at a true effect):
    the mean share of rejected nulls among the rejections stays ≤ α."""
    rng = np.random.default_rng(5)
    real = scipy_stats.ttest_1samp(rng.normal(1.5, 1.0, size=(200, 10, 6)), 0.0, axis=2).pvalue
    null = rng.uniform(size=(200, 12))
    shares = []
    for ps_real, ps_null in zip(real, null, strict=True):
        q = benjamini_hochberg([*ps_null, *ps_real])
        rejected = [x < ALPHA for x in q]
        false = sum(rejected[:12])
        shares.append(false / max(1, sum(rejected)))
    assert np.mean(shares) <= ALPHA
    assert np.mean([sum(x < ALPHA for x in benjamini_hochberg(list(p))) for p in real]) > 5  # it still finds


def _sd_one(n: int) -> Estimate:
    """A paired estimate over n seeds whose per-seed differences have sd exactly 1."""
    return Estimate(0.0, 1.0, n, 0.0, 0.0, 1.0 / math.sqrt(n), n - 1)


@pytest.mark.parametrize("n, k", [(6, 1), (6, 4), (10, 19)])
def test_power_at_the_adjusted_level_equals_simulated_t_tests(n, k):
    """Power to detect an effect of 1.5 sd at α/k, and the MDE at α/k, against 40,000 simulated paired t-tests
    rejecting at p < α/k."""
    rng = np.random.default_rng(n * 100 + k)
    level, effect = ALPHA / k, 1.5
    rejected = scipy_stats.ttest_1samp(rng.normal(effect, 1.0, size=(40000, n)), 0.0, axis=1).pvalue < level
    assert power_at(_sd_one(n), effect, level) == pytest.approx(rejected.mean(), abs=0.01)
    mde = min_detectable(_sd_one(n), level)
    at_mde = scipy_stats.ttest_1samp(rng.normal(mde, 1.0, size=(40000, n)), 0.0, axis=1).pvalue < level
    assert at_mde.mean() == pytest.approx(0.8, abs=0.04)  # the usual approximation, not exact


@pytest.mark.parametrize("n, k, margin", [(6, 1, 1.5), (6, 19, 1.5), (20, 19, 1.0)])
def test_equivalence_power_at_the_adjusted_level_equals_simulated_tosts(n, k, margin):
    """TOST at α/k (the (1 − α/k) interval inside ±margin) at a true difference of 0: the report's power, against
    simulation. At n = 6 and α/19 it is under 10%: a claim of equivalence pooled with 18 others could hardly pass."""
    rng = np.random.default_rng(n + k)
    d = rng.normal(0.0, 1.0, size=(40000, n))
    lo, hi = scipy_stats.t.interval(1 - ALPHA / k, n - 1, loc=d.mean(1), scale=d.std(1, ddof=1) / math.sqrt(n))
    simulated = ((lo > -margin) & (hi < margin)).mean()
    assert power_at(_sd_one(n), margin, ALPHA / k, equivalence=True) == pytest.approx(simulated, abs=0.01)


@pytest.mark.parametrize("effect, k, equivalence", [(1.0, 1, False), (1.0, 5, False), (1.0, 1, True)])
def test_seeds_needed_is_the_first_n_whose_simulated_power_reaches_80_percent(effect, k, equivalence):
    n = seeds_needed(1.0, effect, ALPHA / k, 0.8, equivalence)
    assert n is not None and n > 2
    assert power_at(_sd_one(n), effect, ALPHA / k, equivalence) >= 0.8 > power_at(_sd_one(n - 1), effect,
                                                                                 ALPHA / k, equivalence)
    if not equivalence:
        rng = np.random.default_rng(n)
        sims = scipy_stats.ttest_1samp(rng.normal(effect, 1.0, size=(40000, n)), 0.0, axis=1).pvalue < ALPHA / k
        assert sims.mean() >= 0.8 - 0.01

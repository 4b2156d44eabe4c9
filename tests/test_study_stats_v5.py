"""The study's and sweeps' statistics where a naive t-test would mislead (synthetic numbers, no training): no
spread is no evidence, counts are judged exactly on their totals."""
import math

import numpy as np
import pytest
import scipy.stats as scipy_stats

from training.stats import (
    BETTER,
    EQUIVALENT,
    INCONCLUSIVE,
    PASS,
    WORSE,
    benjamini_hochberg,
    crossfit_sensitivity,
    difference,
    estimate,
    holm,
    judge,
    judge_counts,
    lr_sensitivity,
    paired_difference,
    rate_difference_interval,
)
from training.study.claims import CLAIMS
from training.study.grid import SCALES, shallow, train
from training.study.judge import from_samples, judge_tests
from training.study.statistics import STATISTICS, Context, lr_reach_censored, unbracketed
from training.study.timing import between_run_estimate, round_orders, run_medians
from training.sweep.analysis import LrGroup

SCALE = SCALES["quick"]


def _claim_test(test_id: str):
    return next(t for c in CLAIMS for t in c.tests if t.id == test_id)


@pytest.mark.parametrize("a, b", [([4.1] * 5, [4.0] * 5), ([4.0, 4.1, 4.2], [4.0, 4.1, 4.2])])
def test_no_spread_gives_no_t_based_p_and_no_verdict(a, b):
    d = paired_difference(a, b)  # every seed's difference the same: se = 0
    assert d.no_spread and "no spread" in str(d)
    assert math.isnan(d.p_value()) and math.isnan(d.p_equivalent(0.05)) and math.isnan(d.p_exceeds(0.05))
    for margin, claim in ((0.05, False), (0.5, False), (0.5, True), (None, False)):
        j = judge(d, margin, equivalence_claim=claim)
        assert j.verdict == INCONCLUSIVE and math.isnan(j.p["difference"]) and math.isnan(j.p["equivalence"])
    welch = difference([4.1] * 3, [4.0] * 3)
    assert math.isnan(welch.p_value()) and judge(welch, 0.5).verdict == INCONCLUSIVE


def test_no_spread_in_a_study_test_is_not_a_pass():
    t = _claim_test("15a")  # an equivalence claim on the held-out loss
    o = from_samples(t, [4.0] * 6, [4.0] * 6)
    judge_tests([o])
    assert o.verdict == INCONCLUSIVE and o.verdict not in (PASS, BETTER, WORSE, EQUIVALENT)


def test_zero_of_eighteen_against_zero_is_not_equivalence():
    t = _claim_test("15e")  # diverged runs per seed, equivalent within ±0.5 per seed
    assert t.stat == "diverged_runs" and t.margin == 0.5 and t.kind == "equivalent"
    o = from_samples(t, [0.0] * 6, [0.0] * 6)  # 6 seeds × 3 LRs, no run diverged in either arm
    judge_tests([o])
    assert o.verdict != PASS and o.verdict == INCONCLUSIVE
    # one divergence each, at the same seed: the paired differences are all 0 (no spread), yet 1 of 18 against
    # 1 of 18 bounds the rate difference only to about ±1 per seed, so equivalence within ±0.5 is not shown
    o = from_samples(t, [1.0] + [0.0] * 5, [1.0] + [0.0] * 5)
    judge_tests([o])
    assert o.verdict == INCONCLUSIVE and o.p["equivalence"] > 0.05
    lo, hi = rate_difference_interval(0, 0, 6)
    assert -0.75 < lo < -0.5 and 0.5 < hi < 0.75  # 0 of 18 each: still up to ~0.73 per seed apart


def test_a_clear_difference_in_counts_is_detected():
    t = _claim_test("15e")
    o = from_samples(t, [3.0, 3.0, 2.0, 3.0, 3.0, 2.0], [0.0] * 6)
    judge_tests([o])
    assert o.judgement.verdict == WORSE and o.verdict == "FAIL" and o.judgement.exact_only
    assert o.p["difference"] == pytest.approx(2 / 64)  # the sign-flip test's, the larger of the two exact p's
    many = judge_counts({"x": ([0] * 40, [0] * 40), "y": ([0] * 60, [1] + [0] * 59)}, margin=0.5)
    assert many["x"].verdict == INCONCLUSIVE  # nothing happened: no test at all
    assert many["y"].verdict == EQUIVALENT  # 0 of 60 against 1 of 60: the rates are bounded well inside ±0.5


def _sensitivity_bias(noise_a: float, noise_b: float, crossfit: bool, draws: int = 1000, seeds: int = 12) -> float:
    """The mean over simulated draws of the mean per-seed LR-sensitivity difference a − b, both arms with the
    same mean curve over a 5-LR grid and independent per-run noise."""
    curve = np.array([3.6, 3.3, 3.2, 3.35, 3.9])
    rng = np.random.default_rng(0)
    out = []
    for _ in range(draws):
        arms = [curve[:, None] + rng.normal(0, sd, (len(curve), seeds)) for sd in (noise_a, noise_b)]
        if crossfit:
            a, b = (crossfit_sensitivity(arm.tolist()) for arm in arms)
        else:  # the per-seed minimum
            a, b = ([lr_sensitivity(dict(enumerate(col)), math.inf) for col in arm.T] for arm in arms)
        out.append(np.mean(a) - np.mean(b))
    return float(np.mean(out))


def test_crossfit_lr_sensitivity_has_no_noise_bias():
    assert abs(_sensitivity_bias(0.10, 0.02, crossfit=True)) < 0.005
    # the per-seed minimum makes the noisier arm look more sensitive: what the cross-fit removes
    assert 0.02 < _sensitivity_bias(0.10, 0.02, crossfit=False) < 0.06  # 4× the tolerance above


def test_the_sweep_and_the_study_share_the_crossfit_sensitivity():
    grid = {s: [3.6 + 0.1 * s, 3.3, 3.2 + 0.05 * (s % 3), 3.35, 3.9 - 0.02 * s] for s in range(5)}
    group = LrGroup("g", dict.fromkeys([1e-3, 3e-3, 1e-2, 3e-2, 0.1]), {}, {}, None, None, grid)
    per_lr = [[grid[s][i] for s in grid] for i in range(5)]
    expected = crossfit_sensitivity(per_lr)
    assert list(group.per_seed_sensitivity().values()) == pytest.approx(expected)
    # each seed: its grid mean minus its value at the LR best on the other four seeds' mean curve
    s0 = grid[0]
    others = np.mean([grid[s] for s in range(1, 5)], axis=0)
    assert expected[0] == pytest.approx(np.mean(s0) - s0[int(np.argmin(others))])


LOSSES = [6.0, 5.5, 5.0, 4.8, 4.6, 4.5, 4.4, 4.3, 4.2, 4.1]  # a run that trains


def _lr_ctx(per_seed_curves: list[list[float]], lrs=(1e-4, 1e-3, 1e-2, 1e-1)) -> Context:
    """A family `x@i` over `lrs` whose held-out loss at seed s and LR i is per_seed_curves[s][i]."""
    roles = {f"x@{i}": train(SCALE, shallow(SCALE), lr=lr) for i, lr in enumerate(lrs)}
    results = {roles[f"x@{i}"]: [{"losses": LOSSES, "diverged_at": None, "val_loss": curve[i]}
                                 for curve in per_seed_curves] for i in range(len(lrs))}
    return Context(SCALE, roles, results)


REACH_CURVES = [[4.5, 3.98, 4.0, 4.3], [4.5, 4.3, 4.1, 4.15], [4.6, 4.2, 4.05, 4.6]]


def test_lr_reach_per_seed_by_hand():
    # every leave-one-out mean curve is best at 1e-2 (index 2); each seed is read there, delta 0.1 nats:
    # seed 0, level 4.1: left between 1e-4 (4.5) and 1e-3 (3.98) at −3 − 0.12/0.52, right between 1e-2 and 1e-1
    # (4.3) at −2 + 0.1/0.3 — its own best (3.98 at 1e-3) would give 1.459 instead
    # seed 1, level 4.2: left at −2 − 0.1/0.2, right open at 1e-1 (4.15 is inside): censored, at least 1.5
    # seed 2, level 4.15: left at −2 − 0.1/0.15, right at −2 + 0.1/0.55
    ctx = _lr_ctx(REACH_CURVES)
    widths = STATISTICS["lr_reach"](ctx, "x", delta=0.1)
    by_hand = [(-2 + 0.1 / 0.3) - (-3 - 0.12 / 0.52), 1.5, 0.1 / 0.55 + 0.1 / 0.15]
    assert widths == pytest.approx(by_hand, rel=1e-9)
    assert lr_reach_censored(ctx, "x", delta=0.1) == [False, True, False]
    assert STATISTICS["lr_reach"](ctx, "x") == pytest.approx(by_hand)  # delta defaults to 0.1 nats


def test_unbracketed_names_the_edge_of_the_best_lr():
    assert unbracketed(_lr_ctx(REACH_CURVES), "x") is None
    low = [[4.0, 4.2, 4.5, 5.0]] * 3
    assert unbracketed(_lr_ctx(low), "x") == "lowest"
    assert unbracketed(_lr_ctx([list(reversed(c)) for c in low]), "x") == "highest"
    assert unbracketed(_lr_ctx([[4.0]], lrs=(1e-3,)), "x") is None  # one LR: no grid to be at the edge of
    # high_lr_sensitivity is defined at the lowest edge, and not at the highest (nothing above to measure)
    assert STATISTICS["high_lr_sensitivity"](_lr_ctx(low), "x") == pytest.approx([(0.2 + 0.5 + 1.0) / 3] * 3)
    assert all(math.isnan(x) for x in STATISTICS["high_lr_sensitivity"](
        _lr_ctx([list(reversed(c)) for c in low]), "x"))


P_FAMILY = [0.001, 0.04, 0.03, 0.2, 0.012, 0.5, 0.049, 0.0101]


def test_holm_and_benjamini_hochberg_match_statsmodels():
    multitest = pytest.importorskip("statsmodels.stats.multitest")
    assert holm(P_FAMILY) == pytest.approx(list(multitest.multipletests(P_FAMILY, method="holm")[1]), rel=1e-12)
    assert benjamini_hochberg(P_FAMILY) == pytest.approx(
        list(multitest.multipletests(P_FAMILY, method="fdr_bh")[1]), rel=1e-12)
    assert benjamini_hochberg(P_FAMILY) == pytest.approx(list(scipy_stats.false_discovery_control(P_FAMILY)))


@pytest.mark.parametrize("a, b, margin", [
    ([4.01, 4.10, 3.91, 4.04, 3.98], [4.0, 4.1, 3.9, 4.05, 4.0], 0.05),
    ([4.3, 4.1, 4.2, 4.25], [4.0, 4.05, 3.95, 4.1], 0.1),  # far outside: p near 1, capped at 1
])
def test_tost_is_twice_statsmodels_ttost(a, b, margin):
    """normlab's equivalence p is 2 × the usual TOST p (the larger one-sided p), capped at 1: equivalence at α
    is the usual TOST at α/2, i.e. the (1 − α) interval inside ±margin. Paired and Welch alike."""
    weightstats = pytest.importorskip("statsmodels.stats.weightstats")
    paired = weightstats.ttost_paired(np.array(a), np.array(b), -margin, margin)[0]
    assert paired_difference(a, b).p_equivalent(margin) == pytest.approx(min(1.0, 2 * paired), rel=1e-9)
    welch = weightstats.ttost_ind(np.array(a), np.array(b), -margin, margin, usevar="unequal")[0]
    assert difference(a, b).p_equivalent(margin) == pytest.approx(min(1.0, 2 * welch), rel=1e-9)


def test_timing_is_judged_between_runs():
    # two timing runs whose rounds agree closely within each run but sit 10% apart: the rounds of one run (or the
    # rounds pooled) give a narrow interval that misses the other run; the per-run medians' interval covers both
    rng = np.random.default_rng(0)
    runs = [list(1.00 * np.exp(rng.normal(0, 0.005, 30))), list(1.10 * np.exp(rng.normal(0, 0.005, 30)))]
    medians = run_medians(runs)
    e = between_run_estimate(runs)
    assert e.n == 2 and all(e.lo < math.log(m) < e.hi for m in medians)
    pooled = estimate([math.log(x) for r in runs for x in r])
    assert not all(pooled.lo < math.log(m) < pooled.hi for m in medians)  # what one run's rounds would claim
    assert medians == pytest.approx([float(np.median(r)) for r in runs])


def test_timing_rounds_are_in_a_balanced_seeded_random_order():
    orders = round_orders(30, seed=0)
    assert sum(orders) == 15 and orders == round_orders(30, seed=0)
    assert orders != round_orders(30, seed=1)  # each run its own order
    assert orders != [r % 2 == 1 for r in range(30)] and orders != [r % 2 == 0 for r in range(30)]
    assert sum(round_orders(5, seed=3)) == 3

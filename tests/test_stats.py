"""training.stats on synthetic numbers: paired and Welch intervals and p-values against scipy's own tests, Holm
against the step-down procedure as Holm (1979) defines it, the four comparison verdicts, the exact outcome tests,
and Wortsman et al.'s LR sensitivity on a hand-computed grid."""
import itertools
import math

import pytest
import scipy.stats as scipy_stats

from training.stats import (
    BETTER,
    EQUIVALENT,
    INCONCLUSIVE,
    WORSE,
    difference,
    estimate,
    holm,
    judge,
    judge_family,
    lr_sensitivity,
    outcome_test,
    paired_difference,
    training_outcome,
)

A = [5.12, 5.31, 4.95, 5.20, 5.07, 5.26]
B = [5.02, 5.25, 4.80, 5.15, 4.99, 5.12]  # each seed a little lower than A's: a consistent paired effect


def test_paired_interval_and_p_match_scipy_ttest_rel():
    d = paired_difference(A, B)
    res = scipy_stats.ttest_rel(A, B)
    ci = res.confidence_interval(0.95)
    assert (d.lo, d.hi) == pytest.approx((ci.low, ci.high), rel=1e-9)
    assert d.p_value() == pytest.approx(res.pvalue, rel=1e-9)
    assert d.interval(0.9) == pytest.approx(tuple(res.confidence_interval(0.9)), rel=1e-9)


def test_pairing_sees_what_the_unpaired_interval_cannot():
    # The seeds' spread (~0.13) swamps a 0.09 shift unpaired; paired, the shift is far outside the noise.
    assert paired_difference(A, B).lo > 0
    welch = difference(A, B)
    assert welch.lo < 0 < welch.hi
    res = scipy_stats.ttest_ind(A, B, equal_var=False)
    assert welch.p_value() == pytest.approx(res.pvalue, rel=1e-9)


def test_equivalence_p_is_the_two_one_sided_tests():
    d = paired_difference(A, B)
    margin = 0.3
    diffs = [a - b for a, b in zip(A, B, strict=True)]
    p_low = scipy_stats.ttest_1samp(diffs, -margin, alternative="greater").pvalue
    p_high = scipy_stats.ttest_1samp(diffs, margin, alternative="less").pvalue
    assert d.p_equivalent(margin) == pytest.approx(min(1.0, 2 * max(p_low, p_high)), rel=1e-9)
    # < 0.05 exactly when the 95% interval lies inside ±margin
    for m in (0.05, 0.1, 0.12, 0.15, 0.3):
        assert (d.p_equivalent(m) < 0.05) == (-m < d.lo and d.hi < m)


def _holm_rejects(p_values, alpha):
    """Holm's step-down procedure as defined: reject the i-th smallest while p_(i) <= alpha / (k - i)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    rejected = set()
    for rank, i in enumerate(order):
        if p_values[i] > alpha / (len(p_values) - rank):
            break
        rejected.add(i)
    return rejected


@pytest.mark.parametrize("p_values", [[0.01, 0.04, 0.03, 0.005], [0.2, 0.001, 0.049, 0.5, 0.0125],
                                      [0.03], [0.02, 0.02, 0.02]])
def test_holm_adjusted_p_values_reject_what_the_procedure_rejects(p_values):
    adjusted = holm(p_values)
    for alpha in (0.01, 0.02, 0.025, 0.05, 0.1, 0.2):
        assert {i for i, p in enumerate(adjusted) if p <= alpha} == _holm_rejects(p_values, alpha)
    assert all(a >= p for a, p in zip(adjusted, p_values, strict=True))


def test_holm_worked_example_and_nan():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    out = holm([0.01, math.nan, 0.04])  # the untestable comparison does not count towards k
    assert out[0] == pytest.approx(0.02) and math.isnan(out[1]) and out[2] == pytest.approx(0.04)


@pytest.mark.parametrize("candidate, baseline, better, expected", [
    ([4.0, 4.1, 3.9, 4.05], [4.5, 4.6, 4.4, 4.55], "lower", BETTER),  # 0.5 lower on every seed
    ([4.5, 4.6, 4.4, 4.55], [4.0, 4.1, 3.9, 4.05], "lower", WORSE),
    ([4.5, 4.6, 4.4, 4.55], [4.0, 4.1, 3.9, 4.05], "higher", BETTER),  # an accuracy: higher is better
    ([4.01, 4.10, 3.91, 4.04], [4.0, 4.1, 3.9, 4.05], "lower", EQUIVALENT),  # a measured null inside ±0.05
    ([4.3, 3.8, 4.2, 3.9], [4.0, 4.1, 3.9, 4.05], "lower", INCONCLUSIVE),  # noisy: neither
])
def test_four_verdicts(candidate, baseline, better, expected):
    assert judge(paired_difference(candidate, baseline), 0.05, better).verdict == expected


def test_a_significant_difference_smaller_than_the_margin_is_equivalent():
    d = paired_difference([4.02, 4.12, 3.92, 4.07], [4.0, 4.1, 3.9, 4.05])  # 0.02 lower on every seed
    assert d.lo > 0  # it is real ...
    assert judge(d, 0.05).verdict == EQUIVALENT  # ... and smaller than what matters


def test_holm_across_the_family_can_withdraw_a_verdict():
    # One borderline comparison among several nulls: significant alone, not after Holm's correction.
    base = [4.0, 4.1, 3.9, 4.05, 4.0]
    borderline = paired_difference([3.94, 4.08, 3.82, 4.01, 3.97], base)
    assert 0.01 < borderline.p_value() < 0.05 and judge(borderline, 0.01).verdict == BETTER
    family = {"borderline": borderline, **{f"null{i}": paired_difference([b + e for b, e in zip(
        base, (0.03, -0.04, 0.05, -0.02, 0.01)[i:] + (0.03, -0.04, 0.05, -0.02, 0.01)[:i], strict=True)], base)
        for i in range(3)}}
    judged = judge_family(family, 0.01)
    assert judged["borderline"].verdict == INCONCLUSIVE
    assert judged["borderline"].p_difference_adjusted == pytest.approx(
        holm([family[n].p_value() for n in family])[0])


def test_deterministic_and_single_seed_edge_cases():
    same = paired_difference([4.0, 4.1], [4.0, 4.1])  # identical runs: no difference, no noise
    assert judge(same, 0.05).verdict == EQUIVALENT
    assert judge(paired_difference([4.0], [4.5]), 0.05).verdict == INCONCLUSIVE  # one seed: no noise estimate
    diverged = estimate([math.inf, 4.0])
    assert diverged.mean == math.inf and math.isnan(diverged.p_value())


@pytest.mark.parametrize("bad_a, n_a, bad_b, n_b", [(3, 3, 0, 3), (5, 6, 1, 6), (0, 4, 0, 4), (2, 10, 7, 9)])
def test_outcome_counts_fisher_matches_scipy(bad_a, n_a, bad_b, n_b):
    table = [[bad_a, n_a - bad_a], [bad_b, n_b - bad_b]]
    assert outcome_test(bad_a, n_a, bad_b, n_b) == pytest.approx(scipy_stats.fisher_exact(table).pvalue)


def test_outcome_counts_paired_is_mcnemar_exact():
    # 6 seeds: 5 diverge only in a, 0 only in b, 1 in both: the exact binomial test on the 5 discordant pairs.
    p = outcome_test(6, 6, 1, 6, discordant=(5, 0))
    assert p == pytest.approx(2 * 0.5 ** 5)
    assert outcome_test(1, 3, 1, 3, discordant=(0, 0)) == 1.0


def test_lr_sensitivity_counts_divergence_as_the_initial_loss():
    init = math.log(256)  # ~5.55
    flat = {1e-3: 4.0, 3e-3: 4.0, 1e-2: 4.0}
    assert lr_sensitivity(flat, init) == 0.0
    curve = {1e-3: 4.3, 3e-3: 4.0, 1e-2: math.inf}  # diverged at the top LR
    assert lr_sensitivity(curve, init) == pytest.approx(((4.3 - 4.0) + 0 + (init - 4.0)) / 3)
    worse_than_init = {1e-3: 9.0, 3e-3: 4.0}  # a loss above the initial one is capped at it
    assert lr_sensitivity(worse_than_init, init) == pytest.approx((init - 4.0) / 2)


def test_p_values_are_uniform_under_the_null_in_aggregate():
    # Sanity of the whole pipeline: among all 4-element paired samples from a small symmetric grid, the share
    # with p < 0.05 stays near (and not above) 5%.
    values = (-1.0, -0.3, 0.2, 0.9)
    ps = [estimate(list(xs)).p_value() for xs in itertools.product(values, repeat=4)]
    share = sum(p < 0.05 for p in ps if not math.isnan(p)) / len(ps)
    assert share <= 0.08


def test_one_sample_interval_matches_scipy_t_interval():
    e = estimate(A)
    lo, hi = scipy_stats.t.interval(0.95, len(A) - 1, loc=sum(A) / len(A), scale=scipy_stats.sem(A))
    assert (e.lo, e.hi) == pytest.approx((lo, hi), rel=1e-12)
    assert e.p_value(5.0) == pytest.approx(scipy_stats.ttest_1samp(A, 5.0).pvalue, rel=1e-9)


NULL = ([4.3, 3.8, 4.2, 3.9, 4.0, 4.1], [4.0, 4.1, 3.9, 4.05, 4.2, 3.8])  # noisy: the metric alone is INCONCLUSIVE
CLEAR = ([4.0, 4.1, 3.9, 4.05, 4.0, 4.1], [4.5, 4.6, 4.4, 4.55, 4.5, 4.6])  # 0.5 lower on every seed: BETTER


@pytest.mark.parametrize("samples, discordant, expected", [
    (NULL, (0, 0), INCONCLUSIVE),
    (NULL, (0, 6), BETTER),  # the baseline diverged on 6 seeds the candidate trained on: p = 2 / 2^6 < 0.05
    (NULL, (6, 0), WORSE),
    (CLEAR, (1, 0), INCONCLUSIVE),  # better where both trained, but it diverged once where the baseline did not
    (CLEAR, (0, 1), INCONCLUSIVE),  # one discordant seed: p = 1, nothing shown
    (CLEAR, (6, 0), INCONCLUSIVE),  # diverges more, yet better when it trains: mixed, no verdict
    (CLEAR, (0, 6), BETTER),
])
def test_a_divergence_in_one_arm_only_decides_before_the_metric(samples, discordant, expected):
    judged = judge(paired_difference(*samples), 0.05, discordant=discordant)
    assert judged.verdict == expected
    if sum(discordant):
        assert judged.p_outcome == pytest.approx(scipy_stats.binomtest(discordant[0], sum(discordant)).pvalue)


def test_equivalence_needs_no_divergence_in_one_arm():
    same = ([4.01, 4.10, 3.91, 4.04], [4.0, 4.1, 3.9, 4.05])
    assert judge(paired_difference(*same), 0.05).verdict == EQUIVALENT
    assert judge(paired_difference(*same), 0.05, discordant=(0, 1)).verdict == INCONCLUSIVE


def test_without_a_margin_there_is_no_equivalence():
    same = paired_difference([4.01, 4.10, 3.91, 4.04], [4.0, 4.1, 3.9, 4.05])
    j = judge(same, None)
    assert j.verdict == INCONCLUSIVE and math.isnan(j.p_equivalent)
    assert judge(paired_difference(*CLEAR), None).verdict == BETTER


def test_outcome_family_holm_counts_only_comparisons_with_a_discordant_seed():
    diffs = {"a": paired_difference(*NULL), "b": paired_difference(*NULL), "c": paired_difference(*NULL)}
    judged = judge_family(diffs, 0.05, discordant={"a": (0, 7), "b": (0, 0), "c": (2, 3)})
    p_a, p_c = 2 * 0.5 ** 7, scipy_stats.binomtest(2, 5).pvalue
    assert judged["a"].p_outcome_adjusted == pytest.approx(holm([p_a, p_c])[0]) == pytest.approx(2 * p_a)
    assert math.isnan(judged["b"].p_outcome) and judged["b"].verdict == INCONCLUSIVE
    assert judged["a"].verdict == BETTER and judged["c"].verdict == INCONCLUSIVE


@pytest.mark.parametrize("losses, diverged, expected", [
    ([5.5, 5.0, 4.5, 4.2, 4.0, 3.9, 3.8, 3.8, 3.7, 3.7], False, "trains"),
    ([5.5, 5.49, 5.5, 5.48, 5.47, 5.5, 5.46, 5.47, 5.48, 5.46], False, "stalled"),  # < 0.1 nats of progress
    ([5.5, 5.0, 4.5, 4.2, 4.0, 3.9, 3.8, 4.9, 5.9, 6.3], False, "diverged"),  # ended above where it started
    ([5.5, 5.0, math.nan], False, "diverged"),
    ([5.5, 5.0, 4.5], True, "diverged"),  # stopped on a non-finite loss that was never logged
])
def test_training_outcome_is_the_studys(losses, diverged, expected):
    from training.study.measure import outcome

    assert training_outcome(losses, diverged) == expected
    if all(math.isfinite(x) for x in losses):
        assert outcome({"losses": losses, "diverged_at": 3 if diverged else None}) == expected

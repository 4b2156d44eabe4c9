"""training.stats on synthetic numbers: paired and Welch intervals and p-values against scipy's own tests, Holm
against the step-down procedure as Holm (1979) defines it and Benjamini–Hochberg against scipy, the sign-flip
test against enumeration of every sign pattern (and Wilcoxon's exact test), the four comparison verdicts, the
divergence rule, and the learning-rate statistics on hand-computed grids. The simulations of what the rules
guarantee (error rates, power at the adjusted level) are in tests/test_stats_simulation.py."""
import itertools
import math

import numpy as np
import pytest
import scipy.stats as scipy_stats

from training.stats import (
    BETTER,
    EQUIVALENT,
    INCONCLUSIVE,
    WORSE,
    benjamini_hochberg,
    best_index,
    best_lr_bootstrap,
    crossfit_best,
    difference,
    estimate,
    holm,
    initial_loss_cap,
    judge,
    judge_family,
    lr_sensitivity,
    paired_difference,
    sign_flip_p,
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
    assert judged["borderline"].p_adjusted["difference"] == pytest.approx(
        holm([family[n].p_value() for n in family])[0])
    assert judged["borderline"].level == pytest.approx(0.05 / 4)  # power and MDE are given at α/k


def test_deterministic_and_single_seed_edge_cases():
    same = paired_difference([4.0, 4.1], [4.0, 4.1])  # identical runs: no spread, so no t-test and no verdict
    assert judge(same, 0.05).verdict == INCONCLUSIVE and math.isnan(same.p_value())
    assert judge(paired_difference([4.0], [4.5]), 0.05).verdict == INCONCLUSIVE  # one seed: no noise estimate
    diverged = estimate([math.inf, 4.0])
    assert diverged.mean == math.inf and math.isnan(diverged.p_value())


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
WORSE4 = ([4.3, 4.35, 4.2, 4.4], [4.0, 4.1, 3.9, 4.05])  # 4 seeds where both trained: the candidate worse on each


@pytest.mark.parametrize("samples, discordant, expected", [
    (NULL, (0, 0), INCONCLUSIVE),
    (NULL, (0, 6), BETTER),  # the baseline diverged on 6 more seeds, ranking worst: p = 0.045 over 12 seeds
    (CLEAR, (1, 0), INCONCLUSIVE),  # better on 6 seeds but diverged on a 7th, the largest rank: p = 0.28
    (CLEAR, (0, 1), BETTER),  # 7 of 7 seeds one way: p = 2/128
    (CLEAR, (6, 0), INCONCLUSIVE),  # diverges 6 times, better on the 6 that trained: mixed, no verdict
    (CLEAR, (0, 6), BETTER),  # better on every one of 12 seeds
    (WORSE4, (2, 0), WORSE),  # worse on 4 seeds, diverged on 2 more: 6 of 6 one way, p = 2/64 (claim 17b)
    (WORSE4, (0, 2), INCONCLUSIVE),  # the two baseline divergences point the other way
])
def test_a_divergence_in_one_arm_only_counts_as_the_worst_value_with_the_others(samples, discordant, expected):
    judged = judge(paired_difference(*samples), 0.05, discordant=discordant)
    assert judged.verdict == expected
    if sum(discordant):  # the exact signed-rank test over every seed, a diverged run ranking last
        values = [a - b for a, b in zip(*samples, strict=True)] + [math.inf] * discordant[0] + \
            [-math.inf] * discordant[1]
        assert judged.p["difference"] == pytest.approx(_signed_rank_p_by_enumeration(values))
        assert math.isnan(judged.p["equivalence"])  # never EQUIVALENT: one arm diverged where the other did not


def test_claim_17b_all_seeds_one_way_is_a_verdict():
    """4 seeds where both trained, the candidate worse on each, 2 where only it diverged: every seed points one
    way, the exact sign test's p is 2/2^6; McNemar on the 2 diverged seeds alone (the former rule) gave 0.5."""
    j = judge(paired_difference(*WORSE4), 0.05, discordant=(2, 0))
    assert j.p["difference"] == pytest.approx(2 / 64) and j.verdict == WORSE


def test_equivalence_needs_no_divergence_in_one_arm():
    same = ([4.01, 4.10, 3.91, 4.04], [4.0, 4.1, 3.9, 4.05])
    assert judge(paired_difference(*same), 0.05).verdict == EQUIVALENT
    assert judge(paired_difference(*same), 0.05, discordant=(0, 1)).verdict == INCONCLUSIVE


def test_without_a_margin_there_is_no_equivalence():
    same = paired_difference([4.01, 4.10, 3.91, 4.04], [4.0, 4.1, 3.9, 4.05])
    j = judge(same, None)
    assert j.verdict == INCONCLUSIVE and math.isnan(j.p["equivalence"])
    assert judge(paired_difference(*CLEAR), None).verdict == BETTER


def _signs(n):
    return itertools.product((1, -1), repeat=n)


def _flip_p_by_enumeration(values, alternative="two-sided"):
    """Every one of the 2^n sign patterns, by itertools: the share whose sum is at least as extreme."""
    obs = sum(values)
    sums = [sum(s * v for s, v in zip(signs, values, strict=True)) for signs in _signs(len(values))]
    tol = 1e-9
    if alternative == "greater":
        return sum(x >= obs - tol for x in sums) / len(sums)
    if alternative == "less":
        return sum(x <= obs + tol for x in sums) / len(sums)
    return sum(abs(x) >= abs(obs) - tol for x in sums) / len(sums)


def _signed_rank_p_by_enumeration(values):
    """The two-sided exact signed-rank p by enumeration: zeros dropped, |values| ranked with mid-ranks for ties,
    +inf above every number."""
    xs = [v for v in values if v != 0 and not math.isnan(v)]
    order = sorted(abs(v) for v in xs)
    rank = {a: (order.index(a) + 1 + len(order) - order[::-1].index(a)) / 2 for a in order}
    return _flip_p_by_enumeration([math.copysign(rank[abs(v)], v) for v in xs])


@pytest.mark.parametrize("values", [
    [0.31, -0.12, 0.44, 0.05, 0.27, 0.19],
    [1.0, 1.0, -1.0, 2.0, 0.0, 3.0, -0.5],  # ties and a zero
    [0.3, 0.3, 0.3],  # every seed the same: the smallest p three seeds allow
    [-2.5, 0.1, -0.7, -1.2, -0.4, -3.3, 0.2, -0.9, -1.1],
])
def test_sign_flip_p_equals_enumerating_every_sign_pattern(values):
    for alternative in ("two-sided", "greater", "less"):
        assert sign_flip_p(values, alternative) == pytest.approx(_flip_p_by_enumeration(values, alternative))
    assert sign_flip_p(values, ranks=True) == pytest.approx(_signed_rank_p_by_enumeration(values))


def test_sign_flip_ranks_match_wilcoxons_exact_test_and_admit_divergences():
    xs = [0.31, -0.12, 0.44, 0.05, 0.27, 0.19, -0.08, 0.5]  # no ties, no zeros: scipy's exact distribution
    assert sign_flip_p(xs, ranks=True) == pytest.approx(scipy_stats.wilcoxon(xs, method="exact").pvalue)
    assert sign_flip_p([*xs[:-1], math.inf], ranks=True) == pytest.approx(sign_flip_p(xs, ranks=True))
    assert math.isnan(sign_flip_p([0.1, math.inf]))  # values: a diverged run has no number
    assert sign_flip_p([0.2] * 6) == pytest.approx(2 / 64)  # six seeds one way: the smallest two-sided p


def test_sign_flip_beyond_exact_enumeration_samples_the_patterns():
    rng = np.random.default_rng(3)
    xs = list(rng.normal(0.3, 1.0, 26))  # 2^26 patterns: sampled; the normal approximation is close at n = 26
    approx = scipy_stats.wilcoxon(xs, method="approx").pvalue
    assert sign_flip_p(xs, ranks=True) == pytest.approx(approx, abs=0.02)


def test_the_sign_flip_twin_is_flagged_where_the_verdicts_differ():
    # four seeds: the t-test rejects, but no sign-flip p can be below 2/2^4 = 0.125
    j = judge(paired_difference([4.0, 4.1, 3.9, 4.05], [4.5, 4.6, 4.4, 4.55]), 0.05)
    assert j.verdict == BETTER and j.verdict_perm == INCONCLUSIVE and j.disagree
    assert j.p["difference_perm"] == pytest.approx(0.125)
    six = judge(paired_difference(*CLEAR), 0.05)
    assert six.verdict == six.verdict_perm == BETTER and not six.disagree


def test_benjamini_hochberg_equals_scipy():
    ps = [0.001, 0.04, 0.03, 0.2, 0.012, 0.5, 0.049]
    assert benjamini_hochberg(ps) == pytest.approx(list(scipy_stats.false_discovery_control(ps)))
    out = benjamini_hochberg([0.01, math.nan, 0.04])
    assert out[0] == pytest.approx(0.02) and math.isnan(out[1]) and out[2] == pytest.approx(0.04)


@pytest.mark.parametrize("losses, diverged, expected", [
    ([5.5, 5.0, 4.5, 4.2, 4.0, 3.9, 3.8, 3.8, 3.7, 3.7], False, "trains"),
    ([5.5, 5.49, 5.5, 5.48, 5.47, 5.5, 5.46, 5.47, 5.48, 5.46], False, "plateau"),  # within 0.05 of H = 5.5
    ([5.5, 5.0, 4.5, 4.2, 4.0, 3.9, 3.8, 4.9, 5.9, 6.3], False, "diverged"),  # ended above where it started
    ([5.5, 5.0, math.nan], False, "diverged"),
    ([5.5, 5.0, 4.5], True, "diverged"),  # stopped on a non-finite loss that was never logged
])
def test_training_outcome_is_the_studys(losses, diverged, expected):
    from training.study.measure import outcome

    assert training_outcome(losses, diverged, entropy=5.5) == expected
    if all(math.isfinite(x) for x in losses):
        assert outcome({"losses": losses, "diverged_at": 3 if diverged else None, "unigram_entropy": 5.5}) == expected


def test_initial_loss_cap_and_best_index():
    assert initial_loss_cap([7.62, 7.61, math.inf, 7.63]) == pytest.approx(7.62)  # the median of those known
    assert initial_loss_cap([]) == math.inf
    assert best_index([4.2, 4.0, math.nan, 4.0]) == 1 and best_index([0.3, 0.7, 0.5], "max") == 1


def test_crossfit_best_reads_each_seed_at_the_lr_the_other_seeds_chose():
    # [LR][seed]: LR 1 is best on average, but seed 2 alone would pick LR 0 (its own noise)
    grid = [[4.3, 4.4, 3.9], [4.0, 4.1, 4.2], [4.6, 4.7, 4.8]]
    # seed 0: the others (seeds 1, 2) average 4.15, 4.15, 4.75 → LR 0 (first of the tie); seed 1: 4.1, 4.1 → LR 0;
    # seed 2: 4.35, 4.05 → LR 1
    assert crossfit_best(grid) == pytest.approx([4.3, 4.4, 4.2])
    assert crossfit_best([[4.0], [3.0]]) == [3.0]  # one seed keeps its own choice


def test_best_lr_bootstrap_redoes_the_choice_in_every_resample():
    """The same resamples (the same generator and seed) computed with plain loops: per resample, each arm's
    best LR on the resampled seeds, then the difference of their means there."""
    rng = np.random.default_rng(7)
    a = rng.normal(4.0, 0.2, size=(3, 6)) + np.array([[0.3], [0.0], [0.1]])
    b = rng.normal(3.8, 0.2, size=(3, 6))
    lo, hi = best_lr_bootstrap(a, b, resamples=500, seed=11)
    draws = np.random.default_rng(11).integers(0, 6, size=(500, 6))
    diffs = []
    for idx in draws:
        at_best = [min(sum(m[lr][i] for i in idx) / 6 for lr in range(3)) for m in (a, b)]
        diffs.append(at_best[0] - at_best[1])
    assert (lo, hi) == pytest.approx(tuple(np.quantile(diffs, [0.025, 0.975])))


def test_a_held_out_loss_above_the_initial_one_is_a_divergence():
    losses = [7.6, 6.0, 5.5, 5.2, 5.0, 4.9, 4.8, 4.8, 4.7, 4.7]
    assert training_outcome(losses, final_loss=4.8, entropy=6.3) == "trains"
    assert training_outcome(losses, final_loss=9.7e6, entropy=6.3) == "diverged"
    assert training_outcome(losses, final_loss=math.inf, entropy=6.3) == "diverged"

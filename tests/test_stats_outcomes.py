"""The run-level outcomes of training.stats on synthetic series: a metric's reductions against numpy, the spike count
against the non-finite guard's own z-score replayed step by step, the exact test of paired counts against an
enumeration of every sign pattern (no verdict from 0 against 0, never p = 0 from a zero standard error), the LR
reach against a float64 interpolation written here, its paired comparison's permutation p against a brute-force
enumeration, and the reach on two arms with the same mean curve and different noise (no spurious difference)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from training.callbacks.guard import NonFiniteGuard
from training.stats import (
    INCONCLUSIVE,
    WORSE,
    Reduction,
    compare_reach,
    count_spikes,
    exact_can_reject,
    judge_counts,
    judge_reach,
    lr_reach,
    seeds_for_exact,
    series_peak,
)

POINTS = [(1, 9.0), (4, 7.5), (8, 6.0), (12, 6.4), (16, 6.2)]
LRS = [3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3]


@pytest.mark.parametrize("raw, expected", [
    ("final", 6.2), ("min", 6.0), ("max", 9.0), ({"mean_last": 3}, np.mean([6.0, 6.4, 6.2])),
    ({"mean_last": 9}, np.mean([v for _, v in POINTS])),
])
def test_reductions_of_a_logged_series(raw, expected):
    value, step = Reduction.parse(raw)(POINTS)
    assert value == pytest.approx(expected) and step == 16


@pytest.mark.parametrize("raw", ["median", {"mean_last": 0}, {"mean_last": 2.5}, {"last": 3}, "mean_last"])
def test_a_bad_reduction_names_the_valid_ones(raw):
    with pytest.raises(ValueError, match="final, min, max|mean_last"):
        Reduction.parse(raw)


def test_spikes_are_the_guards_z_score_replayed():
    """count_spikes over a loss series equals the guard's own _zscore, fed the same losses as it keeps them (every
    finite loss enters its window), and a float64 z-score written here."""
    rng = np.random.default_rng(0)
    losses = list(5.0 - np.linspace(0, 1, 300) + rng.normal(0, 0.02, 300))
    for i in (60, 61, 150, 240):
        losses[i] += 0.3
    guard = NonFiniteGuard(spike_window=20)
    by_guard = 0
    for loss in losses:
        by_guard += guard._zscore(loss) > 4.0
        guard._losses.append(loss)
    by_hand = sum((x - np.mean(w)) / np.std(w, ddof=1) > 4.0
                  for i, x in enumerate(losses) if len(w := np.array(losses[max(0, i - 20):i])) >= 2)
    assert count_spikes(losses, 20, 4.0) == by_guard == by_hand >= 3  # 61 follows a spike: the window absorbs it
    assert count_spikes([*losses[:100], math.nan, *losses[100:]], 20, 4.0) == by_guard  # a NaN is skipped


def test_the_peak_of_several_series():
    assert series_peak([[(1, 3.0), (5, 9.5)], [(1, 4.0)]]) == 9.5
    assert series_peak([[(1, 3.0), (5, math.nan)]]) == math.inf and math.isnan(series_peak([]))


def _enumerated_p(d: list[float]) -> float:
    sums = [abs(sum(s * x for s, x in zip(signs, d, strict=True)))
            for signs in itertools.product((1, -1), repeat=len(d))]
    return sum(s >= abs(sum(d)) - 1e-12 for s in sums) / len(sums)


def test_paired_counts_get_the_exact_test_alone():
    mine, base = [3, 1, 2, 4, 1, 2, 0, 2], [0, 0, 1, 0, 0, 1, 0, 1]
    zeros = [0] * 8
    judged = judge_counts({"more": (mine, base), "none": (zeros, zeros), "same": ([1] * 8, [1] * 8)}, margin=1)
    more, none, same = judged["more"], judged["none"], judged["same"]
    d = [a - b for a, b in zip(mine, base, strict=True)]
    assert more.p["difference"] == more.p["difference_perm"] == pytest.approx(_enumerated_p(d))
    assert more.p["difference"] > 0 and more.verdict == WORSE and more.exact_only
    # 0 spikes against 0: nothing to test, so no verdict at all (not BETTER, not EQUIVALENT)
    assert math.isnan(none.p["difference"]) and none.verdict == INCONCLUSIVE
    # equal counts at every seed: no difference (p = 1); 8 against 8 spikes over 8 seeds bounds the rates' difference
    # only to about ±1.8 per seed, so equivalence within one spike is not shown (no spread is not certainty)
    assert same.p["difference"] == 1.0 and same.verdict == INCONCLUSIVE and same.p["equivalence"] > 0.05
    # Holm across the two comparisons that have a test (k = 2): the nothing-happened one does not count
    assert more.level == pytest.approx(0.025)


def test_a_count_with_the_same_difference_at_every_seed_is_not_p_zero():
    judged = judge_counts({"x": ([1] * 4, [0] * 4)}, margin=None)["x"]
    assert judged.p["difference"] == pytest.approx(2 / 16) and judged.verdict == INCONCLUSIVE


def test_the_exact_test_needs_six_seeds_at_alpha():
    assert [exact_can_reject(n, 0.05) for n in (2, 5, 6)] == [False, False, True]
    assert seeds_for_exact(0.05) == 6 and seeds_for_exact(0.025) == 7


def _by_hand(curve: list[float], delta: float) -> tuple[float, float]:
    """(low, high) in log10 LR: the contiguous range around the minimum within delta, linear between points."""
    x, y = np.log10(LRS), np.asarray(curve, dtype=np.float64)
    ib, level = int(np.argmin(y)), y.min() + delta
    hi = next((x[i] + (level - y[i]) / (y[i + 1] - y[i]) * (x[i + 1] - x[i])
               for i in range(ib, len(x) - 1) if y[i + 1] > level), x[-1])
    lo = next((x[i] - (level - y[i]) / (y[i - 1] - y[i]) * (x[i] - x[i - 1])
               for i in range(ib, 0, -1) if y[i - 1] > level), x[0])
    return lo, hi


def test_reach_against_a_hand_interpolation():
    curve = [6.40, 6.10, 5.97, 6.05, 6.34, 6.58, 6.75]
    r = lr_reach(LRS, curve, 0.1)
    lo, hi = _by_hand(curve, 0.1)
    assert (r.low, r.high, r.width) == pytest.approx((lo, hi, hi - lo)) and not r.at_least and not r.unbracketed
    edge = lr_reach(LRS[2:], curve[2:], 0.1)  # the best LR at the grid's lowest: unbracketed, a lower bound
    assert edge.unbracketed and edge.open_low and edge.at_least and str(edge).startswith("≥ ")
    assert edge.high == pytest.approx(hi)
    accuracy = lr_reach(LRS, [-v for v in curve], 0.1, mode="max")  # mode max: within delta below the best
    assert accuracy.width == pytest.approx(r.width)


def test_the_reach_permutation_p_is_every_swap_of_arms():
    rng = np.random.default_rng(3)
    curve = np.array([6.4, 6.1, 5.97, 6.05, 6.34, 6.58, 6.75])[:, None]
    a, b = curve + rng.normal(0, 0.05, (7, 5)), curve + 0.1 * np.arange(7)[:, None] / 7 + rng.normal(0, 0.05, (7, 5))
    c = compare_reach(LRS, a, b, 0.1, resamples=300)

    def diff(x, y):
        return lr_reach(LRS, x.mean(1), 0.1).width - lr_reach(LRS, y.mean(1), 0.1).width

    observed = diff(a, b)
    swapped = [diff(np.where(s, b, a), np.where(s, a, b)) for s in itertools.product((False, True), repeat=5)]
    assert c.estimate.mean == pytest.approx(observed)
    assert c.p_permutation == pytest.approx(np.mean(np.abs(swapped) >= abs(observed) - 1e-9))
    loo = np.array([diff(np.delete(a, s, 1), np.delete(b, s, 1)) for s in range(5)])
    assert c.estimate.se == pytest.approx(math.sqrt(4 / 5 * np.sum((loo - loo.mean()) ** 2)))


def test_equal_mean_curves_with_different_noise_give_no_difference():
    """The per-seed-minimum bias: two arms with the same mean curve, per-run sd 0.10 against 0.02, 12 seeds. The
    reach on seed-mean curves is unbiased to well within its noise (a per-seed reach averaged over seeds is off by
    about five times its spread here), and one such sweep is judged INCONCLUSIVE."""
    curve = np.array([6.3, 6.1, 6.0, 6.02, 6.05, 6.3, 6.6])[:, None]  # flat-bottomed: where the bias is largest
    rng = np.random.default_rng(1)
    draws = [(curve + rng.normal(0, 0.10, (7, 12)), curve + rng.normal(0, 0.02, (7, 12))) for _ in range(300)]
    d = np.array([lr_reach(LRS, a.mean(1), 0.1).width - lr_reach(LRS, b.mean(1), 0.1).width for a, b in draws])
    assert abs(d.mean()) < 0.5 * d.std()
    judged = judge_reach({"noisy": compare_reach(LRS, *draws[0], 0.1, resamples=300)}, margin=0.25)["noisy"]
    assert judged.verdict == INCONCLUSIVE and judged.exact_can_decide

"""Exact tests of counts on their totals (a Poisson model: each seed's count of events — diverged runs, loss
spikes — a Poisson variable with the arm's rate per seed). A per-seed t-test cannot judge counts: they are small
integers, often all equal, and a standard error of 0 says nothing about the rate (0 of 18 runs diverged is
compatible with a rate of 0.7 per seed of three runs). These tests use the totals over the seeds instead:

- `p_rate_difference`: the exact conditional test of equal rates — given the two arms' total count k_a + k_b over
  the same number of seeds, k_a is Binomial(k_a + k_b, ½) under the null;
- `rate_difference_interval`: an exact (conservative) interval of the difference of the rates per seed, from each
  arm's Garwood (exact Poisson, chi-square) interval at 1 − α/2 (Bonferroni: both cover at once with ≥ 1 − α);
  a binomial count (k of N runs) is covered too, the Poisson interval being the wider;
- `p_rate_equivalent`: the equivalence test on that interval, in normlab's convention (< α exactly when the
  (1 − α) interval lies inside ±margin per seed)."""
from __future__ import annotations

import math

from scipy import stats as _scipy


def poisson_interval(total: float, confidence: float) -> tuple[float, float]:
    """Garwood's exact two-sided interval of a Poisson mean from one observed `total`."""
    a = 1 - confidence
    lo = 0.0 if total <= 0 else float(_scipy.chi2.ppf(a / 2, 2 * total)) / 2
    return lo, float(_scipy.chi2.ppf(1 - a / 2, 2 * total + 2)) / 2


def rate_difference_interval(total_a: float, total_b: float, seeds: int,
                             confidence: float = 0.95) -> tuple[float, float]:
    """An interval of rate_a − rate_b (per seed, both arms over `seeds` seeds) with coverage ≥ `confidence`."""
    each = 1 - (1 - confidence) / 2
    (la, ha), (lb, hb) = poisson_interval(total_a, each), poisson_interval(total_b, each)
    return (la - hb) / seeds, (ha - lb) / seeds


def p_rate_difference(total_a: float, total_b: float) -> float:
    """Two-sided exact conditional p of equal rates (same seeds in both arms); NaN when neither arm counted
    anything (nothing to test)."""
    k, n = round(total_a), round(total_a + total_b)
    return float(_scipy.binomtest(k, n, 0.5).pvalue) if n > 0 else math.nan


def p_rate_equivalent(total_a: float, total_b: float, seeds: int, margin: float) -> float:
    """The smallest α at which the (1 − α) `rate_difference_interval` lies inside (−margin, margin): < α exactly
    when equivalence within ±margin per seed is shown at α. 1 when even the narrowest interval reaches out."""
    margin = abs(margin)

    def inside(alpha: float) -> bool:
        lo, hi = rate_difference_interval(total_a, total_b, seeds, 1 - alpha)
        return -margin < lo and hi < margin

    if seeds < 1 or not inside(1 - 1e-12):
        return 1.0
    lo, hi = 0.0, 1 - 1e-12  # inside(hi) holds; the interval only widens as alpha falls
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if inside(mid) else (mid, hi)
    return hi

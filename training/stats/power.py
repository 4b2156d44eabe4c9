"""Power before a comparison is run: the smallest effect a test detects (`min_detectable`), the probability it
rejects at a given effect (`power_at`, for a difference and for equivalence), and the seeds a question needs
(`seeds_needed`, what `normlab sweep --plan` prints)."""
from __future__ import annotations

import math

from scipy import integrate
from scipy import stats as _scipy

from training.stats.estimates import ALPHA, Estimate, t_quantile


def min_detectable(est: Estimate, alpha: float = ALPHA, power: float = 0.8) -> float:
    """The smallest true effect a two-sided t-test at `alpha` detects with probability `power`, given the
    estimate's standard error and degrees of freedom: (t_{1−α/2} + t_{power})·se (the usual approximation)."""
    if est.df < 1 or not est.se > 0:
        return math.nan
    return (t_quantile(1 - alpha / 2, est.df) + t_quantile(power, est.df)) * est.se


def power_at(est: Estimate, effect: float, alpha: float = ALPHA, equivalence: bool = False) -> float:
    """The probability that the test rejects at level `alpha` at a true effect `effect`, given the estimate's
    standard error and degrees of freedom: for the two-sided t-test of 0, from the noncentral t; for
    equivalence within ±`effect` (TOST at α/2 per side: the (1−α) interval inside ±effect) at a true
    difference of 0, exactly, by integrating over the sampling distribution of the standard error (the
    interval's half-width is random too). Give the level the test is actually judged at (α/k in a family of
    k)."""
    if est.df < 1 or not est.se > 0:
        return math.nan
    crit = t_quantile(1 - alpha / 2, est.df)
    if equivalence:
        return _tost_power(abs(effect), est.se, est.df, crit)
    nc = abs(effect) / est.se
    return float(_scipy.nct.sf(crit, est.df, nc) + _scipy.nct.cdf(-crit, est.df, nc))


def _tost_power(margin: float, se: float, df: float, crit: float) -> float:
    """P(|mean| + crit·ŝe < margin) at a true mean 0, mean ~ N(0, se²), ŝe² ~ se²·χ²_df/df independent."""
    upper = df * (margin / (crit * se)) ** 2  # χ² values beyond it leave no room inside the margin

    def inside(u: float) -> float:
        half = margin - crit * se * math.sqrt(u / df)
        return (2 * _scipy.norm.cdf(half / se) - 1) * _scipy.chi2.pdf(u, df)

    return float(max(0.0, integrate.quad(inside, 0.0, upper, limit=200)[0]))


def seeds_needed(sd: float, effect: float, alpha: float = ALPHA, power: float = 0.8, equivalence: bool = False,
                 most: int = 1000) -> int | None:
    """The fewest seeds (≥ 2) at which a paired comparison whose per-seed differences have standard deviation
    `sd` reaches `power` (`power_at` at level `alpha`): to detect a true effect of `effect`, or (equivalence)
    to show |difference| < `effect` at a true difference of 0. None if not within `most` seeds."""
    if not sd > 0 or not effect:
        return None
    for n in range(2, most + 1):
        est = Estimate(0.0, sd, n, 0.0, 0.0, sd / math.sqrt(n), n - 1)
        if power_at(est, effect, alpha, equivalence) >= power:
            return n
    return None

"""Estimates over seeds: the mean of one statistic with its t-interval (`estimate`), the paired difference of two
arms that share their seeds (`paired_difference`), the Welch difference of two that share nothing (`difference`),
and a least-squares `slope`. An `Estimate` carries its samples, standard error and degrees of freedom, so it gives
its interval at any level and the p-values of the tests (verdicts.py)."""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from scipy import stats as _scipy

ALPHA = 0.05


@dataclass(frozen=True)
class Estimate:
    """A mean (or a difference of means) over `n` seeds: its sd (of the samples; for a Welch difference, the
    standard error), its standard error `se` with `df` degrees of freedom, and the interval [lo, hi] at
    `confidence`. One sample: sd = se = 0, df = 0, lo = hi = mean (no noise estimate: no test can reject).
    Several samples that are all equal (`no_spread`): se = 0 too, and a t-statistic of d / 0 is not evidence —
    it would make any nonzero mean "infinitely significant" — so every t-based p is NaN (no verdict); only an
    exact test of the samples themselves (the sign-flip twins, the exact count tests) can judge them.
    `samples`: the finite values it was computed from (empty for a Welch difference), for the sign-flip tests."""

    mean: float
    sd: float
    n: int
    lo: float
    hi: float
    se: float = 0.0
    df: float = 0.0
    confidence: float = 0.95
    samples: tuple[float, ...] = field(default=(), repr=False)

    def __str__(self) -> str:
        if not math.isfinite(self.mean):
            return (f"{self.mean} (n={self.n}: a seed is non-finite; no interval)" if math.isinf(self.mean)
                    else f"— (n={self.n}: no finite value)")
        if self.n == 1:
            return f"{self.mean:.4g}"
        if self.no_spread:
            return f"{self.mean:.3g} (n={self.n}, no spread: every seed the same; no t-interval)"
        return (f"{self.mean:.3g} ± {self.sd:.2g} (n={self.n}, {self.confidence:.0%} CI "
                f"[{self.lo:.3g}, {self.hi:.3g}])")

    @property
    def no_spread(self) -> bool:
        """Two or more finite samples, all equal: no noise estimate, so no t-based test (the report's "no
        spread")."""
        return self.n > 1 and math.isfinite(self.mean) and self.se == 0

    def interval(self, confidence: float) -> tuple[float, float]:
        """The two-sided t-interval at `confidence`."""
        if self.df < 1 or not math.isfinite(self.mean) or self.se == 0:
            return self.lo, self.hi
        half = t_quantile(0.5 + confidence / 2, self.df) * self.se
        return self.mean - half, self.mean + half

    def p_value(self, null: float = 0.0) -> float:
        """Two-sided p of the t-test of `mean == null` (NaN when there is no noise estimate and no exact answer)."""
        if not math.isfinite(self.mean):
            return math.nan
        if not self.se > 0 or self.df < 1:
            return math.nan  # no spread, or one sample: the t-statistic is undefined (class docstring)
        return float(2 * _scipy.t.sf(abs(self.mean - null) / self.se, self.df))

    def p_equivalent(self, margin: float) -> float:
        """p of the two one-sided tests of |mean| < margin, doubled: < α exactly when the (1−α) interval lies
        inside (−margin, margin) (each one-sided test at α/2), so one threshold serves both families. This is
        twice the p of the usual TOST (the larger one-sided p, each side at α): normlab's equivalence at α is
        the usual TOST at α/2. NaN without a noise estimate (one sample, or no spread)."""
        margin = abs(margin)
        if not math.isfinite(self.mean) or not self.se > 0 or self.df < 1:
            return math.nan
        p_lower = _scipy.t.sf((self.mean + margin) / self.se, self.df)  # H0: mean ≤ −margin
        p_upper = _scipy.t.cdf((self.mean - margin) / self.se, self.df)  # H0: mean ≥ +margin
        return float(min(1.0, 2 * max(p_lower, p_upper)))

    def p_exceeds(self, margin: float) -> float:
        """The reverse of `p_equivalent`: p of |mean| > margin, the smaller of the two one-sided tests (mean >
        +margin, mean < −margin) doubled, so < α exactly when the (1−α) interval lies wholly outside ±margin.
        NaN without a noise estimate (one sample, or no spread)."""
        margin = abs(margin)
        if not math.isfinite(self.mean) or self.df < 1 or self.se <= 0:
            return math.nan
        p_above = _scipy.t.sf((self.mean - margin) / self.se, self.df)  # H0: mean ≤ +margin
        p_below = _scipy.t.cdf((self.mean + margin) / self.se, self.df)  # H0: mean ≥ −margin
        return float(min(1.0, 2 * min(p_above, p_below)))


def t_quantile(q: float, df: float) -> float:
    """The q-quantile of Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"a t-quantile needs positive degrees of freedom, got {df}")
    return float(_scipy.t.ppf(q, df))


def _finite(samples: Sequence[float]) -> list[float] | None:
    xs = [float(x) for x in samples]
    return xs if all(math.isfinite(x) for x in xs) else None


def _non_finite(xs: Sequence[float], n: int) -> Estimate:
    """A sample with a non-finite value (a diverged run's loss): infinite, not silently smaller."""
    m = math.inf if any(x == math.inf for x in xs) else -math.inf if any(x == -math.inf for x in xs) else math.nan
    if any(math.isnan(float(x)) for x in xs):
        m = math.nan
    return Estimate(m, math.nan, n, m, m, math.nan, 0.0)


def estimate(samples: Sequence[float], confidence: float = 0.95) -> Estimate:
    """Mean, sd and t-interval of one statistic's per-seed values."""
    if not samples:
        raise ValueError("estimate needs at least one sample")
    xs = _finite(samples)
    if xs is None:
        return _non_finite(samples, len(samples))
    mean = statistics.fmean(xs)
    if len(xs) == 1:
        return Estimate(mean, 0.0, 1, mean, mean, 0.0, 0.0, confidence, tuple(xs))
    sd = statistics.stdev(xs)
    se = sd / math.sqrt(len(xs))
    lo, hi = mean, mean
    if se > 0:
        half = t_quantile(0.5 + confidence / 2, len(xs) - 1) * se
        lo, hi = mean - half, mean + half
    return Estimate(mean, sd, len(xs), lo, hi, se, len(xs) - 1, confidence, tuple(xs))


def paired_difference(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> Estimate:
    """mean(a_i − b_i) over paired samples (a_i and b_i from the same seed) with its t-interval."""
    if len(a) != len(b):
        raise ValueError(f"paired samples must have equal lengths, got {len(a)} and {len(b)}")
    return estimate([x - y for x, y in zip(a, b, strict=True)], confidence)


def difference(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> Estimate:
    """mean(a) − mean(b) with a Welch interval (unequal variances, Welch–Satterthwaite df); `sd` and `se` are
    the standard error of the difference. With one sample on a side that side counts as exact."""
    ea, eb = estimate(a), estimate(b)
    d = ea.mean - eb.mean
    if not math.isfinite(d):
        return Estimate(d, math.nan, ea.n + eb.n, d, d, math.nan, 0.0, confidence)
    va, vb = (ea.sd ** 2 / ea.n if ea.n > 1 else 0.0), (eb.sd ** 2 / eb.n if eb.n > 1 else 0.0)
    se = math.sqrt(va + vb)
    if se == 0:
        df = float(max(ea.n - 1, 0) + max(eb.n - 1, 0))
        return Estimate(d, 0.0, ea.n + eb.n, d, d, 0.0, df, confidence)
    df = (va + vb) ** 2 / sum(v ** 2 / (n - 1) for v, n in ((va, ea.n), (vb, eb.n)) if n > 1 and v > 0)
    half = t_quantile(0.5 + confidence / 2, df) * se
    return Estimate(d, se, ea.n + eb.n, d - half, d + half, se, df, confidence)


def no_estimate(n: int = 0) -> Estimate:
    """The estimate of nothing (no seed with a number on both sides): NaN, which no test can judge."""
    return Estimate(math.nan, math.nan, n, math.nan, math.nan, math.nan, 0.0)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx

"""Seed statistics and the three verdicts.

Every number a verdict uses is a sample over seeds. `estimate` gives its mean, sd and a 95% t-interval;
`difference` the Welch interval of a difference of two means. A verdict compares an interval with a threshold
fixed in `training/study/claims.py` before any run:

- `greater` (the claim: statistic > threshold): PASS when the whole interval lies above it, FAIL when the whole
  interval lies below it, INCONCLUSIVE when the interval contains it — a difference smaller than its noise.
- `less`: the mirror image.
- `equivalent` (the claim: |statistic| < margin): PASS when the interval lies inside (−margin, margin), FAIL
  when it lies wholly outside, INCONCLUSIVE otherwise (the usual two one-sided tests, at 95% each side).
- `exact`: a deterministic quantity (one sample, no noise), PASS when |value − threshold| ≤ tolerance.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
VERDICTS = (PASS, FAIL, INCONCLUSIVE)
KINDS = ("greater", "less", "equivalent", "exact", "report")

# Two-sided 95% quantiles of Student's t, df = 1..30; beyond 30 the normal's 1.96 is within 2%.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: float) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (df rounded down; ≥ 1)."""
    if df < 1:
        raise ValueError(f"a t-interval needs at least 1 degree of freedom, got {df}")
    k = int(df)
    return _T975[k - 1] if k <= len(_T975) else 1.96


@dataclass(frozen=True)
class Estimate:
    """A mean over `n` seeds with its sd and 95% interval [lo, hi] (lo = hi = mean for one sample)."""

    mean: float
    sd: float
    n: int
    lo: float
    hi: float

    def __str__(self) -> str:
        if self.n == 1:
            return f"{self.mean:.4g}"
        return f"{self.mean:.3g} ± {self.sd:.2g} (n={self.n}, 95% CI [{self.lo:.3g}, {self.hi:.3g}])"


def estimate(samples: Sequence[float]) -> Estimate:
    """Mean, sd and 95% t-interval of one statistic's per-seed values. Non-finite values (a diverged run's
    loss) make the estimate infinite, not silently smaller."""
    xs = [float(x) for x in samples]
    if not xs:
        raise ValueError("estimate needs at least one sample")
    if not all(math.isfinite(x) for x in xs):
        m = math.inf if any(x == math.inf for x in xs) else math.nan
        return Estimate(m, math.nan, len(xs), m, m)
    mean = statistics.fmean(xs)
    if len(xs) == 1:
        return Estimate(mean, 0.0, 1, mean, mean)
    sd = statistics.stdev(xs)
    half = t975(len(xs) - 1) * sd / math.sqrt(len(xs))
    return Estimate(mean, sd, len(xs), mean - half, mean + half)


def difference(a: Sequence[float], b: Sequence[float]) -> Estimate:
    """mean(a) − mean(b) with a Welch 95% interval (unequal variances; Welch–Satterthwaite df); `sd` is the
    standard error of the difference. With one sample on a side that side counts as exact."""
    ea, eb = estimate(a), estimate(b)
    d = ea.mean - eb.mean
    if not math.isfinite(d):
        return Estimate(d, math.nan, ea.n + eb.n, d, d)
    va, vb = (ea.sd ** 2 / ea.n if ea.n > 1 else 0.0), (eb.sd ** 2 / eb.n if eb.n > 1 else 0.0)
    se = math.sqrt(va + vb)
    if se == 0:
        return Estimate(d, 0.0, ea.n + eb.n, d, d)
    df = (va + vb) ** 2 / sum(v ** 2 / (n - 1) for v, n in ((va, ea.n), (vb, eb.n)) if n > 1 and v > 0)
    half = t975(max(1.0, df)) * se
    return Estimate(d, se, ea.n + eb.n, d - half, d + half)


def verdict(est: Estimate, kind: str, threshold: float = 0.0, tolerance: float = 0.0) -> str:
    """PASS / FAIL / INCONCLUSIVE of `est` against `threshold` under `kind` (see the module docstring).
    An infinite estimate (a diverged run) is judged like any large value; NaN is INCONCLUSIVE."""
    if kind not in KINDS or kind == "report":
        raise ValueError(f"verdict kind {kind!r} is not one of {KINDS[:-1]}")
    if math.isnan(est.lo) or math.isnan(est.hi):
        return INCONCLUSIVE
    if kind == "exact":
        return PASS if abs(est.mean - threshold) <= tolerance else FAIL
    if kind == "greater":
        return PASS if est.lo > threshold else FAIL if est.hi < threshold else INCONCLUSIVE
    if kind == "less":
        return PASS if est.hi < threshold else FAIL if est.lo > threshold else INCONCLUSIVE
    margin = abs(threshold)
    if -margin < est.lo and est.hi < margin:
        return PASS
    return FAIL if est.lo >= margin or est.hi <= -margin else INCONCLUSIVE


def combine(verdicts: Sequence[str]) -> str:
    """A claim's verdict from its tests': PASS if all pass, FAIL if any fails, else INCONCLUSIVE."""
    if verdicts and all(v == PASS for v in verdicts):
        return PASS
    return FAIL if FAIL in verdicts else INCONCLUSIVE


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx

"""Seed statistics for every verdict normlab gives — the study's claims and a sweep's cells — in one place.

Every number a verdict uses is a sample over seeds:
- `estimate(xs)`: mean, sd and a t-interval of one statistic;
- `paired_difference(a, b)`: the mean of the per-seed differences a_i − b_i with its t-interval — for arms that
  share a seed (same initialization, same batches), where the seed's own effect cancels;
- `difference(a, b)`: the Welch interval of mean(a) − mean(b), for arms that share nothing.

An `Estimate` carries its standard error and degrees of freedom, so it gives its interval at any level and the
p-values of the tests below. A comparison against a practical-significance margin m (the smallest effect of
interest, fixed before any run) has four outcomes:

- EQUIVALENT — the difference is inside ±m (two one-sided tests: both `d > −m` and `d < m` rejected at α/2 each,
  i.e. for a single comparison the (1−α) interval lies inside (−m, m)): a measured null;
- BETTER / WORSE — otherwise, when "no difference" is rejected at α (the (1−α) interval excludes 0), by the sign
  of the difference and which direction is better;
- INCONCLUSIVE — neither: the difference is within its noise.

With several comparisons (a sweep's cells against one baseline, a study's primary tests) `judge_family` adjusts
each family of p-values with Holm's step-down procedure before applying the rule, so the chance of any false
BETTER/WORSE (or any false EQUIVALENT) across the family stays ≤ α. Outcomes that are not numbers — a run that
diverged — are compared as counts with exact tests (`outcome_test`), never dropped as missing: given the seeds
whose run diverged in one arm only, `judge_family` decides on those first (see `_verdict`).
A run's outcome (trains / stalled / diverged) is `training_outcome` of its training losses.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scipy import stats as _scipy

BETTER, WORSE, EQUIVALENT, INCONCLUSIVE = "BETTER", "WORSE", "EQUIVALENT", "INCONCLUSIVE"
COMPARISONS = (BETTER, WORSE, EQUIVALENT, INCONCLUSIVE)
PASS, FAIL = "PASS", "FAIL"  # a claim's threshold test (`verdict`); INCONCLUSIVE as above
VERDICTS = (PASS, FAIL, INCONCLUSIVE)
KINDS = ("greater", "less", "equivalent", "exact", "report")
ALPHA = 0.05


@dataclass(frozen=True)
class Estimate:
    """A mean (or a difference of means) over `n` seeds: its sd (of the samples; for a Welch difference, the
    standard error), its standard error `se` with `df` degrees of freedom, and the interval [lo, hi] at
    `confidence`. One sample: sd = se = 0, df = 0, lo = hi = mean (no noise estimate: no test can reject)."""

    mean: float
    sd: float
    n: int
    lo: float
    hi: float
    se: float = 0.0
    df: float = 0.0
    confidence: float = 0.95

    def __str__(self) -> str:
        if self.n == 1:
            return f"{self.mean:.4g}"
        return (f"{self.mean:.3g} ± {self.sd:.2g} (n={self.n}, {self.confidence:.0%} CI "
                f"[{self.lo:.3g}, {self.hi:.3g}])")

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
        if self.se == 0:
            return 1.0 if self.mean == null else (0.0 if self.n > 1 else math.nan)
        if self.df < 1:
            return math.nan
        return float(2 * _scipy.t.sf(abs(self.mean - null) / self.se, self.df))

    def p_equivalent(self, margin: float) -> float:
        """p of the two one-sided tests of |mean| < margin, doubled: < α exactly when the (1−α) interval lies
        inside (−margin, margin) (each one-sided test at α/2), so one threshold serves both families."""
        margin = abs(margin)
        if not math.isfinite(self.mean):
            return math.nan
        if self.se == 0:
            return 0.0 if abs(self.mean) < margin and self.n > 1 else (1.0 if self.n > 1 else math.nan)
        if self.df < 1:
            return math.nan
        p_lower = _scipy.t.sf((self.mean + margin) / self.se, self.df)  # H0: mean ≤ −margin
        p_upper = _scipy.t.cdf((self.mean - margin) / self.se, self.df)  # H0: mean ≥ +margin
        return float(min(1.0, 2 * max(p_lower, p_upper)))

    def p_exceeds(self, margin: float) -> float:
        """The reverse of `p_equivalent`: p of |mean| > margin, the smaller of the two one-sided tests (mean >
        +margin, mean < −margin) doubled, so < α exactly when the (1−α) interval lies wholly outside ±margin.
        NaN without a noise estimate."""
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
        return Estimate(mean, 0.0, 1, mean, mean, 0.0, 0.0, confidence)
    sd = statistics.stdev(xs)
    se = sd / math.sqrt(len(xs))
    lo, hi = mean, mean
    if se > 0:
        half = t_quantile(0.5 + confidence / 2, len(xs) - 1) * se
        lo, hi = mean - half, mean + half
    return Estimate(mean, sd, len(xs), lo, hi, se, len(xs) - 1, confidence)


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


def min_detectable(est: Estimate, alpha: float = ALPHA, power: float = 0.8) -> float:
    """The smallest true effect a two-sided t-test at `alpha` detects with probability `power`, given the
    estimate's standard error and degrees of freedom: (t_{1−α/2} + t_{power})·se (the usual approximation)."""
    if est.df < 1 or not est.se > 0:
        return math.nan
    return (t_quantile(1 - alpha / 2, est.df) + t_quantile(power, est.df)) * est.se


def power_at(est: Estimate, effect: float, alpha: float = ALPHA, equivalence: bool = False) -> float:
    """The probability that the test rejects at a true effect `effect`, given the estimate's standard error and
    degrees of freedom: for the two-sided t-test of 0, from the noncentral t; for equivalence within ±`effect`
    (TOST at α/2 per side) at a true difference of 0, the usual approximation 2·F_t(effect/se − t_{1−α/2}) − 1."""
    if est.df < 1 or not est.se > 0:
        return math.nan
    crit = t_quantile(1 - alpha / 2, est.df)
    if equivalence:
        return max(0.0, 2 * float(_scipy.t.cdf(abs(effect) / est.se - crit, est.df)) - 1)
    nc = abs(effect) / est.se
    return float(_scipy.nct.sf(crit, est.df, nc) + _scipy.nct.cdf(-crit, est.df, nc))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979), in the input order: the i-th smallest of k is multiplied
    by k − i + 1, made monotone and capped at 1. NaN entries (tests that could not be run) stay NaN and do not
    count towards k."""
    indexed = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    k = len(indexed)
    out = [math.nan] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(indexed):
        running = max(running, min(1.0, (k - rank) * p))
        out[i] = running
    return out


@dataclass(frozen=True)
class Judgement:
    """One comparison: the difference (candidate − baseline), its two p-values before and after Holm's
    adjustment across the family, and the verdict."""

    difference: Estimate
    margin: float | None
    p_difference: float
    p_equivalent: float
    p_difference_adjusted: float
    p_equivalent_adjusted: float
    verdict: str
    discordant: tuple[int, int] = (0, 0)  # seeds diverged in the candidate only, in the baseline only
    p_outcome: float = math.nan  # McNemar's exact test on `discordant` (NaN: no discordant seed, nothing to test)
    p_outcome_adjusted: float = math.nan


def _direction(candidate_wins: bool) -> str:
    return BETTER if candidate_wins else WORSE


def _metric_verdict(d: Estimate, p_diff: float, p_equiv: float, better: str, alpha: float) -> str:
    if not math.isnan(p_equiv) and p_equiv < alpha:
        return EQUIVALENT
    if not math.isnan(p_diff) and p_diff < alpha and d.mean != 0:
        return _direction((d.mean < 0) == (better == "lower"))
    return INCONCLUSIVE


def comparison_verdict(d: Estimate, p_diff: float, p_equiv: float, better: str, alpha: float,
                       discordant: tuple[int, int], p_outcome: float) -> str:
    """The verdict of one comparison from its Holm-adjusted p-values.

    With no seed that diverged in one arm only, the metric decides (`d` is over the seeds where both arms have
    a number). Otherwise a divergence is a difference the metric's interval cannot see, so: when the exact test
    on the discordant seeds rejects, the arm that diverges less is BETTER (a diverged run is worse than any run
    that trained) — unless the metric significantly says the opposite, which is INCONCLUSIVE; when it does not
    reject, INCONCLUSIVE (never EQUIVALENT: one arm diverged where the other did not)."""
    metric = _metric_verdict(d, p_diff, p_equiv, better, alpha)
    only_candidate, only_baseline = discordant
    if only_candidate + only_baseline == 0:
        return metric
    if math.isnan(p_outcome) or p_outcome >= alpha:
        return INCONCLUSIVE
    by_outcome = _direction(only_candidate < only_baseline)
    return by_outcome if metric in (by_outcome, EQUIVALENT, INCONCLUSIVE) else INCONCLUSIVE


def judge_family(differences: Mapping[str, Estimate], margin: float | None, better: str = "lower",
                 alpha: float = ALPHA, discordant: Mapping[str, tuple[int, int]] | None = None
                 ) -> dict[str, Judgement]:
    """The four-way verdict of each difference (candidate − baseline) against ±`margin`, Holm-adjusted across
    the family. `better`: "lower" (a loss) or "higher" (an accuracy) — which sign of the difference is good.
    `margin` None: no equivalence test (the verdict is BETTER, WORSE or INCONCLUSIVE).
    `discordant`: per comparison, (seeds whose run diverged in the candidate only, in the baseline only), for
    paired arms; their McNemar exact p-values form a third family, Holm-adjusted over the comparisons that have
    a discordant seed (one with none cannot reject, so it does not count towards k — Tarone 1990)."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better={better!r} must be 'lower' or 'higher'")
    if margin is not None and not margin > 0:
        raise ValueError(f"margin={margin!r} must be > 0 (the smallest difference that matters)")
    names = list(differences)
    counts = [(discordant or {}).get(n, (0, 0)) for n in names]
    p_diff = [differences[n].p_value() for n in names]
    p_equiv = [math.nan if margin is None else differences[n].p_equivalent(margin) for n in names]
    p_out = [outcome_test(0, 0, 0, 0, discordant=c) if sum(c) else math.nan for c in counts]
    adj_diff, adj_equiv, adj_out = holm(p_diff), holm(p_equiv), holm(p_out)
    return {n: Judgement(differences[n], margin, p_diff[i], p_equiv[i], adj_diff[i], adj_equiv[i],
                         comparison_verdict(differences[n], adj_diff[i], adj_equiv[i], better, alpha, counts[i],
                                            adj_out[i]),
                         counts[i], p_out[i], adj_out[i])
            for i, n in enumerate(names)}


def judge(difference_: Estimate, margin: float | None, better: str = "lower", alpha: float = ALPHA,
          discordant: tuple[int, int] = (0, 0)) -> Judgement:
    """`judge_family` of a single comparison: EQUIVALENT exactly when the (1−α) interval is inside ±margin,
    BETTER/WORSE when it excludes 0."""
    return judge_family({"_": difference_}, margin, better, alpha, {"_": discordant})["_"]


def no_estimate(n: int = 0) -> Estimate:
    """The estimate of nothing (no seed with a number on both sides): NaN, which no test can judge."""
    return Estimate(math.nan, math.nan, n, math.nan, math.nan, math.nan, 0.0)


def outcome_test(bad_a: int, n_a: int, bad_b: int, n_b: int, discordant: tuple[int, int] | None = None) -> float:
    """Two-sided exact p-value that two arms have the same rate of a bad outcome (diverged, stalled):
    Fisher's exact test on the 2×2 counts; for paired arms, give `discordant` = (seeds bad only in a, seeds bad
    only in b) and get McNemar's exact test (a binomial test on the discordant pairs) instead."""
    if discordant is not None:
        only_a, only_b = discordant
        if only_a + only_b == 0:
            return 1.0
        return float(_scipy.binomtest(only_a, only_a + only_b, 0.5).pvalue)
    table = [[bad_a, n_a - bad_a], [bad_b, n_b - bad_b]]
    return float(_scipy.fisher_exact(table).pvalue)


STALL_NATS = 0.1  # progress over the last 80% of steps below which a run "stalled"


def training_outcome(losses: Sequence[float], diverged: bool = False) -> str:
    """A run's outcome from its training losses in step order (the study's definition):
    "diverged" — `diverged` (the loss became non-finite and training stopped), a non-finite loss, or a mean over
    the last 10% of the losses above the first one; "stalled" — less than STALL_NATS of progress from the best of
    the first 20% to that tail mean; else "trains"."""
    if diverged or not losses:
        return "diverged"
    tail = losses[-max(1, len(losses) // 10):]
    end = sum(tail) / len(tail)
    if not all(math.isfinite(x) for x in losses) or end > losses[0]:
        return "diverged"
    early = min(losses[: max(1, len(losses) // 5)])
    return "stalled" if early - end < STALL_NATS else "trains"


def lr_sensitivity(final_by_lr: Mapping[float, float], initial_loss: float) -> float:
    """Wortsman et al. 2023's learning-rate sensitivity of one configuration: the mean over the LR grid of
    min(final loss, initial loss) − the best final loss. A diverged run (non-finite loss) counts as the loss at
    initialization — no better than not training — so a configuration that diverges over much of the grid is
    sensitive, and one whose loss is flat across the grid scores 0."""
    if not final_by_lr:
        raise ValueError("lr_sensitivity needs at least one learning rate")
    capped = [capped_loss(x, initial_loss) for x in final_by_lr.values()]
    return statistics.fmean(capped) - min(capped)


def capped_loss(loss: float, initial_loss: float) -> float:
    """A final loss as LR sensitivity counts it: no worse than the loss at initialization, which is also what a
    diverged run (a non-finite loss) counts as."""
    return min(loss, initial_loss) if math.isfinite(loss) else initial_loss


def verdict(est: Estimate, kind: str, threshold: float = 0.0, tolerance: float = 0.0) -> str:
    """A claim's threshold test: PASS / FAIL / INCONCLUSIVE of `est` against `threshold` under `kind`.
    - `greater` (the claim: statistic > threshold): PASS when the whole interval lies above it, FAIL when the whole
      interval lies below it, INCONCLUSIVE when the interval contains it;
    - `less`: the mirror image;
    - `equivalent` (the claim: |statistic| < margin): PASS when the interval lies inside (−margin, margin), FAIL when
      it lies wholly outside, INCONCLUSIVE otherwise;
    - `exact`: a deterministic quantity (one sample, no noise), PASS when |value − threshold| ≤ tolerance.
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

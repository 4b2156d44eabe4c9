"""Seed statistics for every verdict normlab gives — the study's claims and a sweep's cells — in one place.

Every number a verdict uses is a sample over seeds:
- `estimate(xs)`: mean, sd and a t-interval of one statistic;
- `paired_difference(a, b)`: the mean of the per-seed differences a_i − b_i with its t-interval — for arms that
  share a seed (same initialization, same batches), where the seed's own effect cancels;
- `difference(a, b)`: the Welch interval of mean(a) − mean(b), for arms that share nothing.

An `Estimate` carries its samples, standard error and degrees of freedom, so it gives its interval at any level,
the p-values of the t-tests below and of their distribution-free twins (`sign_flip_p`: the exact sign-flip
permutation test of the per-seed differences). A comparison against a practical-significance margin m (the
smallest effect of interest, fixed before any run) has four outcomes:

- EQUIVALENT — the difference is inside ±m (two one-sided tests: both `d > −m` and `d < m` rejected at α/2 each,
  i.e. for a single comparison the (1−α) interval lies inside (−m, m)): a measured null;
- BETTER / WORSE — otherwise, when "no difference" is rejected at α (the (1−α) interval excludes 0), by the sign
  of the difference and which direction is better;
- INCONCLUSIVE — neither: the difference is within its noise.

Multiplicity: `judge_family` adjusts each family of p-values with Holm's step-down procedure, so within one
family the chance of any false BETTER/WORSE (or any false EQUIVALENT) stays ≤ α. A family is one question — a
study claim's primaries, a sweep's compared cells — never everything a command happened to run, so a verdict
does not depend on what else was run. Across families (a study's claims) `benjamini_hochberg` gives q-values that
bound the expected share of false findings on a scorecard. Power and the minimum detectable effect are given at
the level the family's smallest p must beat (α/k).

A run that diverged is an outcome, not a number: it counts as worse than any run that trained. A comparison
with seeds where only one arm diverged is decided by the exact sign-flip test of the signed ranks of every
seed's difference (diverged = worst), so agreeing evidence from both kinds of seed adds up; the t-interval over
the seeds where both trained is shown beside it. A run's outcome (trains / stalled / diverged) is
`training_outcome` of its losses. The learning-rate statistics (`initial_loss_cap`, `lr_sensitivity`,
`best_index`, `crossfit_best`, `best_lr_bootstrap`) are defined here once for the study and the sweeps.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import integrate
from scipy import stats as _scipy

BETTER, WORSE, EQUIVALENT, INCONCLUSIVE = "BETTER", "WORSE", "EQUIVALENT", "INCONCLUSIVE"
COMPARISONS = (BETTER, WORSE, EQUIVALENT, INCONCLUSIVE)
PASS, FAIL = "PASS", "FAIL"  # a study claim's verdict names (training/study/judge.py); INCONCLUSIVE as above
ALPHA = 0.05
P_KEYS = ("difference", "equivalence", "difference_perm", "equivalence_perm")  # a comparison's p-values
EXACT_FLIPS = 20  # up to this many seeds every sign pattern is enumerated; beyond, a fixed sample of them
SAMPLED_FLIPS = 1 << 16


@dataclass(frozen=True)
class Estimate:
    """A mean (or a difference of means) over `n` seeds: its sd (of the samples; for a Welch difference, the
    standard error), its standard error `se` with `df` degrees of freedom, and the interval [lo, hi] at
    `confidence`. One sample: sd = se = 0, df = 0, lo = hi = mean (no noise estimate: no test can reject).
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


def benjamini_hochberg(p_values: Sequence[float]) -> list[float]:
    """Benjamini–Hochberg q-values (step-up, 1995), in the input order: the i-th smallest of k times k / i, made
    monotone from the largest down and capped at 1; rejecting every q ≤ α keeps the expected share of false
    rejections ≤ α for independent tests. NaN entries stay NaN and do not count towards k."""
    indexed = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    k = len(indexed)
    out = [math.nan] * len(p_values)
    running = 1.0
    for rank in range(k - 1, -1, -1):
        p, i = indexed[rank]
        running = min(running, k * p / (rank + 1))
        out[i] = running
    return out


def _flip_sums(values: np.ndarray) -> np.ndarray:
    """Σ s_i·v_i over every sign pattern s (n ≤ EXACT_FLIPS), else over SAMPLED_FLIPS fixed random ones plus the
    observed pattern."""
    if len(values) <= EXACT_FLIPS:
        sums = np.zeros(1)
        for v in values:  # each value doubles the list: the sums with +v and with −v
            sums = np.concatenate([sums + v, sums - v])
        return sums
    signs = np.random.default_rng(0).choice([-1.0, 1.0], size=(SAMPLED_FLIPS, len(values)))
    return np.concatenate([signs @ values, [values.sum()]])


def sign_flip_p(values: Sequence[float], alternative: str = "two-sided", ranks: bool = False) -> float:
    """The sign-flip permutation p of per-seed differences (Fisher's exact test for paired data): under the
    null each difference is as likely to have either sign (symmetric about 0), so the observed sum is compared
    with its value under all 2^n sign patterns — exact, no normality assumed; with n seeds the smallest
    two-sided p is 2/2^n. `ranks`: the signed ranks of |difference| instead of the values (Wilcoxon's
    statistic, exact, ties at mid-ranks, zeros dropped), which admits ±inf (a diverged run: worse than any
    number). `alternative`: "two-sided", "greater" (the differences exceed 0) or "less". NaN entries are
    dropped (no information); without ranks an infinite value gives NaN."""
    xs = np.asarray([float(v) for v in values if not math.isnan(v)])
    if ranks:
        xs = xs[xs != 0]
        xs = np.sign(xs) * _scipy.rankdata(np.abs(xs))
    elif not np.isfinite(xs).all():
        return math.nan
    if len(xs) == 0:
        return math.nan
    sums, observed = _flip_sums(xs), float(xs.sum())
    tol = 1e-9 * max(1.0, float(np.abs(xs).sum()))  # float sums of equal patterns differ in the last bits
    if alternative == "two-sided":
        return float(np.mean(np.abs(sums) >= abs(observed) - tol))
    if alternative == "greater":
        return float(np.mean(sums >= observed - tol))
    if alternative == "less":
        return float(np.mean(sums <= observed + tol))
    raise ValueError(f"alternative={alternative!r} must be 'two-sided', 'greater' or 'less'")


def _perm_equivalent(xs: Sequence[float], margin: float) -> float:
    """The sign-flip twin of `Estimate.p_equivalent`: twice the larger of the one-sided tests of d + m > 0 and
    d − m < 0."""
    return min(1.0, 2 * max(sign_flip_p([x + margin for x in xs], "greater"),
                            sign_flip_p([x - margin for x in xs], "less")))


def _perm_exceeds(xs: Sequence[float], margin: float) -> float:
    """The sign-flip twin of `Estimate.p_exceeds`: twice the smaller of the tests of d − m > 0 and d + m < 0."""
    return min(1.0, 2 * min(sign_flip_p([x - margin for x in xs], "greater"),
                            sign_flip_p([x + margin for x in xs], "less")))


def with_divergences(d: Estimate, discordant: tuple[int, int]) -> list[float]:
    """The per-seed differences of a paired comparison, a seed where only the candidate diverged as +inf and
    one where only the baseline diverged as −inf (in loss orientation: a diverged run is the larger loss)."""
    return [*d.samples, *[math.inf] * discordant[0], *[-math.inf] * discordant[1]]


def p_values(d: Estimate, margin: float | None, discordant: tuple[int, int] = (0, 0),
             equivalence_claim: bool = False) -> tuple[dict[str, float], float]:
    """The raw p-values of one comparison (`P_KEYS`) and the sign of its effect.

    Without a seed that diverged in one arm only: "difference", the t-test of 0 (for an equivalence claim,
    `p_exceeds`: |d| > margin); "equivalence", TOST within ±margin; and their sign-flip twins. With such seeds:
    "difference" is the exact sign-flip test of the signed ranks over every seed (diverged = worst:
    `with_divergences`), its twin the same, and no equivalence (one arm diverged where the other did not)."""
    nan = math.nan
    if sum(discordant):
        values = with_divergences(d, discordant)
        ranked = [v for v in values if v != 0]
        direction = float(np.sum(np.sign(ranked) * _scipy.rankdata(np.abs(ranked)))) if ranked else 0.0
        p = sign_flip_p(values, ranks=True)
        return {"difference": p, "equivalence": nan, "difference_perm": p, "equivalence_perm": nan}, direction
    xs, m = d.samples, margin
    perm = bool(xs) and len(xs) == d.n
    p = {"difference": d.p_exceeds(m) if equivalence_claim and m else d.p_value(),
         "equivalence": d.p_equivalent(m) if m else nan,
         "difference_perm": (_perm_exceeds(xs, m) if equivalence_claim and m else sign_flip_p(xs)) if perm else nan,
         "equivalence_perm": _perm_equivalent(xs, m) if m and perm else nan}
    return p, d.mean


def comparison_verdict(direction: float, p_diff: float, p_equiv: float, better: str, alpha: float = ALPHA) -> str:
    """The verdict of one comparison from its (adjusted) p-values: EQUIVALENT when "equivalence" rejects, else
    BETTER / WORSE by the sign of `direction` when "difference" rejects, else INCONCLUSIVE (NaN never rejects)."""
    if p_equiv < alpha:
        return EQUIVALENT
    if p_diff < alpha and direction != 0:
        return BETTER if (direction < 0) == (better == "lower") else WORSE
    return INCONCLUSIVE


@dataclass(frozen=True)
class Judgement:
    """One comparison of a family: the difference (candidate − baseline, over the seeds where both have a
    number), the seeds that diverged in the candidate only / the baseline only, its p-values raw and after
    Holm's adjustment across the family (`P_KEYS`), the verdict and the same rule on the sign-flip p-values
    (`verdict_perm`), and the power and minimum detectable effect at `level` = α/k, the level the family's
    smallest p must beat."""

    difference: Estimate
    margin: float | None
    p: dict[str, float]
    p_adjusted: dict[str, float]
    verdict: str
    verdict_perm: str
    direction: float
    discordant: tuple[int, int] = (0, 0)
    level: float = ALPHA
    power: float = math.nan  # at a true effect of one margin (equivalence claim: at a true difference of 0)
    mde: float = math.nan  # the smallest effect detected with 80% power at `level`

    @property
    def disagree(self) -> bool:
        """The t-test and its distribution-free twin give different verdicts (flag it: normality decided)."""
        return not math.isnan(self.p["difference_perm"]) and self.verdict != self.verdict_perm


def judge_family(differences: Mapping[str, Estimate], margin: float | None | Mapping[str, float | None],
                 better: str = "lower", alpha: float = ALPHA, discordant: Mapping[str, tuple[int, int]] | None = None,
                 equivalence_claim: bool | Mapping[str, bool] = False) -> dict[str, Judgement]:
    """The four-way verdict of each difference (candidate − baseline) of one family against ±`margin`, each
    p-value Holm-adjusted across the family (`P_KEYS` separately). `better`: "lower" (a loss) or "higher" (an
    accuracy). `margin` None: no equivalence test. `discordant`: per comparison, (seeds whose run diverged in
    the candidate only, in the baseline only) — see `p_values`. `equivalence_claim`: the question is whether
    the arms are the same (the "difference" p tests |d| > margin; power is the equivalence test's). `margin`
    and `equivalence_claim` may be given per comparison (a mapping by name)."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better={better!r} must be 'lower' or 'higher'")
    names = list(differences)
    margins = {n: margin.get(n) if isinstance(margin, Mapping) else margin for n in names}
    same = {n: bool(equivalence_claim.get(n)) if isinstance(equivalence_claim, Mapping) else equivalence_claim
            for n in names}
    for m in margins.values():
        if m is not None and not m > 0:
            raise ValueError(f"margin={m!r} must be > 0 (the smallest difference that matters)")
    counts = {n: (discordant or {}).get(n, (0, 0)) for n in names}
    raw = {n: p_values(differences[n], margins[n], counts[n], same[n]) for n in names}
    adjusted = {n: {} for n in names}
    for key in P_KEYS:
        for name, q in zip(names, holm([raw[n][0][key] for n in names]), strict=True):
            adjusted[name][key] = q
    level = alpha / max(1, sum(not math.isnan(raw[n][0]["difference"]) for n in names))
    out = {}
    for n in names:
        d, (p, direction), q = differences[n], raw[n], adjusted[n]
        power = power_at(d, margins[n], level, same[n]) if margins[n] else math.nan
        out[n] = Judgement(d, margins[n], p, q, comparison_verdict(direction, q["difference"], q["equivalence"], better,
                                                               alpha),
                           comparison_verdict(direction, q["difference_perm"], q["equivalence_perm"], better, alpha),
                           direction, counts[n], level, power, min_detectable(d, level))
    return out


def judge(difference_: Estimate, margin: float | None, better: str = "lower", alpha: float = ALPHA,
          discordant: tuple[int, int] = (0, 0), equivalence_claim: bool = False) -> Judgement:
    """`judge_family` of a single comparison: EQUIVALENT exactly when the (1−α) interval is inside ±margin,
    BETTER/WORSE when it excludes 0."""
    return judge_family({"_": difference_}, margin, better, alpha, {"_": discordant}, equivalence_claim)["_"]


def no_estimate(n: int = 0) -> Estimate:
    """The estimate of nothing (no seed with a number on both sides): NaN, which no test can judge."""
    return Estimate(math.nan, math.nan, n, math.nan, math.nan, math.nan, 0.0)


STALL_NATS = 0.1  # progress over the last 80% of steps below which a run "stalled"


def training_outcome(losses: Sequence[float], diverged: bool = False, final_loss: float | None = None) -> str:
    """A run's outcome from its training losses in step order, the first one at initialization (the study's
    and the sweeps' one definition):
    "diverged" — `diverged` (the loss became non-finite and training stopped), a non-finite loss, a mean over
    the last 10% of the losses above the first one, or a held-out `final_loss` (when the metric is a loss)
    above the first one — no better than not training; "stalled" — less than STALL_NATS of progress from the
    best of the first 20% to that tail mean; else "trains"."""
    if diverged or not losses:
        return "diverged"
    tail = losses[-max(1, len(losses) // 10):]
    end = sum(tail) / len(tail)
    if not all(math.isfinite(x) for x in losses) or end > losses[0]:
        return "diverged"
    if final_loss is not None and final_loss > losses[0]:
        return "diverged"
    early = min(losses[: max(1, len(losses) // 5)])
    return "stalled" if early - end < STALL_NATS else "trains"


def initial_loss_cap(initial_losses: Sequence[float]) -> float:
    """The loss a diverged run counts as in the learning-rate statistics: the loss at initialization (step 0,
    before any update) — no better than not training. Given the step-0 losses of the runs compared at one seed
    (the same weights and first batch at every LR, so equal up to nondeterminism), their median; +inf when
    none is known."""
    finite = [x for x in initial_losses if math.isfinite(x)]
    return statistics.median(finite) if finite else math.inf


def capped_loss(loss: float, cap: float) -> float:
    """A final loss as the learning-rate statistics count it: no worse than `cap` (`initial_loss_cap`), which is
    also what a diverged run (a non-finite loss) counts as."""
    return min(loss, cap) if math.isfinite(loss) else cap


def lr_sensitivity(final_by_lr: Mapping[float, float], cap: float) -> float:
    """Wortsman et al. 2023's learning-rate sensitivity of one configuration at one seed: the mean over the LR
    grid of the capped final loss (`capped_loss`) minus the best of them. A configuration that diverges over
    much of the grid is sensitive; one whose loss is flat across the grid scores 0."""
    if not final_by_lr:
        raise ValueError("lr_sensitivity needs at least one learning rate")
    capped = [capped_loss(x, cap) for x in final_by_lr.values()]
    return statistics.fmean(capped) - min(capped)


def best_index(scores: Sequence[float], mode: str = "min") -> int:
    """The best learning rate of a grid: the index of the lowest (mode "min") or highest ("max") score, each
    score the mean over seeds of the capped final metric; NaN scores are skipped, ties go to the first."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode={mode!r} must be 'min' or 'max'")
    valid = [i for i, x in enumerate(scores) if not math.isnan(x)]
    if not valid:
        raise ValueError("best_index needs at least one score that is a number")
    sign = 1.0 if mode == "min" else -1.0
    return min(valid, key=lambda i: sign * scores[i])


def crossfit_best(per_lr: Sequence[Sequence[float]], mode: str = "min") -> list[float]:
    """Per seed, the capped final metric at the best learning rate chosen on the *other* seeds (leave one seed
    out): the value at "its own best LR" without the optimism of choosing the LR on the same runs it is read
    from. `per_lr` [LR][seed]; one seed alone keeps its own choice."""
    values = np.asarray(per_lr, dtype=float)
    n = values.shape[1]
    out = []
    for s in range(n):
        others = values[:, [i for i in range(n) if i != s]] if n > 1 else values
        out.append(float(values[best_index(list(others.mean(axis=1)), mode), s]))
    return out


def best_lr_bootstrap(per_lr_a: Sequence[Sequence[float]], per_lr_b: Sequence[Sequence[float]],
                      mode: str = "min", confidence: float = 0.95, resamples: int = 4000,
                      seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of "a at its best LR − b at its best LR" over paired seeds (`per_lr_*`
    [LR][seed], the same seeds), the best LR chosen again in every resample — so the interval carries the
    uncertainty of the choice itself."""
    a, b = np.asarray(per_lr_a, dtype=float), np.asarray(per_lr_b, dtype=float)
    n = a.shape[1]
    draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    pick = np.argmin if mode == "min" else np.argmax
    best = [x[:, draws] for x in (a, b)]  # [LR, resample, seed]
    diff = [np.take_along_axis(m.mean(axis=2), pick(m.mean(axis=2), axis=0)[None], axis=0)[0] for m in best]
    lo, hi = np.quantile(diff[0] - diff[1], [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(lo), float(hi)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx

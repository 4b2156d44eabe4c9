"""Verdicts: the tests of an `Estimate` against 0 and against a margin (t-tests and their exact sign-flip twins),
the four outcomes BETTER / WORSE / EQUIVALENT / INCONCLUSIVE, Holm's correction within a family
(`judge_family`) and Benjamini–Hochberg q-values across families (a scorecard); see the package docstring."""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as _scipy

from training.stats.counts import p_rate_difference, p_rate_equivalent
from training.stats.estimates import ALPHA, Estimate
from training.stats.power import min_detectable, power_at

BETTER, WORSE, EQUIVALENT, INCONCLUSIVE = "BETTER", "WORSE", "EQUIVALENT", "INCONCLUSIVE"
COMPARISONS = (BETTER, WORSE, EQUIVALENT, INCONCLUSIVE)
PASS, FAIL = "PASS", "FAIL"  # a study claim's verdict names (training/study/judge.py); INCONCLUSIVE as above
# a study test whose arm never leaves the unigram plateau: its statistic measures the plateau, not the claim
AT_PLATEAU = "AT PLATEAU"
P_KEYS = ("difference", "equivalence", "difference_perm", "equivalence_perm")  # a comparison's p-values
EXACT_FLIPS = 20  # up to this many seeds every sign pattern is enumerated; beyond, a fixed sample of them
SAMPLED_FLIPS = 1 << 16


def exact_can_reject(n: int, level: float) -> bool:
    """Whether an exact sign-flip test of n paired seeds can give p < `level`: its smallest two-sided p is 2/2ⁿ
    (every seed pointing one way), so at α = 0.05 it takes 6 seeds, and 7 for a family of two (α/2)."""
    return n >= 1 and 2.0 / 2.0 ** n < level


def seeds_for_exact(level: float) -> int:
    """The fewest seeds with which the exact sign-flip test can reject at `level` (`exact_can_reject`)."""
    return next(n for n in range(1, 64) if exact_can_reject(n, level))


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


def perm_equivalent(xs: Sequence[float], margin: float) -> float:
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


def signed_rank_sum(values: Sequence[float]) -> float:
    """Wilcoxon's signed-rank sum of per-seed differences (zeros dropped; ±inf rank beyond every number): the
    direction of a comparison decided on ranks."""
    ranked = [v for v in values if v != 0]
    return float(np.sum(np.sign(ranked) * _scipy.rankdata(np.abs(ranked)))) if ranked else 0.0


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
        direction = signed_rank_sum(values)
        p = sign_flip_p(values, ranks=True)
        return {"difference": p, "equivalence": nan, "difference_perm": p, "equivalence_perm": nan}, direction
    xs, m = d.samples, margin
    perm = bool(xs) and len(xs) == d.n
    p = {"difference": d.p_exceeds(m) if equivalence_claim and m else d.p_value(),
         "equivalence": d.p_equivalent(m) if m else nan,
         "difference_perm": (_perm_exceeds(xs, m) if equivalence_claim and m else sign_flip_p(xs)) if perm else nan,
         "equivalence_perm": perm_equivalent(xs, m) if m and perm else nan}
    return p, d.mean


def count_p_values(mine: Sequence[float], base: Sequence[float], margin: float | None,
                   discordant: tuple[int, int] = (0, 0)) -> tuple[dict[str, float], float]:
    """The raw p-values (`P_KEYS`) and direction of paired counts (per seed: the candidate's, the baseline's),
    judged by exact tests alone, never a t-test. Each p is the larger of two exact tests, so both must reject:
    the paired sign-flip test of the per-seed differences (robust to seeds that differ in rate) and the Poisson
    test on the totals (training/stats/counts.py, which does not mistake counts that are equal at every seed for
    certainty); the "_perm" keys hold the same values. With seeds that diverged in one arm only (left out of the
    counts): the signed-rank sign-flip test over every seed, as for any metric, and no equivalence. Where both
    arms counted nothing at every seed there is nothing to test (NaN: no verdict)."""
    xs = [float(a) - float(b) for a, b in zip(mine, base, strict=True)]
    if sum(discordant):
        values = [*xs, *[math.inf] * discordant[0], *[-math.inf] * discordant[1]]  # as `with_divergences`
        p, e, direction = sign_flip_p(values, ranks=True), math.nan, signed_rank_sum(values)
    elif not any(mine) and not any(base):
        p, e, direction = math.nan, math.nan, 0.0  # nothing happened in either arm
    else:
        ta, tb = float(sum(mine)), float(sum(base))
        p = max(sign_flip_p(xs), p_rate_difference(ta, tb))
        e = max(perm_equivalent(xs, margin), p_rate_equivalent(ta, tb, len(xs), margin)) if margin else math.nan
        direction = sum(xs)
    return {"difference": p, "equivalence": e, "difference_perm": p, "equivalence_perm": e}, direction


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
    exact_only: bool = False  # judged by the exact test alone (a count): `verdict` is `verdict_perm`

    @property
    def seeds(self) -> int:
        """The seeds the exact test sees: those with a difference, and those where one arm alone diverged."""
        return self.difference.n + sum(self.discordant)

    @property
    def exact_can_decide(self) -> bool:
        """Whether the exact sign-flip test can reject at all with these seeds, at the level its family's smallest
        p must beat (`exact_can_reject`). When it cannot, a verdict would rest on the t-test's normal tails alone."""
        return exact_can_reject(self.seeds, self.level)

    @property
    def disagree(self) -> bool:
        """The t-test and its distribution-free twin give different verdicts (flag it: normality decided)."""
        return not math.isnan(self.p["difference_perm"]) and self.verdict != self.verdict_perm


def judge_family(differences: Mapping[str, Estimate], margin: float | None | Mapping[str, float | None],
                 better: str = "lower", alpha: float = ALPHA, discordant: Mapping[str, tuple[int, int]] | None = None,
                 equivalence_claim: bool | Mapping[str, bool] = False,
                 counts: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None) -> dict[str, Judgement]:
    """The four-way verdict of each difference (candidate − baseline) of one family against ±`margin`, each
    p-value Holm-adjusted across the family (`P_KEYS` separately). `better`: "lower" (a loss) or "higher" (an
    accuracy). `margin` None: no equivalence test. `discordant`: per comparison, (seeds whose run diverged in
    the candidate only, in the baseline only) — see `p_values`. `equivalence_claim`: the question is whether
    the arms are the same (the "difference" p tests |d| > margin; power is the equivalence test's). `margin`
    and `equivalence_claim` may be given per comparison (a mapping by name). `counts`: the comparisons whose
    statistic is a count, by name (the candidate's and the baseline's per-seed counts): judged by exact tests
    alone (`count_p_values`), in the same Holm family as the rest."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better={better!r} must be 'lower' or 'higher'")
    names = list(differences)
    margins = {n: margin.get(n) if isinstance(margin, Mapping) else margin for n in names}
    same = {n: bool(equivalence_claim.get(n)) if isinstance(equivalence_claim, Mapping) else equivalence_claim
            for n in names}
    for m in margins.values():
        if m is not None and not m > 0:
            raise ValueError(f"margin={m!r} must be > 0 (the smallest difference that matters)")
    counts_d = {n: (discordant or {}).get(n, (0, 0)) for n in names}
    counted = counts or {}
    raw = {n: count_p_values(*counted[n], margins[n], counts_d[n]) if n in counted else
           p_values(differences[n], margins[n], counts_d[n], same[n]) for n in names}

    def planning(n: str, level: float) -> tuple[float, float]:
        d = differences[n]
        return (power_at(d, margins[n], level, same[n]) if margins[n] else math.nan), min_detectable(d, level)

    return assemble(differences, margins, raw, better, alpha, counts_d, planning, set(counted))


def assemble(estimates: Mapping[str, Estimate], margins: Mapping[str, float | None],
             raw: Mapping[str, tuple[dict[str, float], float]], better: str, alpha: float = ALPHA,
             discordant: Mapping[str, tuple[int, int]] | None = None,
             planning: Callable[[str, float], tuple[float, float]] | None = None,
             exact_only: bool | Collection[str] = False) -> dict[str, Judgement]:
    """The family's Judgements from each comparison's raw p-values (`P_KEYS`) and direction: every key
    Holm-adjusted across the family, the verdicts of the t-tests and of their sign-flip twins (`exact_only`, for
    every comparison or the named ones: the exact test's verdict is the verdict), and `planning(name, level)` →
    (power, MDE) at level α/k."""
    names = list(estimates)
    adjusted: dict[str, dict[str, float]] = {n: {} for n in names}
    for key in P_KEYS:
        for name, q in zip(names, holm([raw[n][0][key] for n in names]), strict=True):
            adjusted[name][key] = q
    level = alpha / max(1, sum(not math.isnan(raw[n][0]["difference"]) for n in names))
    out = {}
    for n in names:
        (p, direction), q = raw[n], adjusted[n]
        perm = comparison_verdict(direction, q["difference_perm"], q["equivalence_perm"], better, alpha)
        exact = exact_only if isinstance(exact_only, bool) else n in exact_only
        verdict = perm if exact else comparison_verdict(direction, q["difference"], q["equivalence"], better,
                                                             alpha)
        power, mde = planning(n, level) if planning is not None else (math.nan, math.nan)
        out[n] = Judgement(estimates[n], margins[n], p, q, verdict, perm, direction,
                           (discordant or {}).get(n, (0, 0)), level, power, mde, exact)
    return out


def judge(difference_: Estimate, margin: float | None, better: str = "lower", alpha: float = ALPHA,
          discordant: tuple[int, int] = (0, 0), equivalence_claim: bool = False) -> Judgement:
    """`judge_family` of a single comparison: EQUIVALENT exactly when the (1−α) interval is inside ±margin,
    BETTER/WORSE when it excludes 0."""
    return judge_family({"_": difference_}, margin, better, alpha, {"_": discordant}, equivalence_claim)["_"]

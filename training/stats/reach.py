"""Learning-rate reach: how wide the range of learning rates is over which a configuration trains about as well as
at its best — a summary of an LR sweep that does not depend on how far the grid extends beyond it (LR
sensitivity, Wortsman et al. 2023, averages over the whole grid and does).

Definition (`lr_reach`). On the seed-mean curve m(η) of a configuration's final metric over its LR grid (a
diverged run counted as its seed's cap, as everywhere in the LR statistics), with x = log₁₀ η: the best LR η*,
and the contiguous range of x around it where m stays within δ of m(η*) (below m* + δ for a loss, above m* − δ
for an accuracy), each end placed where the curve, linear in x between grid points, crosses m* ± δ. The reach is
that range's width in decades of LR. The curve is the mean over seeds, never a per-seed curve: a per-seed best
is biased low by the seed's noise, so a noisier configuration would look flatter (the
per-seed-minimum bias); the mean curve's noise is √n smaller, and the comparison's intervals carry what is left.
A range that reaches an end of the grid is open there: the reach is "at least" its width (`Reach.at_least`) —
always so when the best LR is itself at an end (`Reach.unbracketed`).

Comparison (`compare_reach`), two configurations on the same seeds (each seed's runs share initialization and
batches across the configurations): the difference of the two reaches from the seed-mean curves, with
- its standard error by the jackknife over seeds (leave one seed out of both arms, recompute both mean curves
  and reaches) and a t-interval on n − 1 degrees of freedom: the "t" test;
- an exact paired permutation test: under "no difference" the two configurations' runs at a seed are
  exchangeable, so the reference distribution is the difference recomputed with the arms swapped at every
  subset of seeds (all 2ⁿ up to 12 seeds, else 4096 random subsets and the observed one) — the sign-flip test's
  twin for a statistic that is not a mean of per-seed values;
- a paired percentile bootstrap interval (seeds resampled with replacement, both arms together), shown beside
  the t-interval and used for the distribution-free equivalence test (both one-sided bootstrap tails beyond
  ±margin).
A comparison where either reach is open ("at least") has no verdict: a lower bound cannot be subtracted.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from training.stats.estimates import ALPHA, Estimate, no_estimate, t_quantile
from training.stats.lr import MODES, best_index, crossfit_indices
from training.stats.verdicts import Judgement, assemble

EXACT_SWAPS = 12  # up to this many seeds every subset of swapped seeds is enumerated
SAMPLED_SWAPS = 4096


@dataclass(frozen=True)
class Reach:
    """The reach of one mean curve: `width` in decades of LR, from log₁₀ LR `low` to `high`; `open_low` /
    `open_high`: the range runs to that end of the grid (the true end may lie beyond)."""

    width: float
    low: float
    high: float
    best_lr: float
    open_low: bool
    open_high: bool
    unbracketed: bool

    @property
    def at_least(self) -> bool:
        return self.open_low or self.open_high

    def __str__(self) -> str:
        where = f"10^{self.low:.2f} to 10^{self.high:.2f}"
        return f"{'≥ ' if self.at_least else ''}{self.width:.3f} ({where})"


def _crossing(x0: float, y0: float, x1: float, y1: float, level: float) -> float:
    """Where the line through (x0, y0), (x1, y1) reaches `level` (y0 inside, y1 outside; y1 may be infinite)."""
    return x0 if not math.isfinite(y1) else x0 + (level - y0) / (y1 - y0) * (x1 - x0)


def lr_reach(lrs: Sequence[float], scores: Sequence[float], delta: float, mode: str = "min",
             at: int | None = None) -> Reach:
    """The reach of the curve `scores` (the seed-mean final metric per LR, `lrs` ascending) within `delta` of its
    best (module docstring). `at`: the index of the LR the range is centred on and whose score is the reference
    (one seed's curve read at the LR chosen on the other seeds: `crossfit_reaches`); default the curve's own
    best."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be 'min' or 'max'")
    if not delta > 0:
        raise ValueError(f"the reach's delta={delta!r} must be > 0 (in the metric's units)")
    if len(lrs) != len(scores) or not lrs or any(b <= a for a, b in itertools.pairwise(lrs)) or min(lrs) <= 0:
        raise ValueError("lr_reach needs positive LRs in ascending order, one score each")
    x, y = [math.log10(lr) for lr in lrs], [float(v) for v in scores]
    ib = best_index(y, mode) if at is None else at
    level = y[ib] + delta if mode == "min" else y[ib] - delta

    def inside(v: float) -> bool:
        return v <= level if mode == "min" else v >= level

    ends = []
    for step in (1, -1):  # walk away from the best LR until the curve leaves the band
        i = ib
        while 0 <= i + step < len(x) and inside(y[i + step]):
            i += step
        j = i + step
        ends.append((x[i], True) if not 0 <= j < len(x) else (_crossing(x[i], y[i], x[j], y[j], level), False))
    (high, open_high), (low, open_low) = ends
    return Reach(high - low, low, high, lrs[ib], open_low, open_high, ib in (0, len(lrs) - 1) and len(lrs) > 1)


def crossfit_reaches(lrs: Sequence[float], per_lr: Sequence[Sequence[float]], delta: float,
                     mode: str = "min") -> list[Reach]:
    """Per seed, the reach of the seed's own curve (`per_lr` [LR][seed], `lrs` ascending) around the LR that is
    best on the *other* seeds' mean curve (`crossfit_indices`), within `delta` of the seed's value there: one
    paired value per seed for a per-seed statistic. The reference is read at an LR chosen without the seed's
    runs, so it is not a minimum of the seed's noise (which would sit below its mean and narrow a noisier
    configuration's reach); the seed-mean curve's best would depend on the seed's own runs in the same way."""
    return [lr_reach(lrs, [float(row[s]) for row in per_lr], delta, mode, at)
            for s, at in enumerate(crossfit_indices(per_lr, mode))]


def _width(lrs: Sequence[float], grid: np.ndarray, delta: float, mode: str) -> float:
    """The reach of the mean over the columns (seeds) of `grid` [LR][seed]."""
    return lr_reach(lrs, list(grid.mean(axis=1)), delta, mode).width


def reach_interval(lrs: Sequence[float], per_lr: Sequence[Sequence[float]], delta: float, mode: str = "min",
                   confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of one configuration's reach: seeds resampled with replacement, the mean
    curve and its reach recomputed each time (`per_lr` [LR][seed]); NaN with fewer than two seeds."""
    grid = np.asarray(per_lr, dtype=float)
    if grid.ndim != 2 or grid.shape[1] < 2:
        return math.nan, math.nan
    draws = [_width(lrs, grid[:, i], delta, mode)
             for i in np.random.default_rng(seed).integers(0, grid.shape[1], size=(resamples, grid.shape[1]))]
    lo, hi = np.quantile(draws, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(lo), float(hi)


@dataclass(frozen=True)
class ReachComparison:
    """Configuration a against b (same seeds): the difference of their reaches (`estimate`: plug-in mean, jackknife
    standard error, t-interval), the bootstrap draws' percentile interval, the exact permutation p, and each
    configuration's own reach."""

    estimate: Estimate
    bootstrap: tuple[float, float]
    p_permutation: float
    reach_a: Reach
    reach_b: Reach
    draws: tuple[float, ...] = ()  # the bootstrap differences, for the equivalence test

    @property
    def censored(self) -> bool:
        """Either reach is a lower bound ("at least"): no verdict."""
        return self.reach_a.at_least or self.reach_b.at_least

    def p_equivalent_bootstrap(self, margin: float) -> float:
        """The bootstrap twin of TOST: twice the larger share of draws beyond −margin and beyond +margin."""
        if not self.draws:
            return math.nan
        d = np.asarray(self.draws)
        return float(min(1.0, 2 * max(np.mean(d <= -abs(margin)), np.mean(d >= abs(margin)))))


def compare_reach(lrs: Sequence[float], per_lr_a: Sequence[Sequence[float]], per_lr_b: Sequence[Sequence[float]],
                  delta: float, mode: str = "min", confidence: float = 0.95, resamples: int = 2000,
                  seed: int = 0) -> ReachComparison:
    """The reach of configuration a minus that of b, both on the LR grid `lrs` (ascending) and the same seeds in
    the same column order (`per_lr_*` [LR][seed], capped final metrics): the module docstring's tests."""
    a, b = np.asarray(per_lr_a, dtype=float), np.asarray(per_lr_b, dtype=float)
    if a.shape != b.shape or a.shape[0] != len(lrs):
        raise ValueError(f"compare_reach needs both arms on the same {len(lrs)} LRs and seeds, got {a.shape} and "
                         f"{b.shape}")
    n = a.shape[1]
    reach_a, reach_b = (lr_reach(lrs, list(g.mean(axis=1)), delta, mode) for g in (a, b))
    d = reach_a.width - reach_b.width
    if n < 2:
        return ReachComparison(no_estimate(n), (math.nan, math.nan), math.nan, reach_a, reach_b)
    loo = np.array([_width(lrs, np.delete(a, s, 1), delta, mode) - _width(lrs, np.delete(b, s, 1), delta, mode)
                    for s in range(n)])
    se = math.sqrt((n - 1) / n * float(np.sum((loo - loo.mean()) ** 2)))
    half = t_quantile(0.5 + confidence / 2, n - 1) * se if se > 0 else 0.0
    est = Estimate(d, se * math.sqrt(n), n, d - half, d + half, se, n - 1, confidence)
    rng = np.random.default_rng(seed)
    draws = [_width(lrs, a[:, i], delta, mode) - _width(lrs, b[:, i], delta, mode)
             for i in rng.integers(0, n, size=(resamples, n))]
    lo, hi = np.quantile(draws, [(1 - confidence) / 2, (1 + confidence) / 2])
    return ReachComparison(est, (float(lo), float(hi)), _swap_p(lrs, a, b, d, delta, mode, rng), reach_a, reach_b,
                           tuple(float(x) for x in draws))


def _swap_p(lrs: Sequence[float], a: np.ndarray, b: np.ndarray, observed: float, delta: float, mode: str,
            rng: np.random.Generator) -> float:
    """The two-sided p of the paired permutation test: the difference recomputed with the arms swapped at every
    subset of seeds (sampled beyond EXACT_SWAPS seeds, the observed assignment included)."""
    n = a.shape[1]
    if n <= EXACT_SWAPS:
        swaps = np.array(list(itertools.product((False, True), repeat=n)))
    else:
        swaps = np.vstack([rng.random((SAMPLED_SWAPS, n)) < 0.5, np.zeros((1, n), dtype=bool)])
    sums_a, sums_b = a.sum(axis=1), b.sum(axis=1)
    tol = 1e-9 * max(1.0, abs(observed))
    hits = 0
    for swap in swaps:  # swapping seed s moves its runs from one arm's mean to the other's
        moved = (b[:, swap] - a[:, swap]).sum(axis=1)
        ca, cb = (sums_a + moved) / n, (sums_b - moved) / n
        diff = lr_reach(lrs, list(ca), delta, mode).width - lr_reach(lrs, list(cb), delta, mode).width
        hits += abs(diff) >= abs(observed) - tol
    return hits / len(swaps)


def judge_reach(comparisons: Mapping[str, ReachComparison], margin: float | None,
                alpha: float = ALPHA) -> dict[str, Judgement]:
    """The verdict of each reach difference (candidate − baseline; a wider reach is better) against ±`margin`,
    Holm across the family: the jackknife t-test and TOST, with the permutation p and the bootstrap equivalence as
    their distribution-free twins. A censored comparison (either reach "at least") is not tested."""
    raw = {}
    for name, c in comparisons.items():
        e = c.estimate
        if c.censored or e.n < 2:
            p = dict.fromkeys(("difference", "equivalence", "difference_perm", "equivalence_perm"), math.nan)
        else:
            p = {"difference": e.p_value(), "equivalence": e.p_equivalent(margin) if margin else math.nan,
                 "difference_perm": c.p_permutation,
                 "equivalence_perm": c.p_equivalent_bootstrap(margin) if margin else math.nan}
        raw[name] = (p, e.mean)
    estimates = {n: c.estimate for n, c in comparisons.items()}
    return assemble(estimates, dict.fromkeys(comparisons, margin), raw, "higher", alpha)

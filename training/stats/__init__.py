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
the seeds where both trained is shown beside it. A run's outcome (trains / plateau / diverged) is
`training_outcome` of its losses and the unigram entropy of its training data (`on_plateau`). The learning-rate
statistics (`initial_loss_cap`, `lr_sensitivity` and `crossfit_sensitivity` — read at the LR the other seeds chose,
free of the per-seed-minimum bias —, `best_index`, `crossfit_best`, `best_lr_bootstrap`) are defined here once for
the study and the sweeps.

Run-level outcomes beside the final metric (outcomes.py: a metric's reduction over its logged values, loss
spikes by the guard's z-score rule, a series' peak, the exact test of paired counts) and the learning-rate reach
(reach.py: how wide the range of LRs is whose seed-mean metric lies within δ of its best, compared paired over
seeds) are defined here once too, for the sweep's report, `normlab compare` and the study.

A verdict is decisive only where both of its tests could decide: with n seeds the exact sign-flip test's smallest
p is 2/2ⁿ, so below `seeds_for_exact(α/k)` seeds (6 at α = 0.05) it can never reject, and a BETTER/WORSE
would rest on the t-test's normal tails alone (`Judgement.exact_can_decide`; the report then gives no verdict).

By topic: estimates.py (`Estimate` and the intervals), power.py (power, the minimum detectable effect, the seeds
a question needs), verdicts.py (the tests, the four outcomes, Holm and Benjamini–Hochberg), lr.py (a run's
outcome and the learning-rate statistics), outcomes.py and reach.py; every name is importable from
`training.stats`.
"""

from __future__ import annotations

from training.stats.counts import p_rate_difference, p_rate_equivalent, poisson_interval, rate_difference_interval
from training.stats.estimates import (
    ALPHA,
    Estimate,
    difference,
    estimate,
    no_estimate,
    paired_difference,
    slope,
    t_quantile,
)
from training.stats.lr import (
    MODES,
    PLATEAU_NATS,
    best_index,
    best_lr_bootstrap,
    capped_loss,
    crossfit_best,
    crossfit_indices,
    crossfit_sensitivity,
    initial_loss_cap,
    lr_sensitivity,
    on_plateau,
    training_outcome,
)
from training.stats.outcomes import (
    REDUCTIONS,
    Reduction,
    count_spikes,
    judge_counts,
    loss_z,
    mean_and_sd,
    series_peak,
)
from training.stats.power import min_detectable, power_at, seeds_needed
from training.stats.reach import (
    Reach,
    ReachComparison,
    compare_reach,
    crossfit_reaches,
    judge_reach,
    lr_reach,
    reach_interval,
)
from training.stats.verdicts import (
    AT_PLATEAU,
    BETTER,
    COMPARISONS,
    EQUIVALENT,
    EXACT_FLIPS,
    FAIL,
    INCONCLUSIVE,
    P_KEYS,
    PASS,
    SAMPLED_FLIPS,
    WORSE,
    Judgement,
    benjamini_hochberg,
    comparison_verdict,
    count_p_values,
    exact_can_reject,
    holm,
    judge,
    judge_family,
    p_values,
    perm_equivalent,
    seeds_for_exact,
    sign_flip_p,
    signed_rank_sum,
    with_divergences,
)

__all__ = ["ALPHA", "AT_PLATEAU", "BETTER", "COMPARISONS", "EQUIVALENT", "EXACT_FLIPS", "Estimate", "FAIL",
           "INCONCLUSIVE", "Judgement", "MODES", "PASS", "PLATEAU_NATS", "P_KEYS", "REDUCTIONS", "Reach",
           "ReachComparison", "Reduction", "SAMPLED_FLIPS", "WORSE", "benjamini_hochberg", "best_index",
           "best_lr_bootstrap", "capped_loss", "compare_reach", "comparison_verdict", "count_p_values", "count_spikes",
           "crossfit_best", "crossfit_indices", "crossfit_reaches", "crossfit_sensitivity", "difference", "estimate",
           "exact_can_reject", "holm", "initial_loss_cap", "judge", "judge_counts", "judge_family", "judge_reach",
           "loss_z", "lr_reach", "lr_sensitivity", "mean_and_sd", "min_detectable", "no_estimate", "on_plateau",
           "p_rate_difference", "p_rate_equivalent", "p_values", "paired_difference", "perm_equivalent",
           "poisson_interval", "power_at", "rate_difference_interval", "reach_interval", "seeds_for_exact",
           "seeds_needed", "series_peak", "sign_flip_p", "signed_rank_sum", "slope", "t_quantile", "training_outcome",
           "with_divergences"]

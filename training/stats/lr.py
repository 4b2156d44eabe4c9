"""A run's outcome (trains / plateau / diverged: `training_outcome`, with the plateau rule `on_plateau`), and the
learning-rate statistics the study and the sweeps share: a diverged run's capped loss, Wortsman et al. 2023's LR
sensitivity, the best LR of a grid (`MODES`: which way is better), cross-fitted and bootstrapped."""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import numpy as np

MODES = ("min", "max")  # which way a metric is better: lower (a loss) or higher (an accuracy)
# A final loss within this many nats of the unigram entropy is "on the plateau": the study's loss margin (the
# smallest held-out-loss difference its claims count), so a run the rule calls "trains" has beaten the
# frequency-only model by at least an effect the study would notice.
PLATEAU_NATS = 0.05


def on_plateau(final_loss: float, entropy: float) -> bool:
    """Whether a final loss (nats) is at the unigram plateau: ≥ `entropy` − PLATEAU_NATS, where `entropy` is the
    unigram entropy of the training tokens (`data.entropy.unigram_entropy`) — the loss of a model that learned
    the token frequencies and nothing of their context. A run's warm-up or early losses play no part."""
    return final_loss >= entropy - PLATEAU_NATS


def training_outcome(losses: Sequence[float], diverged: bool = False, final_loss: float | None = None, *,
                     entropy: float) -> str:
    """A run's outcome from its training losses in step order, the first one at initialization (the study's
    and the sweeps' one definition):
    "diverged" — `diverged` (the loss became non-finite and training stopped), a non-finite loss, a mean over
    the last 10% of the losses above the first one, or a held-out `final_loss` (when the metric is a loss)
    above the first one — no better than not training; "plateau" — the final loss (the held-out `final_loss`
    when given, else that tail mean) is on the unigram plateau of the training data (`on_plateau` against
    `entropy`); else "trains". `entropy` is required: an outcome without it would have to guess the plateau."""
    if diverged or not losses:
        return "diverged"
    tail = losses[-max(1, len(losses) // 10):]
    end = sum(tail) / len(tail)
    if not all(math.isfinite(x) for x in losses) or end > losses[0]:
        return "diverged"
    if final_loss is not None and final_loss > losses[0]:
        return "diverged"
    if entropy is None or math.isnan(entropy):
        raise ValueError(f"training_outcome needs the unigram entropy of the training data, got {entropy!r}")
    return "plateau" if on_plateau(end if final_loss is None else final_loss, entropy) else "trains"


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


def lr_sensitivity(final_by_lr: Mapping[float, float], cap: float, at: float | None = None) -> float:
    """Wortsman et al. 2023's learning-rate sensitivity of one configuration at one seed: the mean over the LR
    grid of the capped final loss (`capped_loss`) minus the loss at the best LR `at` — chosen on the other seeds
    (`crossfit_sensitivity`, what the study and the sweeps compare) — or, without `at`, minus this seed's own
    minimum. The own minimum is biased low by the seed's noise (the minimum of noisy values sits below the
    minimum of their means), the more so the noisier the configuration, so it makes a noisier configuration
    look more sensitive; use it for one seed alone only. A configuration that diverges over much of the grid is
    sensitive; one whose loss is flat across the grid scores about 0."""
    if not final_by_lr:
        raise ValueError("lr_sensitivity needs at least one learning rate")
    capped = {lr: capped_loss(x, cap) for lr, x in final_by_lr.items()}
    return statistics.fmean(capped.values()) - (min(capped.values()) if at is None else capped[at])


def crossfit_sensitivity(per_lr: Sequence[Sequence[float]]) -> list[float]:
    """Per seed, the LR sensitivity (`lr_sensitivity`) read at the LR that is best on the *other* seeds' mean
    curve (`crossfit_best`): the mean over the grid of the seed's capped final losses minus its loss at that LR.
    The LR is chosen on runs independent of the seed's own, so its noise does not lower the reference value:
    two configurations with the same mean curve get the same expected sensitivity whatever their noise, and the
    per-seed values stay paired with the other configuration's seeds (a paired test applies). `per_lr`
    [LR][seed], already capped (`capped_loss`); one seed alone falls back to its own minimum."""
    values = np.asarray(per_lr, dtype=float)
    return [float(values[:, s].mean()) - ref for s, ref in enumerate(crossfit_best(per_lr, "min"))]


def best_index(scores: Sequence[float], mode: str = "min") -> int:
    """The best learning rate of a grid: the index of the lowest (mode "min") or highest ("max") score, each
    score the mean over seeds of the capped final metric; NaN scores are skipped, ties go to the first."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be 'min' or 'max'")
    valid = [i for i, x in enumerate(scores) if not math.isnan(x)]
    if not valid:
        raise ValueError("best_index needs at least one score that is a number")
    sign = 1.0 if mode == "min" else -1.0
    return min(valid, key=lambda i: sign * scores[i])


def crossfit_indices(per_lr: Sequence[Sequence[float]], mode: str = "min") -> list[int]:
    """Per seed, the index of the best learning rate on the mean curve of the *other* seeds (leave one seed out);
    `per_lr` [LR][seed]; one seed alone keeps its own choice."""
    values = np.asarray(per_lr, dtype=float)
    n = values.shape[1]
    return [best_index(list((values[:, [i for i in range(n) if i != s]] if n > 1 else values).mean(axis=1)), mode)
            for s in range(n)]


def crossfit_best(per_lr: Sequence[Sequence[float]], mode: str = "min") -> list[float]:
    """Per seed, the capped final metric at the best learning rate chosen on the *other* seeds
    (`crossfit_indices`): the value at "its own best LR" without the optimism of choosing the LR on the same runs
    it is read from. `per_lr` [LR][seed]; one seed alone keeps its own choice."""
    values = np.asarray(per_lr, dtype=float)
    return [float(values[i, s]) for s, i in enumerate(crossfit_indices(per_lr, mode))]


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

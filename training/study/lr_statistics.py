"""The statistics of a claim's learning-rate sweeps (a family of roles `name@0`, `name@1`, ... differing only
in the learning rate), registered in `training.study.statistics.STATISTICS`.

A diverged run's held-out loss is +inf (`measure.final_loss`); where a statistic needs a number for every run of
the grid it counts as the seed's loss at init (`training.stats.initial_loss_cap`). Every value read "at the best
LR" is cross-fitted: at the LR best on the other seeds' mean curve (`training.stats.crossfit_indices`), so a
seed's own noise does not choose its reference — the per-seed minimum would be biased low, the more so the
noisier the arm.
"""
from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

from training.stats import (
    Reach,
    best_index,
    capped_loss,
    crossfit_best,
    crossfit_indices,
    crossfit_reaches,
    crossfit_sensitivity,
    initial_loss_cap,
)
from training.study.measure import final_loss, initial_loss, outcome

if TYPE_CHECKING:
    from training.study.statistics import Context


def capped_final_loss(r: dict) -> float:
    """The held-out loss, a diverged run counting as its loss at init (no better than not training)."""
    return capped_loss(final_loss(r), initial_loss_cap([initial_loss(r)]))


def _sweep(ctx: Context, family: str) -> list[list[dict]]:
    """Per LR index of the family, its runs (seed order)."""
    return [ctx.runs(r) for r in ctx.family(family)]


def _caps(sweep: list[list[dict]]) -> list[float]:
    """Per seed, the loss a diverged run counts as: `training.stats.initial_loss_cap` of the seed's runs."""
    return [initial_loss_cap([initial_loss(runs[s]) for runs in sweep]) for s in range(len(sweep[0]))]


def capped_grid(ctx: Context, family: str) -> list[list[float]]:
    """[LR index][seed] the held-out loss capped at the seed's loss at init."""
    sweep = _sweep(ctx, family)
    caps = _caps(sweep)
    return [[capped_loss(final_loss(r), cap) for r, cap in zip(runs, caps, strict=True)] for runs in sweep]


def best_lr_index(ctx: Context, family: str) -> int:
    """The LR index with the lowest mean capped held-out loss over seeds (`training.stats.best_index`)."""
    return best_index([statistics.fmean(x) for x in capped_grid(ctx, family)])


def best_lr_loss(ctx: Context, role: str) -> list[float]:
    """Per seed, the capped held-out loss at the best LR chosen on the other seeds (`training.stats.
    crossfit_best`): "at its own best LR" without the optimism of choosing on the runs it is read from."""
    return crossfit_best(capped_grid(ctx, role))


def lr_sensitivities(ctx: Context, role: str) -> list[float]:
    """Per seed, Wortsman et al.'s LR sensitivity over the family's sweep, cross-fitted (`training.stats.
    crossfit_sensitivity`): the mean over the grid of the seed's capped held-out loss minus its loss at the LR
    that is best on the other seeds' mean curve — not the seed's own minimum, which noise biases low and would
    make the noisier arm look more sensitive."""
    return crossfit_sensitivity(capped_grid(ctx, role))


def high_lr_sensitivity(ctx: Context, role: str) -> list[float]:
    """Per seed, the one-sided LR sensitivity above the best LR, cross-fitted (`training.stats.crossfit_indices`:
    the LR best on the other seeds' mean curve, so the seed's own noise does not lower the reference): the mean
    over the higher LRs of the seed's capped held-out loss minus its loss at that LR. NaN for a seed whose best
    LR so chosen is the grid's highest (the grid does not reach the arm's failure: nothing to measure); whether
    the family's best LR sits at an edge of the grid is `unbracketed`."""
    grid = capped_grid(ctx, role)
    out = []
    for s, best in enumerate(crossfit_indices(grid)):
        above = grid[best + 1:]
        out.append(statistics.fmean(row[s] - grid[best][s] for row in above) if above else math.nan)
    return out


def unbracketed(ctx: Context, family: str) -> str | None:
    """Which edge of the LR grid the family's best LR (`best_lr_index`: lowest mean capped held-out loss over
    seeds) sits at — "lowest" or "highest" — else None. At an edge the optimum may lie beyond the grid, so
    statistics read relative to the best LR (LR sensitivity, `high_lr_sensitivity`, `best_lr_loss`, `lr_reach`)
    describe the grid rather than the configuration; the sweeps flag the same (`LrGroup.unbracketed`)."""
    lrs = [ctx.roles[r].lr for r in ctx.family(family)]
    if len(lrs) < 2:
        return None
    best = lrs[best_lr_index(ctx, family)]
    return "lowest" if best == min(lrs) else "highest" if best == max(lrs) else None


def _seed_reaches(ctx: Context, role: str, delta: float) -> list[Reach]:
    """Per seed, the LR reach of the family's capped held-out loss (`training.stats.crossfit_reaches`), the grid
    put in ascending LR order."""
    lrs = [ctx.roles[r].lr for r in ctx.family(role)]
    order = sorted(range(len(lrs)), key=lambda i: lrs[i])
    grid = capped_grid(ctx, role)
    return crossfit_reaches([lrs[i] for i in order], [grid[i] for i in order], delta)


def lr_reach_widths(ctx: Context, role: str, delta: float = 0.1) -> list[float]:
    """Per seed, the LR reach in decades (`training.stats.lr_reach`, the sweeps' definition): the width in log₁₀
    LR of the contiguous range, linear in log LR between grid points, whose capped held-out loss stays within
    `delta` nats of the seed's loss at the LR that is best on the *other* seeds' mean curve. That reference is
    cross-fitted rather than the seed's own best (a minimum of its noise, biased low, which narrows a noisier
    arm's range) or the seed-mean best (which includes the seed's own runs); it keeps one paired value per seed.
    A range that reaches a grid edge is only a lower bound: `lr_reach_censored` says which seeds."""
    return [r.width for r in _seed_reaches(ctx, role, delta)]


def lr_reach_censored(ctx: Context, role: str, delta: float = 0.1) -> list[bool]:
    """Per seed, whether its `lr_reach_widths` value runs to an edge of the grid (`Reach.at_least`): the true
    reach may be wider, so a comparison of such values is a comparison of lower bounds."""
    return [r.at_least for r in _seed_reaches(ctx, role, delta)]


def diverged_runs(ctx: Context, role: str) -> list[float]:
    """Per seed, how many of the family's runs diverged."""
    return [float(sum(outcome(runs[s]) == "diverged" for runs in _sweep(ctx, role)))
            for s in range(len(_sweep(ctx, role)[0]))]


def max_trainable_lr(ctx: Context, role: str) -> list[float]:
    sweep, lrs = _sweep(ctx, role), [ctx.roles[r].lr for r in ctx.family(role)]
    return [max([lr for lr, runs in zip(lrs, sweep, strict=True) if outcome(runs[s]) == "trains"], default=0.0)
            for s in range(len(sweep[0]))]

"""A sweep's statistics from its runs' results (training/sweep/results.py): per cell, the cells of the spec's
question against the baseline (paired over seeds, Holm across exactly those cells), and per learning-rate group
(best LR, LR sensitivity) with each group against the baseline's group (LR sensitivity, and "at its own best
LR" cross-fitted).

Every definition (the cap of a diverged run, the LR sensitivity, the best-LR choice, Holm, the divergence
rule) is training/stats/'s, shared with the study. One implementation for the sweep's report, its `--plan`
and `normlab compare --group_by`; the tests live in tests/test_stats.py (the statistics) and
tests/test_sweep_report.py (on real runs).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from training.stats import (
    ALPHA,
    Estimate,
    Judgement,
    best_index,
    best_lr_bootstrap,
    capped_loss,
    crossfit_best,
    crossfit_sensitivity,
    estimate,
    initial_loss_cap,
    judge_counts,
    judge_family,
    no_estimate,
    paired_difference,
)
from training.sweep.results import RunResult

OUTCOMES = ("trains", "plateau", "diverged")


@dataclass(frozen=True)
class Cell:
    """One configuration of the grid and its runs, one per seed."""

    name: str
    params: dict[str, Any]
    runs: tuple[RunResult, ...]

    @property
    def included(self) -> list[RunResult]:
        return [r for r in self.runs if r.included]

    @property
    def numbers(self) -> list[RunResult]:
        """Runs with a final metric (trained, or on the plateau), in seed order."""
        return [r for r in self.included if r.has_number]

    def counts(self) -> dict[str, int]:
        return {o: sum(r.outcome == o for r in self.included) for o in OUTCOMES}

    def estimate(self) -> Estimate | None:
        return estimate([r.final for r in self.numbers]) if self.numbers else None

    def by_seed(self) -> dict[Any, RunResult]:
        return {r.seed: r for r in self.included}


def seed_order(run: RunResult) -> tuple:
    """Integer seeds numerically, anything else after them as text."""
    return (0, run.seed, "") if isinstance(run.seed, int) else (1, 0, str(run.seed))


def cells_of(results: Sequence[RunResult]) -> list[Cell]:
    """The cells of `results`, in the order they first appear; each cell's runs in seed order."""
    names = list(dict.fromkeys(r.cell for r in results))
    return [Cell(n, next(r.params for r in results if r.cell == n),
                 tuple(sorted((r for r in results if r.cell == n), key=seed_order)))
            for n in names]


@dataclass(frozen=True)
class Comparison:
    """A cell (or an LR group) against the baseline: the seeds both have a run for, those where both have a
    number (the paired difference's), and the judgement (training.stats.judge_family, Holm across its family).
    `bootstrap`: for a best-LR comparison, the interval with the best LR chosen again in every resample."""

    cell: str
    shared: tuple[Any, ...]
    paired: tuple[Any, ...]
    judgement: Judgement
    bootstrap: tuple[float, float] | None = None
    diverged: tuple[int, int] = (0, 0)  # seeds that diverged in this cell only, in the baseline only


def outcome_value(name: str | None) -> Callable[[RunResult], float]:
    """What a run contributes to a comparison: its final metric (`name` None), else its stability outcome `name`
    (NaN when it has none: left out, as a run without a final metric is)."""
    return (lambda r: r.final) if name is None else (lambda r: r.values.get(name, math.nan))


def compare_to_baseline(cells: Sequence[Cell], baseline: str, margin: float | None, mode: str,
                        alpha: float = ALPHA, family: Sequence[str] | None = None,
                        outcome: str | None = None) -> list[Comparison]:
    """The cells of `family` (default: every other cell) against `baseline`: the paired difference (cell −
    baseline) of the final metric (or of the stability `outcome`) over the seeds where both have a number, the
    seeds that diverged in one arm only (they enter the test as the worst value), and the verdicts,
    Holm-adjusted across exactly these cells. The spike count is judged by the exact test alone
    (`training.stats.judge_counts`)."""
    value = outcome_value(outcome)

    def has_number(r: RunResult) -> bool:
        return r.outcome in ("trains", "plateau") and math.isfinite(value(r))

    base = next(c for c in cells if c.name == baseline).by_seed()
    names = [c.name for c in cells if c.name != baseline] if family is None else list(family)
    diffs: dict[str, Estimate] = {}
    pairs: dict[str, tuple[list[float], list[float]]] = {}
    discordant: dict[str, tuple[int, int]] = {}
    counts: dict[str, tuple[int, int]] = {}
    seeds: dict[str, tuple[tuple, tuple]] = {}
    for cell in cells:
        if cell.name not in names:
            continue
        mine = cell.by_seed()
        shared = tuple(s for s in mine if s in base)
        paired = tuple(s for s in shared if has_number(mine[s]) and has_number(base[s]))
        pairs[cell.name] = ([value(mine[s]) for s in paired], [value(base[s]) for s in paired])
        diffs[cell.name] = paired_difference(*pairs[cell.name]) if paired else no_estimate()
        diverged = [(mine[s].outcome == "diverged", base[s].outcome == "diverged") for s in shared]
        counts[cell.name] = here, there = sum(a and not b for a, b in diverged), sum(b and not a for a, b in diverged)
        # in the metric's orientation a diverged run is the worse value: the larger one for a loss
        discordant[cell.name] = (here, there) if mode == "min" else (there, here)
        seeds[cell.name] = (shared, paired)
    if outcome == "spikes":
        judged = judge_counts(pairs, margin, discordant, alpha)
    else:
        judged = judge_family(diffs, margin, "lower" if mode == "min" else "higher", alpha, discordant)
    return [Comparison(name, *seeds[name], judged[name], diverged=counts[name]) for name in diffs]


def best_cell(cells: Sequence[Cell], mode: str) -> str | None:
    """The cell with the best mean final metric (a cell with a diverged run is not a candidate)."""
    scored = [(c.estimate().mean, c.name) for c in cells if c.estimate() is not None and not c.counts()["diverged"]]
    if not scored:
        return None
    return (min if mode == "min" else max)(scored)[1]


@dataclass(frozen=True)
class LrGroup:
    """The cells that differ only in the learning rate. `caps`: per seed, the loss a diverged run (or a final
    loss above it) counts as — `training.stats.initial_loss_cap` of the seed's runs' step-0 losses; `scores`:
    per LR, the mean over seeds of the final metric so capped (mode max: a diverged run scores −inf);
    `best_lr`: the LR with the best score; `sensitivity`: Wortsman et al.'s LR sensitivity over the seeds that
    have a run at every LR, each seed read at the LR the other seeds chose (`per_seed_sensitivity`; mode min
    only); `grid`: [LR][seed] the capped values of those seeds, for the
    between-group comparisons; `late_caps`: seeds whose cap is a loss logged after some updates (the run did not
    log its step-0 loss)."""

    name: str
    cells: dict[float, Cell]
    caps: dict[Any, float]
    scores: dict[float, float]
    best_lr: float | None
    sensitivity: Estimate | None
    grid: dict[Any, list[float]]
    late_caps: tuple[Any, ...] = ()

    @property
    def best(self) -> Cell | None:
        return None if self.best_lr is None else self.cells[self.best_lr]

    @property
    def unbracketed(self) -> bool:
        """The best LR is at an end of the grid: the optimum may lie beyond it."""
        return self.best_lr is not None and len(self.cells) > 1 and self.best_lr in (min(self.cells), max(self.cells))

    @property
    def cap(self) -> float:
        """The median of the per-seed caps (what the report prints)."""
        finite = [c for c in self.caps.values() if math.isfinite(c)]
        return statistics.median(finite) if finite else math.inf

    def per_seed_sensitivity(self) -> dict[Any, float]:
        """Per seed of `grid`, the LR sensitivity read at the LR the other seeds chose (`training.stats.
        crossfit_sensitivity`: no per-seed-minimum bias, so a noisier group does not look more sensitive)."""
        seeds = list(self.grid)
        per_lr = [[self.grid[s][i] for s in seeds] for i in range(len(self.cells))]
        return dict(zip(seeds, crossfit_sensitivity(per_lr), strict=True)) if seeds else {}


def _scored(run: RunResult, cap: float, mode: str) -> float | None:
    """A run's final metric as the LR table counts it: diverged → the cap (min) or −inf (max); no metric → None."""
    if run.outcome == "diverged":
        return capped_loss(math.inf, cap) if mode == "min" else -math.inf
    if not run.has_number:
        return None
    return capped_loss(run.final, cap) if mode == "min" else run.final


def _group_name(cell: Cell, axes: Sequence[str], drop: set[str]) -> str:
    """The cell's name without the dropped axes' components (names are `short=value,...` in axis order)."""
    parts = cell.name.split(",")
    if len(parts) == len(axes):
        kept = [p for p, axis in zip(parts, axes, strict=True) if axis not in drop]
    else:
        kept = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in cell.params.items() if k not in drop]
    return ",".join(kept) or "all"


def tied_keys(cells: Sequence[Cell], lr_key: str) -> set[str]:
    """`lr_key` and the axes that vary with it (a zipped `optim.min_lr`): every key whose value the LR fixes."""
    tied = {lr_key}
    for key in {k for c in cells for k in c.params} - tied:
        seen: dict[Any, Any] = {}
        if all(seen.setdefault(repr(c.params.get(lr_key)), repr(c.params.get(key))) == repr(c.params.get(key))
               for c in cells):
            tied.add(key)
    return tied


def lr_groups(cells: Sequence[Cell], lr_key: str, axes: Sequence[str], mode: str) -> list[LrGroup]:
    """The cells grouped by every axis but the LR (and the axes tied to it), each group's LRs ascending."""
    drop = tied_keys(cells, lr_key)
    groups: dict[str, list[Cell]] = {}
    for cell in cells:
        if lr_key in cell.params:
            groups.setdefault(_group_name(cell, axes, drop), []).append(cell)
    return [_lr_group(name, members, lr_key, mode) for name, members in groups.items()]


def _caps(by_lr: dict[float, Cell]) -> tuple[dict[Any, float], tuple[Any, ...]]:
    """Per seed, the cap from the step-0 losses of the seed's runs (else, for runs that did not log it, from
    their first logged loss: listed as late)."""
    seeds = {r.seed for c in by_lr.values() for r in c.included}
    caps, late = {}, []
    for seed in seeds:
        runs = [c.by_seed()[seed] for c in by_lr.values() if seed in c.by_seed()]
        at_init = [r.initial_loss for r in runs if r.initial_step == 1]
        if not at_init:
            at_init = [r.initial_loss for r in runs]
            late.append(seed)
        caps[seed] = initial_loss_cap(at_init)
    return caps, tuple(sorted(late, key=str))


def _lr_group(name: str, members: list[Cell], lr_key: str, mode: str) -> LrGroup:
    by_lr = dict(sorted(((float(c.params[lr_key]), c) for c in members), key=lambda pair: pair[0]))
    caps, late = _caps(by_lr)
    scores = {}
    for lr, cell in by_lr.items():
        scored = [x for r in cell.included if (x := _scored(r, caps[r.seed], mode)) is not None]
        if scored:
            scores[lr] = statistics.fmean(scored)
    lrs = list(scores)
    best_lr = lrs[best_index([scores[lr] for lr in lrs], mode)] if lrs else None
    seeds = set.intersection(*(set(c.by_seed()) for c in by_lr.values())) if by_lr else set()
    grid = {}
    for seed in sorted(seeds, key=lambda s: (0, s, "") if isinstance(s, int) else (1, 0, str(s))):
        row = [_scored(c.by_seed()[seed], caps[seed], mode) for c in by_lr.values()]
        if all(v is not None and math.isfinite(v) for v in row):
            grid[seed] = row
    sensitivity = None
    group = LrGroup(name, by_lr, caps, scores, best_lr, sensitivity, grid, late)
    if mode == "min" and len(by_lr) > 1 and grid:
        group = replace(group, sensitivity=estimate(list(group.per_seed_sensitivity().values())))
    return group


def compare_groups(groups: Sequence[LrGroup], baseline: str, margin: float | None, mode: str, statistic: str,
                   alpha: float = ALPHA, family: Sequence[str] | None = None) -> list[Comparison]:
    """Each group of `family` (default: every other) against the `baseline` group, paired over the seeds both
    have at every LR: `statistic` "lr_sensitivity" (the per-seed difference of LR sensitivities, mode min) or
    "best_lr" (each seed read at the best LR chosen on the other seeds: `training.stats.crossfit_best`, with
    the reselecting bootstrap interval beside it); Holm across the groups compared."""
    base = next(g for g in groups if g.name == baseline)
    names = [g.name for g in groups if g.name != baseline] if family is None else list(family)
    diffs, seeds, boots = {}, {}, {}
    for g in groups:
        if g.name not in names:
            continue
        shared = tuple(s for s in g.grid if s in base.grid)
        seeds[g.name] = shared
        if statistic == "lr_sensitivity":
            mine, theirs = g.per_seed_sensitivity(), base.per_seed_sensitivity()
            a, b = [mine[s] for s in shared], [theirs[s] for s in shared]
        else:
            grid_a = [[g.grid[s][i] for s in shared] for i in range(len(g.cells))]
            grid_b = [[base.grid[s][i] for s in shared] for i in range(len(base.cells))]
            a, b = (crossfit_best(x, mode) if shared else [] for x in (grid_a, grid_b))
            boots[g.name] = best_lr_bootstrap(grid_a, grid_b, mode) if len(shared) > 1 else None
        diffs[g.name] = paired_difference(a, b) if shared else no_estimate()
    better = "lower" if mode == "min" or statistic == "lr_sensitivity" else "higher"
    judged = judge_family(diffs, margin, better, alpha)
    return [Comparison(n, seeds[n], seeds[n], judged[n], boots.get(n)) for n in diffs]

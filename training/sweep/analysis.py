"""A sweep's statistics from its runs' results (training/sweep/results.py): per cell, each cell against the
baseline (paired over seeds, Holm across cells), and per learning-rate group (best LR, LR sensitivity).

One implementation for the sweep's report and `normlab compare --group_by`; the tests live in
tests/test_stats.py (the statistics) and tests/test_sweep_report.py (on real runs).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from training.stats import (
    ALPHA,
    Estimate,
    Judgement,
    capped_loss,
    estimate,
    judge_family,
    lr_sensitivity,
    no_estimate,
    paired_difference,
)
from training.sweep.results import RunResult

OUTCOMES = ("trains", "stalled", "diverged")


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
        """Runs with a final metric (trained or stalled), in seed order."""
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
    """A cell against the baseline: the seeds both have a run for, those where both have a number (the paired
    difference's), and the judgement (training.stats.judge_family)."""

    cell: str
    shared: tuple[Any, ...]
    paired: tuple[Any, ...]
    judgement: Judgement


def compare_to_baseline(cells: Sequence[Cell], baseline: str, margin: float | None, mode: str,
                        alpha: float = ALPHA) -> list[Comparison]:
    """Every other cell against `baseline`: the paired difference (cell − baseline) of the final metric over the
    seeds where both have a number, the seeds that diverged in one arm only, and the verdicts, Holm-adjusted
    across the cells compared."""
    base = next(c for c in cells if c.name == baseline).by_seed()
    diffs: dict[str, Estimate] = {}
    discordant: dict[str, tuple[int, int]] = {}
    seeds: dict[str, tuple[tuple, tuple]] = {}
    for cell in cells:
        if cell.name == baseline:
            continue
        mine = cell.by_seed()
        shared = tuple(s for s in mine if s in base)
        paired = tuple(s for s in shared if mine[s].has_number and base[s].has_number)
        diffs[cell.name] = (paired_difference([mine[s].final for s in paired], [base[s].final for s in paired])
                            if paired else no_estimate())
        diverged = [(mine[s].outcome == "diverged", base[s].outcome == "diverged") for s in shared]
        discordant[cell.name] = (sum(a and not b for a, b in diverged), sum(b and not a for a, b in diverged))
        seeds[cell.name] = (shared, paired)
    judged = judge_family(diffs, margin, "lower" if mode == "min" else "higher", alpha, discordant)
    return [Comparison(name, *seeds[name], judged[name]) for name in diffs]


@dataclass(frozen=True)
class LrGroup:
    """The cells that differ only in the learning rate. `cap`: the initial loss that a diverged run (or a final
    loss above it) counts as — the median of the group's runs' first logged train/loss; `scores`: per LR, the
    mean over seeds of the final metric so capped (mode max: a diverged run scores −inf); `best_lr`: the LR
    with the best score; `sensitivity`: Wortsman et al.'s LR sensitivity over the seeds that have a run at
    every LR (mode min only)."""

    name: str
    cells: dict[float, Cell]
    cap: float
    scores: dict[float, float]
    best_lr: float | None
    sensitivity: Estimate | None

    @property
    def best(self) -> Cell | None:
        return None if self.best_lr is None else self.cells[self.best_lr]


def _raw(run: RunResult) -> float | None:
    """A run's final metric, +inf when it diverged, None without one."""
    return math.inf if run.outcome == "diverged" else run.final if run.has_number else None


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


def _lr_group(name: str, members: list[Cell], lr_key: str, mode: str) -> LrGroup:
    by_lr = dict(sorted(((float(c.params[lr_key]), c) for c in members), key=lambda pair: pair[0]))
    initial = [r.initial_loss for c in members for r in c.included if math.isfinite(r.initial_loss)]
    cap = statistics.median(initial) if initial else math.inf
    scores = {}
    for lr, cell in by_lr.items():
        scored = [x for r in cell.included if (x := _scored(r, cap, mode)) is not None]
        if scored:
            scores[lr] = statistics.fmean(scored)
    best_lr = (min if mode == "min" else max)(scores, key=scores.__getitem__) if scores else None
    sensitivity = None
    if mode == "min" and math.isfinite(cap) and len(by_lr) > 1:
        seeds = set.intersection(*(set(c.by_seed()) for c in by_lr.values()))
        per_seed = []
        for seed in sorted(seeds, key=lambda s: (0, s, "") if isinstance(s, int) else (1, 0, str(s))):
            curve = {lr: _raw(c.by_seed()[seed]) for lr, c in by_lr.items()}  # lr_sensitivity caps them
            if all(v is not None for v in curve.values()):
                per_seed.append(lr_sensitivity(curve, cap))
        sensitivity = estimate(per_seed) if per_seed else None
    return LrGroup(name, by_lr, cap, scores, best_lr, sensitivity)

"""One run's numbers, read back from what `normlab fit` wrote: the final metric, the outcome and the curves.

Shared by the sweep's report (training/sweep/report.py) and `normlab compare` (training/compare.py), so both
give the same number for the same run:
- final metric: the metric's value at the last step it was logged (the run's TensorBoard events, read by
  `training.rundir.RunDir.scalars`: a step logged twice, as after a resume's purge, keeps its newest value),
  with that step. A run whose outcome
  is "diverged" has no final metric (NaN): it is counted as an outcome, never averaged as a number.
- outcome: `training.stats.training_outcome` of the run's logged `train/loss` values in step order (trains /
  stalled / diverged, the study's definition), and "diverged" whenever the runner recorded the run as
  diverged or the final metric is not finite.
- initial loss: the first logged `train/loss` (the loss of update 1, at the initialization, when
  `trainer.log_every_n_steps` is 1; after that many updates otherwise).
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.rundir import Points, RunDir
from training.stats import training_outcome

TRAIN_LOSS = "train/loss"
INCLUDED = ("finished", "diverged")  # statuses whose runs the statistics use; the others are not done yet


def plain_tags(tags: Iterable[str]) -> list[str]:
    """The tags without a per-layer index (`attn/max_logit/L3`), sorted: what an error message suggests."""
    return sorted({t for t in tags if not re.search(r"/L?\d+$", t)})


@dataclass(frozen=True)
class RunResult:
    """One run of a cell at one seed. `outcome` is None for a run not included (not finished: its `status`
    says why); `final` is NaN without a final metric (diverged, or the metric never logged)."""

    cell: str
    params: dict[str, Any]
    seed: Any
    run_dir: Path
    status: str
    outcome: str | None = None
    final: float = math.nan
    final_step: int | None = None
    steps: int = 0
    tokens: float = 0.0
    initial_loss: float = math.nan
    curves: dict[str, Points] = field(default_factory=dict)  # train/loss and the metric, against steps
    tokens_per_step: float = 0.0

    @property
    def included(self) -> bool:
        return self.outcome is not None

    @property
    def has_number(self) -> bool:
        return self.outcome in ("trains", "stalled") and math.isfinite(self.final)


def result(cell: str, params: dict[str, Any], seed: Any, run_dir: Path, status: str, metric: str,
           run: RunDir | None = None) -> RunResult:
    """One run's result (read through `run`, else a `RunDir` of `run_dir`); `status` is `RunDir.status`'s."""
    base = RunResult(cell, params, seed, run_dir, status)
    if status not in INCLUDED:
        return base
    run = run or RunDir(run_dir)
    if not run.has_events:  # a run that diverged before it logged anything
        return RunResult(cell, params, seed, run_dir, status, "diverged") if status == "diverged" else base
    s = run.require_logged().scalars
    losses = [v for _, v in s.get(TRAIN_LOSS, [])]
    points = s.get(metric, [])
    final_step, final = points[-1] if points else (None, math.nan)
    # a metric that was logged non-finite diverged; one never logged is missing (final NaN), not an outcome
    if not losses and status != "diverged":  # nothing to judge the outcome by (logged less often than it ran)
        return RunResult(cell, params, seed, run_dir, f"{status} without {TRAIN_LOSS}")
    outcome = training_outcome(losses, diverged=status == "diverged" or (bool(points) and not math.isfinite(final)))
    steps = max((p[-1][0] for tag, p in s.items() if tag.startswith("train/") and p), default=0)
    per_step = run.tokens_per_step()
    return RunResult(cell, params, seed, run_dir, status, outcome,
                     final if outcome != "diverged" else math.nan, final_step, steps, steps * per_step,
                     losses[0] if losses else math.nan,
                     {tag: s[tag] for tag in (TRAIN_LOSS, metric) if tag in s}, per_step)

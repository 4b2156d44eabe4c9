"""One run's numbers, read back from what `normlab fit` wrote: the final metric, the outcome and the curves.

Shared by the sweep's report (training/sweep/report.py) and `normlab compare` (training/compare.py), so both
give the same number for the same run:
- final metric: the metric's value at the last step it was logged (the run's TensorBoard events, read by
  `training.run.dir.RunDir.scalars`: a step logged twice, as after a resume's purge, keeps its newest value),
  with that step — or the spec's reduction of its logged values (`training.stats.Reduction`: min, max, the mean
  of the last K). A run whose outcome
  is "diverged" has no final metric (NaN): it is counted as an outcome, never averaged as a number.
- outcome: `training.stats.training_outcome` of the run's logged `train/loss` values in step order (trains /
  plateau / diverged, the study's definition): "diverged" also whenever the runner recorded the run as
  diverged, the final metric is not finite, or a final loss (a metric whose tag ends in "loss") is above the
  initial loss — no better than not training, as in the study; "plateau" when the final loss (that metric,
  else the tail of `train/loss`) is within `PLATEAU_NATS` of the unigram entropy of the run's training data
  (`data/unigram_entropy`, which `normlab fit` logs; for a run that did not, counted from its `data.path`).
- initial loss: the first logged `train/loss` and its step (`initial_step`). `normlab fit` logs the loss of
  update 1 — the loss at initialization — at step 1 whatever `trainer.log_every_n_steps` is; a run written
  before that logs it only after `log_every_n_steps` updates, and the report says so.
- stability outcomes (training/sweep/outcomes.py): the spikes of its logged `train/loss` by the guard's rule and
  the peak of its exact max attention logit, when the spec asks for them (NaN where never logged).
- one config per cell (`check_one_config_per_cell`): the runs of a cell, as `normlab sweep` recorded them, were
  trained with the same arguments and `-c` files — else the statistics would judge two configs as one.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data.entropy import ENTROPY_TAG, unigram_entropy
from training.errors import UserError
from training.run.dir import Points, RunDir
from training.stats import Reduction, training_outcome
from training.sweep.outcomes import SPIKE_TAG, logged_every, run_outcomes

TRAIN_LOSS = "train/loss"
PER_RUN_ARGS = ("--runs_dir=", "--name=", "--seed_everything=", "--data.seed=")  # what a cell's seeds differ in
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
    initial_step: int | None = None  # the step of the first logged train/loss (1: the loss at initialization)
    curves: dict[str, Points] = field(default_factory=dict)  # train/loss and the metric, against steps
    tokens_per_step: float = 0.0
    values: dict[str, float] = field(default_factory=dict)  # the spec's per-run stability outcomes
    loss_every: int | None = None  # how often train/loss was logged (steps): what the spike count sees

    @property
    def included(self) -> bool:
        return self.outcome is not None

    @property
    def has_number(self) -> bool:
        return self.outcome in ("trains", "plateau") and math.isfinite(self.final)


def result(cell: str, params: dict[str, Any], seed: Any, run_dir: Path, status: str, metric: str,
           run: RunDir | None = None, reduce: Reduction | None = None,
           outcomes: dict[str, dict[str, Any]] | None = None) -> RunResult:
    """One run's result (read through `run`, else a `RunDir` of `run_dir`); `status` is `RunDir.status`'s; `reduce`:
    what one number of the metric is (default its final value); `outcomes`: the stability outcomes' rules."""
    base = RunResult(cell, params, seed, run_dir, status)
    if status not in INCLUDED:
        return base
    run = run or RunDir(run_dir)
    if not run.has_events:  # a run that diverged before it logged anything
        return RunResult(cell, params, seed, run_dir, status, "diverged") if status == "diverged" else base
    s = run.require_logged().scalars
    losses = [v for _, v in s.get(TRAIN_LOSS, [])]
    points = s.get(metric, [])
    final, final_step = (reduce or Reduction())(points)
    # a metric that was logged non-finite diverged; one never logged is missing (final NaN), not an outcome
    if not losses and status != "diverged":  # nothing to judge the outcome by (logged less often than it ran)
        return RunResult(cell, params, seed, run_dir, f"{status} without {TRAIN_LOSS}")
    stopped = status == "diverged" or (bool(points) and not math.isfinite(final))
    held_out = final if points and metric.endswith("loss") else None
    outcome = training_outcome(losses, stopped, held_out,
                               entropy=run_entropy(run, s) if losses and not stopped else math.nan)
    steps = max((p[-1][0] for tag, p in s.items() if tag.startswith("train/") and p), default=0)
    per_step = run.tokens_per_step()
    return RunResult(cell, params, seed, run_dir, status, outcome,
                     final if outcome != "diverged" else math.nan, final_step, steps, steps * per_step,
                     losses[0] if losses else math.nan, s[TRAIN_LOSS][0][0] if losses else None,
                     {tag: s[tag] for tag in (TRAIN_LOSS, metric) if tag in s}, per_step,
                     run_outcomes(s, outcomes or {}), logged_every(s.get(SPIKE_TAG, [])))


def run_entropy(run: RunDir, scalars: dict[str, Points]) -> float:
    """The unigram entropy (nats) of a run's training data: as its fit logged it (`ENTROPY_TAG`), else counted
    from the `data.path` of its config (a run trained before fits logged it) — or one UserError naming the run
    and how to make it readable."""
    if scalars.get(ENTROPY_TAG):
        return float(scalars[ENTROPY_TAG][-1][1])
    path = (run.config.get("data") or {}).get("path")
    sources = list(path.items()) if isinstance(path, dict) else [(path, 1.0)]
    try:
        return unigram_entropy(sources)
    except (OSError, TypeError, ValueError, KeyError) as e:
        raise UserError(f"run '{run.path}' does not record the unigram entropy of its training data ({ENTROPY_TAG}) "
                        f"and its data.path {path!r} cannot be read ({type(e).__name__}: {e}); run the report from "
                        "the directory its fit ran in, where data.path exists, to judge its plateau") from None


def _trained_config(record: dict[str, Any]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """What a run's record says it was trained with, less what differs between seeds: (fit arguments, -c hashes)."""
    args = tuple(a for a in record.get("command", [])[4:] if not a.startswith(PER_RUN_ARGS))
    return args, tuple(sorted((record.get("config_hashes") or {}).items()))


def check_one_config_per_cell(sweep_dir: Path, runs: list[dict[str, Any]]) -> None:
    """Refuse (one UserError naming the cell, its runs and what differs) a sweep with a cell whose included runs
    were trained with different configs — a spec or `-c` file edited between them: their mean would mix two
    configs. Reads each run's record (`sweep-run.json`: its command and `-c` hashes); runs without one are left
    out (nothing recorded, nothing trained by the sweep)."""
    cells: dict[str, dict[tuple, list[str]]] = {}
    for run in runs:
        record = RunDir(sweep_dir / str(run.get("run_dir"))).record
        if run.get("status") in INCLUDED and record is not None:
            cells.setdefault(run.get("cell"), {}).setdefault(_trained_config(record), []).append(run["run_dir"])
    for cell, configs in cells.items():
        if len(configs) > 1:
            ((args_a, hashes_a), runs_a), ((args_b, hashes_b), runs_b) = list(configs.items())[:2]
            what = [f"{a} / {b}" for a, b in zip(args_a, args_b, strict=False) if a != b]
            what += [f"{len(args_a)} / {len(args_b)} arguments"] if len(args_a) != len(args_b) else []
            what += [f"{file} edited between them" for file, digest in dict(hashes_a).items()
                     if dict(hashes_b).get(file, digest) != digest]
            raise UserError(f"cell '{cell}' holds runs trained with different configs ({', '.join(runs_a)} vs "
                            f"{', '.join(runs_b)}: {', '.join(what) or 'their -c files differ'}); the report would "
                            "judge them as one. Retrain the runs of one config (delete their directories, then run "
                            "the sweep again with the spec and files they should have)")

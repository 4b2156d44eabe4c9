"""One run's numbers, read back from what `normlab fit` wrote: the final metric, the outcome and the curves.

Shared by the sweep's report (training/sweep/report.py) and `normlab compare` (training/compare.py), so both
give the same number for the same run:
- final metric: the metric's value at the last step it was logged (TensorBoard events of the run directory; a
  step logged twice, as after a resume's purge, keeps its newest value), with that step. A run whose outcome
  is "diverged" has no final metric (NaN): it is counted as an outcome, never averaged as a number.
- outcome: `training.stats.training_outcome` of the run's logged `train/loss` values in step order (trains /
  stalled / diverged, the study's definition): "diverged" also whenever the runner recorded the run as
  diverged, the final metric is not finite, or a final loss (a metric whose tag ends in "loss") is above the
  initial loss — no better than not training, as in the study.
- initial loss: the first logged `train/loss` and its step (`initial_step`). `normlab fit` logs the loss of
  update 1 — the loss at initialization — at step 1 whatever `trainer.log_every_n_steps` is; a run written
  before that logs it only after `log_every_n_steps` updates, and the report says so.
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

import yaml

from training.checkpointing.layout import complete_checkpoints
from training.checkpointing.manifest import Manifest
from training.errors import UserError
from training.stats import training_outcome
from training.sweep.state import RUN_RECORD, read_json

TRAIN_LOSS = "train/loss"
PER_RUN_ARGS = ("--runs_dir=", "--name=", "--seed_everything=", "--data.seed=")  # what a cell's seeds differ in
INCLUDED = ("finished", "diverged")  # statuses whose runs the statistics use; the others are not done yet
Points = list[tuple[int, float]]


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted.key: value}."""
    if isinstance(config, dict):
        out: dict[str, Any] = {}
        for key, value in config.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: config}


def has_events(run_dir: Path) -> bool:
    return any(run_dir.glob("events.out.tfevents.*"))


def read_run(run_dir: Path) -> dict[str, Any]:
    """A run's flattened config, its scalars {tag: [(step, value)]} and its newest manifest (or None)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not (run_dir / "config.yaml").is_file() or not has_events(run_dir):
        raise UserError(f"'{run_dir}' is not a normlab run (no config.yaml and TensorBoard events); pass run "
                        "directories such as runs/NAME")
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    # sorted by wall time, so the newest value of a step logged twice wins
    scalars = {tag: sorted({e.step: e.value for e in sorted(acc.Scalars(tag), key=lambda e: e.wall_time)}.items())
               for tag in acc.Tags()["scalars"]}
    found = complete_checkpoints(run_dir)
    return {"dir": run_dir, "config": flatten(_run_config(run_dir / "config.yaml")),
            "scalars": scalars, "manifest": Manifest.read(found[-1]) if found else None}


def _run_config(path: Path) -> dict[str, Any]:
    """A run's config.yaml as a mapping; a damaged one is one UserError naming it."""
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (UnicodeDecodeError, yaml.YAMLError) as err:
        raise UserError(f"'{path}' is not a readable config ({type(err).__name__}: {' '.join(str(err).split())}); "
                        "restore it from a checkpoint's copy (checkpoints/step-*/config.yaml)") from None
    if not isinstance(config, dict):
        raise UserError(f"'{path}' holds a YAML {type(config).__name__}, not a run's config; restore it from a "
                        "checkpoint's copy (checkpoints/step-*/config.yaml)")
    return config


def plain_tags(tags: Iterable[str]) -> list[str]:
    """The tags without a per-layer index (`attn/max_logit/L3`), sorted: what an error message suggests."""
    return sorted({t for t in tags if not re.search(r"/L?\d+$", t)})


def tokens_per_step(run: dict[str, Any]) -> float:
    """Tokens one optimizer step trains on: from the newest manifest, else from the config."""
    manifest, config = run["manifest"], run["config"]
    if manifest and manifest.tokens_seen and manifest.step:
        return manifest.tokens_seen / manifest.step
    devices = config.get("trainer.devices")
    world = (devices if isinstance(devices, int) else 1) * (config.get("trainer.num_nodes") or 1)
    return float(config.get("data.batch_size") or 0) * (config.get("data.seq_len") or 0) * world * (
        config.get("trainer.accumulate_grad_batches") or 1)


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

    @property
    def included(self) -> bool:
        return self.outcome is not None

    @property
    def has_number(self) -> bool:
        return self.outcome in ("trains", "stalled") and math.isfinite(self.final)


def result(cell: str, params: dict[str, Any], seed: Any, run_dir: Path, status: str, metric: str,
           run: dict[str, Any] | None = None) -> RunResult:
    """Read one run (unless given its `read_run`); `status` is the runner's (finished, diverged, ...)."""
    base = RunResult(cell, params, seed, run_dir, status)
    if status not in INCLUDED:
        return base
    if run is None:
        if not has_events(run_dir):  # a run that diverged before it logged anything
            return RunResult(cell, params, seed, run_dir, status, "diverged") if status == "diverged" else base
        run = read_run(run_dir)
    s = run["scalars"]
    losses = [v for _, v in s.get(TRAIN_LOSS, [])]
    points = s.get(metric, [])
    final_step, final = points[-1] if points else (None, math.nan)
    # a metric that was logged non-finite diverged; one never logged is missing (final NaN), not an outcome
    if not losses and status != "diverged":  # nothing to judge the outcome by (logged less often than it ran)
        return RunResult(cell, params, seed, run_dir, f"{status} without {TRAIN_LOSS}")
    stopped = status == "diverged" or (bool(points) and not math.isfinite(final))
    outcome = training_outcome(losses, stopped, final if points and metric.endswith("loss") else None)
    steps = max((p[-1][0] for tag, p in s.items() if tag.startswith("train/") and p), default=0)
    per_step = tokens_per_step(run)
    return RunResult(cell, params, seed, run_dir, status, outcome,
                     final if outcome != "diverged" else math.nan, final_step, steps, steps * per_step,
                     losses[0] if losses else math.nan, s[TRAIN_LOSS][0][0] if losses else None,
                     {tag: s[tag] for tag in (TRAIN_LOSS, metric) if tag in s}, per_step)


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
        record = read_json(sweep_dir / str(run.get("run_dir")) / RUN_RECORD)
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

"""Which checkpoint a `normlab fit | validate | test` starts from, as one decision made before anything is built.

`plan(subcommand, ckpt_path, branch_from, run_dir)` reads only the checkpoints directories (manifests, complete
step directories) and returns a frozen `RunPlan`; `NormlabCLI` applies it (the Trainer's `ckpt_path`, the
logger's purge step, the `BranchSchedule` callback, what the manifests record). The cases:

| `--branch_from` | `--ckpt_path`          | plan                                                                 |
|-----------------|------------------------|----------------------------------------------------------------------|
| —               | —                      | a fresh run: the run directory must hold no checkpoints; purge all   |
| —               | `last`                 | the newest complete checkpoint, else a fresh run                     |
| —               | a step dir / a file    | that checkpoint (a foreign file: passed through, step unknown)      |
| X               | —                      | a new branch from X (fresh run directory, loads X, purge all)        |
| X               | `last`                 | the branch's own newest checkpoint (it must descend from X), else X  |
| X               | anything else          | refused: give one of them                                            |

Resumed checkpoints keep the lineage their manifest records (`branched_from`); a branch records its parent's.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.checkpointing import branch
from training.checkpointing.resume import check_fresh_run
from training.errors import CheckpointError, UserError
from training.run import layout
from training.run.manifest import Manifest, load_path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunPlan:
    """The outcome of `plan`: what the run loads and what it records."""

    load_path: str | None  # what `Trainer.fit | validate | test(ckpt_path=...)` gets (None: fresh weights)
    recorded_ckpt_path: str | None  # the `ckpt_path` the run's config.yaml records (what reruns this command)
    resumed_step: int | None  # the step of a normlab checkpoint being loaded (None: fresh, or a foreign file)
    parent: branch.Parent | None = None  # set when this fit starts a cooldown branch
    purge_step: int | None = None  # TensorBoard drops events at >= this step written before (fit only)
    lineage: dict[str, Any] | None = None  # the manifests' `branched_from` record


def plan(subcommand: str, ckpt_path: str | None, branch_from: str | None, run_dir: str | Path) -> RunPlan:
    """The plan for `normlab <subcommand> --ckpt_path <ckpt_path> --branch_from <branch_from>` in `run_dir`
    (see the module docstring's table). Raises `CheckpointError` / `UserError` naming the fix."""
    if branch_from is not None:
        parent = _branch_parent(subcommand, ckpt_path, branch_from, run_dir)
        if parent is not None:  # a new run: from the parent's checkpoint, into a fresh run directory
            check_fresh_run(run_dir)
            return RunPlan(parent.load_path, ckpt_path, parent.step, parent, purge_step=0, lineage=parent.record())
    load, step = resolve(ckpt_path, run_dir)
    if subcommand != "fit":
        return RunPlan(load, load, step)
    if ckpt_path is None:
        check_fresh_run(run_dir)
    lineage = None
    if load and (layout.ckpt_dir_of(load) / layout.MANIFEST).is_file():  # resumed: keep its record
        lineage = Manifest.read(layout.ckpt_dir_of(load)).branched_from
    # TensorBoard: drop what a crashed run logged after its checkpoint (steps > the checkpoint's; see
    # LitLM._log_eval for the step convention); everything on a fresh start.
    return RunPlan(load, load, step, purge_step=step + 1 if step is not None else 0, lineage=lineage)


def _branch_parent(subcommand: str, ckpt_path: str | None, branch_from: str, run_dir: str | Path
                   ) -> branch.Parent | None:
    """`--branch_from`: the parent to branch from, or None when `--ckpt_path last` finds the branch's own
    checkpoints to resume (which must have branched from the same parent)."""
    if subcommand != "fit":
        raise UserError(f"--branch_from applies to `normlab fit` (a new run), not `normlab {subcommand}`: "
                        "give the checkpoint with --ckpt_path")
    if ckpt_path not in (None, "last"):
        raise UserError(f"--branch_from {branch_from} and --ckpt_path {ckpt_path}: give one of them "
                        "(--branch_from starts a new run from another run's checkpoint; add --ckpt_path last to "
                        "resume that branch once it has checkpoints)")
    own = layout.complete_checkpoints(run_dir) if ckpt_path == "last" else []
    if own:
        branch.check_lineage(branch_from, Manifest.read(own[-1]), run_dir)
        return None
    return branch.resolve_parent(branch_from)


def resolve(ckpt_path: str | None, run_dir: str | Path) -> tuple[str | None, int | None]:
    """`--ckpt_path` → (the path to hand to `Trainer.fit`, the step it resumes at).

    `last`: the newest complete checkpoint of this run, or (None, None) when there is none yet — so the same
    command starts a job and resumes it after a preemption. A normlab checkpoint directory: its load path.
    Anything else (a Lightning file, a foreign DeepSpeed directory) is passed through unchanged.
    Every rank resolves on its own, before the processes connect; nothing writes to the checkpoints directory
    until they have (see `StepCheckpoint.setup`, which also checks that all ranks chose the same checkpoint).
    """
    if ckpt_path is None:
        return None, None
    if ckpt_path == "last":
        for path in layout.incomplete_checkpoints(run_dir):
            log.warning("--ckpt_path last: ignoring the incomplete checkpoint %s (an interrupted save)", path)
        found = layout.complete_checkpoints(run_dir)
        if not found:
            log.info("--ckpt_path last: no complete checkpoint in %s yet; starting from scratch",
                     layout.checkpoints_dir(run_dir))
            return None, None
        ckpt_dir = found[-1]
    else:
        ckpt_dir = Path(ckpt_path)
        if not ckpt_dir.exists():
            raise CheckpointError(f"--ckpt_path {ckpt_path}: no such checkpoint; give a step directory of a run "
                                  "(<run>/checkpoints/step-XXXXXXXX) or `last`")
        if not (ckpt_dir / layout.MANIFEST).is_file():
            _check_foreign(ckpt_path, ckpt_dir)
            return ckpt_path, None
    return str(load_path(ckpt_dir)), Manifest.read(ckpt_dir).step


def _check_foreign(ckpt_path: str, ckpt_dir: Path) -> None:
    """A `--ckpt_path` without a manifest must be a foreign checkpoint (a Lightning file, a DeepSpeed directory),
    not a normlab step directory whose save was interrupted, nor a directory that holds no checkpoint."""
    if ckpt_dir.is_dir() and layout.step_of_name(ckpt_dir.name) is not None:
        raise CheckpointError(f"--ckpt_path {ckpt_path}: no {layout.MANIFEST}, the save was interrupted; "
                              "resume from an earlier checkpoint (or --ckpt_path last)")
    if ckpt_dir.is_dir() and not (ckpt_dir / "latest").is_file():  # nor a DeepSpeed directory
        inside = layout.complete_checkpoints(ckpt_dir.parent) if ckpt_dir.name == layout.CHECKPOINTS_DIR else []
        hint = f" (the newest complete one here: {inside[-1]})" if inside else ""
        raise CheckpointError(f"--ckpt_path {ckpt_path}: a directory that is no checkpoint (no {layout.MANIFEST}, "
                              f"no DeepSpeed 'latest'); give a step directory{hint} or `last`")

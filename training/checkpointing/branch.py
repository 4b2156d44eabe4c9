"""Cooldown branches: a new run that starts from another run's checkpoint, with its own name and schedule.

`normlab fit --name cool-200 --branch_from runs/trunk/checkpoints/step-00000800 --optim.schedule wsd ...`
loads the parent's weights, optimizer state (AdamW moments and step counts), data position (tokens consumed),
guard window and every rank's RNG state, and continues the global step from the parent's step k — exactly
what `--ckpt_path` of that checkpoint would restore — except for what makes it a branch:
- its run directory is fresh (refused if it holds checkpoints, like any new run), so it gets its own TensorBoard
  run and checkpoints;
- the learning rate follows the branch's own `--optim.*` settings, evaluated at step k: the parent's scheduler
  state and every param group's values (lr and its `optim.groups` / μP multiplier, betas, eps, weight decay,
  Muon's settings) are replaced by the branch's own, group by group (`optim.restart_schedule`), and the
  schedule's length is the branch's `--trainer.max_steps` (or `--optim.decay_steps`);
- every checkpoint manifest of the branch records its parent under `branched_from` (checkpoint, run directory,
  step, tokens seen, config/tokenizer hashes, git revision, the sha256 of the parent's manifest, and the
  parent's own `branched_from`: the lineage).
The model config must match the parent's, with the same checks as a resume (`resume.check_fits`).
With the parent's own settings a branch therefore continues exactly like the parent (tested bit for bit).
`--ckpt_path last` beside `--branch_from` resumes the branch once it has checkpoints (and branches until then),
so one command starts and restarts a branch.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from training.errors import CheckpointError
from training.optim import restart_schedule
from training.run.dir import RunDir
from training.run.layout import LIGHTNING_FILE, MANIFEST, MODEL_CONFIG_FILE
from training.run.manifest import Manifest, load_path, read_verified

log = logging.getLogger(__name__)

MANIFEST_KEY = "branched_from"  # the Manifest field (and JSON key) recording a branch's parent


@dataclass(frozen=True)
class Parent:
    """A complete normlab checkpoint directory that a branch starts from."""

    ckpt_dir: Path  # absolute
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def load_path(self) -> str:
        """What `Trainer.fit(ckpt_path=...)` takes (see training/run/manifest.py `load_path`)."""
        return str(load_path(self.ckpt_dir))

    def record(self) -> dict[str, Any]:
        """What the branch's manifests record about this parent."""
        m = self.manifest
        run = RunDir.of_checkpoint(self.ckpt_dir)
        record = {"checkpoint": str(self.ckpt_dir), "run_dir": str(run.path) if run else None,
                  "step": self.step, "tokens_seen": m.tokens_seen, "config_hash": m.config_hash,
                  "tokenizer_hash": m.tokenizer_hash, "git_revision": m.git_revision,
                  "manifest_sha256": hashlib.sha256((self.ckpt_dir / MANIFEST).read_bytes()).hexdigest()}
        if m.branched_from:
            record[MANIFEST_KEY] = m.branched_from
        return record


def resolve_parent(branch_from: str) -> Parent:
    """`--branch_from` → the parent checkpoint, whole (every file its manifest lists, at its size); a step
    directory, or the `model.ckpt` inside one."""
    path = _step_dir(branch_from)
    where = f"--branch_from {branch_from}"
    if not path.exists():
        raise CheckpointError(f"{where}: no such checkpoint; give a complete step directory of another run "
                              "(<run>/checkpoints/step-XXXXXXXX)")
    if not path.is_dir() or not (path / MANIFEST).is_file():
        raise CheckpointError(f"{where}: no {MANIFEST} there — an interrupted save, or not a normlab checkpoint "
                              "directory; branch from a complete step directory (<run>/checkpoints/step-XXXXXXXX, "
                              "e.g. an earlier one)")
    manifest = read_verified(path)
    for needed in (MODEL_CONFIG_FILE, *([] if manifest.deepspeed else [LIGHTNING_FILE])):
        if not (path / needed).is_file():
            raise CheckpointError(f"{where}: '{needed}' is missing, the checkpoint is incomplete; branch from "
                                  "another step directory")
    return Parent(path.resolve(), manifest)


def _step_dir(branch_from: str) -> Path:
    """The step directory `--branch_from` names (it may also name the `model.ckpt` inside one)."""
    path = Path(branch_from)
    return path.parent if path.name == LIGHTNING_FILE else path


def check_lineage(branch_from: str, resumed_manifest: Manifest, run_dir: str | Path) -> None:
    """`--branch_from X --ckpt_path last` on a branch that has checkpoints: they must have branched from X. Only the
    recorded path is compared: a resumed branch never reads its parent again, which may be gone by then (the
    trunk's `keep_last_n` rotation)."""
    recorded = resumed_manifest.branched_from or {}
    if recorded.get("checkpoint") != str(_step_dir(branch_from).resolve()):
        origin = f"branched from {recorded['checkpoint']}" if recorded else "is not a branch"
        raise CheckpointError(f"--branch_from {branch_from} --ckpt_path last: {run_dir} already holds checkpoints of "
                              f"a run that {origin}; resume it without --branch_from, or branch into a new --name")


class BranchSchedule(Callback):
    """At the start of a branch's training (after Lightning restored the parent's optimizer and scheduler),
    put the branch's own hyper-parameters and LR schedule, at the inherited step, in their place. Attached by
    the CLI to a branch's first fit only: a resumed branch restores its own schedule from its checkpoint."""

    def __init__(self, parent_step: int) -> None:
        self.parent_step = parent_step

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step != self.parent_step:
            raise RuntimeError(f"a branch from step {self.parent_step} started training at step {trainer.global_step}")
        for config in trainer.lr_scheduler_configs:
            restart_schedule(config.scheduler, pl_module.optim, trainer.global_step)
        if trainer.is_global_zero:
            log.info("branch: continuing from step %d with this run's schedule (lr %.3g at this step)",
                     trainer.global_step, trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0])

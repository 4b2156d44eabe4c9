"""`StepCheckpoint`: when to save a crash-safe checkpoint — every N optimizer steps, the step a fit ends at,
on SIGTERM / Ctrl-C — and which old ones to remove (`keep_last_n`). How one is saved atomically, with a failing
rank's error held until every rank is through the save: `training/checkpointing/save.py` (`save_step`); the
layout: `training/run/layout.py`.

Every fit that ends normally also saves the step it ended at (unless that step is saved already): at
`max_steps`, when another callback stops it (`trainer.should_stop`), and on SIGTERM, Ctrl-C or the cluster's
warning signal, after which the ranks agree to stop after the same step (`StopOnSignal`, training/cluster/stop.py,
the callback right before this one) and the run exits cleanly once it is saved.
Old checkpoints are purged only after a new one is complete.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from training.checkpointing.resume import check_resume
from training.checkpointing.save import RunRecord, move_aside, save_step
from training.cluster.stop import StopOnSignal
from training.errors import CheckpointError
from training.run.layout import MANIFEST, ckpt_dir_of, complete_checkpoints, incomplete_checkpoints
from training.run.manifest import git_revision

log = logging.getLogger(__name__)


class StepCheckpoint(Callback):
    """Saves every `every_n_steps` optimizer steps into `<run dir>/checkpoints/step-XXXXXXXX/`, atomically (see
    the module docstring), keeping the newest `keep_last_n` complete checkpoints (None: all), and the step the
    fit ends at — also the step a `StopOnSignal` among the trainer's callbacks stopped it at (SIGTERM, Ctrl-C, the
    warning signal). `every_n_steps=0` disables every checkpoint, the final one too.

    The run directory is the trainer's `default_root_dir` (the CLI sets it to `runs/<name>`). The run's own state
    comes with the constructor (the CLI builds this callback with it; Lightning only learns the checkpoint path
    after `setup`): `resume_from`, the checkpoint this fit loads (the resolved `--ckpt_path`, which every rank must
    have resolved alike), and `record`, what every manifest of the run records — its full configuration as YAML, a
    cooldown branch's lineage (training/checkpointing/branch.py), the `--init_from` source
    (training/checkpointing/init_from.py); its git revision is this checkout's, taken at setup.
    """

    def __init__(self, every_n_steps: int = 100, keep_last_n: int | None = None, *, resume_from: str | None = None,
                 record: RunRecord | None = None) -> None:
        if every_n_steps < 0:
            raise ValueError(f"checkpoint.every_n_steps={every_n_steps} must be >= 0 (0 disables checkpoints)")
        if keep_last_n is not None and keep_last_n < 2:
            # One is not enough: a checkpoint found corrupt later must have a predecessor to fall back to.
            raise ValueError(f"checkpoint.keep_last_n={keep_last_n} must be >= 2, or null to keep every checkpoint")
        self.every_n_steps, self.keep_last_n = every_n_steps, keep_last_n
        self.resume_from, self.record = resume_from, record or RunRecord()
        self._last_saved = -1
        self._boundary = -1  # the global step of the last update boundary seen
        self._stop: StopOnSignal | None = None  # the trainer's, if any: whether the ranks stop after this step

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # The processes are connected now: every rank must resume the same checkpoint (each resolved `last` on
        # its own, see `resolve`), and from here on only rank 0 decides about the checkpoints directory.
        mine = self.resume_from
        theirs = trainer.strategy.broadcast(mine)
        if mine != theirs:
            raise CheckpointError(f"rank {trainer.global_rank} resolved the checkpoint {mine}, rank 0 {theirs}: "
                                  "the ranks do not see the same checkpoints directory (use shared storage)")
        self._stop = next((c for c in trainer.callbacks if isinstance(c, StopOnSignal)), None)
        if trainer.is_global_zero:
            self.record = dataclasses.replace(self.record, git_revision=git_revision())
            for path in incomplete_checkpoints(trainer.default_root_dir):
                move_aside(path, "an interrupted save: no manifest")
        if mine is not None and (ckpt_dir_of(mine) / MANIFEST).is_file():
            check_resume(ckpt_dir_of(mine), trainer, pl_module)
        trainer.strategy.barrier("StepCheckpoint.setup")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_saved = self._boundary = trainer.global_step  # never re-save the step a run resumed from

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        # Called once per micro-batch: with gradient accumulation the step repeats until the next update.
        if step == self._boundary:
            return
        self._boundary = step
        stopping = self._stop is not None and self._stop.decision.stop  # agreed at this boundary, just before
        last = stopping or 0 < trainer.max_steps <= step
        if self.every_n_steps and (last or step % self.every_n_steps == 0) and step != self._last_saved:
            path = self.save(trainer, pl_module)
            if last:
                self._announce(path, trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A fit stopped by another callback (trainer.should_stop) ends between the boundaries saved above.
        if self.every_n_steps and trainer.global_step != self._last_saved:
            self._announce(self.save(trainer, pl_module), trainer)

    def _announce(self, path: Path, trainer: Trainer) -> None:
        """Name the checkpoint a fit ended with: "final" only for a run that finished (max_steps reached, or its
        epochs run out), "stop" for one a signal or a callback stopped early — which resumes as it is."""
        if not trainer.is_global_zero:
            return
        step = trainer.global_step
        # (a signal's stop lowers the trainer's max_steps to this step: its decision decides, not max_steps)
        signalled = self._stop is not None and self._stop.decision.stop
        stopped = signalled or (trainer.should_stop and not 0 < trainer.max_steps <= step)
        if stopped:
            log.info("stop checkpoint (step %d): %s — stopped before the end; resume with --ckpt_path last", step, path)
        else:
            log.info("final checkpoint (step %d): %s — continue with --ckpt_path last", step, path)

    def save(self, trainer: Trainer, pl_module: LightningModule) -> Path:
        """Save this step (every rank: a collective), then remove checkpoints beyond `keep_last_n`."""
        path = save_step(trainer, pl_module, self.record)
        self._last_saved = trainer.global_step
        if trainer.is_global_zero and self.keep_last_n:
            self._purge(trainer.default_root_dir)
        return path

    def _purge(self, run_dir: str | Path) -> None:
        """Delete the oldest complete checkpoints beyond `keep_last_n` — only after a new one is complete. A step
        directory that is a symbolic link loses the link only: what it points to (an archived copy, another
        run's checkpoint) is not this run's to delete, and rmtree on a link would stop the run."""
        for old in complete_checkpoints(run_dir)[:-self.keep_last_n]:
            if old.is_symlink():
                target = os.readlink(old)
                old.unlink()
                log.warning("removed the symbolic link %s (checkpoint.keep_last_n=%d); what it points to, %s, is "
                            "kept", old, self.keep_last_n, target)
                continue
            shutil.rmtree(old)
            log.info("removed checkpoint %s (checkpoint.keep_last_n=%d)", old, self.keep_last_n)

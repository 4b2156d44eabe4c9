"""`StepCheckpoint`: crash-safe checkpoints every N optimizer steps (layout: `training/checkpointing/layout.py`).

A save is atomic (DeepSpeed writes shards in place and its `latest` can name a half-written checkpoint;
Lightning's DeepSpeed strategy bypasses Lightning's own atomic save — so it is done here):
1. rank 0 moves any leftover `.tmp-step-X` (a crashed attempt) aside; barrier;
2. every rank writes into `checkpoints/.tmp-step-X/` (DeepSpeed's save ends in a barrier);
3. rank 0 writes the sidecars, then the manifest (temporary file + fsync + rename), fsyncs the directory and
   renames it to `step-X`; its success is broadcast, so a failing rank 0 never leaves the others in a barrier;
4. only then are old checkpoints purged (`keep_last_n`).
A kill at any point leaves either the previous checkpoints untouched or a complete new one.

Every fit that ends normally also saves the step it ended at (unless that step is saved already): at
`max_steps`, when another callback stops it (`trainer.should_stop`), and on SIGTERM or Ctrl-C, after which the
ranks agree to stop after the same step (`stop_signals.py`) and the run exits cleanly once it is saved.

A rank whose file write fails does not raise at once: it would leave the other ranks waiting forever in the
save's remaining collectives. Its error is held until the save is over on every rank, then gathered, and every
rank raises the same error, naming the rank and its cause. A full disk reads the same whichever writer hit it
(`_write_error`): torch.save's zip writer reports it as a RuntimeError without an errno.

The manifest records every file's size and sha256 (checked before any load, see checkpointing/manifest.py).
Each rank hashes the shards it wrote right after writing them, while they are still in the page cache and in
parallel across ranks; rank 0 hashes only the small files it writes itself.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from training.callbacks.stop_signals import StopSignals
from training.checkpointing.layout import (
    CONFIG_FILE,
    DEEPSPEED_TAG,
    LIGHTNING_FILE,
    MANIFEST,
    MODEL_CONFIG_FILE,
    TMP_PREFIX,
    CheckpointError,
    checkpoints_dir,
    ckpt_dir_of,
    complete_checkpoints,
    config_hash,
    file_hash,
    file_sizes,
    fsync_path,
    git_revision,
    incomplete_checkpoints,
    move_aside,
    step_dirname,
    versions,
    write_text_atomic,
)
from training.checkpointing.manifest import Manifest, hash_file, hash_files
from training.checkpointing.resume import check_resume
from training.compat import hold_checkpoint_writes
from training.distributed import gather_objects
from training.strategy import is_deepspeed

log = logging.getLogger(__name__)

# torch.save's zip writer (PyTorchStreamWriter) turns a short write into a RuntimeError that carries no errno;
# on a local file a write comes up short when the disk (or the quota) is full.
_ZIP_WRITE_FAILED = ("PytorchStreamWriter failed writing", "inline_container.cc")


def _write_error(err: Exception) -> str:
    """One line for a failed checkpoint write; a full disk reads `OSError: [Errno 28] ...` from any writer."""
    if isinstance(err, RuntimeError) and any(mark in str(err) for mark in _ZIP_WRITE_FAILED):
        return f"OSError: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} (torch.save: {str(err).strip()})"
    return f"{type(err).__name__}: {err}"


@contextmanager
def _write_errors_held(trainer: Trainer) -> Iterator[tuple[list[str], list[Path]]]:
    """Within the block, an error from one of this rank's checkpoint writes is recorded in the first yielded list
    instead of raised, so the rank goes on through the save's remaining collectives (the second list: the files
    this rank wrote, hashed right after the save). A full disk shows as an OSError, or as a RuntimeError from
    torch.save's zip writer. Which writes are wrapped: see `compat.hold_checkpoint_writes`; DeepSpeed's `latest`
    is left to `_commit` (rank 0, after every shard is written — it would otherwise be a raw write on rank 0 just
    before DeepSpeed's last barrier)."""
    held: list[str] = []
    written: list[Path] = []
    strategy, rank = trainer.strategy, trainer.global_rank

    def holding(write: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                result = write(*args, **kwargs)
            except (OSError, RuntimeError) as err:
                log.error("rank %d could not write its checkpoint: %s", rank, err)
                held.append(_write_error(err))
                return None
            if len(args) >= 2 and isinstance(args[1], (str, os.PathLike)):  # save(state, path): a file written
                written.append(Path(args[1]))
            return result
        return call

    with hold_checkpoint_writes(strategy, is_deepspeed(strategy), holding):
        yield held, written


def _zero_stage(trainer: Trainer) -> int | None:
    if not is_deepspeed(trainer.strategy):
        return None
    return trainer.strategy.config.get("zero_optimization", {}).get("stage", 0)


class StepCheckpoint(Callback):
    """Saves every `every_n_steps` optimizer steps into `<run dir>/checkpoints/step-XXXXXXXX/`, atomically (see
    the module docstring), keeping the newest `keep_last_n` complete checkpoints (None: all), and the step the
    fit ends at — also on SIGTERM / Ctrl-C. `every_n_steps=0` disables every checkpoint, the final one too.

    The run directory is the trainer's `default_root_dir` (the CLI sets it to `runs/<name>`).
    `resolved_config` is the YAML text of the run's full configuration, `resume_from` the resolved
    `--ckpt_path` and `branched_from` the parent of a cooldown branch (training/checkpointing/branch.py),
    recorded in every manifest (all set by the CLI; Lightning only learns the checkpoint path after `setup`).
    """

    def __init__(self, every_n_steps: int = 100, keep_last_n: int | None = None) -> None:
        if every_n_steps < 0:
            raise ValueError(f"checkpoint.every_n_steps={every_n_steps} must be >= 0 (0 disables checkpoints)")
        if keep_last_n is not None and keep_last_n < 2:
            # One is not enough: a checkpoint found corrupt later must have a predecessor to fall back to.
            raise ValueError(f"checkpoint.keep_last_n={keep_last_n} must be >= 2, or null to keep every checkpoint")
        self.every_n_steps, self.keep_last_n = every_n_steps, keep_last_n
        self.resolved_config: str | None = None
        self.resume_from: str | None = None
        self.branched_from: dict[str, Any] | None = None
        self._last_saved = -1
        self._boundary = -1  # the global step of the last update boundary seen
        self._signals = StopSignals()
        self._git_revision = "unknown"

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
        if trainer.is_global_zero:
            self._git_revision = git_revision()
            for path in incomplete_checkpoints(trainer.default_root_dir):
                move_aside(path, "an interrupted save: no manifest")
        if mine is not None and (ckpt_dir_of(mine) / MANIFEST).is_file():
            check_resume(ckpt_dir_of(mine), trainer, pl_module)
        trainer.strategy.barrier("StepCheckpoint.setup")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_saved = self._boundary = trainer.global_step  # never re-save the step a run resumed from
        self._signals.install(trainer)  # after Lightning installed its own handlers (see stop_signals.py)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        # Called once per micro-batch: with gradient accumulation the step repeats until the next update.
        if step == self._boundary:
            return
        self._boundary = step
        stop = self._signals.agreed(trainer)  # a collective, at every update boundary of every rank
        last = stop or 0 < trainer.max_steps <= step
        if self.every_n_steps and (last or step % self.every_n_steps == 0) and step != self._last_saved:
            path = self.save(trainer, pl_module)
            if last:
                self._announce(path, trainer)
        if stop:
            # Ends the fit after this step, as max_steps does (trainer.should_stop would run one more validation).
            trainer.fit_loop.epoch_loop.max_steps = step
            if trainer.is_global_zero:
                log.warning("stopping after step %d on %s", step, self._signals.received or "another rank's signal")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._signals.restore()
        # A fit stopped by another callback (trainer.should_stop) ends between the boundaries saved above.
        if self.every_n_steps and trainer.global_step != self._last_saved:
            self._announce(self.save(trainer, pl_module), trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._signals.restore()

    def _announce(self, path: Path, trainer: Trainer) -> None:
        if trainer.is_global_zero:
            log.info("final checkpoint (step %d): %s — continue with --ckpt_path last", trainer.global_step, path)

    def save(self, trainer: Trainer, pl_module: LightningModule) -> Path:
        step = trainer.global_step
        root = checkpoints_dir(trainer.default_root_dir)
        final, tmp = root / step_dirname(step), root / (TMP_PREFIX + step_dirname(step))
        if trainer.is_global_zero:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                move_aside(tmp, "left by an interrupted save")
            if final.exists():  # e.g. re-training from an earlier checkpoint: keep the old one, aside
                move_aside(final, f"superseded by a new save of step {step}")
        trainer.strategy.barrier("StepCheckpoint.prepare")
        deepspeed = is_deepspeed(trainer.strategy)
        # Every rank calls save_checkpoint: it is a collective (shards, RNG gather), and it ends in a barrier.
        with _write_errors_held(trainer) as (held, written):
            trainer.save_checkpoint(tmp if deepspeed else tmp / LIGHTNING_FILE, weights_only=False)
        digests = {} if held else {str(p.relative_to(tmp)): hash_file(p) for p in written if p.is_file()}
        gathered = gather_objects((held[0] if held else None, digests))
        error = "; ".join(f"rank {rank}: {err}" for rank, (err, _) in enumerate(gathered) if err) or None
        if trainer.is_global_zero and error is None:
            known = {rel: digest for _, theirs in gathered for rel, digest in theirs.items()}
            try:
                self._commit(tmp, final, trainer, pl_module, "deepspeed" if deepspeed else "lightning", known)
            except OSError as err:
                error = _write_error(err)
        # Rank 0's outcome reaches every rank (a barrier would leave the others waiting forever if it raised).
        error = trainer.strategy.broadcast(error)
        if error is not None:
            raise CheckpointError(self._save_failed(error, tmp, trainer))
        self._last_saved = step
        if trainer.is_global_zero and self.keep_last_n:
            self._purge(trainer.default_root_dir)
        return final

    def _commit(self, tmp: Path, final: Path, trainer: Trainer, pl_module: LightningModule, fmt: str,
                digests: dict[str, str]) -> None:
        if fmt == "deepspeed":  # DeepSpeed's pointer to its tag, which its loaders read (see _write_errors_held)
            write_text_atomic(tmp / "latest", DEEPSPEED_TAG)
        self._write_sidecars(tmp, trainer, pl_module, fmt, digests)  # the manifest last
        for path in (tmp, *(p for p in tmp.rglob("*") if p.is_dir())):
            fsync_path(path)  # directory entries of every shard, before the rename publishes them
        os.replace(tmp, final)
        fsync_path(final.parent)
        log.info("saved checkpoint %s", final)

    def _save_failed(self, error: str, tmp: Path, trainer: Trainer) -> str:
        where = ""
        if trainer.is_global_zero and tmp.exists():
            where = f"; the partial checkpoint was moved to {move_aside(tmp, 'the save failed')}"
        disk_full = f"[Errno {errno.ENOSPC}]" in error
        cause = "the disk is full" if disk_full else "writing failed"
        try:  # what is left there now (a full disk, or what the failed save freed again)
            free = f"; {shutil.disk_usage(tmp.parent).free / 2**30:.1f} GiB free there"
        except OSError:
            free = ""
        return (f"saving checkpoint step {trainer.global_step} into {tmp.parent} failed: {cause} ({error}){free}"
                f"{where}. Earlier checkpoints are intact: free space (or set --checkpoint.keep_last_n), then resume "
                "with --ckpt_path last")

    def _purge(self, run_dir: str | Path) -> None:
        """Delete the oldest complete checkpoints beyond `keep_last_n` — only after a new one is complete."""
        for old in complete_checkpoints(run_dir)[:-self.keep_last_n]:
            shutil.rmtree(old)
            log.info("removed checkpoint %s (checkpoint.keep_last_n=%d)", old, self.keep_last_n)

    def _write_sidecars(self, ckpt_dir: Path, trainer: Trainer, pl_module: LightningModule, fmt: str,
                        digests: dict[str, str]) -> None:
        if self.resolved_config is not None:
            write_text_atomic(ckpt_dir / CONFIG_FILE, self.resolved_config)
        model_config = pl_module.config.to_dict()
        write_text_atomic(ckpt_dir / MODEL_CONFIG_FILE, json.dumps(model_config, indent=2) + "\n")
        datamodule = trainer.datamodule
        manifest = Manifest(
            step=trainer.global_step,
            tokens_seen=datamodule.tokens_seen(),  # across restarts, also on other world sizes
            format=fmt,
            world_size=trainer.world_size,
            zero_stage=_zero_stage(trainer),
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            micro_batch_size=datamodule.batch_size,
            seq_len=datamodule.seq_len,
            config_hash=config_hash(model_config),
            tokenizer_hash=file_hash(datamodule.tokenizer_path),
            versions=versions(),
            git_revision=self._git_revision,
            time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            branched_from=self.branched_from,
            # checked before a resume or a load (see verify_files); shards were hashed by the ranks that wrote them
            files=file_sizes(ckpt_dir),
            sha256=hash_files(ckpt_dir, digests),
        )
        write_text_atomic(ckpt_dir / MANIFEST, manifest.to_json())  # last: marks complete

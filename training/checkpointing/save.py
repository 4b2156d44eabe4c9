"""`save_step`: the mechanism of one crash-safe checkpoint save (when to save is `StepCheckpoint`'s policy,
training/callbacks/step_checkpoint.py; the layout is training/run/layout.py).

A save is atomic (DeepSpeed and FSDP2's DCP write shards in place, and DeepSpeed's `latest` can name a half-written
checkpoint; Lightning's DeepSpeed strategy bypasses Lightning's own atomic save — so it is done here):
1. rank 0 moves any leftover `.tmp-step-X` (a crashed attempt) aside; barrier;
2. every rank writes into `checkpoints/.tmp-step-X/` (DeepSpeed's and DCP's saves are collectives);
3. rank 0 writes the sidecars, then the manifest (temporary file + fsync + rename), fsyncs the directory and
   renames it to `step-X`; its success is broadcast, so a failing rank 0 never leaves the others in a barrier.
A kill at any point leaves either the previous checkpoints untouched or a complete new one.

A rank whose file write fails does not raise at once: it would leave the other ranks waiting forever in the
save's remaining collectives. Its error is held until the save is over on every rank, then gathered, and every
rank raises the same error, naming the rank and its cause. A full disk reads the same whichever writer hit it
(`_write_error`): torch.save's zip writer reports it as a RuntimeError without an errno.

The manifest records every file's size and sha256 (checked before any load, see training/run/manifest.py).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule, Trainer

from data.atomic import fsync_path, write_text_atomic
from training.distributed import gather_objects, is_deepspeed, is_fsdp2
from training.errors import CheckpointError
from training.precision import precision_record
from training.run.layout import (
    CONFIG_FILE,
    DEEPSPEED_TAG,
    INCOMPLETE_DIR,
    LIGHTNING_FILE,
    MODEL_CONFIG_FILE,
    TMP_PREFIX,
    checkpoints_dir,
    step_dirname,
)
from training.run.manifest import VERSION as MANIFEST_VERSION
from training.run.manifest import Manifest, config_hash, file_hash, file_sizes, hash_file, hash_files, versions

log = logging.getLogger(__name__)

# torch.save's zip writer (PyTorchStreamWriter) turns a short write into a RuntimeError that carries no errno;
# on a local file a write comes up short when the disk (or the quota) is full.
_ZIP_WRITE_FAILED = ("PytorchStreamWriter failed writing", "inline_container.cc")


@dataclass(frozen=True)
class RunRecord:
    """What every manifest of a run records besides the trainer's state (set by the CLI and StepCheckpoint)."""

    resolved_config: str | None = None  # the run's full configuration as YAML, copied beside the checkpoint
    branched_from: dict[str, Any] | None = None  # a cooldown branch's lineage (training/checkpointing/branch.py)
    init_from: dict[str, Any] | None = None  # the weights a run started from (training/checkpointing/init_from.py)
    git_revision: str = "unknown"


def move_aside(path: Path, reason: str) -> Path:
    """Move a checkpoint directory to `checkpoints/incomplete/` (never delete it) and say so."""
    dest_dir = path.parent / INCOMPLETE_DIR
    dest_dir.mkdir(exist_ok=True)
    dest = dest_dir / path.name.removeprefix(TMP_PREFIX)
    n = 1
    while dest.exists():
        dest, n = dest_dir / f"{path.name.removeprefix(TMP_PREFIX)}.{n}", n + 1
    os.replace(path, dest)
    log.warning("moved %s aside to %s (%s)", path, dest, reason)
    return dest


def save_step(trainer: Trainer, pl_module: LightningModule, record: RunRecord) -> Path:
    """Save the trainer's state at its global step into `<run dir>/checkpoints/step-XXXXXXXX/`, atomically (see
    the module docstring); a collective, called by every rank. Returns the step directory; raises
    `CheckpointError` (the same on every rank) when any rank's write failed."""
    step = trainer.global_step
    root = checkpoints_dir(trainer.default_root_dir)
    final, tmp = root / step_dirname(step), root / (TMP_PREFIX + step_dirname(step))
    if trainer.is_global_zero:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            move_aside(tmp, "left by an interrupted save")
        if final.exists():  # e.g. re-training from an earlier checkpoint: keep the old one, aside
            move_aside(final, f"superseded by a new save of step {step}")
    trainer.strategy.barrier("save_step.prepare")
    fmt = checkpoint_format(trainer.strategy)
    # Every rank calls save_checkpoint: it is a collective (shards, RNG gather), and it ends in a barrier.
    with _write_errors_held(trainer) as (held, written):
        if fmt == "deepspeed":  # DeepSpeed's `latest` is left to `_commit` (rank 0, once every shard is written)
            trainer.save_checkpoint(tmp, weights_only=False, storage_options={"save_latest": False})
        elif fmt == "dcp":  # every rank its shards, rank 0 the rest (training/fsdp2.py)
            trainer.save_checkpoint(tmp, weights_only=False)
        else:
            trainer.save_checkpoint(tmp / LIGHTNING_FILE, weights_only=False)
    digests = {} if held else {str(p.relative_to(tmp)): hash_file(p) for p in written if p.is_file()}
    gathered = gather_objects((held[0] if held else None, digests))
    error = "; ".join(f"rank {rank}: {err}" for rank, (err, _) in enumerate(gathered) if err) or None
    if trainer.is_global_zero and error is None:
        known = {rel: digest for _, theirs in gathered for rel, digest in theirs.items()}
        try:
            _commit(tmp, final, trainer, pl_module, fmt, record, known)
        except OSError as err:
            error = _write_error(err)
    # Rank 0's outcome reaches every rank (a barrier would leave the others waiting forever if it raised).
    error = trainer.strategy.broadcast(error)
    if error is not None:
        raise CheckpointError(_save_failed(error, tmp, trainer))
    return final


def checkpoint_format(strategy: Any) -> str:
    """What the manifest's `format` says a checkpoint of `strategy` is: "deepspeed" (DeepSpeed's directory), "dcp"
    (FSDP2's Distributed Checkpoint shards and meta.pt) or "lightning" (model.ckpt)."""
    return "deepspeed" if is_deepspeed(strategy) else "dcp" if is_fsdp2(strategy) else "lightning"


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
    torch.save's zip writer. The writes: under DeepSpeed, every file its engine writes (its checkpoint engine and
    the recovery-script copy, `DeepSpeed.writes_held` in training/strategy.py), but `latest`, left to `_commit`
    (it would otherwise be a raw write on rank 0 just before DeepSpeed's last barrier); under FSDP2 its DCP shards
    and meta.pt (`FSDP2.writes_held`, training/fsdp2.py); otherwise Lightning's checkpoint IO (`_HeldIO`). A
    write that returns a list of paths wrote those files (DCP: this rank's shards); otherwise the file is the
    write's second argument (`save(state, path)`)."""
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
            if isinstance(result, list):
                written.extend(result)
            elif len(args) >= 2 and isinstance(args[1], (str, os.PathLike)):  # save(state, path): a file written
                written.append(Path(args[1]))
            return result
        return call

    if is_deepspeed(strategy) or is_fsdp2(strategy):
        with strategy.writes_held(holding):
            yield held, written
        return
    io = strategy.checkpoint_io
    strategy.checkpoint_io = _HeldIO(io, holding)
    try:
        yield held, written
    finally:
        strategy.checkpoint_io = io


class _HeldIO(CheckpointIO):
    """Lightning's checkpoint IO `io` for one save, its writes through `hold`."""

    def __init__(self, io: CheckpointIO, hold: Any) -> None:
        self.io, self.hold = io, hold

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.hold(self.io.save_checkpoint)(checkpoint, path, storage_options)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        return self.io.load_checkpoint(*args, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        self.io.remove_checkpoint(path)


def _commit(tmp: Path, final: Path, trainer: Trainer, pl_module: LightningModule, fmt: str,
            record: RunRecord, digests: dict[str, str]) -> None:
    if fmt == "deepspeed":  # DeepSpeed's pointer to its tag, which its loaders read (see _write_errors_held)
        write_text_atomic(tmp / "latest", DEEPSPEED_TAG)
    _write_sidecars(tmp, trainer, pl_module, fmt, record, digests)  # the manifest last
    for path in (tmp, *(p for p in tmp.rglob("*") if p.is_dir())):
        fsync_path(path)  # directory entries of every shard, before the rename publishes them
    os.replace(tmp, final)
    fsync_path(final.parent)
    log.info("saved checkpoint %s", final)


def _save_failed(error: str, tmp: Path, trainer: Trainer) -> str:
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


def _zero_stage(trainer: Trainer) -> int | None:
    if not is_deepspeed(trainer.strategy):
        return None
    return trainer.strategy.config.get("zero_optimization", {}).get("stage", 0)


def _write_sidecars(ckpt_dir: Path, trainer: Trainer, pl_module: LightningModule, fmt: str,
                    record: RunRecord, digests: dict[str, str]) -> None:
    if record.resolved_config is not None:
        write_text_atomic(ckpt_dir / CONFIG_FILE, record.resolved_config)
    model_config = pl_module.config.to_dict()
    write_text_atomic(ckpt_dir / MODEL_CONFIG_FILE, json.dumps(model_config, indent=2) + "\n")
    datamodule = trainer.datamodule
    manifest = Manifest(
        step=trainer.global_step,
        manifest_version=MANIFEST_VERSION,
        tokens_seen=datamodule.tokens_seen(),  # across restarts, also on other world sizes
        format=fmt,
        world_size=trainer.world_size,
        zero_stage=_zero_stage(trainer),
        precision=precision_record(trainer, pl_module),  # one regime on every strategy (training/strategy.py)
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        micro_batch_size=datamodule.batch_size,
        seq_len=datamodule.seq_len,
        config_hash=config_hash(model_config),
        tokenizer_hash=file_hash(datamodule.tokenizer_path),
        versions=versions(),
        git_revision=record.git_revision,
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        branched_from=record.branched_from,
        init_from=record.init_from,
        schedule=getattr(pl_module, "schedule_record", None),  # what a resume continues (optim/continuation.py)
        # checked before a resume or a load (see verify_files); shards were hashed by the ranks that wrote them
        files=file_sizes(ckpt_dir),
        sha256=hash_files(ckpt_dir, digests),
    )
    manifest.write(ckpt_dir)  # last: marks complete

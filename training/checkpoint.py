"""Checkpoint naming, resolution and crash-safe writing: `runs/<name>/checkpoints/step-XXXXXXXX/`.

Every checkpoint is a directory, whatever the strategy, so that one name means one checkpoint:
- under DeepSpeed it is DeepSpeed's own sharded checkpoint directory (each rank writes its shards);
- otherwise it holds Lightning's single file, `model.ckpt`.
Beside the weights: `config.yaml` (the resolved CLI config), `model_config.json` (the exact `ModelConfig`) and
`manifest.json` (step, tokens seen, format, world size, ZeRO stage, config and tokenizer hashes, versions, git
revision).

A save is atomic (DeepSpeed writes shards in place and its `latest` can name a half-written checkpoint;
Lightning's DeepSpeed strategy bypasses Lightning's own atomic save — so it is done here):
1. rank 0 moves any leftover `.tmp-step-X` (a crashed attempt) aside; barrier;
2. every rank writes into `checkpoints/.tmp-step-X/` (DeepSpeed's save ends in a barrier);
3. rank 0 writes the sidecars, then the manifest (temporary file + fsync + rename), fsyncs the directory and
   renames it to `step-X`; its success is broadcast, so a failing rank 0 never leaves the others in a barrier;
4. only then are old checkpoints purged (`keep_last_n`).
A kill at any point leaves either the previous checkpoints untouched or a complete new one. `last` considers
only directories with a manifest; at the next fit, rank 0 moves incomplete ones to `checkpoints/incomplete/`
and logs it — nothing is deleted silently.

Fault injection for tests (`NORMLAB_FAULT=<point>@<step>`, with `NORMLAB_FAULT_MARKER=<file>` touched when
a pause begins; `NORMLAB_FAULT_RANK=<r>` limits it to one rank): `pause_after_shards` (every shard written, no
manifest yet), `pause_before_step` (between optimizer steps), `enospc_manifest` (the manifest write fails with
ENOSPC, as on a full disk), `enospc_shard` (a checkpoint file write fails with ENOSPC).

A rank whose file write fails does not raise at once: it would leave the other ranks waiting forever in the
save's remaining collectives. Its error is held until the save is over on every rank, then gathered, and every
rank raises the same error, naming the rank and its cause.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import time
from importlib import metadata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from data.tokenizer import sha256_file
from training.strategy import is_deepspeed

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
INCOMPLETE_DIR = "incomplete"  # inside checkpoints/: interrupted saves, moved aside at the next fit
MANIFEST = "manifest.json"
CONFIG_FILE = "config.yaml"
MODEL_CONFIG_FILE = "model_config.json"
LIGHTNING_FILE = "model.ckpt"  # the checkpoint file inside the directory when not under DeepSpeed
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
FAULT_ENV, FAULT_MARKER_ENV, FAULT_RANK_ENV = "NORMLAB_FAULT", "NORMLAB_FAULT_MARKER", "NORMLAB_FAULT_RANK"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, unreadable or does not fit this run; the message names the path
    and the fix."""


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def read_manifest(ckpt_dir: str | Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest, dict) or not isinstance(manifest.get("step"), int):
            raise ValueError("it has no integer 'step'")
        return manifest
    except (OSError, UnicodeDecodeError, ValueError) as err:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"corrupt manifest '{path}' ({err}): move {Path(ckpt_dir).name} out of the "
                              "checkpoints directory and resume from the previous checkpoint") from err


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's complete checkpoint directories (with a manifest), oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def incomplete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Interrupted saves: temporary directories, and step directories without a manifest."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (
        p.name.startswith(TMP_PREFIX) or (_STEP_DIR.match(p.name) and not (p / MANIFEST).is_file())))


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


def load_path(ckpt_dir: Path) -> Path:
    """What the strategy's loader takes: the directory itself for DeepSpeed, the file inside it otherwise."""
    return ckpt_dir if read_manifest(ckpt_dir)["format"] == "deepspeed" else ckpt_dir / LIGHTNING_FILE


def ckpt_dir_of(load_path: str | Path) -> Path:
    """Inverse of `load_path`: the step directory of what `Trainer.fit` was given."""
    path = Path(load_path)
    return path if path.is_dir() else path.parent


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
        for path in incomplete_checkpoints(run_dir):
            log.warning("--ckpt_path last: ignoring the incomplete checkpoint %s (an interrupted save)", path)
        found = complete_checkpoints(run_dir)
        if not found:
            log.info("--ckpt_path last: no complete checkpoint in %s yet; starting from scratch",
                     checkpoints_dir(run_dir))
            return None, None
        ckpt_dir = found[-1]
    else:
        ckpt_dir = Path(ckpt_path)
        if not ckpt_dir.exists():
            raise FileNotFoundError(f"--ckpt_path {ckpt_path}: no such checkpoint")
        if not (ckpt_dir / MANIFEST).is_file():
            if ckpt_dir.is_dir() and _STEP_DIR.match(ckpt_dir.name):
                raise CheckpointError(f"--ckpt_path {ckpt_path}: no {MANIFEST}, the save was interrupted; "
                                      "resume from an earlier checkpoint (or --ckpt_path last)")
            return ckpt_path, None
    return str(load_path(ckpt_dir)), int(read_manifest(ckpt_dir)["step"])


def check_fresh_run(run_dir: str | Path) -> None:
    """A new (non-resumed) fit must not write over another run's checkpoints."""
    found = complete_checkpoints(run_dir)
    if found:
        raise FileExistsError(
            f"{run_dir} already holds checkpoints (newest: {found[-1].name}). Resume it with `--ckpt_path last`, "
            f"or start a new run with `--name <new name>`."
        )


def check_format(ckpt_path: str, deepspeed: bool) -> None:
    """A DeepSpeed checkpoint directory resumes only under DeepSpeed, a Lightning file only without it."""
    if Path(ckpt_path).is_dir() and not deepspeed:
        raise ValueError(f"{ckpt_path} is a DeepSpeed checkpoint: load it under DeepSpeed, with the ZeRO stage "
                         "that wrote it (e.g. --trainer.strategy zero2)")
    if Path(ckpt_path).is_file() and deepspeed:
        raise ValueError(f"{ckpt_path} is a Lightning checkpoint file: load it without DeepSpeed "
                         "(--trainer.strategy auto)")


def git_revision(repo: Path = Path(__file__).resolve().parents[1]) -> str:
    """The commit of the code that is running, `-dirty` if tracked files changed; `unknown` outside git."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def config_hash(model_config: dict[str, Any]) -> str:
    """sha256 of the model config in canonical JSON: equal hashes ⇔ the same architecture."""
    return hashlib.sha256(json.dumps(model_config, sort_keys=True).encode()).hexdigest()


def file_hash(path: str | Path | None) -> str | None:
    if path is None or not Path(path).is_file():
        return None
    return sha256_file(path)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for package in ("normlab", "torch", "lightning", "deepspeed"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return out


def file_sizes(ckpt_dir: Path) -> dict[str, int]:
    """{relative path: bytes} of every file in a checkpoint directory but the manifest (recorded in it)."""
    return {str(p.relative_to(ckpt_dir)): p.stat().st_size for p in sorted(ckpt_dir.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def verify_files(ckpt_dir: Path, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists is there with its size: a missing or truncated shard fails here, with its
    name, instead of deep inside a loader."""
    for rel, size in (manifest.get("files") or {}).items():
        path = ckpt_dir / rel
        if not path.is_file():
            raise CheckpointError(f"checkpoint {ckpt_dir} is damaged: '{rel}' is missing; restore it or use an "
                                  "earlier checkpoint")
        if path.stat().st_size != size:
            raise CheckpointError(f"checkpoint {ckpt_dir} is damaged: '{rel}' is truncated or altered "
                                  f"({path.stat().st_size} bytes, {size} when saved); use an earlier checkpoint")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temporary file, fsync and rename, so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fault(point: str, step: int, rank: int | None = None) -> None:
    """The test injection point `point` at optimizer step `step` (see the module docstring); a no-op unless
    NORMLAB_FAULT names it (and NORMLAB_FAULT_RANK, when set, names `rank`)."""
    if os.environ.get(FAULT_ENV) != f"{point}@{step}":
        return
    if os.environ.get(FAULT_RANK_ENV) not in (None, str(rank)):
        return
    if point.startswith("enospc"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + f" (injected by {FAULT_ENV})")
    log.warning("%s: pausing at %s of step %d until killed", FAULT_ENV, point, step)
    if os.environ.get(FAULT_MARKER_ENV):
        Path(os.environ[FAULT_MARKER_ENV]).write_text(f"{point}@{step} pid={os.getpid()}\n")
    while True:
        time.sleep(1)


@contextmanager
def _write_errors_held(trainer: Trainer) -> Iterator[list[str]]:
    """Within the block, an OSError from one of this rank's checkpoint file writes (DeepSpeed's checkpoint engine,
    or Lightning's checkpoint IO) is recorded in the yielded list instead of raised, so the rank goes on through
    the save's remaining collectives."""
    held: list[str] = []
    strategy = trainer.strategy
    owner, name = ((strategy.deepspeed_engine.checkpoint_engine, "save") if is_deepspeed(strategy)
                   else (strategy.checkpoint_io, "save_checkpoint"))
    write = getattr(owner, name)

    def holding(*args: Any, **kwargs: Any) -> Any:
        try:
            fault("enospc_shard", trainer.global_step, trainer.global_rank)
            return write(*args, **kwargs)
        except OSError as err:
            log.error("rank %d could not write its checkpoint file: %s", trainer.global_rank, err)
            held.append(f"{type(err).__name__}: {err}")
            return None

    setattr(owner, name, holding)
    try:
        yield held
    finally:
        setattr(owner, name, write)


def _gather(trainer: Trainer, value: str | None) -> list[str | None]:
    """Every rank's `value`, in rank order, on every rank."""
    if trainer.world_size == 1 or not torch.distributed.is_initialized():
        return [value]
    values: list[str | None] = [None] * trainer.world_size
    torch.distributed.all_gather_object(values, value)
    return values


def _zero_stage(trainer: Trainer) -> int | None:
    if not is_deepspeed(trainer.strategy):
        return None
    return trainer.strategy.config.get("zero_optimization", {}).get("stage", 0)


class StepCheckpoint(Callback):
    """Saves every `every_n_steps` optimizer steps into `<run dir>/checkpoints/step-XXXXXXXX/`, atomically (see
    the module docstring), keeping the newest `keep_last_n` complete checkpoints (None: all).

    The run directory is the trainer's `default_root_dir` (the CLI sets it to `runs/<name>`).
    `resolved_config` is the YAML text of the run's full configuration and `resume_from` the resolved
    `--ckpt_path` (both set by the CLI; Lightning only learns the checkpoint path after `setup`).
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
        self._last_saved = -1
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
        self._last_saved = trainer.global_step  # never re-save the step a run resumed from

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.is_global_zero:
            fault("pause_before_step", trainer.global_step)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        # Called once per micro-batch: with gradient accumulation the step repeats until the next update.
        if self.every_n_steps and step % self.every_n_steps == 0 and step != self._last_saved:
            self.save(trainer, pl_module)

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
        with _write_errors_held(trainer) as held:
            trainer.save_checkpoint(tmp if deepspeed else tmp / LIGHTNING_FILE, weights_only=False)
        failed = _gather(trainer, held[0] if held else None)
        error = "; ".join(f"rank {rank}: {err}" for rank, err in enumerate(failed) if err) or None
        if trainer.is_global_zero and error is None:
            fault("pause_after_shards", step)
            try:
                self._commit(tmp, final, trainer, pl_module, "deepspeed" if deepspeed else "lightning")
            except OSError as err:
                error = f"{type(err).__name__}: {err}"
        # Rank 0's outcome reaches every rank (a barrier would leave the others waiting forever if it raised).
        error = trainer.strategy.broadcast(error)
        if error is not None:
            raise CheckpointError(self._save_failed(error, tmp, trainer))
        self._last_saved = step
        if trainer.is_global_zero and self.keep_last_n:
            self._purge(trainer.default_root_dir)
        return final

    def _commit(self, tmp: Path, final: Path, trainer: Trainer, pl_module: LightningModule, fmt: str) -> None:
        self._write_sidecars(tmp, trainer, pl_module, fmt)  # the manifest last
        for path in (tmp, *(p for p in tmp.rglob("*") if p.is_dir())):
            _fsync(path)  # directory entries of every shard, before the rename publishes them
        os.replace(tmp, final)
        _fsync(final.parent)
        log.info("saved checkpoint %s", final)

    def _save_failed(self, error: str, tmp: Path, trainer: Trainer) -> str:
        where = ""
        if trainer.is_global_zero and tmp.exists():
            where = f"; the partial checkpoint was moved to {move_aside(tmp, 'the save failed')}"
        disk_full = str(errno.ENOSPC) in error or "No space left" in error
        cause = "the disk is full" if disk_full else "writing failed"
        return (f"saving checkpoint step {trainer.global_step} into {tmp.parent} failed: {cause} ({error}){where}. "
                "Earlier checkpoints are intact: free space (or set --checkpoint.keep_last_n), then resume with "
                "--ckpt_path last")

    def _purge(self, run_dir: str | Path) -> None:
        """Delete the oldest complete checkpoints beyond `keep_last_n` — only after a new one is complete."""
        for old in complete_checkpoints(run_dir)[:-self.keep_last_n]:
            shutil.rmtree(old)
            log.info("removed checkpoint %s (checkpoint.keep_last_n=%d)", old, self.keep_last_n)

    def _write_sidecars(self, ckpt_dir: Path, trainer: Trainer, pl_module: LightningModule, fmt: str) -> None:
        if self.resolved_config is not None:
            write_text_atomic(ckpt_dir / CONFIG_FILE, self.resolved_config)
        model_config = pl_module.config.to_dict()
        write_text_atomic(ckpt_dir / MODEL_CONFIG_FILE, json.dumps(model_config, indent=2) + "\n")
        datamodule = trainer.datamodule
        manifest = {
            "step": trainer.global_step,
            "tokens_seen": datamodule.tokens_seen(),  # across restarts, also on other world sizes
            "format": fmt,
            "world_size": trainer.world_size,
            "zero_stage": _zero_stage(trainer),
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "micro_batch_size": datamodule.batch_size,
            "seq_len": datamodule.seq_len,
            "config_hash": config_hash(model_config),
            "tokenizer_hash": file_hash(datamodule.tokenizer_path),
            "versions": versions(),
            "git_revision": self._git_revision,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": file_sizes(ckpt_dir),  # checked before a resume or a load (see verify_files)
        }
        fault("enospc_manifest", trainer.global_step)
        write_text_atomic(ckpt_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")  # last: marks complete


def check_resume(ckpt_dir: Path, trainer: Trainer, pl_module: LightningModule) -> None:
    """Refuse to resume a checkpoint that does not fit this run (same result on every rank: no collective)."""
    manifest = read_manifest(ckpt_dir)
    verify_files(ckpt_dir, manifest)
    config_file = ckpt_dir / MODEL_CONFIG_FILE
    if config_file.is_file():
        saved = json.loads(config_file.read_text())
        current = pl_module.model_config().to_dict()
        if config_hash(saved) != config_hash(current):
            diff = ", ".join(f"{k}: {saved.get(k)!r} → {current.get(k)!r}" for k in sorted(set(saved) | set(current))
                             if saved.get(k) != current.get(k))
            raise CheckpointError(
                f"cannot resume {ckpt_dir}: the model config changed ({diff}). "
                "Resume with the checkpoint's model config (see its model_config.json), or start a new run "
                "with --name")
    saved_tok = manifest.get("tokenizer_hash")
    current_tok = file_hash(trainer.datamodule.tokenizer_path)
    if saved_tok and current_tok and saved_tok != current_tok:
        raise CheckpointError(f"cannot resume {ckpt_dir}: the tokenizer differs from the one it was trained with "
                              f"({trainer.datamodule.tokenizer_path} has another hash); use the run's --data.path")
    saved_world = manifest.get("world_size")
    if saved_world is not None and saved_world != trainer.world_size:
        check_reshard(ckpt_dir, manifest, trainer)


def check_reshard(ckpt_dir: Path, manifest: dict[str, Any], trainer: Trainer) -> None:
    """A world-size change on resume: which formats reshard, and what happens to the data position."""
    saved_world, stage = manifest["world_size"], manifest.get("zero_stage")
    if manifest.get("format") == "deepspeed" and stage not in (1, 2, 3):
        raise CheckpointError(
            f"cannot resume {ckpt_dir} (DeepSpeed ZeRO stage {stage}, {saved_world} ranks) on {trainer.world_size} "
            "ranks: only ZeRO-1/2/3 checkpoints convert to DeepSpeed's universal format. Resume on "
            f"{saved_world} ranks, or start a new run from its consolidated weights (`normlab export`)")
    if trainer.is_global_zero:
        log.warning("resuming %s, written by %d ranks, on %d ranks: optimizer state is resharded; the data goes on "
                    "after the %s tokens seen so far", ckpt_dir, saved_world, trainer.world_size,
                    manifest.get("tokens_seen"))

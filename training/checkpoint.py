"""Checkpoint naming, resolution and writing: `runs/<name>/checkpoints/step-XXXXXXXX/`.

Every checkpoint is a directory, whatever the strategy, so that one name means one checkpoint:
- under DeepSpeed it is DeepSpeed's own sharded checkpoint directory (each rank writes its shards);
- otherwise it holds Lightning's single file, `model.ckpt`.
Beside the weights: `config.yaml` (the resolved CLI config the run was started with), `model_config.json`
(the exact `ModelConfig`), and `manifest.json` (step, tokens seen, format, world size, ZeRO stage, git
revision), which rank 0 writes last, after every rank has finished writing. A directory without a manifest is incomplete
and `last` never resolves to it.

Today the shards are written in place; making the save atomic (a temporary directory renamed into place
after the manifest) only changes `StepCheckpoint.save` and `_write_sidecars` — naming and resolution stay.
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from training.strategy import is_deepspeed

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "manifest.json"
CONFIG_FILE = "config.yaml"
MODEL_CONFIG_FILE = "model_config.json"
LIGHTNING_FILE = "model.ckpt"  # the checkpoint file inside the directory when not under DeepSpeed
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def read_manifest(ckpt_dir: str | Path) -> dict[str, Any]:
    with open(Path(ckpt_dir) / MANIFEST) as f:
        return json.load(f)


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's complete checkpoint directories (with a manifest), oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def load_path(ckpt_dir: Path) -> Path:
    """What the strategy's loader takes: the directory itself for DeepSpeed, the file inside it otherwise."""
    return ckpt_dir if read_manifest(ckpt_dir)["format"] == "deepspeed" else ckpt_dir / LIGHTNING_FILE


def resolve(ckpt_path: str | None, run_dir: str | Path) -> tuple[str | None, int | None]:
    """`--ckpt_path` → (the path to hand to `Trainer.fit`, the step it resumes at).

    `last`: the newest complete checkpoint of this run, or (None, None) when there is none yet — so the same
    command starts a job and resumes it after a preemption. A normlab checkpoint directory: its load path.
    Anything else (a Lightning file, a foreign DeepSpeed directory) is passed through unchanged.
    """
    if ckpt_path is None:
        return None, None
    if ckpt_path == "last":
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


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _zero_stage(trainer: Trainer) -> int | None:
    if not is_deepspeed(trainer.strategy):
        return None
    return trainer.strategy.config.get("zero_optimization", {}).get("stage", 0)


class StepCheckpoint(Callback):
    """Saves every `every_n_steps` optimizer steps into `<run dir>/checkpoints/step-XXXXXXXX/`.

    The run directory is the trainer's `default_root_dir` (the CLI sets it to `runs/<name>`).
    `resolved_config` is the YAML text of the run's full configuration (set by the CLI).
    """

    def __init__(self, every_n_steps: int = 100) -> None:
        if every_n_steps < 0:
            raise ValueError(f"checkpoint.every_n_steps={every_n_steps} must be >= 0 (0 disables checkpoints)")
        self.every_n_steps = every_n_steps
        self.resolved_config: str | None = None
        self._last_saved = -1
        self._git_revision = "unknown"

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero:
            self._git_revision = git_revision()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_saved = trainer.global_step  # never re-save the step a run resumed from

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        # Called once per micro-batch: with gradient accumulation the step repeats until the next update.
        if self.every_n_steps and step % self.every_n_steps == 0 and step != self._last_saved:
            self.save(trainer, pl_module)

    def save(self, trainer: Trainer, pl_module: LightningModule) -> Path:
        step = trainer.global_step
        ckpt_dir = checkpoints_dir(trainer.default_root_dir) / step_dirname(step)
        deepspeed = is_deepspeed(trainer.strategy)
        # Every rank calls save_checkpoint: it is a collective (shards, RNG gather), and it ends in a barrier.
        trainer.save_checkpoint(ckpt_dir if deepspeed else ckpt_dir / LIGHTNING_FILE, weights_only=False)
        if trainer.is_global_zero:
            self._write_sidecars(ckpt_dir, trainer, pl_module, "deepspeed" if deepspeed else "lightning")
        trainer.strategy.barrier("StepCheckpoint.save")
        self._last_saved = step
        return ckpt_dir

    def _write_sidecars(self, ckpt_dir: Path, trainer: Trainer, pl_module: LightningModule, fmt: str) -> None:
        if self.resolved_config is not None:
            write_text_atomic(ckpt_dir / CONFIG_FILE, self.resolved_config)
        write_text_atomic(ckpt_dir / MODEL_CONFIG_FILE, json.dumps(pl_module.config.to_dict(), indent=2) + "\n")
        datamodule = trainer.datamodule
        manifest = {
            "step": trainer.global_step,
            "tokens_seen": trainer.global_step * datamodule.tokens_per_step(trainer.accumulate_grad_batches,
                                                                             trainer.world_size),
            "format": fmt,
            "world_size": trainer.world_size,
            "zero_stage": _zero_stage(trainer),
            "git_revision": self._git_revision,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_text_atomic(ckpt_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")  # last: marks complete
        log.info("saved checkpoint %s", ckpt_dir)

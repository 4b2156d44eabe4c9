"""Checkpoint layout and manifest: `runs/<name>/checkpoints/step-XXXXXXXX/`, and which of them are complete.

Every checkpoint is a directory, whatever the strategy, so that one name means one checkpoint:
- under DeepSpeed it is DeepSpeed's own sharded checkpoint directory (each rank writes its shards);
- otherwise it holds Lightning's single file, `model.ckpt`.
Beside the weights: `config.yaml` (the resolved CLI config), `model_config.json` (the exact `ModelConfig`) and
`manifest.json` (training/checkpointing/manifest.py: step, tokens seen, format, world size, ZeRO stage, config
and tokenizer hashes, versions, git revision, every file's size and sha256; a cooldown branch's parent under
`branched_from`, see training/checkpointing/branch.py), written last: a directory is complete exactly when it
has a manifest. `last` considers only complete directories; incomplete ones (interrupted saves) are moved to
`checkpoints/incomplete/`, never deleted. Writing is `training/callbacks/step_checkpoint.py`; what a resume
checks, `training/checkpointing/resume.py`; how files are read without running code from them, `safe.py`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from data.tokenizer import sha256_file
from training.checkpointing.manifest import (  # re-exported: the layout's public names
    MANIFEST,
    CheckpointError,
    Manifest,
    file_sizes,
    verify_files,
    write_text_atomic,
)

__all__ = ["MANIFEST", "CheckpointError", "Manifest", "file_sizes", "verify_files", "write_text_atomic"]

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
INCOMPLETE_DIR = "incomplete"  # inside checkpoints/: interrupted saves, moved aside at the next fit
CONFIG_FILE = "config.yaml"
MODEL_CONFIG_FILE = "model_config.json"
LIGHTNING_FILE = "model.ckpt"  # the checkpoint file inside the directory when not under DeepSpeed
DEEPSPEED_TAG = "checkpoint"  # the tag Lightning's DeepSpeedStrategy saves under (named by the `latest` file)
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def step_of(ckpt_dir: str | Path) -> int:
    """The step of a checkpoint directory `step-XXXXXXXX`."""
    return int(_STEP_DIR.match(Path(ckpt_dir).name).group(1))


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def read_manifest(ckpt_dir: str | Path) -> dict[str, Any]:
    """The manifest as plain JSON (for tools and tests; normlab's own readers use `Manifest.read`)."""
    return Manifest.read(ckpt_dir).to_dict()


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's complete checkpoint directories (with a manifest), oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=step_of)


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
    return ckpt_dir if Manifest.read(ckpt_dir).deepspeed else ckpt_dir / LIGHTNING_FILE


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
            raise CheckpointError(f"--ckpt_path {ckpt_path}: no such checkpoint; give a step directory of a run "
                                  "(<run>/checkpoints/step-XXXXXXXX) or `last`")
        if not (ckpt_dir / MANIFEST).is_file():
            if ckpt_dir.is_dir() and _STEP_DIR.match(ckpt_dir.name):
                raise CheckpointError(f"--ckpt_path {ckpt_path}: no {MANIFEST}, the save was interrupted; "
                                      "resume from an earlier checkpoint (or --ckpt_path last)")
            if ckpt_dir.is_dir() and not (ckpt_dir / "latest").is_file():  # nor a DeepSpeed directory
                inside = complete_checkpoints(ckpt_dir.parent) if ckpt_dir.name == CHECKPOINTS_DIR else []
                hint = f" (the newest complete one here: {inside[-1]})" if inside else ""
                raise CheckpointError(f"--ckpt_path {ckpt_path}: a directory that is no checkpoint (no {MANIFEST}, "
                                      f"no DeepSpeed 'latest'); give a step directory{hint} or `last`")
            return ckpt_path, None
    return str(load_path(ckpt_dir)), Manifest.read(ckpt_dir).step


def git_revision(repo: Path | None = None) -> str:
    """The commit of the code that is running (of `repo`, default this checkout), `-dirty` if tracked files
    changed; `unknown` outside git."""
    repo = repo if repo is not None else Path(__file__).resolve().parents[1]
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


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


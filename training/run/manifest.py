"""`Manifest`: what `manifest.json` records about a checkpoint directory, typed, with its one reader; and the
values it records about the code and config that wrote it (`git_revision`, `config_hash`, `versions`).

A directory is complete exactly when it has a manifest (written last, atomically: training/checkpointing/save.py).
Every field but `step` may be absent in a manifest written by an older normlab, and reads as None (or empty):
readers treat a missing record as "not checked", never as a match. Keys this version does not know (written by a
newer one) are kept in `extra` and written back unchanged.

`files` ({relative path: bytes}) and `sha256` ({relative path: hex digest}) cover every file of the directory
but the manifest itself; `verify_files` checks both before anything is unpickled, so a truncated, missing or
altered shard is one error naming it. Every reader of a checkpoint directory goes through `read_verified`, which
also refuses a file of the directory that a manifest of this version leaves out (the universal-format cache,
written later under its own manifest, excepted) and a listed path that leads outside the directory.

`manifest_version` (VERSION) marks a manifest written by this normlab, which always records every file's sha256:
such a manifest listing a file without its digest was edited, and is refused. A manifest without it (an older
normlab's) that lacks digests is checked by sizes only, and a warning says so. The hash detects accidental damage
(a flipped bit, a half-copied shard), not a deliberate edit: whoever can change a shard can change the manifest.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import platform
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from data.atomic import write_text_atomic
from data.tokenizer import sha256_file
from training.errors import CheckpointError
from training.run.layout import (
    LIGHTNING_FILE,
    MANIFEST,
    TMP_PREFIX,
    UNIVERSAL_LATEST,
    UNIVERSAL_MANIFEST,
    UNIVERSAL_TAG,
)

log = logging.getLogger(__name__)

VERSION = 2  # manifest_version: 2 = every listed file has its sha256 (1, unwritten: sizes, sha256 when present)
HASH = "sha256"  # faster than blake2b here (hashlib on OpenSSL with SHA extensions), and what the other hashes use
_CHUNK = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Manifest:
    step: int  # the optimizer step the checkpoint was saved after
    manifest_version: int | None = None  # VERSION when written by this normlab; None: an older one
    format: str | None = None  # "deepspeed" (a DeepSpeed directory), "dcp" (FSDP2's shards) or "lightning" (model.ckpt)
    tokens_seen: int | None = None  # across restarts, also on other world sizes
    world_size: int | None = None
    zero_stage: int | None = None  # None without DeepSpeed
    precision: dict[str, Any] | None = None  # the precision regime (training/precision.py: precision_record)
    accumulate_grad_batches: int | None = None
    micro_batch_size: int | None = None
    seq_len: int | None = None
    config_hash: str | None = None  # config_hash of model_config.json
    tokenizer_hash: str | None = None  # sha256 of the tokenizer file
    versions: dict[str, str] = field(default_factory=dict)
    git_revision: str | None = None
    time: str | None = None
    branched_from: dict[str, Any] | None = None  # a cooldown branch's parent (training/checkpointing/branch.py)
    init_from: dict[str, Any] | None = None  # the weights a run started from (training/checkpointing/init_from.py)
    schedule: dict[str, Any] | None = None  # the LR schedule trained with (training/optim/continuation.py)
    files: dict[str, int] = field(default_factory=dict)  # {relative path: bytes}
    sha256: dict[str, str] = field(default_factory=dict)  # {relative path: hex digest}
    extra: dict[str, Any] = field(default_factory=dict)  # keys written by a newer normlab, kept as they are

    @property
    def deepspeed(self) -> bool:
        return self.format == "deepspeed"

    @property
    def dcp(self) -> bool:
        return self.format == "dcp"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values = {k: v for k, v in data.items() if k in known}
        for name in ("versions", "files", "sha256"):
            values[name] = values.get(name) or {}
        return cls(**values, extra={k: v for k, v in data.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        for optional in ("branched_from", "init_from", "schedule"):  # a branch, a run started from weights; not old
            if out[optional] is None:
                del out[optional]
        return {**out, **self.extra}

    @classmethod
    def read(cls, ckpt_dir: str | Path) -> Manifest:
        """The manifest of `ckpt_dir`; a missing or corrupt one is a CheckpointError naming it and the fix."""
        path = Path(ckpt_dir) / MANIFEST
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("step"), int):
                raise ValueError("it has no integer 'step'")
            return cls.from_dict(data)
        except (OSError, UnicodeDecodeError, ValueError, TypeError) as err:  # JSONDecodeError is a ValueError
            raise CheckpointError(f"corrupt manifest '{path}' ({err}): move {Path(ckpt_dir).name} out of the "
                                  "checkpoints directory and resume from the previous checkpoint") from err

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def write(self, ckpt_dir: str | Path) -> None:
        """Atomically (temporary file, fsync, rename): the manifest marks its directory complete."""
        write_text_atomic(Path(ckpt_dir) / MANIFEST, self.to_json())


def load_path(ckpt_dir: Path) -> Path:
    """What the strategy's loader takes: the directory itself for DeepSpeed and DCP, the file inside it otherwise."""
    manifest = Manifest.read(ckpt_dir)
    return ckpt_dir if manifest.deepspeed or manifest.dcp else ckpt_dir / LIGHTNING_FILE


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


def hash_file(path: str | Path) -> str:
    """The hex digest (HASH) of a file, read in 1 MiB chunks."""
    digest = hashlib.new(HASH)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def hash_files(ckpt_dir: Path, known: dict[str, str] | None = None) -> dict[str, str]:
    """{relative path: digest} of every file in `ckpt_dir` but the manifest; digests already in `known` (taken
    by the rank that wrote the file, right after writing it) are not computed again."""
    known = known or {}
    return {rel: known.get(rel) or hash_file(p) for rel, p in _files(ckpt_dir).items()}


def file_sizes(ckpt_dir: Path) -> dict[str, int]:
    """{relative path: bytes} of every file in a checkpoint directory but the manifest (recorded in it)."""
    return {rel: p.stat().st_size for rel, p in _files(ckpt_dir).items()}


def _files(ckpt_dir: Path) -> dict[str, Path]:
    return {str(p.relative_to(ckpt_dir)): p for p in sorted(ckpt_dir.rglob("*")) if p.is_file() and p.name != MANIFEST}


def read_verified(ckpt_dir: str | Path, select: Callable[[Manifest], Manifest] | None = None) -> Manifest:
    """The manifest of `ckpt_dir` once every file it lists is checked (`verify_files`): what every reader of a
    checkpoint directory calls before anything in it is unpickled. `select`: the part of the manifest this
    reader reads (a resuming rank's files, resume.rank_files) — only those are checked; the whole manifest is
    returned."""
    manifest = Manifest.read(ckpt_dir)
    if manifest.manifest_version is not None:
        _check_coverage(Path(ckpt_dir), manifest)
    verify_files(Path(ckpt_dir), manifest if select is None else select(manifest))
    return manifest


# Written into a step directory after its manifest, under a manifest of their own (checkpointing/universal.py)
_OWN_MANIFEST = (UNIVERSAL_TAG, UNIVERSAL_LATEST, UNIVERSAL_MANIFEST, TMP_PREFIX + UNIVERSAL_TAG)


def _check_coverage(ckpt_dir: Path, manifest: Manifest) -> None:
    """A manifest of this version lists every file of its directory with its digest, so any file the loaders
    would read (model.ckpt, a shard, model_config.json) is checked before it is: one it leaves out was added or
    edited out later, and is refused rather than read unverified."""
    for rel in _files(ckpt_dir):
        listed = rel in manifest.files or rel in manifest.sha256  # (one without its digest: verify_files')
        if Path(rel).parts[0] not in _OWN_MANIFEST and not listed:
            raise CheckpointError(f"checkpoint {ckpt_dir} is damaged: its {MANIFEST} (version "
                                  f"{manifest.manifest_version}) does not list '{rel}', which normlab always records "
                                  "— the manifest was edited or the file added later; nothing was loaded — use an "
                                  "earlier checkpoint")


def _check_inside(ckpt_dir: Path, manifest: Manifest) -> None:
    """Every path the manifest lists is relative and stays inside `ckpt_dir`: one that leads out (`../x`, an
    absolute path) would have the checks, and the loaders' trust, reach a file of another directory."""
    for rel in sorted({*manifest.files, *manifest.sha256}):
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts or not parts:
            raise CheckpointError(f"checkpoint {ckpt_dir} is damaged: its {MANIFEST} lists '{rel}', which is not a "
                                  "path inside the checkpoint directory — the manifest was edited; nothing was loaded "
                                  "— use an earlier checkpoint")


def verify_files(ckpt_dir: Path, manifest: Manifest | dict[str, Any]) -> None:
    """Every file the manifest lists is there with its size and content hash: a missing, truncated or altered
    shard fails here, with its name, before anything reads it. Digests missing from a manifest of this version
    are refused; from an older manifest, only sizes are checked, with a warning. A listed path outside `ckpt_dir`
    is refused. (Files this manifest does not list are `read_verified`'s to refuse: here the manifest may be one
    rank's part of it.)"""
    if isinstance(manifest, dict):
        manifest = Manifest.from_dict(manifest)
    _check_inside(ckpt_dir, manifest)
    unhashed = sorted(set(manifest.files) - set(manifest.sha256))
    if manifest.manifest_version is not None and (unhashed or not manifest.files):
        what = f"'{unhashed[0]}' without its {HASH}" if unhashed else "no files"
        raise CheckpointError(f"checkpoint {ckpt_dir} is damaged: its {MANIFEST} (version "
                              f"{manifest.manifest_version}) lists {what}, which normlab always records — the "
                              "manifest was edited; nothing was loaded — use an earlier checkpoint")
    if unhashed:
        named = ", ".join(unhashed[:3]) + (f" and {len(unhashed) - 3} more" if len(unhashed) > 3 else "")
        log.warning("checkpoint %s: its %s, from an older normlab, records no %s for %s: checking sizes only",
                    ckpt_dir, MANIFEST, HASH, named)
    for rel, size in manifest.files.items():
        path = ckpt_dir / rel
        if not path.is_file():
            raise CheckpointError(f"checkpoint {ckpt_dir} is damaged: '{rel}' is missing; restore it or use an "
                                  "earlier checkpoint")
        if path.stat().st_size != size:
            raise CheckpointError(f"checkpoint {ckpt_dir} is damaged: '{rel}' is truncated or altered "
                                  f"({path.stat().st_size} bytes, {size} when saved); use an earlier checkpoint")
    for rel, digest in manifest.sha256.items():
        path = ckpt_dir / rel
        if not path.is_file():
            raise CheckpointError(f"checkpoint {ckpt_dir} is damaged: '{rel}' is missing; restore it or use an "
                                  "earlier checkpoint")
        if hash_file(path) != digest:
            raise CheckpointError(f"checkpoint {ckpt_dir} is damaged: '{rel}' was altered after it was saved (its "
                                  f"{HASH} differs from the manifest's); nothing was loaded — use an earlier "
                                  "checkpoint")

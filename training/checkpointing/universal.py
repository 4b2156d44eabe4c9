"""DeepSpeed's universal checkpoint format: converted once per checkpoint directory, cached in it, and hashed.

Resuming a ZeRO-1/2/3 checkpoint on another world size goes through DeepSpeed's universal format
(training/strategy.py): rank 0 converts the step directory once (`deepspeed.checkpoint.ds_to_universal`, in a
subprocess that reads weights-only, see safe.py) into `checkpoint_universal/` + `latest_universal` inside it.
That cache is written after the step's manifest, which therefore does not cover it, so it has a manifest of its
own, `universal_manifest.json`: every cache file's size and sha256, written last (temporary file, fsync, rename),
so the cache is complete exactly when it has one. Every rank checks the cache against it before the universal
loader reads a byte (`verify_cache`; they all read all of it): an altered cache file is refused in one line naming
it. A cache without its manifest (an interrupted conversion, or one converted by an older normlab) is converted
again.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from data.atomic import write_text_atomic
from training.checkpointing.safe import UnsafeCheckpointError
from training.errors import CheckpointError
from training.run.layout import UNIVERSAL_LATEST as LATEST
from training.run.layout import UNIVERSAL_MANIFEST as CACHE_MANIFEST
from training.run.layout import UNIVERSAL_TAG  # beside DeepSpeed's own tag ("checkpoint", Lightning's choice)
from training.run.manifest import Manifest, file_sizes, hash_file, verify_files


def to_universal(ckpt_dir: Path) -> None:
    """Convert a DeepSpeed checkpoint directory to the universal format in place, once: a cache with its manifest
    is kept as it is (every rank verifies it before reading it, `verify_cache`)."""
    if (ckpt_dir / CACHE_MANIFEST).is_file():
        return
    shutil.rmtree(ckpt_dir / UNIVERSAL_TAG, ignore_errors=True)  # a cache nobody hashed: convert it again
    (ckpt_dir / LATEST).unlink(missing_ok=True)
    tag = (ckpt_dir / "latest").read_text().strip()
    tmp = ckpt_dir / f".tmp-{UNIVERSAL_TAG}"
    shutil.rmtree(tmp, ignore_errors=True)  # our own leftover from an interrupted conversion
    # A subprocess: the converter parses its own argv; it reads the shards weights-only (safe.py's entry point).
    proc = subprocess.run([sys.executable, "-m", "training.checkpointing.safe", "--input_folder",
                           str(ckpt_dir / tag), "--output_folder", str(tmp), "--inject_missing_state",
                           "--num_extract_workers", "1", "--num_merge_workers", "1"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a refused or failed conversion leaves nothing behind
    if proc.returncode != 0 and "refusing to load" in proc.stderr:  # a shard holds a type that could run code
        raise UnsafeCheckpointError(proc.stderr.strip().splitlines()[-1].removeprefix("error: "))
    if proc.returncode != 0:
        raise RuntimeError(f"converting {ckpt_dir} to DeepSpeed's universal checkpoint failed; resume on the "
                           f"world size that wrote it:\n{(proc.stdout + proc.stderr)[-3000:]}")
    (ckpt_dir / LATEST).unlink(missing_ok=True)  # the converter writes it beside its output
    os.replace(tmp, ckpt_dir / UNIVERSAL_TAG)
    write_text_atomic(ckpt_dir / LATEST, UNIVERSAL_TAG)
    write_text_atomic(ckpt_dir / CACHE_MANIFEST, _cache_manifest(ckpt_dir).to_json())


def _cache_manifest(ckpt_dir: Path) -> Manifest:
    """The cache's files (relative to `ckpt_dir`) with their sizes and digests; `step` is the checkpoint's."""
    files = [*(f"{UNIVERSAL_TAG}/{rel}" for rel in file_sizes(ckpt_dir / UNIVERSAL_TAG)), LATEST]
    return Manifest(step=Manifest.read(ckpt_dir).step, format="deepspeed-universal",
                    files={rel: (ckpt_dir / rel).stat().st_size for rel in files},
                    sha256={rel: hash_file(ckpt_dir / rel) for rel in files})


def verify_cache(ckpt_dir: Path) -> None:
    """Every file of the universal cache is there with the size and sha256 its manifest recorded: a missing,
    truncated or altered one is a CheckpointError naming it, before the universal loader reads anything."""
    path = ckpt_dir / CACHE_MANIFEST
    fix = (f"delete {UNIVERSAL_TAG}/, {LATEST} and {CACHE_MANIFEST} in {ckpt_dir} and resume again: normlab "
           "converts the checkpoint anew")
    try:
        manifest = Manifest.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"the universal-format cache of {ckpt_dir} has no readable {CACHE_MANIFEST} ({err}); "
                              f"{fix}") from err
    try:
        verify_files(ckpt_dir, manifest)
    except CheckpointError as err:  # its first clause names the file; the fix for a cache is to rebuild it
        raise CheckpointError(f"{str(err).split(';')[0]} (the universal-format cache); {fix}") from None

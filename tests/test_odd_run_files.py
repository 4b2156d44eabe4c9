"""Files in a run directory that an accident (or someone else) shaped: a symlinked step directory, a garbled
requeue record, a manifest that leaves files out or points outside its checkpoint. Each is handled without a
traceback and without touching anything outside the run. (The run lock's own shapes: tests/test_run_lock.py.)"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from training.callbacks.step_checkpoint import StepCheckpoint
from training.errors import CheckpointError
from training.run import layout
from training.run.manifest import VERSION as MANIFEST_VERSION
from training.run.manifest import Manifest, file_sizes, hash_file, hash_files, read_verified, verify_files


def test_keep_last_n_removes_a_symlinked_step_directory_as_a_link_only(tmp_path, caplog):
    """A step directory that is a symbolic link (to a checkpoint kept elsewhere) and falls out of `keep_last_n`:
    the link goes, with a warning; what it points to stays whole, and the real old directory is removed."""
    run, archive = tmp_path / "run", tmp_path / "archive" / "step-00000002"
    for step_dir in (layout.checkpoints_dir(run) / layout.step_dirname(s) for s in (1, 3, 4)):
        step_dir.mkdir(parents=True)
        (step_dir / layout.MANIFEST).write_text("{}")
    archive.mkdir(parents=True)
    (archive / layout.MANIFEST).write_text("{}")
    (archive / layout.LIGHTNING_FILE).write_text("weights")
    (layout.checkpoints_dir(run) / layout.step_dirname(2)).symlink_to(archive, target_is_directory=True)
    with caplog.at_level("WARNING", logger="training.callbacks.step_checkpoint"):
        StepCheckpoint(keep_last_n=2)._purge(run)
    assert sorted(p.name for p in layout.checkpoints_dir(run).iterdir()) == ["step-00000003", "step-00000004"]
    assert sorted(p.name for p in archive.iterdir()) == sorted([layout.LIGHTNING_FILE, layout.MANIFEST])
    assert [r.getMessage() for r in caplog.records] == [
        f"removed the symbolic link {layout.checkpoints_dir(run) / 'step-00000002'} (checkpoint.keep_last_n=2); what "
        f"it points to, {archive}, is kept"]


def step_dir(root: Path) -> Path:
    """A version-2 checkpoint directory as a save leaves it (the weights stand-in is never unpickled here)."""
    ckpt = root / "step-00000002"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / layout.LIGHTNING_FILE).write_bytes(b"weights")
    (ckpt / layout.MODEL_CONFIG_FILE).write_text("{}")
    (ckpt / "sub" / "shard.pt").write_bytes(b"shard")
    Manifest(step=2, manifest_version=MANIFEST_VERSION, format="lightning", files=file_sizes(ckpt),
             sha256=hash_files(ckpt)).write(ckpt)
    return ckpt


def edit_manifest(ckpt: Path, drop: str | None = None, add: Path | None = None, as_: str = "") -> None:
    """Edit the manifest: `drop` a listed file, or `add` the file `add` under the listed name `as_`."""
    data = json.loads((ckpt / layout.MANIFEST).read_text())
    if drop is not None:
        del data["files"][drop], data["sha256"][drop]
    if add is not None:
        data["files"][as_], data["sha256"][as_] = add.stat().st_size, hash_file(add)
    (ckpt / layout.MANIFEST).write_text(json.dumps(data))


def test_a_manifest_must_list_every_file_of_its_directory_but_the_universal_cache(tmp_path):
    ckpt = step_dir(tmp_path)
    (ckpt / layout.UNIVERSAL_TAG).mkdir()
    (ckpt / layout.UNIVERSAL_TAG / "x.pt").write_bytes(b"cache")  # (its own manifest covers it)
    (ckpt / layout.UNIVERSAL_LATEST).write_text(layout.UNIVERSAL_TAG)
    assert read_verified(ckpt).step == 2


@pytest.mark.parametrize("rel", [layout.LIGHTNING_FILE, "sub/shard.pt"])
def test_a_file_the_manifest_leaves_out_is_refused(rel, tmp_path):
    """A version-2 manifest with `model.ckpt` (or a shard) edited out would let the loader read that file
    unchecked: refused in one line naming it, before anything is read."""
    ckpt = step_dir(tmp_path)
    edit_manifest(ckpt, drop=rel)
    with pytest.raises(CheckpointError, match=rf"^checkpoint {ckpt} is damaged: its manifest.json \(version 2\) "
                                              rf"does not list '{rel}', .* use an earlier checkpoint$"):
        read_verified(ckpt)


@pytest.mark.parametrize("where", ["../outside.bin", "sub/../../outside.bin", "/abs/outside.bin"])
def test_a_manifest_path_outside_its_directory_is_refused(where, tmp_path):
    """A listed path that leads out of the checkpoint (`..`, absolute) — even with the outside file's true size
    and digest — is refused before any file is checked, by the whole-manifest and the per-rank check alike."""
    ckpt = step_dir(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"elsewhere")
    where = where.replace("/abs", str(tmp_path))
    edit_manifest(ckpt, add=outside, as_=where)
    message = rf"^checkpoint {ckpt} is damaged: its manifest.json lists '{re.escape(where)}', which is not a path"
    for check in (read_verified, lambda c: verify_files(c, Manifest.read(c))):
        with pytest.raises(CheckpointError, match=message):
            check(ckpt)

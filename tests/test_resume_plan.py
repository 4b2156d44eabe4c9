"""`training.checkpointing.plan`: the resume/branch decision as data, on checkpoint directories written by hand
(a manifest, the files it lists), without Lightning running: every row of the plan's table, and its refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.checkpointing.plan import RunPlan, plan
from training.errors import CheckpointError, UserError
from training.run.layout import LIGHTNING_FILE, MANIFEST, MODEL_CONFIG_FILE, checkpoints_dir, step_dirname
from training.run.manifest import file_sizes


def save(run_dir: Path, step: int, branched_from: dict | None = None) -> Path:
    """A complete (Lightning-format) normlab step directory of `run_dir`, as StepCheckpoint lays it out."""
    ckpt = checkpoints_dir(run_dir) / step_dirname(step)
    ckpt.mkdir(parents=True)
    (ckpt / LIGHTNING_FILE).write_bytes(b"weights" * step)
    (ckpt / MODEL_CONFIG_FILE).write_text("{}\n")
    manifest = {"step": step, "format": "lightning", "files": file_sizes(ckpt)}
    if branched_from is not None:
        manifest["branched_from"] = branched_from
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    return ckpt


def test_fresh_fit(tmp_path: Path) -> None:
    assert plan("fit", None, None, tmp_path / "run") == RunPlan(None, None, None, purge_step=0)
    save(tmp_path / "old", 4)
    with pytest.raises(CheckpointError, match="already holds checkpoints.*--ckpt_path last"):
        plan("fit", None, None, tmp_path / "old")  # a new fit never writes over a run's checkpoints


def test_resume_last_and_explicit(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert plan("fit", "last", None, run) == RunPlan(None, None, None, purge_step=0)  # nothing yet: a fresh start
    save(run, 4)
    newest = save(run, 8, branched_from={"checkpoint": "/trunk/step-00000002"})
    (checkpoints_dir(run) / ".tmp-step-00000012").mkdir()  # an interrupted save is never resumed
    got = plan("fit", "last", None, run)
    assert got == RunPlan(str(newest / LIGHTNING_FILE), str(newest / LIGHTNING_FILE), 8, purge_step=9,
                          lineage={"checkpoint": "/trunk/step-00000002"})  # a resumed branch keeps its lineage
    older = plan("fit", str(checkpoints_dir(run) / "step-00000004"), None, run)
    assert (older.resumed_step, older.purge_step, older.lineage) == (4, 5, None)
    foreign = tmp_path / "foreign.ckpt"
    foreign.write_bytes(b"x")
    assert plan("fit", str(foreign), None, run) == RunPlan(str(foreign), str(foreign), None, purge_step=0)


def test_validate_and_test_load_without_purging(tmp_path: Path) -> None:
    ckpt = save(tmp_path / "run", 4)
    for sub in ("validate", "test"):
        assert plan(sub, "last", None, tmp_path / "run") == RunPlan(str(ckpt / LIGHTNING_FILE),
                                                                    str(ckpt / LIGHTNING_FILE), 4)
    with pytest.raises(UserError, match="--branch_from applies to `normlab fit`"):
        plan("validate", None, str(ckpt), tmp_path / "run")


def test_branch_then_resume_the_branch(tmp_path: Path) -> None:
    parent = save(tmp_path / "trunk", 6)
    branch_dir = tmp_path / "cool"
    new = plan("fit", "last", str(parent), branch_dir)  # no checkpoints of its own yet: branches
    assert (new.load_path, new.recorded_ckpt_path, new.resumed_step, new.purge_step) == (
        str(parent.resolve() / LIGHTNING_FILE), "last", 6, 0)  # config.yaml reruns it with --ckpt_path last
    assert new.parent is not None and new.parent.step == 6
    assert new.lineage["checkpoint"] == str(parent.resolve()) and new.lineage["step"] == 6
    own = save(branch_dir, 8, branched_from=new.lineage)
    resumed = plan("fit", "last", str(parent), branch_dir)  # the same command, once it has checkpoints: resumes
    assert (resumed.parent, resumed.load_path, resumed.lineage) == (None, str(own / LIGHTNING_FILE), new.lineage)
    other = save(tmp_path / "trunk2", 6)
    with pytest.raises(CheckpointError, match="already holds checkpoints of a run that branched from"):
        plan("fit", "last", str(other), branch_dir)
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        plan("fit", None, str(parent), branch_dir)  # a new branch into a used run directory
    with pytest.raises(UserError, match="give one of them"):
        plan("fit", str(own), str(parent), branch_dir)

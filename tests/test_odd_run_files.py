"""Files in a run directory that an accident (or someone else) shaped: a symlinked step directory, a garbled
requeue record, a manifest that leaves files out or points outside its checkpoint. Each is handled without a
traceback and without touching anything outside the run. (The run lock's own shapes: tests/test_run_lock.py.)"""
from __future__ import annotations

from training.callbacks.step_checkpoint import StepCheckpoint
from training.run import layout


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

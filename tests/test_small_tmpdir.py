"""A `$TMPDIR` smaller than one checkpoint does not stop a save: `model.ckpt` is written beside its destination
(training/checkpointing/safe.py `SafeCheckpointIO.save_checkpoint`), where Lightning's own save would stage the
whole file in $TMPDIR first. The small $TMPDIR is a real 64 KiB tmpfs, mounted for the test (root only)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import lightning.pytorch  # noqa: F401
import pytest

from tests.helpers.multiproc import REPO
from training.checkpointing.load import load_checkpoint
from training.cli import main
from training.run import layout

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


@pytest.fixture
def small_tmpdir(tmp_path, monkeypatch):
    """$TMPDIR on a 64 KiB tmpfs (a tiny model's checkpoint is ~1 MB). `tempfile.tempdir` is where Python keeps
    $TMPDIR once read, so setting it is what a smaller $TMPDIR at start-up does."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(small))
        yield small
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_a_checkpoint_saves_with_a_tmpdir_smaller_than_it(small_tmpdir, workdir, tmp_path):
    assert tempfile.gettempdir() == str(small_tmpdir)
    assert main(["fit", "-c", str(REPO / "tests" / "helpers" / "tiny.yaml"), "--data.path", str(workdir / "tiny"),
                 "--runs_dir", str(tmp_path / "runs"), "--name", "small", "--trainer.max_steps", "2",
                 "--checkpoint.every_n_steps", "2", "--metrics.every_n_steps", "0", "--trainer.logger", "false"]) == 0
    ckpt = layout.checkpoints_dir(tmp_path / "runs" / "small") / layout.step_dirname(2)
    assert (ckpt / layout.LIGHTNING_FILE).stat().st_size > 64 * 1024  # bigger than $TMPDIR
    assert load_checkpoint(ckpt).step == 2  # complete: its sha256 verified, its weights loaded
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.yaml", "manifest.json", "model.ckpt",
                                                      "model_config.json"]  # no temporary file left beside it
    assert not list(small_tmpdir.iterdir())

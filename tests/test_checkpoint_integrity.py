"""Every reader of a checkpoint directory verifies it against its manifest (sizes and sha256) before reading it —
`normlab validate` and `normlab test` as evaluate, export and fit do — and a manifest of this version that lost
its digests is refused, while an older one's fallback to sizes is stated (training/run/manifest.py)."""
from __future__ import annotations

import json
import logging
import re
import shutil
import zipfile
from pathlib import Path

import lightning.pytorch  # noqa: F401  (before capsys: Lightning binds its log handler at import)
import pytest
import torch

from tests.helpers.multiproc import REPO
from tests.helpers.runs import read_manifest
from training.checkpointing.load import load_checkpoint
from training.cli import main
from training.errors import DEBUG_ENV, CheckpointError
from training.run import layout

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

TINY = ["-c", str(REPO / "tests" / "helpers" / "tiny.yaml"), "--trainer.logger", "false",
        "--metrics.every_n_steps", "0"]


def args(command: str, data: Path, runs: Path, name: str, *extra: str) -> list[str]:
    return [command, *TINY, "--data.path", str(data), "--runs_dir", str(runs), "--name", name, *extra]


@pytest.fixture(scope="module")
def finished(workdir) -> Path:
    """Step 2 of a real 2-step run: a Lightning `model.ckpt` with its manifest."""
    assert main(args("fit", workdir / "tiny", workdir / "runs", "finished", "--trainer.max_steps", "2",
                     "--checkpoint.every_n_steps", "2")) == 0
    return layout.checkpoints_dir(workdir / "runs" / "finished") / layout.step_dirname(2)


def patch_in_place(file: Path) -> None:
    """Overwrite 1 KiB of the largest tensor's bytes with +inf, inside the zip archive: same size, and the file
    still loads (torch stores tensors uncompressed)."""
    info = max(zipfile.ZipFile(file).infolist(), key=lambda i: i.file_size)
    with open(file, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        f.seek(info.header_offset + 30 + name_len + extra_len)
        f.write(b"\x00\x00\x80\x7f" * 256)


def rewrite(file: Path) -> None:
    """Every weight set to 7.0 and saved again by torch (another size: an extra tensor is stored)."""
    ckpt = torch.load(file, weights_only=True)
    for value in ckpt["state_dict"].values():
        if value.is_floating_point():
            value.fill_(7.0)
    ckpt["state_dict"]["extra"] = torch.zeros(16)
    torch.save(ckpt, file)


def one_line_refusal(argv: list[str], capsys, where: Path) -> str:
    before = sorted(where.rglob("*"))
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"normlab {argv[0]}: error: "), err
    assert "Traceback" not in err and not [ln for ln in lines[:-1] if "error" in ln.lower()], err
    assert sorted(where.rglob("*")) == before  # nothing written: no run directory for the refused command
    return lines[-1]


@pytest.mark.parametrize("command", ["validate", "test"])
@pytest.mark.parametrize("damage, message", [
    (patch_in_place, r"'model.ckpt' was altered after it was saved \(its sha256 differs from the manifest's\)"),
    (rewrite, r"'model.ckpt' is truncated or altered \(\d+ bytes, \d+ when saved\)"),
])
def test_validate_and_test_refuse_an_altered_model_file(command, damage, message, finished, workdir, tmp_path,
                                                        capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    ckpt = Path(shutil.copytree(finished, tmp_path / finished.name))
    size = (ckpt / layout.LIGHTNING_FILE).stat().st_size
    damage(ckpt / layout.LIGHTNING_FILE)
    assert ((ckpt / layout.LIGHTNING_FILE).stat().st_size == size) == (damage is patch_in_place)
    torch.load(ckpt / layout.LIGHTNING_FILE, weights_only=True)  # the damage still loads: only the manifest tells
    line = one_line_refusal(args(command, workdir / "tiny", tmp_path / "runs", "scored", "--ckpt_path", str(ckpt)),
                            capsys, tmp_path)
    assert f"checkpoint {ckpt} is damaged: " in line
    assert re.search(message, line), line


@pytest.mark.slow
@pytest.mark.parametrize("command", ["validate", "test"])
def test_validate_and_test_refuse_an_altered_deepspeed_shard(command, zero1_run, zero_workdir, tmp_path, capsys,
                                                             monkeypatch):
    """A ZeRO-1 model-states shard altered in place (same size), validated on 1 rank under DeepSpeed."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    ckpt = Path(shutil.copytree(layout.checkpoints_dir(zero1_run) / layout.step_dirname(8), tmp_path / "step"))
    shard = ckpt / "checkpoint" / "mp_rank_00_model_states.pt"
    patch_in_place(shard)
    line = one_line_refusal(args(command, zero_workdir / "tiny", tmp_path / "runs", "scored", "--ckpt_path", str(ckpt),
                                 "--trainer.strategy", "zero1", "--trainer.devices", "1"), capsys, tmp_path)
    assert line.endswith(f"checkpoint {ckpt} is damaged: 'checkpoint/mp_rank_00_model_states.pt' was altered after "
                         "it was saved (its sha256 differs from the manifest's); nothing was loaded — use an earlier "
                         "checkpoint"), line


def edit_manifest(ckpt: Path, *keys: str) -> None:
    manifest = json.loads((ckpt / layout.MANIFEST).read_text())
    for key in keys:
        del manifest[key]
    (ckpt / layout.MANIFEST).write_text(json.dumps(manifest))


def test_a_manifest_of_this_version_without_digests_is_refused(finished, workdir, tmp_path, capsys, monkeypatch):
    """Its sha256 deleted, a same-size edit would pass on sizes alone: every reader refuses the manifest (load,
    validate, a resume), naming the file it lists without a digest."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert read_manifest(finished)["manifest_version"] == 2
    run = tmp_path / "runs" / "edited"
    ckpt = Path(shutil.copytree(finished, layout.checkpoints_dir(run) / finished.name))
    patch_in_place(ckpt / layout.LIGHTNING_FILE)
    edit_manifest(ckpt, "sha256")
    expected = (f"checkpoint {ckpt} is damaged: its manifest.json (version 2) lists 'config.yaml' without its "
                "sha256, which normlab always records — the manifest was edited; nothing was loaded")
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        load_checkpoint(ckpt)
    for argv in (args("validate", workdir / "tiny", tmp_path / "runs", "scored", "--ckpt_path", str(ckpt)),
                 args("fit", workdir / "tiny", tmp_path / "runs", "edited", "--ckpt_path", "last",
                      "--trainer.max_steps", "4")):
        assert expected in one_line_refusal(argv, capsys, tmp_path)


def test_an_older_manifest_without_digests_is_read_by_sizes_with_a_warning(finished, tmp_path, caplog):
    """A manifest from before digests (no manifest_version, no sha256) is still read: sizes are checked, and one
    warning line says that only sizes were."""
    ckpt = Path(shutil.copytree(finished, tmp_path / finished.name))
    edit_manifest(ckpt, "sha256", "manifest_version")
    with caplog.at_level(logging.WARNING, logger="training.run.manifest"):
        assert load_checkpoint(ckpt).step == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"checkpoint {ckpt}: its manifest.json, from an older normlab, records no sha256 for "
                        "config.yaml, model.ckpt, model_config.json: checking sizes only"]
    (ckpt / layout.LIGHTNING_FILE).write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"'model.ckpt' is truncated or altered \(0 bytes"):
        load_checkpoint(ckpt)

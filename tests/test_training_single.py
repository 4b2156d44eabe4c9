"""A single-process (no DeepSpeed) run: exact resume from Lightning-file checkpoints, and what a run writes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.faults import kill_when_paused
from tests.helpers.multiproc import REPO, run_here, run_normlab
from tests.helpers.runs import consolidated_state_dict, scalars

pytestmark = pytest.mark.slow

HELPERS = REPO / "tests" / "helpers"


def fit(root: Path, name: str, probe: str, *extra: str) -> Path:
    """A tiny fit in this process; with interrupted.yaml in its own (its StopAtStep ends the process, as a crash
    would)."""
    args = ["fit", "-c", str(HELPERS / "tiny.yaml"), "-c", str(HELPERS / probe), "--data.path", str(root / "tiny"),
            "--runs_dir", str(root / "runs"), "--name", name, *extra]
    if probe == "interrupted.yaml":
        run_normlab(args, cwd=root)
    else:
        run_here(args)
    return root / "runs" / name


def test_single_process_exact_resume_and_run_layout(workdir, tmp_path):
    straight = fit(workdir, "straight", "probe.yaml")
    resumed = fit(workdir, "resumed", "interrupted.yaml")
    assert max(scalars(resumed, "train/loss")) == 6
    fit(workdir, "resumed", "probe.yaml", "--ckpt_path", "last")
    # from step 4: a run that started over would have superseded it (moved aside into incomplete/)
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step-00000004", "step-00000008"]

    for tag in ("train/loss", "train/lr", "val/loss", "val/ppl", "probe/rng", "guard/loss_z"):
        assert scalars(resumed, tag) == scalars(straight, tag), tag
    final = [consolidated_state_dict(run / "checkpoints" / "step-00000008", tmp_path) for run in (straight, resumed)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])

    # The run directory: events, the run's config, and self-describing checkpoints.
    ckpt = resumed / "checkpoints" / "step-00000008"
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.yaml", "manifest.json", "model.ckpt",
                                                       "model_config.json"]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["format"] == "lightning" and manifest["step"] == 8 and manifest["zero_stage"] is None
    config = yaml.safe_load((ckpt / "config.yaml").read_text())
    assert config["model"]["dim"] == 32 and config["name"] == "resumed"
    assert (resumed / "config.yaml").is_file() and list(resumed.glob("events.out.tfevents.*"))
    # Everything in the checkpoint (hyper-parameters, RNG states, model config) is plain data.
    state = torch.load(ckpt / "model.ckpt", weights_only=True)
    assert len(state["rng_states"]) == 1 and state["model_config"]["dim"] == 32

    # kill -9 of a single-process run in the middle of writing a checkpoint file (step 8's model.ckpt half on disk,
    # flushed): `last` is step 4, the half-written save is moved aside on resume, and the resumed run ends where
    # the straight one did, bit for bit.
    killed = workdir / "runs" / "killed-mid-write"
    kill_when_paused(["fit", "-c", str(HELPERS / "tiny.yaml"), "-c", str(HELPERS / "probe.yaml"), "--data.path",
                      str(workdir / "tiny"), "--runs_dir", str(workdir / "runs"), "--name", killed.name],
                     workdir, "pause_mid_shard@8", tmp_path / "paused")
    half = killed / "checkpoints" / ".tmp-step-00000008" / "model.ckpt"
    half_size = half.stat().st_size
    assert 0 < half_size < (ckpt / "model.ckpt").stat().st_size
    fit(workdir, killed.name, "probe.yaml", "--ckpt_path", "last")
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["incomplete", "step-00000004",
                                                                           "step-00000008"]
    # Only the torn save was moved aside, as it was (not re-used, overwritten or deleted); a resume that started
    # over instead of from step 4 would have superseded step 4 too (moved aside as incomplete/step-00000004).
    aside = killed / "checkpoints" / "incomplete"
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000008"]
    assert (aside / "step-00000008" / "model.ckpt").stat().st_size == half_size
    again = consolidated_state_dict(killed / "checkpoints" / "step-00000008", tmp_path)
    assert all(torch.equal(final[0][k], again[k]) for k in final[0])
    assert scalars(killed, "train/loss") == scalars(straight, "train/loss")


def test_train_loss_is_the_mean_over_the_updates_micro_batches(workdir, tmp_path):
    """With 2 micro-batches per update, train/loss is their mean (Lightning alone would log the last one's)."""
    record = tmp_path / "micro.json"
    (tmp_path / "recorder.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: tests.helpers.callbacks.MicroBatchLosses\n"
        f"      init_args: {{path: '{record}'}}\n")
    run = fit(workdir, "micro", str(tmp_path / "recorder.yaml"), "--trainer.max_steps", "1",
              "--checkpoint.every_n_steps", "0")
    losses = json.loads(record.read_text())
    assert len(losses) == 2 and losses[0] != losses[1]
    assert scalars(run, "train/loss")[1] == pytest.approx(sum(losses) / 2, rel=1e-6)

"""A cooldown branch of a 2-rank DeepSpeed ZeRO-2 trunk (real processes on CPU): it starts from the trunk's
exact step-4 weights and follows its own schedule. The trunk is the session's 2-rank ZeRO-2 reference run
(tests/helpers/zero_runs.py, checked by tests/test_training_deepspeed.py: the default schedule, which the branch
replaces with its own). (~1 minute on 2 idle cores, mostly process start-up.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.multiproc import REPO, run_normlab
from tests.helpers.runs import consolidated_state_dict, read_manifest, scalars
from tests.test_branch import probe_config, wsd_linear
from training.run import layout

pytestmark = pytest.mark.slow

HELPERS = REPO / "tests" / "helpers"


def fit_args(workdir: Path, name: str, *extra: str) -> list[str]:
    return ["fit", "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"), "--runs_dir",
            str(workdir / "runs"), "--name", name, "--trainer.strategy", "zero2", "--trainer.devices", "2",
            "--metrics.every_n_steps", "0", *extra]


def test_zero2_cooldown_branch(workdir, zero2_run, tmp_path):
    parent = layout.checkpoints_dir(zero2_run) / "step-00000004"
    run_normlab(fit_args(workdir, "cool", "-c", str(probe_config(tmp_path)), "--branch_from", str(parent),
                         "--optim.schedule", "wsd", "--optim.decay_fraction", "0.5", "--optim.weight_decay", "0.05"),
                cwd=workdir)
    cool = workdir / "runs" / "cool"

    first = torch.load(tmp_path / "first.pt", weights_only=True)  # rank 0, before the branch's first update
    saved = consolidated_state_dict(parent, tmp_path)
    weights = {k.removeprefix("model."): v for k, v in first["state_dict"].items()}
    assert first["global_step"] == 4 and weights.keys() == saved.keys()
    assert all(torch.equal(weights[k], saved[k]) for k in saved)
    assert {g["name"]: g["weight_decay"] for g in first["groups"]} == {"decay": 0.05, "no_decay": 0.0}
    lrs = scalars(cool, "train/lr")
    assert sorted(lrs) == [5, 6, 7, 8]
    for step, lr in lrs.items():
        assert lr == pytest.approx(wsd_linear(step - 1), rel=1e-6), step
    manifest = read_manifest(layout.checkpoints_dir(cool) / "step-00000008")
    assert manifest["format"] == "deepspeed" and manifest["zero_stage"] == 2
    assert manifest["branched_from"]["checkpoint"] == str(parent.resolve())
    assert manifest["branched_from"]["step"] == 4

"""Cooldown branches (`normlab fit --branch_from`), single process, in-process runs of the tiny config.

One WSD trunk (8 steps, checkpoints 4 and 8; stable at lr 1e-3 until step 6) is shared. A branch from its step 4
with the trunk's own settings must continue it exactly; a branch with another schedule must start from the
trunk's exact state at step 4 (weights, AdamW moments) and follow its own schedule from there.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from lightning.pytorch import Callback

from tests.helpers.multiproc import REPO
from tests.helpers.runs import read_manifest, scalars
from training.cli import main
from training.errors import DEBUG_ENV, CheckpointError
from training.run import layout

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

HELPERS = REPO / "tests" / "helpers"
TRUNK = ("--optim.schedule", "wsd", "--optim.decay_fraction", "0.25")  # decays over steps 6-8 of 8


class FirstStepProbe(Callback):
    """Saves, at the first training batch (before the run's first update), what the run starts from: the
    weights, the optimizer state and the param groups' hyper-parameters (rank 0; ZeRO: weights and groups)."""

    def __init__(self, path: str) -> None:
        self.path, self.done = path, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.done or not trainer.is_global_zero:
            return
        self.done = True
        optimizer = trainer.lr_scheduler_configs[0].scheduler.optimizer
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        state = None if hasattr(trainer.strategy, "deepspeed_engine") else optimizer.state_dict()["state"]
        torch.save({"global_step": trainer.global_step, "groups": groups, "optimizer": state,
                    "state_dict": {k: v.detach().clone() for k, v in pl_module.state_dict().items()}}, self.path)


def probe_config(tmp_path: Path) -> Path:
    path = tmp_path / "probe.yaml"
    path.write_text("trainer:\n  callbacks:\n    - class_path: tests.test_branch.FirstStepProbe\n"
                    f"      init_args: {{path: '{tmp_path / 'first.pt'}'}}\n")
    return path


def fit(workdir: Path, name: str, *extra: str) -> Path:
    """`normlab fit` on the tiny config, in this process; a user error raises (NORMLAB_DEBUG=1)."""
    with mock.patch.dict(os.environ, {DEBUG_ENV: "1"}):
        main(["fit", "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"), "--runs_dir",
              str(workdir / "runs"), "--name", name, "--trainer.devices", "1", "--metrics.every_n_steps", "0",
              *extra])
    return workdir / "runs" / name


def ckpt(run: Path, step: int) -> Path:
    return layout.checkpoints_dir(run) / layout.step_dirname(step)


def lightning_state(run: Path, step: int) -> dict:
    return torch.load(ckpt(run, step) / "model.ckpt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def trunk(workdir) -> Path:
    return fit(workdir, "trunk", *TRUNK)


def test_a_branch_with_the_parents_settings_continues_it_exactly(workdir, trunk):
    """Weights, AdamW state, data position, RNG and step all carried: steps 5-8 are the trunk's, bit for bit."""
    same = fit(workdir, "same", *TRUNK, "--branch_from", str(ckpt(trunk, 4)))
    final, again = lightning_state(trunk, 8)["state_dict"], lightning_state(same, 8)["state_dict"]
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)
    for tag in ("train/loss", "train/lr", "val/loss"):
        wanted = {s: v for s, v in scalars(trunk, tag).items() if s > 4}
        assert wanted and scalars(same, tag) == wanted, tag  # its own TensorBoard run, from step 5 on
    assert not ckpt(same, 4).exists() and ckpt(same, 8).is_dir()


def wsd_linear(step: int, lr: float = 1e-3, min_lr: float = 1e-4, total: int = 8, fraction: float = 0.5) -> float:
    """The branch's schedule by hand: stable at lr, then linear to min_lr over the last `fraction` of `total`."""
    start = total - fraction * total
    return lr if step < start else lr - (lr - min_lr) * (step - start) / (total * fraction)


def test_a_cooldown_branch_starts_from_the_parent_with_its_own_schedule(workdir, trunk, tmp_path):
    parent = ckpt(trunk, 4)
    args = ("-c", str(probe_config(tmp_path)), "--branch_from", str(parent), "--ckpt_path", "last",
            "--optim.schedule", "wsd", "--optim.decay_fraction", "0.5", "--optim.weight_decay", "0.05",
            "--checkpoint.every_n_steps", "2")
    cool = fit(workdir, "cool", *args)  # no checkpoints of its own yet: `last` branches

    # Before its first update: the trunk's step-4 weights and AdamW moments, bit for bit, at step 4.
    first, saved = torch.load(tmp_path / "first.pt", weights_only=True), lightning_state(trunk, 4)
    assert first["global_step"] == 4
    assert first["state_dict"].keys() == saved["state_dict"].keys()
    assert all(torch.equal(first["state_dict"][k], saved["state_dict"][k]) for k in saved["state_dict"])
    moments = saved["optimizer_states"][0]["state"]
    assert first["optimizer"].keys() == moments.keys() and all(
        torch.equal(first["optimizer"][i][k], moments[i][k]) for i in moments for k in moments[i])
    # ... with this run's own hyper-parameters (the trunk's weight decay was 0.1).
    decay = {g["name"]: g["weight_decay"] for g in first["groups"]}
    assert decay == {"decay": 0.05, "no_decay": 0.0} and {g["initial_lr"] for g in first["groups"]} == {1e-3}

    # Its own schedule at the inherited step: decay over steps 4-8 (the trunk stays at 1e-3 until step 6). The
    # update computed at step s is logged at s + 1.
    lrs = scalars(cool, "train/lr")
    assert sorted(lrs) == [5, 6, 7, 8]
    for step, lr in lrs.items():
        assert lr == pytest.approx(wsd_linear(step - 1), rel=1e-6), step
    assert scalars(trunk, "train/lr")[6] == pytest.approx(1e-3)

    # The parent, in every manifest of the branch; the recorded config reruns the branch.
    trunk_manifest = read_manifest(parent)
    for step in (6, 8):
        record = read_manifest(ckpt(cool, step))["branched_from"]
        assert record["checkpoint"] == str(parent.resolve()) and record["run_dir"] == str(trunk.resolve())
        assert record["step"] == 4 and record["tokens_seen"] == trunk_manifest["tokens_seen"] == 4 * 2 * 4 * 16
        assert record["manifest_sha256"] == hashlib.sha256((parent / "manifest.json").read_bytes()).hexdigest()
        assert record["config_hash"] == trunk_manifest["config_hash"]
    config = yaml.safe_load((ckpt(cool, 8) / "config.yaml").read_text())
    assert config["branch_from"] == str(parent) and config["ckpt_path"] == "last"

    # The same command again resumes the branch (from its own step 8), still recording the parent — also when the
    # parent's checkpoint is gone by then (a trunk's keep_last_n rotation): a resumed branch never reads it.
    aside = parent.with_name(parent.name + ".aside")
    parent.rename(aside)
    try:
        fit(workdir, "cool", *args, "--trainer.max_steps", "10", "--optim.continuation", "hold")
    finally:
        aside.rename(parent)
    assert read_manifest(ckpt(cool, 10))["branched_from"] == record
    assert sorted(scalars(cool, "train/lr")) == [5, 6, 7, 8, 9, 10]
    # ... but not with another parent.
    with pytest.raises(CheckpointError, match=r"--branch_from .*step-00000008 --ckpt_path last: .*cool already holds "
                                              r"checkpoints of a run that branched from .*trunk/checkpoints/step-0000"
                                              r"0004; resume it without --branch_from"):
        fit(workdir, "cool", *args[2:], "--branch_from", str(ckpt(trunk, 8)))


def test_a_branch_of_a_branch_records_the_lineage(workdir, trunk):
    """A branch's manifest holds its parent's `branched_from`: the chain back to the trunk."""
    first = fit(workdir, "first", *TRUNK, "--branch_from", str(ckpt(trunk, 4)), "--trainer.max_steps", "6",
                "--checkpoint.every_n_steps", "2")
    second = fit(workdir, "second", *TRUNK, "--branch_from", str(ckpt(first, 6)), "--trainer.max_steps", "7",
                 "--checkpoint.every_n_steps", "1")
    record = read_manifest(ckpt(second, 7))["branched_from"]
    assert record["checkpoint"] == str(ckpt(first, 6).resolve()) and record["step"] == 6
    assert record["branched_from"]["checkpoint"] == str(ckpt(trunk, 4).resolve())
    assert json.loads((ckpt(first, 6) / "manifest.json").read_text())["branched_from"] == record["branched_from"]

"""Reliability without DeepSpeed, in-process and single-device (seconds each): the guard's `skip` policy, a
full disk during a save, and the resume/load checks with their messages (docs/errors.md lists them all).

The multi-process DeepSpeed side (kill -9, resharding, the guard under ZeRO) is tests/test_reliability_deepspeed.py.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from data.errors import DataError
from tests.helpers.faults import installed
from tests.helpers.multiproc import REPO
from tests.helpers.runs import read_manifest
from training.callbacks.guard import NonFiniteError, NonFiniteGuard
from training.callbacks.step_checkpoint import StepCheckpoint
from training.checkpointing import resume
from training.checkpointing.load import load_checkpoint
from training.checkpointing.plan import resolve
from training.checkpointing.save import move_aside
from training.cli import main
from training.errors import DEBUG_ENV, CheckpointError
from training.run import layout

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

HELPERS = REPO / "tests" / "helpers"


def fit(workdir: Path, name: str, *extra: str) -> None:
    """`normlab fit` on the tiny config; under NORMLAB_DEBUG=1 a user error raises (with its type and message)
    instead of being printed as one line, so the tests below check each error where it is raised."""
    with mock.patch.dict(os.environ, {DEBUG_ENV: "1"}):
        main(["fit", "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"), "--runs_dir",
              str(workdir / "runs"), "--name", name, "--trainer.devices", "1", "--trainer.logger", "false",
              "--metrics.every_n_steps", "0", "--checkpoint.every_n_steps", "2", *extra])


def step_dir(workdir: Path, name: str, step: int) -> Path:
    return workdir / "runs" / name / "checkpoints" / layout.step_dirname(step)


@pytest.fixture(scope="module")
def finished(workdir) -> Path:
    """A complete 4-step run (checkpoints 2 and 4) for the resume checks."""
    fit(workdir, "finished", "--trainer.max_steps", "4")
    return workdir / "runs" / "finished"


def copy_run(finished: Path, name: str) -> Path:
    return Path(shutil.copytree(finished, finished.parent / name))


def test_guard_skip_leaves_weights_and_optimizer_untouched_then_aborts(workdir, tmp_path):
    """NaN gradients at updates 3, 4 and 5 with `skip` and max_consecutive_skips=2: updates 3 and 4 are dropped
    (checkpoint 4 holds exactly checkpoint 2's weights and AdamW state), the third in a row aborts."""
    nan = tmp_path / "nan.yaml"
    nan.write_text("trainer:\n  callbacks:\n    - class_path: tests.helpers.faults.InjectNaNGrad\n"
                   "      init_args: {steps: [3, 4, 5], rank: 0}\n")
    with pytest.raises(NonFiniteError, match=r"non-finite gradient, first in layer L1 \(layers\.1\..*at step 5: "
                                             r"3 consecutive updates skipped \(guard.max_consecutive_skips=2\)"):
        fit(workdir, "skip", "-c", str(nan), "--guard.policy", "skip", "--guard.max_consecutive_skips", "2")
    two, four = (torch.load(step_dir(workdir, "skip", s) / "model.ckpt", weights_only=True) for s in (2, 4))
    assert four["global_step"] == 4 and two["global_step"] == 2
    assert all(torch.equal(two["state_dict"][k], four["state_dict"][k]) for k in two["state_dict"])
    state2, state4 = (c["optimizer_states"][0]["state"] for c in (two, four))
    assert all(torch.equal(state2[i][k], state4[i][k]) for i in state2 for k in state2[i])
    assert not step_dir(workdir, "skip", 6).exists()


def test_guard_skips_a_loss_spike(workdir, tmp_path, caplog):
    """A 10x loss at update 5 with `skip` and skip_spike_z=3: the z-score is logged, the update is dropped
    (checkpoint 5 holds exactly checkpoint 4's weights and AdamW state) and training goes on."""
    spike = tmp_path / "spike.yaml"
    spike.write_text("trainer:\n  callbacks:\n    - class_path: tests.helpers.faults.InjectLossSpike\n"
                     "      init_args: {steps: [5]}\n")
    with caplog.at_level("WARNING", logger="training.callbacks.guard"):
        fit(workdir, "spike", "-c", str(spike), "--guard.policy", "skip", "--guard.skip_spike_z", "3",
            "--checkpoint.every_n_steps", "1", "--trainer.max_steps", "6")
    assert "skipped update: loss spike at step 5" in caplog.text
    four, five, six = (torch.load(step_dir(workdir, "spike", s) / "model.ckpt", weights_only=True) for s in (4, 5, 6))
    assert all(torch.equal(four["state_dict"][k], five["state_dict"][k]) for k in four["state_dict"])
    state4, state5 = (c["optimizer_states"][0]["state"] for c in (four, five))
    assert all(torch.equal(state4[i][k], state5[i][k]) for i in state4 for k in state4[i])
    assert not all(torch.equal(five["state_dict"][k], six["state_dict"][k]) for k in five["state_dict"])


@pytest.mark.parametrize("nonfinite", ["nan", "inf"])
def test_guard_catches_a_nonfinite_loss_with_finite_gradients(workdir, tmp_path, nonfinite):
    """A NaN or Inf *loss* whose gradients are finite (zero): only the loss check sees it. `abort` stops before the
    update; `skip` drops it (checkpoint 3 holds checkpoint 2's weights) and counts it."""
    bad = tmp_path / "loss.yaml"
    bad.write_text("trainer:\n  callbacks:\n    - class_path: tests.helpers.faults.InjectNonFiniteLoss\n"
                   f"      init_args: {{steps: [3], value: {nonfinite}}}\n")
    name = f"loss-{nonfinite}"
    with pytest.raises(NonFiniteError, match=r"non-finite loss at step 3: stopped before the optimizer step"):
        fit(workdir, name, "-c", str(bad))
    assert sorted(p.name for p in step_dir(workdir, name, 2).parent.iterdir()) == ["step-00000002"]
    fit(workdir, f"{name}-skip", "-c", str(bad), "--guard.policy", "skip", "--checkpoint.every_n_steps", "1",
        "--trainer.max_steps", "4")
    two, three, four = (torch.load(step_dir(workdir, f"{name}-skip", s) / "model.ckpt", weights_only=True)
                        for s in (2, 3, 4))
    assert all(torch.equal(two["state_dict"][k], three["state_dict"][k]) for k in two["state_dict"])
    assert not all(torch.equal(three["state_dict"][k], four["state_dict"][k]) for k in two["state_dict"])
    guard_state = next(v for k, v in four["callbacks"].items() if k.startswith("NonFiniteGuard"))
    assert guard_state["skipped"] == 1


DISK_FULL = (r"saving checkpoint step 4 into .* failed: the disk is full \({rank}OSError: \[Errno 28\] No space left "
             r"on device.*{moved}\. Earlier checkpoints are intact: free space \(or set --checkpoint.keep_last_n\), "
             r"then resume with --ckpt_path last")


@pytest.mark.parametrize("fault", ["enospc_manifest@4", "enospc_shard@4"])
def test_disk_full_during_save(workdir, fault):
    """A real write to /dev/full (no space left on the device) at step 4 — the manifest (a plain file write: OSError
    with errno 28) or the checkpoint file itself (torch.save's zip writer: a RuntimeError without errno) — gives
    docs/errors.md's message, moves any partial checkpoint aside (the manifest case: the model file is written),
    leaves step 2 intact, and `--ckpt_path last` resumes from it."""
    name = f"full-{fault.split('@')[0]}"
    manifest = "manifest" in fault
    rank = "" if manifest else "rank 0: "  # a shard write's error is gathered from the ranks
    moved = "; the partial checkpoint was moved to .*incomplete/step-00000004" if manifest else ""
    with installed(fault), pytest.raises(CheckpointError, match=DISK_FULL.format(rank=rank, moved=moved)):
        fit(workdir, name)
    ckpts = workdir / "runs" / name / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == (["incomplete", "step-00000002"] if manifest else
                                                       ["step-00000002"])
    if manifest:
        assert (ckpts / "incomplete" / "step-00000004" / "model.ckpt").is_file()
    fit(workdir, name, "--ckpt_path", "last", "--trainer.max_steps", "4", "--optim.continuation", "hold")
    assert read_manifest(ckpts / "step-00000004")["step"] == 4


def test_resume_with_a_vocab_size_smaller_than_the_data(workdir):
    """The model/data vocabulary check, reached through a real fit: data tokenized with 320 pieces, a model with
    256 embeddings."""
    message = r"tokenized with 320 pieces \(meta.json\), more than the model's vocab_size 256"
    with pytest.raises(DataError, match=message):
        fit(workdir, "small-vocab", "--model.vocab_size", "256")


def test_resume_with_an_accumulation_that_splits_an_update(workdir, finished):
    """Through a real resume: step 4 of accumulation 2 is 8 micro-batches; 3 does not divide them, 4 does (and the
    resumed run then reaches step 5)."""
    with pytest.raises(CheckpointError, match=r"step-00000004 with accumulate_grad_batches 3: it was saved after 8 "
                                              r"micro-batches \(4 updates of 2\)"):
        fit(workdir, "finished", "--ckpt_path", "last", "--trainer.accumulate_grad_batches", "3")
    run = copy_run(finished, "reaccumulated")
    fit(workdir, "reaccumulated", "--ckpt_path", "last", "--trainer.accumulate_grad_batches", "4",
        "--trainer.max_steps", "5", "--checkpoint.every_n_steps", "1", "--optim.continuation", "hold")
    assert read_manifest(run / "checkpoints" / "step-00000005")["accumulate_grad_batches"] == 4


def test_resume_with_changed_model_config(workdir, finished):
    with pytest.raises(CheckpointError, match=r"cannot resume .*step-00000004: the model config changed \(dim: 32 "
                                              r"→ 64.*model_config.json"):
        fit(workdir, "finished", "--ckpt_path", "last", "--model.dim", "64")


def test_resume_with_another_tokenizer(workdir, finished):
    run = copy_run(finished, "retokenized")
    manifest = json.loads((run / "checkpoints" / "step-00000004" / "manifest.json").read_text())
    manifest["tokenizer_hash"] = "0" * 64  # as if trained with another tokenizer
    (run / "checkpoints" / "step-00000004" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"the tokenizer differs from the one it was trained with"):
        fit(workdir, "retokenized", "--ckpt_path", "last")


def test_corrupt_manifest(workdir, finished):
    run = copy_run(finished, "corrupt")
    (run / "checkpoints" / "step-00000004" / "manifest.json").write_text('{"step": 4, "form')
    with pytest.raises(CheckpointError, match=r"corrupt manifest .*step-00000004/manifest.json.*resume from the "
                                              r"previous checkpoint"):
        fit(workdir, "corrupt", "--ckpt_path", "last")
    with pytest.raises(CheckpointError, match="corrupt manifest"):
        load_checkpoint(run / "checkpoints" / "step-00000004")


def test_missing_or_truncated_shard(workdir, finished):
    run = copy_run(finished, "damaged")
    ckpt = run / "checkpoints" / "step-00000004"
    assert "model.ckpt" in read_manifest(ckpt)["files"]
    data = (ckpt / "model.ckpt").read_bytes()
    (ckpt / "model.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"'model.ckpt' is truncated or altered \(\d+ bytes, \d+ when saved\)"):
        fit(workdir, "damaged", "--ckpt_path", "last")
    with pytest.raises(CheckpointError, match=r"'model.ckpt' is truncated"):
        load_checkpoint(ckpt)
    (ckpt / "model.ckpt").unlink()
    with pytest.raises(CheckpointError, match=r"'model.ckpt' is missing; restore it or use an earlier checkpoint"):
        load_checkpoint(ckpt)


def test_interrupted_step_dir_is_refused_and_last_skips_it(tmp_path):
    ckpts = layout.checkpoints_dir(tmp_path)
    (ckpts / "step-00000002").mkdir(parents=True)
    (ckpts / "step-00000002" / "manifest.json").write_text(json.dumps({"step": 2, "format": "lightning"}))
    (ckpts / "step-00000004").mkdir()  # shards, no manifest
    (ckpts / ".tmp-step-00000006").mkdir()
    assert resolve("last", tmp_path) == (str(ckpts / "step-00000002" / "model.ckpt"), 2)
    with pytest.raises(CheckpointError, match=r"no manifest.json, the save was interrupted"):
        resolve(str(ckpts / "step-00000004"), tmp_path)
    assert [p.name for p in layout.incomplete_checkpoints(tmp_path)] == [".tmp-step-00000006",
                                                                             "step-00000004"]
    moved = move_aside(ckpts / ".tmp-step-00000006", "test")
    assert moved == ckpts / "incomplete" / "step-00000006" and moved.is_dir()


def test_ranks_that_resolved_different_checkpoints_stop(tmp_path):
    """Each rank resolves `--ckpt_path last` on its own; rank 1 seeing another newest checkpoint than rank 0 (no
    shared storage) must stop at setup, before any rank loads or writes. (The broadcast is rank 0's answer.)"""
    callback = StepCheckpoint()
    callback.resume_from = str(tmp_path / "checkpoints" / "step-00000004")
    strategy = SimpleNamespace(broadcast=lambda value: str(tmp_path / "checkpoints" / "step-00000006"))
    trainer = SimpleNamespace(strategy=strategy, global_rank=1, is_global_zero=False)
    with pytest.raises(CheckpointError, match=r"rank 1 resolved the checkpoint .*step-00000004, rank 0 .*step-00000006"
                                              r": the ranks do not see the same checkpoints directory"):
        callback.setup(trainer, None, "fit")


def test_accumulation_change_must_keep_update_boundaries():
    """5 updates of 2 micro-batches: 10 micro-batches read. Accumulation 5 (or 1, 2, 10) continues on an update
    boundary; 4 would close the first update after 2 micro-batches."""
    manifest = {"step": 5, "accumulate_grad_batches": 2}
    for ok in (1, 2, 5, 10):
        resume.check_accumulation(Path("step-00000005"), manifest, SimpleNamespace(accumulate_grad_batches=ok))
    with pytest.raises(CheckpointError, match=r"step-00000005 with accumulate_grad_batches 4: it was saved after 10 "
                                              r"micro-batches \(5 updates of 2\), not a whole number of updates of 4\. "
                                              r"Use an accumulate_grad_batches that divides 10"):
        resume.check_accumulation(Path("step-00000005"), manifest, SimpleNamespace(accumulate_grad_batches=4))


def test_world_size_change_without_zero_is_refused():
    """DeepSpeed without ZeRO (stage 0) has no ZeRO shards to convert to the universal format."""
    trainer = SimpleNamespace(world_size=1, is_global_zero=True)
    manifest = {"step": 4, "world_size": 2, "zero_stage": 0, "format": "deepspeed"}
    with pytest.raises(CheckpointError, match=r"\(DeepSpeed ZeRO stage 0, 2 ranks\) on 1 ranks: only ZeRO-1/2/3 "
                                              r"checkpoints convert"):
        resume.check_reshard(Path("step-00000004"), manifest, trainer)
    for stage in (1, 2, 3):
        resume.check_reshard(Path("step-00000004"), {**manifest, "zero_stage": stage}, trainer)


@pytest.mark.parametrize("make, message", [
    (lambda: StepCheckpoint(keep_last_n=1), r"checkpoint.keep_last_n=1 must be >= 2, or null"),
    (lambda: NonFiniteGuard(policy="ignore"), r"guard.policy='ignore' is not one of \['abort', 'skip'\]"),
    (lambda: NonFiniteGuard(max_consecutive_skips=0), r"guard.max_consecutive_skips=0 must be >= 1"),
    (lambda: NonFiniteGuard(skip_spike_z=3.0), r"guard.skip_spike_z=3.0 needs .* guard.policy=skip"),
])
def test_invalid_reliability_options(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_every_torch_load_is_weights_only():
    """No pickle execution from files normlab reads (DeepSpeed's internal loads excepted: docs/errors.md)."""
    import re

    offenders = []
    # normlab's own code only: a virtualenv inside the checkout (CI makes one) holds other projects' loads.
    for path in [p for top in ("model", "data", "training", "scripts", "tests") for p in (REPO / top).glob("**/*.py")]:
        text = path.read_text(errors="ignore")
        for m in re.finditer(r"torch\.load\(", text):
            call = text[m.start(): text.find("\n", text.find(")", m.start())) + 1]
            if "weights_only=True" not in call:
                offenders.append(f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}")
    assert not offenders, offenders


def test_loss_zscore_over_the_rolling_window():
    guard = NonFiniteGuard(spike_window=4)
    assert guard._zscore(5.0) == 0.0  # too few losses yet
    guard._losses.extend([1.0, 2.0, 3.0, 4.0, 5.0])  # the window keeps the last 4: 2..5, mean 3.5, std 1.29
    assert guard._zscore(3.5) == 0.0
    assert guard._zscore(10.0) == pytest.approx((10.0 - 3.5) / (5 / 3) ** 0.5)


def test_fp16_loss_scale_overflows_are_the_scalers_not_faults(caplog):
    """Under fp16 with a dynamic loss scale (here Lightning's GradScaler), an overflowing gradient with a finite
    loss is routine — the scaler skips that update and lowers its scale: no abort, no skip count, logged. The
    same gradient without a scaler is a fault (the default policy aborts). (A real fp16 run is GPU-only: Lightning
    turns 16-mixed into bf16-mixed on CPU.)"""
    model = torch.nn.Linear(2, 2)
    pl_module = SimpleNamespace(model=model, device=torch.device("cpu"), parameters=model.parameters)
    strategy = SimpleNamespace(reduce=lambda tensor, reduce_op: tensor)
    logged = []
    logger = SimpleNamespace(log_metrics=lambda values, step: logged.append((step, values)))

    def step(guard: NonFiniteGuard, scaler) -> None:
        trainer = SimpleNamespace(strategy=strategy, world_size=1, global_step=0, is_global_zero=True, loggers=[logger],
                                  precision_plugin=SimpleNamespace(scaler=scaler))
        model.weight.grad = torch.full_like(model.weight, float("inf"))
        guard.on_before_backward(trainer, pl_module, torch.tensor(2.0))
        guard.on_before_optimizer_step(trainer, pl_module, None)
        guard.on_train_batch_end(trainer, pl_module)

    guard = NonFiniteGuard()
    with caplog.at_level("INFO", logger="training.callbacks.guard"):
        step(guard, scaler=torch.amp.GradScaler("cpu"))
    assert guard.scaler_overflows == 1 and guard.skipped == 0 and guard.consecutive == 0
    assert "fp16 gradient overflow at step 1: the loss scaler skips it" in caplog.text
    assert logged == [(1, {"guard/scaler_overflows": 1.0})]  # the README's tag, and nothing counted as skipped
    with pytest.raises(NonFiniteError, match=r"non-finite gradient, first in weight \(1 parameters\) at step 1"):
        step(NonFiniteGuard(), scaler=None)

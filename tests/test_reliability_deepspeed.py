"""Reliability under real 2-process DeepSpeed ZeRO-2 on CPU: kill -9 during a save and between steps, the
non-finite guard, and resuming on another world size.

One uninterrupted reference run (checkpoints every 2 steps, the newest 2 kept) is shared by the module's tests;
the ZeRO-1 resume on one rank starts from the session's reference runs (tests/helpers/zero_runs.py) instead. The
module takes ~2-3 minutes on 2 idle cores, almost all of it process start-up.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import zero_runs
from tests.helpers.faults import kill_when_paused, run_with_faults
from tests.helpers.multiproc import REPO, run_normlab
from tests.helpers.runs import consolidated_state_dict, scalars, table_value

pytestmark = pytest.mark.slow

HELPERS = REPO / "tests" / "helpers"


def fit_args(workdir: Path, name: str, *extra: str, devices: int = 2) -> list[str]:
    return ["fit", "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"),
            "--runs_dir", str(workdir / "runs"), "--name", name, "--trainer.strategy", "zero2",
            "--trainer.devices", str(devices), "--checkpoint.every_n_steps", "2", "--checkpoint.keep_last_n", "2",
            *extra]


def ckpt(workdir: Path, name: str, step: int) -> Path:
    return workdir / "runs" / name / "checkpoints" / f"step-{step:08d}"


def steps_on_disk(workdir: Path, name: str) -> list[str]:
    return sorted(p.name for p in (workdir / "runs" / name / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def reference(workdir) -> Path:
    run_normlab(fit_args(workdir, "reference"), cwd=workdir)
    return workdir / "runs" / "reference"


def assert_same_final_weights(workdir: Path, name: str, tmp_path: Path) -> None:
    straight = consolidated_state_dict(ckpt(workdir, "reference", 8), tmp_path)
    again = consolidated_state_dict(ckpt(workdir, name, 8), tmp_path)
    assert straight.keys() == again.keys()
    assert all(torch.equal(straight[k], again[k]) for k in straight)


def test_manifest_and_keep_last_n(workdir, reference):
    assert steps_on_disk(workdir, "reference") == ["step-00000006", "step-00000008"]  # 2 and 4 purged
    manifest = json.loads((ckpt(workdir, "reference", 8) / "manifest.json").read_text())
    assert manifest["step"] == 8 and manifest["world_size"] == 2 and manifest["zero_stage"] == 2
    assert manifest["tokens_seen"] == 8 * 2 * 2 * 4 * 16  # steps · accumulation · ranks · batch · seq_len
    assert len(manifest["config_hash"]) == 64 and len(manifest["tokenizer_hash"]) == 64
    assert {"python", "torch", "lightning", "deepspeed"} <= manifest["versions"].keys()
    assert manifest["git_revision"] == git_head()


def git_head() -> str:
    """`git rev-parse HEAD` of the checkout under test, `-dirty` when `git diff HEAD` shows tracked changes."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(REPO), *args], check=False, capture_output=True, text=True)

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("-dirty" if git("diff", "HEAD", "--quiet").returncode else "")


def test_kill_between_steps_and_during_save(workdir, reference, tmp_path):
    """One run, killed twice with SIGKILL (every rank), resumed each time with `--ckpt_path last`:
    1. between steps (before update 7): `last` is step 6;
    2. while step 8 is half-written (every rank's shards on disk, no manifest): `last` is step 6 again, the
       half-written save is moved aside (not deleted) and step 4 is still there — purging waits for a
       complete new checkpoint.
    The final weights and every logged loss equal the uninterrupted run's."""
    name, run = "killed", workdir / "runs" / "killed"
    kill_when_paused(fit_args(workdir, name), workdir, "pause_before_step@7", tmp_path / "paused-step")
    assert steps_on_disk(workdir, name) == ["step-00000004", "step-00000006"]

    kill_when_paused(fit_args(workdir, name, "--ckpt_path", "last"), workdir, "pause_after_shards@8",
                     tmp_path / "paused-save")
    assert steps_on_disk(workdir, name) == [".tmp-step-00000008", "step-00000004", "step-00000006"]
    half = run / "checkpoints" / ".tmp-step-00000008"
    assert any((half / "checkpoint").iterdir()) and not (half / "latest").exists()  # shards, no pointer to them

    run_normlab(fit_args(workdir, name, "--ckpt_path", "last"), cwd=workdir)
    assert steps_on_disk(workdir, name) == ["incomplete", "step-00000006", "step-00000008"]
    incomplete = run / "checkpoints" / "incomplete" / "step-00000008"
    assert (incomplete / "checkpoint").is_dir() and not (incomplete / "manifest.json").exists()
    # only the half-written save was moved aside: a resume that started over instead of from step 6 would have
    # superseded step 6 as well (and still logged the same losses and reached the same weights)
    assert sorted(p.name for p in incomplete.parent.iterdir()) == ["step-00000008"]
    assert_same_final_weights(workdir, name, tmp_path)
    assert scalars(run, "train/loss") == scalars(reference, "train/loss")


def max_weight_diff(a: Path, b: Path, scratch: Path) -> float:
    """Largest absolute difference between the consolidated weights of two checkpoint directories."""
    left, right = consolidated_state_dict(a, scratch), consolidated_state_dict(b, scratch)
    assert left.keys() == right.keys()
    return max((left[k] - right[k]).abs().max().item() for k in left)


TOKENS_PER_MICRO_BATCH = 4 * 16  # batch · seq_len (tiny.yaml)


def test_resume_on_another_world_size(workdir, reference, tmp_path):
    """Step 6 of the 2-rank run resumes on 3 ranks (DeepSpeed's universal checkpoint reshards the optimizer
    state) with the global batch of 2 ranks x accumulation 3 (3 ranks x 2 = 24 samples), and the data goes on after
    the tokens consumed, whatever the layout: it reads the same samples from the resharded state, so its final
    weights agree to fp32 rounding (the two steps move weights by ~5e-4), and the manifest counts the tokens of its
    layout. The reference is the same 24 samples on the 2 ranks that wrote step 6 (accumulation 3): DeepSpeed's own
    loader, no conversion — so a resharding that lost or garbled the Adam moments shows. (2 -> 1, compared with the
    2-rank run itself: test_zero1_resumes_on_one_rank and test_zero3_skips_nan_and_spike_then_reshards; a
    growing world is the case they leave.)"""
    layouts = {"resharded-3": (3, 2), "reaccumulated-2": (2, 3)}
    for name, (devices, accumulate) in layouts.items():
        run_normlab(fit_args(workdir, name, "--ckpt_path", str(ckpt(workdir, "reference", 6)),
                             "--trainer.accumulate_grad_batches", str(accumulate), devices=devices), cwd=workdir)
        manifest = json.loads((ckpt(workdir, name, 8) / "manifest.json").read_text())
        assert manifest["world_size"] == devices and manifest["step"] == 8
        assert manifest["tokens_seen"] == (6 * 2 * 2 + 2 * accumulate * devices) * TOKENS_PER_MICRO_BATCH
        losses = scalars(workdir / "runs" / name, "train/loss")
        assert sorted(losses) == [7, 8]
        # the loss goes on from where it was (fresh weights would be ~5% off; measured ~0.4%)
        assert losses[7] == pytest.approx(scalars(reference, "train/loss")[7], rel=0.01)
    same = scalars(workdir / "runs" / "reaccumulated-2", "train/loss")
    moved = max_weight_diff(ckpt(workdir, "reference", 6), ckpt(workdir, "reaccumulated-2", 8), tmp_path)
    assert moved > 1e-4
    assert scalars(workdir / "runs" / "resharded-3", "train/loss") == pytest.approx(same, rel=1e-5)
    diff = max_weight_diff(ckpt(workdir, "reaccumulated-2", 8), ckpt(workdir, "resharded-3", 8), tmp_path)
    assert diff < 1e-6, diff


def test_stage0_checkpoint_on_another_world_size_is_refused(workdir, reference, tmp_path):
    """Through a real resume: a DeepSpeed checkpoint without ZeRO (stage 0: nothing to convert to the universal
    format) cannot resume on another world size. (Here the reference's manifest says stage 0.)"""
    copy = tmp_path / "stage0"
    shutil.copytree(ckpt(workdir, "reference", 6), copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "zero_stage": 0}))
    proc = run_normlab(fit_args(workdir, "stage0", "--ckpt_path", str(copy), devices=1), cwd=workdir,
                       expect_ok=False)
    assert proc.returncode != 0
    assert "(DeepSpeed ZeRO stage 0, 2 ranks) on 1 ranks: only ZeRO-1/2/3 checkpoints convert" in (
        proc.stdout + proc.stderr), (proc.stdout + proc.stderr)[-3000:]


def test_damaged_deepspeed_shards_are_refused(workdir, reference, tmp_path):
    """A truncated or missing ZeRO shard (optimizer state or model states) is named before anything loads it."""
    from training.checkpointing.load import load_checkpoint
    from training.errors import CheckpointError

    copy = Path(shutil.copytree(ckpt(workdir, "reference", 8), tmp_path / "damaged"))
    shards = sorted(p for p in copy.rglob("*.pt"))
    optim = next(p for p in shards if "optim_states" in p.name)
    optim.write_bytes(optim.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"'{re.escape(str(optim.relative_to(copy)))}' is truncated or altered"):
        load_checkpoint(copy)
    model = next(p for p in shards if "model_states" in p.name)
    model.unlink()
    with pytest.raises(CheckpointError, match=rf"'{re.escape(str(model.relative_to(copy)))}' is missing"):
        load_checkpoint(copy)


def test_validate_on_another_world_size(workdir, reference):
    """Lightning's `validate` of the 2-rank ZeRO-2 step 8 on 1 rank (its inference engine reads the whole weights
    of ZeRO-1/2 on any world size): the run's own val/loss at step 8."""
    proc = run_normlab(["validate", "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"),
                        "--runs_dir", str(workdir / "runs"), "--name", "validate-1", "--trainer.strategy", "zero2",
                        "--trainer.devices", "1", "--ckpt_path", str(ckpt(workdir, "reference", 8))], cwd=workdir)
    validated = table_value(proc.stdout + proc.stderr, "val/loss")
    assert validated == pytest.approx(scalars(reference, "val/loss")[8], rel=1e-6)


def test_zero1_resumes_on_one_rank(zero_workdir, zero1_run, zero2_run, tmp_path):
    """ZeRO-1 (partitioned optimizer state, whole gradients) through the same universal conversion: the session's
    2-rank ZeRO-1 run (tests/helpers/zero_runs.py) resumed from its step 4 on 1 rank with the same global batch
    ends at the session's 2-rank ZeRO-2 run's weights to fp32 rounding (the stages differ only in summation
    order)."""
    name = "zero1-on-one-rank"  # beside the session's runs, as the resume reads their data
    # a copy: the conversion caches the universal checkpoint beside the shards, and the session's run stays as it was
    step4 = Path(shutil.copytree(zero1_run / "checkpoints" / "step-00000004", tmp_path / "step-00000004"))
    args = zero_runs.fit_args(zero_workdir, name, "zero1", "--ckpt_path", str(step4),
                              "--trainer.accumulate_grad_batches", "4")
    args[args.index("--trainer.devices") + 1] = "1"
    run_normlab(args, cwd=zero_workdir)
    resumed = zero_workdir / "runs" / name / "checkpoints" / "step-00000008"
    manifest = json.loads((resumed / "manifest.json").read_text())
    assert manifest["zero_stage"] == 1 and manifest["world_size"] == 1
    assert max_weight_diff(zero2_run / "checkpoints" / "step-00000008", resumed, tmp_path) < 1e-6


def test_a_shard_write_failing_on_rank_1_stops_every_rank(workdir):
    """Rank 1's shard files of step 4 go to /dev/full (a real failing torch.save, which reports a full disk as a
    RuntimeError from its zip writer, without errno): rank 1 holds the error through the save's remaining
    collectives instead of leaving rank 0 waiting in them forever; then both ranks stop with docs/errors.md's
    message, naming rank 1, the full disk and the free space, and the partial checkpoint is moved aside (step 2
    intact, for --ckpt_path last)."""
    proc = run_with_faults(fit_args(workdir, "shard-enospc"), workdir, "enospc_shard@4:1", timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("saving checkpoint step 4 into") >= 2, out[-3000:]  # every rank says it
    assert "failed: the disk is full (rank 1: OSError: [Errno 28] No space left on device" in out, out[-3000:]
    assert "GiB free there; the partial checkpoint was moved to" in out, out[-3000:]
    assert steps_on_disk(workdir, "shard-enospc") == ["incomplete", "step-00000002"]


def guard_args(workdir: Path, name: str, *extra: str) -> list[str]:
    return [*fit_args(workdir, name, *extra), "-c", str(HELPERS / "nan_grad.yaml")]


def test_guard_abort_names_step_and_layer(workdir):
    """A NaN gradient (one rank, block 1, step 3): both ranks stop before the update, the error names step 3 and
    the first non-finite parameter's layer, and nothing is saved after step 2."""
    proc = run_normlab(guard_args(workdir, "nan-abort"), cwd=workdir, expect_ok=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "NonFiniteError: non-finite gradient, first in layer L1 (layers.1." in out, out[-3000:]
    assert "at step 3: stopped before the optimizer step" in out
    assert steps_on_disk(workdir, "nan-abort") == ["step-00000002"]


def test_guard_skip_lets_deepspeed_drop_the_update(workdir, reference):
    """With `skip`, DeepSpeed's ZeRO optimizer drops the non-finite step itself (verified by the guard through
    engine.skipped_steps); training goes on and the count is logged."""
    run_normlab(guard_args(workdir, "nan-skip", "--guard.policy", "skip"), cwd=workdir)
    run = workdir / "runs" / "nan-skip"
    assert scalars(run, "guard/skipped_steps") == {3: 1.0}
    losses = scalars(run, "train/loss")
    assert sorted(losses) == list(range(1, 9)) and all(torch.isfinite(torch.tensor(list(losses.values()))))
    assert losses[2] == scalars(reference, "train/loss")[2] and losses[8] != scalars(reference, "train/loss")[8]
    assert "guard/loss_z" in _tags(run)


def test_deepspeeds_own_skipped_steps_count_toward_max_consecutive_skips(workdir, tmp_path):
    """With the guard's own gradient check blinded (tests/helpers/faults.py), NaN gradients at updates 3 and 4 are
    caught only by DeepSpeed's ZeRO optimizer, which drops them itself: the guard counts those skips, and the second
    in a row exceeds max_consecutive_skips=1. (One rank: the engine's check is the same on any number.)"""
    nan = tmp_path / "nan.yaml"
    nan.write_text("trainer:\n  callbacks:\n    - class_path: tests.helpers.faults.InjectNaNGrad\n"
                   "      init_args: {steps: [3, 4], rank: 0}\n")
    proc = run_with_faults([*fit_args(workdir, "ds-own-skips", devices=1), "-c", str(nan), "--guard.policy", "skip",
                            "--guard.max_consecutive_skips", "1"], workdir, "blind_guard")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert re.search(r"DeepSpeed skipped step \d \(overflow\): 2 consecutive updates skipped "
                     r"\(guard.max_consecutive_skips=1\); training stopped", out), out[-3000:]
    assert scalars(workdir / "runs" / "ds-own-skips", "guard/skipped_steps") == {3: 1.0, 4: 2.0}


def _tags(run: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run))
    acc.Reload()
    return acc.Tags()["scalars"]


def test_zero3_skips_nan_and_spike_then_reshards(workdir, tmp_path):
    """ZeRO-3, 2 ranks, `skip` with a spike threshold: a NaN gradient at update 3 (rank 1 only) and a 10x loss at
    update 5 are both dropped by the engine itself (the guard poisons the spiking step's gradient before its
    backward and checks engine.skipped_steps), so checkpoints 3 and 5 hold exactly the weights of 2 and 4.
    Then step 6 resumes on 1 rank with the same global batch and reaches the 2-rank run's step 8 to fp32
    rounding — DeepSpeed's ZeRO-3 universal loader needs two repairs for that (training/strategy.py) — and
    Lightning's `test` of step 8 on 1 rank reproduces the run's own validation loss."""
    name, run = "zero3-faults", workdir / "runs" / "zero3-faults"
    faults = ["-c", str(HELPERS / "faults.yaml"), "--guard.policy", "skip", "--guard.skip_spike_z", "3"]
    run_normlab([*fit_args(workdir, name, "--trainer.strategy", "zero3", "--checkpoint.every_n_steps", "1",
                           "--checkpoint.keep_last_n", "null"), *faults], cwd=workdir)
    assert scalars(run, "guard/skipped_steps") == {3: 1.0, 5: 2.0}
    assert scalars(run, "guard/loss_z")[5] > 100
    assert max_weight_diff(ckpt(workdir, name, 2), ckpt(workdir, name, 3), tmp_path) == 0
    assert max_weight_diff(ckpt(workdir, name, 4), ckpt(workdir, name, 5), tmp_path) == 0
    assert max_weight_diff(ckpt(workdir, name, 5), ckpt(workdir, name, 6), tmp_path) > 1e-4

    resumed = "zero3-resharded"
    run_normlab(fit_args(workdir, resumed, "--trainer.strategy", "zero3", "--ckpt_path", str(ckpt(workdir, name, 6)),
                         "--trainer.accumulate_grad_batches", "4", devices=1), cwd=workdir)
    assert max_weight_diff(ckpt(workdir, name, 8), ckpt(workdir, resumed, 8), tmp_path) < 1e-6

    # Lightning's test on 1 rank reads the 2-rank ZeRO-3 shards (consolidated, then loaded into the partitions):
    # the held-out split is the validation windows, so test/loss is the run's own val/loss at step 8.
    proc = run_normlab(["test", "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"), "--runs_dir",
                        str(workdir / "runs"), "--name", "zero3-test", "--trainer.strategy", "zero3",
                        "--trainer.devices", "1", "--ckpt_path", str(ckpt(workdir, name, 8))], cwd=workdir)
    tested = table_value(proc.stdout + proc.stderr, "test/loss")
    assert tested == pytest.approx(scalars(run, "val/loss")[8], rel=1e-6)

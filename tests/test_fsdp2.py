"""`--trainer.strategy fsdp2` on 2 real gloo ranks on CPU, against DDP: the same losses and telemetry, DCP
checkpoints under normlab's manifest, resumed on another world size (2 → 1 → 2 through DCP) with `keep_last_n`,
and read by every command (evaluate, export, generate in this process; validate on 2 ranks, test on 1).

The reference runs are the session's (tests/helpers/zero_runs.py): FSDP2 and DDP, 2 ranks, the same config,
checkpoints at 3, 6 and 8. An exact resume on the same ranks, after a warning on a two-node Slurm, is
tests/test_slurm_cluster.py's; crafted DCP files, tests/test_safe_loading.py's; the parts (DTensor Muon, full
values, the precision policy) against one process, tests/test_fsdp2_units.py's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.multiproc import run_normlab
from tests.helpers.runs import read_manifest, scalars, table_value
from tests.helpers.zero_runs import HELPERS, fit_args
from training.checkpointing import dcp

pytestmark = pytest.mark.slow

N_LAYERS = 2  # tests/helpers/tiny.yaml


@pytest.fixture(scope="module")
def workdir(zero_workdir) -> Path:
    """The session's directory of the reference runs (tests/conftest.py): this module's runs sit beside them."""
    return zero_workdir


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    return dcp.model_state(ckpt_dir)


def test_fsdp2_logs_ddps_numbers_into_hashed_dcp_checkpoints(fsdp2_run, ddp_run):
    """The same batches, weights and updates as DDP: every logged loss, LR and validation value, and the step-0
    telemetry (full gradients and parameters gathered from the shards, rank 0's probes) — to fp32 summation
    order (a reduce-scatter sums where DDP's all-reduce did), measured equal here."""
    for tag in ("train/loss", "train/lr", "val/loss", "probe/rng", "guard/loss_z"):
        assert scalars(fsdp2_run, tag) == pytest.approx(scalars(ddp_run, tag), rel=1e-6, abs=0), tag
    telemetry = [f"{stem}/L{layer}" for stem in ("grad/norm", "param/norm", "resid/rms", "attn/max_logit")
                 for layer in range(N_LAYERS)] + ["grad/global", "grad/norm/tok_embeddings"]
    for tag in telemetry:
        assert scalars(fsdp2_run, tag)[0] == pytest.approx(scalars(ddp_run, tag)[0], rel=1e-6), tag
    for tag in [f"norm/gain_{s}/{role}/L{layer}" for s in ("mean", "max") for role in ("attn_in", "mlp_in")
                for layer in range(N_LAYERS)]:
        assert scalars(fsdp2_run, tag)[0] == 1.0, tag  # γ = 1 at init, gathered whole
    assert sorted(p.name for p in (fsdp2_run / "checkpoints").iterdir()) == [
        "step-00000003", "step-00000006", "step-00000008"]
    manifest = read_manifest(ckpt(fsdp2_run, 8))
    assert manifest["format"] == "dcp" and manifest["world_size"] == 2 and manifest["zero_stage"] is None
    assert manifest["precision"] == {"precision": "32-true", "weights": "float32", "autocast": None}
    files = {p.name for p in ckpt(fsdp2_run, 8).iterdir() if p.name != "manifest.json"}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"} <= files
    assert set(manifest["sha256"]) == set(manifest["files"]) == files  # every shard hashed by the rank writing it


def test_resume_on_one_rank_then_on_two_through_dcp(fsdp2_run, workdir):
    """Step 6 of the 2-rank run on 1 rank (accumulation 4: the same 16 samples per update, DCP resharding the
    weights and Adam moments), keeping the newest 2 of its checkpoints; then its step 7 on 2 ranks again. The
    losses and final weights are the reference's, to fp32 summation order."""
    one = workdir / "runs" / "fsdp2-one-rank"
    run_normlab(fit_args(workdir, one.name, "fsdp2", "--ckpt_path", str(ckpt(fsdp2_run, 6)),
                         "--trainer.accumulate_grad_batches", "4", "--trainer.devices", "1",
                         "--checkpoint.every_n_steps", "1", "--checkpoint.keep_last_n", "2"), cwd=workdir)
    assert sorted(p.name for p in (one / "checkpoints").iterdir()) == ["step-00000007", "step-00000008"]
    assert read_manifest(ckpt(one, 7))["world_size"] == 1
    two = workdir / "runs" / "fsdp2-two-again"
    run_normlab(fit_args(workdir, two.name, "fsdp2", "--ckpt_path", str(ckpt(one, 7))), cwd=workdir)
    reference = scalars(fsdp2_run, "train/loss")
    assert scalars(one, "train/loss") == pytest.approx({7: reference[7], 8: reference[8]}, rel=1e-5)
    assert scalars(two, "train/loss") == pytest.approx({8: reference[8]}, rel=1e-5)
    straight = weights(ckpt(fsdp2_run, 8))
    for path in (ckpt(one, 8), ckpt(two, 8)):
        for name, tensor in weights(path).items():
            torch.testing.assert_close(tensor, straight[name], rtol=1e-5, atol=1e-6)


def test_evaluate_export_and_generate_read_an_fsdp2_checkpoint(fsdp2_run, tmp_path, capsys):
    """In one plain process: evaluate reproduces the run's val/loss at step 8; the export holds the assembled
    weights; generate continues a prompt."""
    from safetensors.torch import load_file

    from training.cli import main

    step8 = str(ckpt(fsdp2_run, 8))
    out = tmp_path / "eval.json"
    assert main(["evaluate", "--checkpoint", step8, "--output", str(out)]) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["loss"] == pytest.approx(scalars(fsdp2_run, "val/loss")[8], rel=1e-5)
    assert main(["export", "--checkpoint", step8, "--output", str(tmp_path / "st"), "--format", "safetensors"]) == 0
    exported = load_file(tmp_path / "st" / "model.safetensors")
    straight = {k.removeprefix("model."): v for k, v in weights(ckpt(fsdp2_run, 8)).items()}
    assert exported.keys() == straight.keys() and all(torch.equal(exported[k], straight[k]) for k in straight)
    assert main(["generate", "--checkpoint", step8, "--prompt", "the", "--max_new_tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("command, devices", [("validate", "2"), ("test", "1")])
def test_validate_and_test_read_an_fsdp2_checkpoint(command, devices, fsdp2_run, workdir):
    """Lightning's own loops on a 2-rank FSDP2 checkpoint, on 2 ranks and resharded onto 1: each prints the val/loss
    the run logged at step 8 (the test split is the run's validation windows)."""
    proc = run_normlab([command, "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"),
                        "--runs_dir", str(workdir / "runs"), "--name", f"fsdp2-{command}", "--trainer.strategy",
                        "fsdp2", "--trainer.devices", devices, "--ckpt_path", str(ckpt(fsdp2_run, 8))], cwd=workdir)
    tag = "val/loss" if command == "validate" else "test/loss"
    assert table_value(proc.stdout + proc.stderr, tag) == pytest.approx(scalars(fsdp2_run, "val/loss")[8], rel=1e-5)

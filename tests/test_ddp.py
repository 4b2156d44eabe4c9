"""DDP (`--trainer.strategy ddp`) with the guarantees the ZeRO strategies have, on 2 real gloo ranks on CPU:
final and SIGTERM checkpoints, bit-identical resume on the same world size, the non-finite guard, the health
metrics, and the manifest's record of the run. (Resuming on another world size reads the data position the same
way under every strategy: tests/test_fsdp2.py and tests/test_reliability_deepspeed.py resume on one rank.)

The session's 2-rank DDP reference run (tests/helpers/zero_runs.py: checkpoints every 3 updates, 3, 6 and the
final 8; tests/test_fsdp2.py compares FSDP2 with it) is shared by every test; three more runs (SIGTERM and its
resume, a NaN gradient) make the module ~2 minutes on 2 idle cores, almost all of it process start-up.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.faults import signal_when_waiting
from tests.helpers.multiproc import REPO, run_normlab
from tests.helpers.runs import consolidated_state_dict, scalars
from tests.helpers.zero_runs import QK_CLIP
from training.strategy import resolve_strategy

HELPERS = REPO / "tests" / "helpers"
TAGS = ("train/loss", "train/lr", "val/loss", "probe/rng", "guard/loss_z")


def fit_args(workdir: Path, name: str, *extra: str, devices: int = 2, probe: str = "probe.yaml") -> list[str]:
    return ["fit", "-c", str(HELPERS / "tiny.yaml"), "-c", str(HELPERS / probe) if "/" not in probe else probe,
            "--data.path", str(workdir / "tiny"), "--runs_dir", str(workdir / "runs"), "--name", name,
            "--trainer.strategy", "ddp", "--trainer.devices", str(devices), "--checkpoint.every_n_steps", "3",
            "--optim.qk_clip", QK_CLIP, *extra]  # the reference run's own arguments (tests/helpers/zero_runs.py)


def ckpt(workdir: Path, name: str, step: int) -> Path:
    return workdir / "runs" / name / "checkpoints" / f"step-{step:08d}"


def steps_on_disk(workdir: Path, name: str) -> list[str]:
    return sorted(p.name for p in (workdir / "runs" / name / "checkpoints").iterdir())


def weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    return consolidated_state_dict(ckpt_dir, ckpt_dir)  # (a Lightning file: nothing to consolidate)


@pytest.fixture(scope="module")
def workdir(zero_workdir) -> Path:
    """The session's directory of the reference runs (tests/conftest.py): this module's runs sit beside them."""
    return zero_workdir


@pytest.fixture(scope="module")
def reference(ddp_run) -> Path:
    return ddp_run


@pytest.mark.slow
def test_ddp_fit_checkpoints_manifest_and_health_metrics(workdir, reference):
    losses = scalars(reference, "train/loss")
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1] - 0.1
    assert steps_on_disk(workdir, "ddp") == ["step-00000003", "step-00000006", "step-00000008"]  # 8: final
    manifest = json.loads((ckpt(workdir, "ddp", 8) / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["format"] == "lightning" and manifest["zero_stage"] is None
    assert manifest["tokens_seen"] == 8 * 2 * 2 * 4 * 16  # steps · accumulation · ranks · batch · seq_len
    assert manifest["precision"] == {"precision": "32-true", "weights": "float32", "autocast": None}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(reference), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"grad/global", "grad/norm/L0", "param/norm/L1", "resid/rms/L1", "attn/entropy/L0",
            "guard/loss_z", "throughput/tokens_per_sec", "val/loss", "optim/update_ratio/attn/L0",
            "attn/max_logit_exact_worst/L1"} <= tags, sorted(tags)
    assert sum(scalars(reference, "qk_clip/heads_clipped").values()) > 0  # (its runs clip: see fit_args)


@pytest.mark.slow
def test_sigterm_to_one_rank_saves_and_resumes_bit_for_bit(workdir, reference, tmp_path):
    """SIGTERM to rank 1 alone during update 5: every rank stops after update 6 (the flags are all-reduced one
    boundary late, see training/cluster/signals.py), saves it and exits 0; resuming on the same 2 ranks
    logs the reference's numbers and reaches bitwise the same weights."""
    marker, log = tmp_path / "waiting", tmp_path / "out.txt"
    (tmp_path / "wait.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: tests.helpers.callbacks.RNGProbe\n"
        "    - class_path: tests.helpers.callbacks.WaitForSignal\n"
        f"      init_args: {{step: 4, marker: '{marker}', rank: 1}}\n")
    args = fit_args(workdir, "ddp-sigterm", "--checkpoint.every_n_steps", "4", probe=str(tmp_path / "wait.yaml"))
    assert signal_when_waiting(args, workdir, marker, log) == 0, log.read_text()[-4000:]
    assert "stopping after step 6 on another rank's signal" in log.read_text()
    assert steps_on_disk(workdir, "ddp-sigterm") == ["step-00000004", "step-00000006"]  # 6: the stop's checkpoint
    run_normlab(fit_args(workdir, "ddp-sigterm", "--checkpoint.every_n_steps", "4", "--ckpt_path", "last"),
                cwd=workdir)
    run = workdir / "runs" / "ddp-sigterm"
    for tag in TAGS:
        assert scalars(run, tag) == scalars(reference, tag), tag
    straight, again = weights(ckpt(workdir, "ddp", 8)), weights(ckpt(workdir, "ddp-sigterm", 8))
    assert all(torch.equal(straight[k], again[k]) for k in straight)


@pytest.mark.slow
def test_guard_skips_a_nan_gradient_on_one_rank_on_every_rank(workdir, reference):
    """A NaN gradient on rank 1 at update 3 reaches rank 0 through DDP's all-reduce: both ranks drop the update
    (checkpoint 3 holds checkpoint 2's weights exactly, but for QK-clip's per-head factors) and training goes
    on."""
    run_normlab([*fit_args(workdir, "ddp-nan", "--trainer.max_steps", "4", "--checkpoint.every_n_steps", "1"),
                 "-c", str(HELPERS / "nan_grad.yaml"), "--guard.policy", "skip"], cwd=workdir)
    run = workdir / "runs" / "ddp-nan"
    assert scalars(run, "guard/skipped_steps") == {3: 1.0}
    losses = scalars(run, "train/loss")
    assert sorted(losses) == [1, 2, 3, 4] and losses[2] == scalars(reference, "train/loss")[2]
    before, skipped, after = (weights(ckpt(workdir, "ddp-nan", s)) for s in (2, 3, 4))
    for k in before:
        if k.endswith(("q_proj.weight", "k_proj.weight")):  # QK-clip (on in these runs) still scales the step's
            ratio = (skipped[k] / before[k]).reshape(4, -1)  # heads over τ: each head's rows by one factor
            torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-5, atol=0)
        else:
            assert torch.equal(before[k], skipped[k]), k
    assert any(not torch.equal(skipped[k], after[k]) for k in before)


@pytest.mark.parametrize("devices, num_nodes, strategy", [(2, 1, "ddp"), ("2", 1, "ddp"), ([0, 1], 1, "ddp"),
                                                          (1, 2, "ddp"), (1, 1, "auto"), ("auto", 1, "auto")])
def test_several_devices_without_a_strategy_resolve_to_ddp(devices, num_nodes, strategy):
    assert resolve_strategy("auto", devices, num_nodes) == strategy
    assert resolve_strategy("zero2", devices, num_nodes) == "zero2"

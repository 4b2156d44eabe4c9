"""One precision regime on every strategy: `bf16-mixed` is torch autocast over fp32 weights on one process and
under ZeRO (training/strategy.py), so a pilot and a ZeRO run of one config compute the same thing.

Measured on CPU (bf16 autocast, the tiny model, 4 updates of 16 samples): one process vs 2 ranks of ZeRO-2 with
the same global batch. With DeepSpeed's own bf16 mode (bf16 weights in forward and backward — before this regime)
the losses differed by up to 8.4e-5 relative (2.1e-5..8.4e-5 after the first update); with autocast everywhere by
at most 8.4e-6, and not at all at the first update. The tolerance, rel 1e-5, is the one the fp32 tests already use
between these two layouts (tests/test_training_deepspeed.py): what remains is the order in which fp32 gradients are
summed (one process's accumulation vs. the ranks' all-reduce), which bf16 matmuls do not widen.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.multiproc import REPO, run_normlab
from tests.helpers.runs import scalars
from training.strategy import autocast_config

HELPERS = REPO / "tests" / "helpers"


def bf16_fit(workdir: Path, name: str, *extra: str) -> Path:
    run_normlab(["fit", "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"), "--runs_dir",
                 str(workdir / "runs"), "--name", name, "--trainer.precision", "bf16-mixed", "--trainer.max_steps",
                 "4", "--trainer.val_check_interval", "100", *extra], cwd=workdir)
    return workdir / "runs" / name


@pytest.fixture(scope="module")
def runs(workdir) -> dict[str, Path]:
    """One process with micro-batches of 8 and 2 ranks of ZeRO-2 with 4 each: the same 16 samples per update."""
    return {"single": bf16_fit(workdir, "single", "--trainer.devices", "1", "--data.batch_size", "8"),
            "zero2": bf16_fit(workdir, "zero2", "--trainer.devices", "2", "--trainer.strategy", "zero2")}


@pytest.mark.slow
def test_bf16_mixed_is_the_same_on_one_process_and_under_zero2(runs):
    single, zero2 = (scalars(runs[k], "train/loss") for k in ("single", "zero2"))
    assert sorted(single) == sorted(zero2) == [1, 2, 3, 4]
    assert zero2[1] == single[1]  # the same weights, batch and bf16 matmuls: bit for bit
    assert zero2 == pytest.approx(single, rel=1e-5, abs=0)


@pytest.mark.slow
def test_the_manifest_records_the_regime(runs):
    for run in runs.values():
        manifest = json.loads((run / "checkpoints" / "step-00000004" / "manifest.json").read_text())
        assert manifest["precision"] == {"precision": "bf16-mixed", "weights": "float32", "autocast": "bfloat16"}


@pytest.mark.parametrize("precision, dtype", [("bf16-mixed", "bfloat16"), ("16-mixed", "float16")])
def test_mixed_precision_becomes_deepspeed_autocast(precision, dtype):
    config = {"zero_optimization": {"stage": 2}}
    autocast_config(config, precision)
    assert config["torch_autocast"] == {"enabled": True, "dtype": dtype, "lower_precision_safe_modules": []}
    # Lightning adds its own bf16/fp16 section only when absent: present and off, it casts no weight
    assert config["bf16" if dtype == "bfloat16" else "fp16"] == {"enabled": False}


@pytest.mark.parametrize("config", [{"bf16": {"enabled": True}}, {"fp16": {"enabled": True}},
                                    {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}])
def test_a_config_that_sets_its_precision_is_used_as_written(config):
    before = json.loads(json.dumps(config))
    autocast_config(config, "bf16-mixed")
    assert config == before


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "16-true"])
def test_other_precisions_are_left_to_lightning(precision):
    config: dict = {}
    autocast_config(config, precision)
    assert config == {}

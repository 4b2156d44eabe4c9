"""FSDP2's parts: against one process on 2 real gloo ranks (tests/helpers/fsdp2_checks.py, one start-up for all of
them) — DTensor Muon, the full values telemetry reads, the per-module precision policy — and in this process the
strategy's settings, its precision regimes and what the manifest records, and DCP files read without running code.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

from tests.helpers.multiproc import REPO, cpu_env, free_port
from training.checkpointing import dcp
from training.checkpointing.safe import UnsafeCheckpointError
from training.errors import CheckpointError, UserError
from training.fsdp2 import FSDP2, check_policy


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fsdp2") / "checks.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "-m", "tests.helpers.fsdp2_checks", str(out)], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_gathered_muon_is_one_process_muon_to_the_bit(checks):
    """Three updates of the row-sharded matrices, Newton–Schulz on each gathered matrix, equal torch.optim.Muon's
    on the whole ones exactly; so does one more after the state went through a DCP checkpoint into a fresh
    optimizer (AdamW driving the rest, in the same optimizer)."""
    assert checks["muon"] == {"after_3": 0.0, "after_resume": 0.0, "algorithms": ["adamw", "muon"]}


@pytest.mark.slow
def test_full_values_under_dtensor_are_one_process_values(checks):
    """What telemetry, the guard and spike dumps read (`full_param`, `full_grad`, per-layer gradient norms): the
    whole parameter and the reduced gradient, equal to one process's; a NaN in one rank's rows is counted."""
    telemetry = checks["telemetry"]
    assert telemetry["params"] == telemetry["grads"] == 0.0
    sharded, plain = telemetry["norms"]
    assert sharded == plain and len(plain) == 6  # embedding, 2 blocks, final norm, head, global
    assert telemetry["nonfinite"] == 0.0 and telemetry["nonfinite_poisoned_summed"] == 1.0


@pytest.mark.slow
def test_precision_policy_keeps_norm_gains_fp32_and_runs_matmuls_in_bf16(checks):
    policy = checks["policy"]
    assert policy["in_forward"] == {"q_proj": "torch.bfloat16", "attn_norm": "torch.float32",
                                    "final_norm": "torch.float32"}
    assert policy["stored"] == ["torch.float32"]  # sharded weights, gradients: fp32 (the optimizer steps fp32)


@pytest.mark.slow
def test_reshard_after_forward_and_compile_shape_the_units(checks):
    """`reshard_after_forward: true` frees a block's gathered weights after its forward (ZeRO-3-like), `false`
    keeps them for the backward (ZeRO-2-like); `--model.compile` compiles each block, then shards it."""
    assert checks["layout"] == {"resharded_after_forward": {"True": True, "False": False},
                                "blocks_compiled_and_sharded": [True, True]}


# -- the strategy's settings and regimes, in this process -------------------------------------------------------
@pytest.mark.parametrize("policy, message", [
    ({"matmul": "bf16"}, r"give both keys \['matmul', 'norms'\]"),
    ({"matmul": "fp8", "norms": "fp32"}, r"precision_policy\.matmul='fp8' is not valid; choose one of \['fp32', "
                                         r"'bf16'\]"),
])
def test_a_bad_precision_policy_is_one_line(policy, message):
    with pytest.raises(ValueError, match=message):
        check_policy(policy)
    assert check_policy({"matmul": "bf16", "norms": "fp32"}) == {"matmul": "bf16", "norms": "fp32"}


def test_a_bad_policy_on_the_command_line_is_one_line(tmp_path, capsys):
    from training.cli import main

    code = main(["fit", "--trainer.strategy", "training.fsdp2.FSDP2", "--trainer.strategy.precision_policy",
                 "{matmul: fp8, norms: fp32}", "--runs_dir", str(tmp_path), "--trainer.accelerator", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "precision_policy.matmul='fp8' is not valid" in err.strip().splitlines()[-1]


@pytest.mark.parametrize("precision, policy, ok", [("32-true", None, True), ("bf16-mixed", None, True),
                                                   ("16-mixed", None, False), ("bf16-true", None, False),
                                                   ("32-true", {"matmul": "bf16", "norms": "fp32"}, True),
                                                   ("bf16-mixed", {"matmul": "bf16", "norms": "fp32"}, False)])
def test_one_regime_unless_the_policy_is_asked_for(precision, policy, ok):
    """`bf16-mixed` is Lightning's autocast over fp32 weights, as on one device and under DDP and ZeRO, and the
    manifest says so; the per-module policy runs in fp32 (no autocast on top) and is recorded as a regime of its
    own; a precision not tested under FSDP2 is one line naming the valid ones."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

    from model import ModelConfig, Transformer
    from training.precision import precision_record

    if not ok:
        strategy = FSDP2(precision_policy=policy)
        strategy.precision_plugin = (MixedPrecision(precision, "cpu") if "mixed" in precision
                                     else HalfPrecision(precision))
        with pytest.raises(UserError, match=rf"--trainer.precision {precision} under fsdp2.*choose one of"):
            strategy.setup_environment()
        return
    trainer = Trainer(accelerator="cpu", devices=2, strategy=FSDP2(precision_policy=policy), precision=precision,
                      logger=False, enable_checkpointing=False)
    autocast = isinstance(trainer.precision_plugin, MixedPrecision)
    assert autocast == (precision == "bf16-mixed")
    record = precision_record(trainer, Transformer(ModelConfig.preset("llama", vocab_size=64, dim=32, n_layers=1,
                                                                      n_heads=4, max_seq_len=16)))
    expected = {"precision": precision, "weights": "float32", "autocast": "bfloat16" if autocast else None}
    assert record == ({**expected, "mp_policy": policy} if policy else expected)


# -- DCP files, read without running code -----------------------------------------------------------------------
class Payload:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def write_dcp(path: Path, extra: object = None) -> dict[str, torch.Tensor]:
    """A DCP directory as FSDP2 writes one (weights, an optimizer group's values), in one process; with `extra`, a
    non-tensor value DCP pickles into a record."""
    weights = {"model.w": torch.arange(12.0).reshape(3, 4), "model.b": torch.ones(4)}
    state = {"state_dict": weights, "optimizer_0": {"param_groups": [{"lr": 0.1, "name": "decay"}]}}
    if extra is not None:
        state["optimizer_0"]["param_groups"][0]["extra"] = extra
    with warnings.catch_warnings():  # (DCP says it assumes one process: what no_dist asks for)
        warnings.simplefilter("ignore", UserWarning)
        torch_dcp.save(state, checkpoint_id=path, no_dist=True)
    return weights


def test_a_dcp_checkpoint_is_assembled_in_one_process(tmp_path):
    weights = write_dcp(tmp_path / "ckpt")
    dcp.refuse_code(tmp_path / "ckpt")
    loaded = dcp.model_state(tmp_path / "ckpt")
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)


def test_a_crafted_record_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "MARKER"
    write_dcp(tmp_path / "ckpt", extra=Payload(marker))
    with pytest.raises(UnsafeCheckpointError, match=r"__0_0\.distcp.*posix\.system"):
        dcp.refuse_code(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"posix\.system"), warnings.catch_warnings():  # the reader: weights-only
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"optimizer_0": {"param_groups": [{"lr": 0.0, "name": "", "extra": None}]}}, tmp_path / "ckpt",
                 no_dist=True)
    assert not marker.exists()


def test_crafted_metadata_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "MARKER"
    write_dcp(tmp_path / "ckpt")
    metadata = dcp.read_metadata(tmp_path / "ckpt")
    metadata.planner_data = Payload(marker)  # torch's own reader would pickle.load it
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata))
    for read in (dcp.refuse_code, dcp.model_state):
        with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*posix\.system"):
            read(tmp_path / "ckpt")
    assert not marker.exists()

"""Spike forensics under 2-rank DeepSpeed ZeRO-2 (real processes on CPU): the gathers are collectives on every
rank, the dump holds both ranks' micro-batches, and its update norms are the consolidated checkpoints'
difference. (~1 minute on 2 idle cores.)"""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.helpers.multiproc import REPO, run_normlab
from tests.helpers.runs import consolidated_state_dict
from tests.test_spikes import THRESHOLD, group_norms

pytestmark = pytest.mark.slow

HELPERS = REPO / "tests" / "helpers"


def test_zero2_spike_dump(workdir, tmp_path):
    spike = tmp_path / "spike.yaml"
    spike.write_text("trainer:\n  callbacks:\n    - class_path: tests.helpers.faults.InjectLossSpike\n"
                     "      init_args: {steps: [4]}\n")
    run_normlab(["fit", "-c", str(HELPERS / "tiny.yaml"), "-c", str(spike), "--data.path", str(workdir / "tiny"),
                 "--runs_dir", str(workdir / "runs"), "--name", "spiky", "--trainer.strategy", "zero2",
                 "--trainer.devices", "2", "--metrics.every_n_steps", "0", "--trainer.max_steps", "4",
                 "--checkpoint.every_n_steps", "1", "--guard.spike_window", "3",
                 "--guard.dump_spike_z", str(THRESHOLD)], cwd=workdir)
    run = workdir / "runs" / "spiky"
    assert sorted(p.name for p in (run / "spikes").iterdir()) == ["step-00000004"]
    dump = run / "spikes" / "step-00000004"
    record, tensors = json.loads((dump / "spike.json").read_text()), load_file(dump / "batch.safetensors")
    assert tensors["tokens"].shape == (2, 2, 4, 17) and tensors["losses"].shape == (2, 2)
    assert not (tensors["tokens"][0] == tensors["tokens"][1]).all()  # each rank's own micro-batches
    assert record["world_size"] == 2 and record["tokens_seen"] == 3 * 2 * 2 * 4 * 16
    assert record["loss"] == pytest.approx(float(tensors["losses"].mean()), rel=1e-5)
    before, after = (consolidated_state_dict(run / "checkpoints" / f"step-0000000{s}", tmp_path) for s in (3, 4))
    update = group_norms({k: after[k] - before[k] for k in before})
    assert update.keys() == record["update_norm"].keys()
    for key, value in update.items():
        assert record["update_norm"][key] == pytest.approx(value, rel=1e-6), key
    assert all(v > 0 for v in record["grad_norm"].values()) and record["grad_norm"].keys() == update.keys()
